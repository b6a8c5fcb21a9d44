"""threadloader.patch(): DataLoader builds, by any name, give ThreadDataLoaders; unpatch restores."""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data
import torch.utils.data.dataloader
from helpers import assert_epochs_equal, collect, torch_epochs
from torch.utils.data import DataLoader, Dataset

import threadloader
from threadloader import ThreadDataLoader
from threadloader.integrations import _divert


class Noisy(Dataset[tuple[int, torch.Tensor, int, str]]):
    """Item i: (i, a draw from the worker's global torch RNG, pid, thread name)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int, str]:
        return i, torch.rand(2), os.getpid(), threading.current_thread().name


class BuiltBeforePatch(DataLoader[Any]):
    """A subclass defined before any patch."""


@pytest.fixture(autouse=True)
def no_patch_left() -> Iterator[None]:
    yield
    while threadloader.is_patched():
        threadloader.unpatch()


def test_every_name_of_dataloader_builds_a_threadloader() -> None:
    """The class by its module paths, a name bound before the patch, one imported after it."""
    early = DataLoader
    with threadloader.patched():
        late = importlib.import_module("torch.utils.data").DataLoader
        loaders = [
            early(Noisy(), batch_size=4, num_workers=2),
            late(Noisy(), batch_size=4, num_workers=2),
            torch.utils.data.DataLoader(Noisy(), batch_size=4, num_workers=2),
            torch.utils.data.dataloader.DataLoader(Noisy(), batch_size=4, num_workers=2),
        ]
    for loader in loaders:
        assert type(loader) is ThreadDataLoader
        assert isinstance(loader, DataLoader)
        batches = collect(loader)
        assert {pid for b in batches for pid in b[2].tolist()} == {os.getpid()}  # no processes
        loader.stats()  # ours
    assert early is torch.utils.data.DataLoader is torch.utils.data.dataloader.DataLoader


def test_diverted_loader_gives_torchs_batches() -> None:
    """Seeded shuffle and per-worker global RNG draws: the batches torch's DataLoader gives."""
    kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(Noisy(), generator=torch.Generator().manual_seed(3), epochs=2, **kwargs)
    with threadloader.patched():
        loader = DataLoader(Noisy(), generator=torch.Generator().manual_seed(3), **kwargs)
    ours = [collect(loader) for _ in range(2)]
    strip = lambda epochs: [[b[:2] for b in e] for e in epochs]
    assert_epochs_equal(strip(ours), strip(theirs))


def test_unpatch_restores_torchs_dataloader() -> None:
    """After unpatch(): DataLoader again, its signature unchanged, copy and pickle of loaders."""
    signature = inspect.signature(DataLoader)
    threadloader.patch()
    assert threadloader.is_patched()
    assert inspect.signature(DataLoader) == signature  # the hook does not show
    threadloader.unpatch()
    assert not threadloader.is_patched()
    loader = DataLoader(list(range(6)), batch_size=2)
    assert type(loader) is DataLoader
    assert type(copy.copy(loader)) is DataLoader
    assert type(pickle.loads(pickle.dumps(loader))) is DataLoader
    assert inspect.signature(DataLoader) == signature
    threadloader.unpatch()  # nothing left to undo: a no-op


def test_nesting_restores_each_layers_options() -> None:
    """The innermost patch's options apply; leaving a block restores the outer one's."""
    with threadloader.patched(log_every_s=60.0):
        assert DataLoader([1], num_workers=1).log_every_s == 60.0
        threadloader.patch(log_every_s=5.0)
        assert DataLoader([1], num_workers=1).log_every_s == 5.0
        with pytest.raises(RuntimeError, match="inside"), threadloader.patched():
            assert DataLoader([1]).log_every_s is None
            raise RuntimeError("inside")
        assert DataLoader([1]).log_every_s == 5.0
        threadloader.unpatch()
        assert DataLoader([1]).log_every_s == 60.0
    assert type(DataLoader([1])) is DataLoader


def test_subclasses_are_built_as_themselves() -> None:
    """Subclasses, defined before or during the patch, keep their class (and worker processes)."""
    with threadloader.patched():

        class BuiltDuringPatch(DataLoader[Any]):
            pass

        before = BuiltBeforePatch(Noisy(), batch_size=6, num_workers=1)
        during = BuiltDuringPatch(Noisy(), batch_size=6)
        explicit = ThreadDataLoader(Noisy(), batch_size=6, num_workers=1)
    assert type(before) is BuiltBeforePatch and type(during) is BuiltDuringPatch
    assert type(explicit) is ThreadDataLoader
    assert {p for b in collect(before) for p in b[2].tolist()} != {os.getpid()}  # a process
    assert len(collect(during)) == 2


def test_options_apply_where_valid() -> None:
    """isolation only to loaders with workers; bad options fail at patch(), not at each build."""
    with threadloader.patched(isolation="process", log_every_s=30.0):
        inline = DataLoader(Noisy(), batch_size=4)  # isolation needs workers: not applied
        assert inline.isolation == "auto" and inline.log_every_s == 30.0
        isolated = DataLoader(Noisy(), batch_size=4, num_workers=1)
        assert isolated.isolation == "process"
    with pytest.raises(ValueError, match="isolation"):
        threadloader.patch(isolation="thread")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log_every_s"):
        threadloader.patch(log_every_s=0)
    with pytest.raises(ValueError, match=r"device_prefetch=2 .* needs device="):
        threadloader.patch(device_prefetch=2)
    assert not threadloader.is_patched()


def test_helpers_apply_to_isolated_loaders_up_to_their_workers() -> None:
    """helpers= reaches loaders with workers that may run in helpers, at most one helper per
    worker; with isolation="threads" it is refused at patch()."""
    with threadloader.patched(isolation="process", helpers=3):
        wide = DataLoader(Noisy(), batch_size=4, num_workers=4)
        narrow = DataLoader(Noisy(), batch_size=4, num_workers=2)
        inline = DataLoader(Noisy(), batch_size=4)
        assert (wide.helpers, narrow.helpers, inline.helpers) == (3, 2, None)
    with threadloader.patched(isolation="auto"):
        assert DataLoader(Noisy(), batch_size=4, num_workers=2).isolation == "auto"
    with threadloader.patched(helpers=2):  # the loaders' default isolation, "auto"
        assert DataLoader(Noisy(), batch_size=4, num_workers=2).helpers == 2
        assert DataLoader(Noisy(), batch_size=4).helpers is None
        pinned = DataLoader(Noisy(), batch_size=4, num_workers=2, isolation="threads")
        assert pinned.helpers is None
    with pytest.raises(ValueError, match="helpers needs isolation"):
        threadloader.patch(isolation="threads", helpers=2)
    with pytest.raises(ValueError, match="helpers must be a positive int"):
        threadloader.patch(isolation="process", helpers=0)
    with pytest.raises(TypeError, match="helpers must be an int"):  # as ThreadDataLoader
        threadloader.patch(isolation="process", helpers=1.5)  # type: ignore[arg-type]
    assert not threadloader.is_patched()


@pytest.mark.parametrize("every", [0, float("nan"), "1", True])
def test_log_every_s_is_checked_at_patch_as_the_loader_checks_it(every: Any) -> None:
    """What ThreadDataLoader refuses, patch() refuses, not each DataLoader(...) built after."""
    with pytest.raises(ValueError, match="log_every_s must be a positive number of seconds"):
        threadloader.patch(log_every_s=every)
    assert not threadloader.is_patched()


def test_stateful_dataloader_is_diverted_and_resumes() -> None:
    """torchdata's StatefulDataLoader(...) builds a ThreadDataLoader; its state resumes."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    kwargs: dict[str, Any] = {"batch_size": 2, "shuffle": True, "num_workers": 2}
    with threadloader.patched():
        loader = stateful.StatefulDataLoader(Noisy(), snapshot_every_n_steps=3, **kwargs)
        assert type(loader) is ThreadDataLoader and loader.snapshot_every_n_steps == 3
        it = iter(loader)
        head = [next(it)[0] for _ in range(2)]
        state = loader.state_dict()
        rest = [b[0] for b in it]
        resumed = stateful.StatefulDataLoader(Noisy(), **kwargs)
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == [b.tolist() for b in rest]
    assert sorted(torch.cat(head + rest).tolist()) == list(range(12))


def test_building_like_is_per_thread() -> None:
    """An integration's rebuild diverts builds in its own thread only."""
    template = ThreadDataLoader([1], num_workers=1, log_every_s=7.0)
    seen: list[type] = []
    with _divert.building_like(template):
        other = threading.Thread(target=lambda: seen.append(type(DataLoader([1]))))
        other.start()
        other.join()
        mine = DataLoader([1], num_workers=1)
    assert seen == [DataLoader]
    assert type(mine) is ThreadDataLoader and mine.log_every_s == 7.0
    assert type(DataLoader([1])) is DataLoader


def test_patching_from_many_threads_leaves_nothing_behind() -> None:
    """Concurrent patched() blocks and builds: every block undoes its own layer, none is lost."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(40):
                with threadloader.patched(log_every_s=1.0):
                    assert type(DataLoader([1])) is ThreadDataLoader
        except BaseException as e:  # noqa: BLE001  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert not threadloader.is_patched() and _divert.layers == []
    assert type(DataLoader([1])) is DataLoader


def test_a_patch_ending_in_another_thread_mid_build_builds_torchs_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last patch ends (another thread's ``with patched()`` exits) while a build looks at
    the layers: the build sees the patch or not, never an IndexError."""

    class EndsWhenLookedAt(list[Any]):
        def __bool__(self) -> bool:
            present = len(self) > 0
            self.clear()  # the other thread's exit, right after this look
            return present

    monkeypatch.setattr(_divert, "layers", EndsWhenLookedAt([(object(), {})]))
    assert _divert._current_options() in (None, ({}, True))
    loader = DataLoader(range(4))
    assert type(loader) in (DataLoader, ThreadDataLoader)
    assert list(loader) == [torch.tensor([i]) for i in range(4)]
