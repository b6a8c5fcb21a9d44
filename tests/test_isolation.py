"""isolation="process": the worker threads run in one helper process, and nothing else changes.

The behaviour tests of the in-process loader run here again through the isolated iterator, on
their own datasets and helpers (imported, not copied): same batches and order as torch, worker
info and worker_init_fn, errors with their original type and traceback, resume, timeout, stats.
Then what only isolation has: the helper process never outlives its use, however the epoch
ends and even when the training process is SIGKILLed; slots are never overwritten while a batch
is held; the training process starts no thread.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from helpers import (
    assert_epochs_equal,
    assert_outcomes_match,
    assert_same_multiset,
    collect,
    collect_epochs,
    interrupted_next,
    outcomes,
    torch_epochs,
    torch_outcomes,
    worker_ids_named,
)
from test_resume import Ids, StatefulShards, assert_resumes_exactly
from test_same_batches_as_torch import SCENARIOS, Dicts, Numbers, SizedStream
from test_worker_errors import (
    FailsAtFive,
    StreamFailsInWorkerOne,
    collate_fails_on_five,
    init_fails_in_worker_one,
)
from test_worker_info import (
    Labelled,
    SeedReporter,
    _seeds_by_worker,
    keep_list,
    label_this_workers_copy,
)
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from threadloader import ThreadDataLoader
from threadloader.isolation import helper as _isolated_worker
from threadloader.isolation import helper_source, link, zygote
from threadloader.isolation.parent import IsolatedDataLoaderIter

HELPER_PREFIX = "threadloader-helper-"
#: Helpers that receive the dataset pickled (never forked from this process, whatever threads
#: it runs): for the tests of what pickling does.
PICKLED = "forkserver"


class IsolatedLoader(ThreadDataLoader[Any]):
    """``ThreadDataLoader(isolation="process")``, dispatching to the isolated iterator itself.

    Works before and after loader.py routes ``isolation="process"`` to ``IsolatedDataLoaderIter``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        workers = kwargs.get("num_workers", args[5] if len(args) > 5 else 0)
        # isolation needs workers: with none, the scenario runs as torch's num_workers=0
        super().__init__(*args, isolation="process" if workers else None, **kwargs)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        resume, self._resume = self._resume, None
        self.check_worker_number_rationality()
        return IsolatedDataLoaderIter(self, resume)


@pytest.fixture(scope="module", autouse=True)
def _fast_helper_starts() -> None:
    # Every helper is forked from the forkserver; one that already imported pytest (which the
    # test modules holding these datasets import) starts each helper ~0.1 s faster.
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is None:
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["__main__", "threadloader.isolation.helper", "pytest"]
        )


def _helpers() -> list[int]:
    """The pids of live helpers: children of this process, or of its zygote."""
    pids = [p.pid for p in multiprocessing.active_children() if p.name.startswith(HELPER_PREFIX)]
    server = zygote.server_pid()
    if server is not None:
        for child in psutil.Process(server).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                pass
    return sorted(p for p in pids if p is not None)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


@pytest.fixture(autouse=True)
def _no_helper_left_behind() -> Iterator[None]:
    threads = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10
    while _helpers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _helpers() == []
    extra = [t for t in threading.enumerate() if t not in threads and t.name.startswith("thread")]
    assert extra == [], "isolation started a thread in the training process"


# --------------------------------------------------------------------------------------------
# Same batches as torch


SAME_BATCHES = [
    "sequential",
    "shuffle with generator",
    "batch_size None shuffled",
    "custom batch_sampler object",
    "drop_last shuffled",
    "custom collate_fn",
    "custom collate_fn without batching",
    "tensors shuffled",
    "numpy arrays",
    "numpy arrays without batching",
    "dicts",
    "namedtuples",
    "strings",
    "__getitems__",
]


@pytest.mark.parametrize("scenario", SAME_BATCHES)
def test_same_batches_in_same_order_as_dataloader(scenario: str) -> None:
    """For each sampling/collation scenario, every batch equals torch's, in the same order."""
    make_dataset, make_kwargs = SCENARIOS[scenario]
    dataset = make_dataset()
    theirs = torch_epochs(dataset, **make_kwargs())[0]
    assert_epochs_equal(collect(IsolatedLoader(dataset, num_workers=2, **make_kwargs())), theirs)


def test_three_workers_and_prefetch_factor_give_the_same_batches() -> None:
    """num_workers=3, prefetch_factor=3: still torch's shuffled batches, in order."""
    make_dataset, make_kwargs = SCENARIOS["tensors shuffled"]
    theirs = torch_epochs(make_dataset(), **make_kwargs())[0]
    loader = IsolatedLoader(make_dataset(), num_workers=3, prefetch_factor=3, **make_kwargs())
    assert_epochs_equal(collect(loader), theirs)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_three_shuffled_epochs_match_dataloader(persistent_workers: bool) -> None:
    """Three epochs of one shuffled loader give torch's three (one helper when persistent)."""
    kwargs = {"batch_size": 4, "shuffle": True, "persistent_workers": persistent_workers}
    theirs = torch_epochs(
        Numbers(), epochs=3, generator=torch.Generator().manual_seed(21), num_workers=2, **kwargs
    )
    loader = IsolatedLoader(
        Numbers(), generator=torch.Generator().manual_seed(21), num_workers=2, **kwargs
    )
    pids = set()
    for epoch in range(3):
        it = iter(loader)
        pids.add(it.helper_pid)  # type: ignore[attr-defined]
        assert_epochs_equal(list(it), theirs[epoch])
        del it
    assert len(pids) == (1 if persistent_workers else 3)
    del loader
    gc.collect()


def test_in_order_false_yields_the_same_multiset_of_batches() -> None:
    """in_order=False yields torch's batches, each exactly once."""
    kwargs = {"batch_size": 3, "shuffle": True}
    theirs = torch_epochs(Dicts(), generator=torch.Generator().manual_seed(8), **kwargs)[0]
    loader = IsolatedLoader(
        Dicts(), generator=torch.Generator().manual_seed(8), in_order=False, num_workers=2, **kwargs
    )
    assert_same_multiset(collect(loader), theirs)


def test_iterable_dataset_is_sharded_and_ordered_like_dataloader() -> None:
    """An IterableDataset sharded by get_worker_info() gives torch's batches in torch's order."""
    theirs = torch_epochs(SizedStream(actual=23), batch_size=3, num_workers=2)[0]
    ours = collect(IsolatedLoader(SizedStream(actual=23), batch_size=3, num_workers=2))
    assert_epochs_equal(ours, theirs)


# --------------------------------------------------------------------------------------------
# Worker info, seeds, worker_init_fn


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_worker_seeds_equal_torch_process_workers_seeds(persistent_workers: bool) -> None:
    """Worker w's seed in each of two epochs equals torch's worker w seed for the same generator."""
    kwargs = {
        "batch_size": 2, "shuffle": True, "num_workers": 2,
        "persistent_workers": persistent_workers, "collate_fn": keep_list,
    }  # fmt: skip
    theirs = torch_epochs(
        SeedReporter(), epochs=2, generator=torch.Generator().manual_seed(99), **kwargs
    )
    loader = IsolatedLoader(SeedReporter(), generator=torch.Generator().manual_seed(99), **kwargs)
    ours = collect_epochs(loader, 2)
    for epoch in range(2):
        assert [[i for i, _, _ in b] for b in ours[epoch]] == [
            [i for i, _, _ in b] for b in theirs[epoch]
        ]
        assert _seeds_by_worker(ours[epoch]) == _seeds_by_worker(theirs[epoch])
    del loader
    gc.collect()


def test_worker_init_fn_configures_only_its_workers_iterable_copy() -> None:
    """worker_init_fn labelling get_worker_info().dataset gives torch's output."""
    kwargs = {"batch_size": 2, "num_workers": 2, "worker_init_fn": label_this_workers_copy}
    theirs = torch_epochs(Labelled(), **kwargs)[0]
    dataset = Labelled()
    assert_epochs_equal(collect(IsolatedLoader(dataset, **kwargs)), theirs)
    assert dataset.label == "unset"


class InfoInHelper(Dataset[Any]):
    """Item i: (i, worker id, worker_method, pid, whether thread_safe_generator is the worker's)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        own = torch.random.thread_safe_generator() is info.rng.torch_generator
        return (index, info.id, info.worker_method, os.getpid(), own)


def test_get_worker_info_answers_in_the_helpers_threads_only() -> None:
    """Items are fetched in the helper's threads, each seeing its own WorkerInfo and generator."""
    batches = collect(IsolatedLoader(InfoInHelper(), batch_size=None, num_workers=2))
    assert [b[0] for b in batches] == list(range(8))
    assert {b[1] for b in batches} == {0, 1}
    assert {b[2] for b in batches} == {"thread"}
    assert len({b[3] for b in batches}) == 1 and batches[0][3] != os.getpid()
    assert all(b[4] for b in batches)
    assert torch.utils.data.get_worker_info() is None


# --------------------------------------------------------------------------------------------
# Errors


def _all_outcomes(loader: Any, limit: int = 30) -> list[Any]:
    iterator = iter(loader)
    try:
        return outcomes(iterator, limit)
    finally:
        del iterator


def _assert_wraps_original(error: BaseException, message: str, raiser: str) -> None:
    text = str(error)
    assert message in text, text
    assert "Traceback (most recent call last)" in text, text
    assert raiser in text, text  # the original frame is quoted
    assert "test_worker_errors.py" in text, text


@pytest.mark.parametrize("batch_size", [2, None])
def test_getitem_error_is_raised_from_next_and_the_epoch_goes_on(batch_size: int | None) -> None:
    """A __getitem__ error reaches next() as torch's type with traceback; later batches follow."""
    kwargs = {"batch_size": batch_size, "num_workers": 2}
    theirs = torch_outcomes(FailsAtFive(), limit=30, **kwargs)
    ours = _all_outcomes(IsolatedLoader(FailsAtFive(), **kwargs))
    assert_outcomes_match(ours, theirs, ["cannot read item 5"])
    error = next(o.error for o in ours if o.error is not None)
    assert type(error) is ValueError
    _assert_wraps_original(error, "cannot read item 5", "explode_in_getitem")
    assert worker_ids_named(str(error).splitlines()[0])[0] in (0, 1)


def test_iterable_error_ends_that_shard_and_others_continue_like_dataloader() -> None:
    """An exception inside an IterableDataset's iteration: raised once, other workers go on."""
    kwargs = {"batch_size": 3, "num_workers": 2}
    theirs = torch_outcomes(StreamFailsInWorkerOne(), limit=30, **kwargs)
    ours = _all_outcomes(IsolatedLoader(StreamFailsInWorkerOne(), **kwargs))
    assert_outcomes_match(ours, theirs, ["stream of worker 1 broke"])
    error = next(o.error for o in ours if o.error is not None)
    _assert_wraps_original(error, "stream of worker 1 broke", "explode_in_iter")


def test_collate_and_worker_init_errors_are_raised_like_dataloader() -> None:
    """collate_fn and worker_init_fn errors: raised at torch's batch, type and traceback kept."""
    kwargs = {"batch_size": 2, "num_workers": 2, "collate_fn": collate_fails_on_five}
    ours = _all_outcomes(IsolatedLoader(list(range(12)), **kwargs))
    assert_outcomes_match(ours, torch_outcomes(list(range(12)), limit=30, **kwargs))
    _assert_wraps_original(
        next(o.error for o in ours if o.error), "cannot collate [4, 5]", "explode_in_collate"
    )
    kwargs = {"batch_size": 2, "num_workers": 2, "worker_init_fn": init_fails_in_worker_one}
    iterator = iter(IsolatedLoader(list(range(12)), **kwargs))
    ours = outcomes(iterator, 2)
    del iterator
    assert_outcomes_match(ours, torch_outcomes(list(range(12)), limit=2, **kwargs))
    assert ours[1].error is not None and 1 in worker_ids_named(str(ours[1].error).splitlines()[0])
    _assert_wraps_original(ours[1].error, "worker 1 could not start", "explode_in_init")


class CannotLoadInHelper(Dataset[int]):
    """Unpickling it anywhere but where it was made raises LookupError."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["pid"] != os.getpid():
            raise LookupError("this dataset only opens in its own process")
        self.__dict__.update(state)


def test_dataset_that_cannot_be_loaded_in_the_helper_raises_its_error() -> None:
    """A dataset failing to unpickle in the helper: next() raises that error, type preserved."""
    loader = IsolatedLoader(CannotLoadInHelper(), num_workers=2, multiprocessing_context=PICKLED)
    iterator = iter(loader)
    with pytest.raises(LookupError, match="only opens in its own process") as info:
        next(iterator)
    assert "isolation helper process" in str(info.value)
    with pytest.raises(RuntimeError, match="was closed"):
        next(iterator)


class ExitsInHelper(CannotLoadInHelper):
    """Loading it elsewhere ends the process (a module it imports calls ``sys.exit``)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["pid"] != os.getpid():
            sys.exit("no configuration in this process")
        self.__dict__.update(state)


def test_a_helper_exiting_while_it_loads_the_dataset_raises_runtime_error_as_torch() -> None:
    """torch's worker process dies: its loader raises RuntimeError. Here the same type, naming
    the SystemExit, which a loop catching Exception survives."""
    loader = IsolatedLoader(ExitsInHelper(), num_workers=2, multiprocessing_context=PICKLED)
    with pytest.raises(RuntimeError, match="Caught SystemExit in threadloader's isolation helper"):
        next(iter(loader))


def _made_at_run_time() -> type[Exception]:
    """An exception class made at run time, as botocore makes ``NoSuchKey``: pickle cannot
    find it by name."""
    return type("NoSuchKey", (LookupError,), {})


class MissingKey(Dataset[int]):
    """Item 2 raises an exception whose class cannot be pickled; so does loading it in a helper,
    with ``on_load``."""

    def __init__(self, on_load: bool = False) -> None:
        self.pid, self.on_load = os.getpid(), on_load

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise _made_at_run_time()("The key 'shard-0002.tar' does not exist")
        return index

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["on_load"] and state["pid"] != os.getpid():
            raise _made_at_run_time()("The key 'index.json' does not exist")
        self.__dict__.update(state)


def test_an_error_whose_class_cannot_be_pickled_keeps_its_message_and_traceback() -> None:
    """The helper cannot send the class: it sends the nearest base class that pickles, with the
    original message and traceback, and the epoch goes on with the next batches."""
    iterator = iter(IsolatedLoader(MissingKey(), batch_size=2, num_workers=2))
    found: list[Any] = []
    while True:
        try:
            found.append(next(iterator))
        except StopIteration:
            break
        except LookupError as raised:
            found.append(raised)
    del iterator
    error = found[1]
    assert type(error) is LookupError
    text = str(error)
    assert "a NoSuchKey, whose class cannot be pickled" in text
    assert "The key 'shard-0002.tar' does not exist" in text
    assert "Traceback (most recent call last)" in text and "__getitem__" in text
    assert [b.tolist() for b in (found[0], found[2])] == [[0, 1], [4, 5]]


def test_a_start_error_whose_class_cannot_be_pickled_keeps_its_message() -> None:
    """The same for an error the helper raises while it loads the dataset."""
    loader = IsolatedLoader(
        MissingKey(on_load=True), num_workers=2, multiprocessing_context=PICKLED
    )
    with pytest.raises(LookupError, match="whose class cannot be pickled") as info:
        next(iter(loader))
    assert "The key 'index.json' does not exist" in str(info.value)


class OwnStats(Dataset[int]):
    """A dataset whose ``stats()`` is its own: it raises, or takes long."""

    def __init__(self, how: str) -> None:
        self.how, self.calls = how, 0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        return index

    def stats(self) -> int:
        if self.how == "raises":
            raise IndexError("no statistics yet")
        self.calls += 1
        time.sleep(0.1)  # computes something over the data
        return self.calls


class ChannelStats(OwnStats):
    """Its ``stats`` needs an argument."""

    def stats(self, channel: int) -> int:  # type: ignore[override]
        raise AssertionError("called without its argument")


@pytest.mark.parametrize("how", ["needs an argument", "raises", "slow"])
def test_a_dataset_method_named_stats_does_not_break_or_slow_the_helpers(how: str) -> None:
    """Helpers send a dataset's ``stats()`` with their batches (RemoteFiles' read counters):
    one that needs an argument is not called, one that raises is no longer asked, and a slow
    one is not taken with every batch. The batches are the dataset's either way."""
    dataset = ChannelStats(how) if how == "needs an argument" else OwnStats(how)
    loader = ThreadDataLoader(dataset, batch_size=1, num_workers=2, isolation="process", helpers=1)
    assert [int(b) for b in loader] == list(range(16))
    if how == "slow":
        assert loader.stats().dataset == 1  # one call in the helper, not one per batch
    else:
        assert loader.stats().dataset is None


class CountsReads(Dataset[int]):
    """Counts its reads in a list its copies share; its ``stats()`` is a counter snapshot whose
    second call is slow once (a wait for the GIL or a CPU on a loaded machine)."""

    def __init__(self) -> None:
        self.reads, self.calls = [0], [0]

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> int:
        self.reads[0] += 1
        return index

    def stats(self) -> int:
        self.calls[0] += 1
        if self.calls[0] == 2:
            time.sleep(0.05)
        return self.reads[0]


def test_one_slow_call_of_a_fast_stats_leaves_the_epochs_last_snapshot_current() -> None:
    """A fast ``stats()`` that once took 50 ms kept the helper from taking it for 2.5 s, and
    the epoch ended meanwhile: ``loader.stats().dataset`` said 2 reads of 32 (the example's
    cache hits, 767 of 1024, under load)."""
    loader = ThreadDataLoader(
        CountsReads(), batch_size=1, num_workers=2, isolation="process", helpers=1
    )
    assert [int(b) for b in loader] == list(range(32))
    assert loader.stats().dataset == 32


class SlowAfterItsFirstCall(OwnStats):
    """Its ``stats()`` answers at once the first time (nothing read yet), then takes 50 ms."""

    def stats(self) -> int:
        self.calls += 1
        if self.calls > 1:
            time.sleep(0.05)
        return self.calls


def test_a_stats_that_turns_slow_is_throttled_after_a_few_calls() -> None:
    """One fast call does not make ``stats()`` fast for good: once its recent calls are all
    slow it is taken rarely again, not with each of 64 batches behind a lock every runner
    waits for (6.5 s an epoch of 128 instead of 0.12 s)."""
    loader = ThreadDataLoader(
        SlowAfterItsFirstCall("slow"), batch_size=1, num_workers=2, isolation="process", helpers=1
    )
    assert len(list(loader)) == 16
    assert loader.stats().dataset <= 4


class Unpicklable(Dataset[int]):
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def test_unpicklable_dataset_raises_at_iter_and_starts_nothing() -> None:
    """iter() of a dataset that cannot be pickled raises the pickling error; no helper is left."""
    with pytest.raises(TypeError, match="pickle") as raised:
        iter(IsolatedLoader(Unpicklable(), num_workers=2, multiprocessing_context=PICKLED))
    notes = getattr(raised.value, "__notes__", [])  # Python 3.11+: why it was pickled
    assert sys.version_info < (3, 11) or any('isolation="threads"' in n for n in notes), notes


class Redefined(Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def test_a_dataset_whose_class_was_defined_again_names_why_it_cannot_reach_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dataset made before its class was defined again (a notebook cell run again): pickle
    cannot send it by its class's name; the error says that the class changed under it."""
    dataset = Redefined()
    monkeypatch.setattr(sys.modules[__name__], "Redefined", type("Redefined", (Redefined,), {}))
    with pytest.raises(pickle.PicklingError, match="not the same object") as raised:
        iter(IsolatedLoader(dataset, num_workers=2, multiprocessing_context=PICKLED))
    notes = getattr(raised.value, "__notes__", [])
    assert sys.version_info < (3, 11) or any("defined again" in n for n in notes), notes


class StateFailsAfterTwo(IterableDataset[int]):
    """A stateful IterableDataset whose state_dict() raises once two items were read."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < 10:
            self.pos += 1
            yield self.pos

    def state_dict(self) -> dict[str, int]:
        if self.pos > 2:
            raise OSError("state store unreachable")
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def test_a_state_snapshot_error_is_raised_at_its_batch_as_in_process() -> None:
    """The dataset's state_dict() raising after a batch is that batch's error, named as such,
    as in the in-process loader; the epoch goes on (its next snapshot fails too, here)."""
    iterator = iter(IsolatedLoader(StateFailsAfterTwo(), batch_size=2, num_workers=1))
    assert next(iterator).tolist() == [1, 2]
    with pytest.raises(OSError, match="state store unreachable") as info:
        next(iterator)
    assert "worker thread 0, batch 1, saving the dataset's state" in str(info.value)
    with pytest.raises(OSError, match="state store unreachable"):
        next(iterator)
    del info, iterator  # the error's traceback holds the iterator's frames


class StateCannotCross(StateFailsAfterTwo):
    """Its state after item 4 holds something pickle refuses (a local function)."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"pos": self.pos, "hook": (lambda: None) if self.pos == 4 else None}


def test_a_state_that_cannot_be_pickled_raises_at_its_batch_and_the_epoch_goes_on() -> None:
    """The batch whose state cannot cross to the training process raises pickle's error there."""
    iterator = iter(IsolatedLoader(StateCannotCross(), batch_size=2, num_workers=1))
    assert next(iterator).tolist() == [1, 2]
    with pytest.raises(AttributeError, match="pickle local object") as info:
        next(iterator)
    assert "worker thread 0, batch 1" in str(info.value)
    assert next(iterator).tolist() == [5, 6]
    iterator.close()  # type: ignore[attr-defined]


def test_fork_context_is_refused() -> None:
    """multiprocessing_context='fork' is refused, naming the reason and what to pass instead."""
    with pytest.raises(ValueError, match="does not take multiprocessing_context='fork'"):
        iter(IsolatedLoader(Numbers(), num_workers=2, multiprocessing_context="fork"))
    with pytest.raises(ValueError, match="isolation must be 'auto', 'process', 'threads' or None"):
        helper_source.check_isolation("processes")


def test_arguments_torch_refuses_raise_torchs_error_before_ours() -> None:
    """A combination torch refuses gets torch's error, also with an option of ours refused too:
    a ``pytest.raises(match=...)`` written against torch still matches."""
    kwargs = {"batch_size": 2, "batch_sampler": [[0, 1]], "num_workers": 2}
    with pytest.raises(ValueError) as theirs:
        torch.utils.data.DataLoader(Numbers(), multiprocessing_context="fork", **kwargs)
    with pytest.raises(ValueError) as ours:
        ThreadDataLoader(Numbers(), isolation="process", multiprocessing_context="fork", **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_helper_killed_mid_epoch_raises_naming_its_pid() -> None:
    """A helper that dies (OOM killer, kill -9) makes next() raise RuntimeError with its pid."""
    iterator = iter(IsolatedLoader(SlowItems(delay=0.05), batch_size=2, num_workers=2))
    next(iterator)
    pid = iterator.helper_pid  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"pid\(s\) {pid}\) exited unexpectedly"):
        for _ in range(20):
            next(iterator)


# --------------------------------------------------------------------------------------------
# Timeout, stats, state


class SlowItems(Dataset[torch.Tensor]):
    """Map-style of ``n`` items; each takes ``delay`` seconds, item ``slow_at`` ``slow_s``."""

    def __init__(
        self, n: int = 64, delay: float = 0.0, slow_at: int = -1, slow_s: float = 2.0
    ) -> None:
        self.n, self.delay, self.slow_at, self.slow_s = n, delay, slow_at, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.slow_s if index == self.slow_at else self.delay)
        return torch.tensor(index)


def test_slow_batch_raises_torchs_timeout_error_and_ends_the_helper() -> None:
    """A batch later than `timeout` raises torch's RuntimeError; the stuck helper is ended.

    The first batch's wait includes the helper's start (torch's includes its workers'), which
    a loaded machine stretched to 5 s: the timeout leaves room for it, and the slow item
    outlasts any timeout (the helper is ended, not waited for)."""
    dataset = SlowItems(slow_at=5, slow_s=600.0)
    loader = IsolatedLoader(dataset, batch_size=1, num_workers=2, timeout=10.0)
    iterator = iter(loader)
    pid = iterator.helper_pid  # type: ignore[attr-defined]
    got = []
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 10.0 seconds"):
        for _ in range(10):
            got.append(int(next(iterator)))
    assert got == [0, 1, 2, 3, 4]
    assert _wait_gone([pid]) == []


def test_stats_count_batches_data_wait_and_helper_stage_times() -> None:
    """stats(): batches delivered, the loop's data wait, fetch/collate timed in the helper."""
    loader = IsolatedLoader(SlowItems(n=32, delay=0.01), batch_size=4, num_workers=2)
    assert len(collect(loader)) == 8
    stats = loader.stats()
    assert stats.batches == 8
    assert stats.num_workers == 2
    assert 0.02 < stats.wait_s <= stats.wall_s
    assert stats.stages["fetch"].count == 8 and stats.stages["fetch"].total_s > 0.25
    assert stats.stages["collate"].count == 8
    assert sum(stats.worker_busy_s) > 0.25 and stats.batches_run_by_caller == 0
    assert "8 batches" in str(stats)


# --------------------------------------------------------------------------------------------
# Waiting for results: poll briefly, then sleep (_isolation point 6)


def _waits(loader: ThreadDataLoader[Any]) -> tuple[list[int], int, int]:
    iterator = iter(loader)
    got = [int(b) for b in iterator]
    link = iterator._links.links[0]  # type: ignore[attr-defined]
    return got, link.polled, link.spun


@pytest.mark.skipif(link.usable_cpus() < 2, reason="polls only with a CPU to spare")
def test_short_waits_for_cheap_batches_are_polled_not_slept() -> None:
    """One fetching thread making sub-millisecond batches: the loop polls and never sleeps."""
    counts = []
    for _ in range(3):  # a loaded machine may keep the loop off the CPU for a whole run
        loader = IsolatedLoader(SlowItems(n=300, delay=0.0002), batch_size=None, num_workers=1)
        got, polled, spun = _waits(loader)
        assert got == list(range(300))
        # Most waits (~298 of 300 with a CPU to spare); a busy CPU (another test process beside
        # this one) stretches some past the polling window, which ends the polling for a while.
        counts.append((polled, spun))
        if spun >= 30:
            return
    raise AssertionError(f"fewer than 30 of 300 waits polled to their batch in 3 runs: {counts}")


def test_waits_longer_than_the_polling_window_sleep() -> None:
    """100 ms batches: the first wait is long, so no wait polls (it would only burn a CPU).

    A wait polls after one that found its batch already there: with 20 ms batches, a loop kept
    off the CPU that long by a loaded machine found one, 1 run in 20 with 3 busy processes."""
    loader = IsolatedLoader(SlowItems(n=8, delay=0.1), batch_size=None, num_workers=1)
    got, polled, _ = _waits(loader)
    assert got == list(range(8))
    assert polled == 0


def test_no_polling_when_the_helper_needs_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one CPU the polling would take it from the helper's fetching thread."""
    monkeypatch.setattr(link, "usable_cpus", lambda: 1)
    loader = IsolatedLoader(SlowItems(n=100, delay=0.0002), batch_size=None, num_workers=1)
    got, polled, _ = _waits(loader)
    assert got == list(range(100))
    assert polled == 0


@pytest.mark.parametrize("cut", [0, 1, 5])
def test_resume_yields_exactly_the_batches_not_yet_seen(cut: int) -> None:
    """Shuffled map-style epoch: a state taken after `cut` batches resumes with the rest."""
    assert_resumes_exactly(
        lambda: IsolatedLoader(
            Ids(), batch_size=8, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(7),
        ),
        cut,
    )  # fmt: skip


def test_state_is_consumer_aligned_not_prefetch_aligned() -> None:
    """After 3 next() calls the state says 3 batches, whatever the helper prefetched."""
    loader = IsolatedLoader(Ids(), batch_size=4, num_workers=2, prefetch_factor=4)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    time.sleep(0.2)  # let the helper run ahead
    assert loader.state_dict()["batches_yielded"] == 3
    del iterator


@pytest.mark.parametrize("cut", [1, 4])
def test_stateful_iterable_dataset_resumes_per_worker(cut: int) -> None:
    """Each worker's IterableDataset copy resumes from the state of its last delivered batch."""
    assert_resumes_exactly(
        lambda: IsolatedLoader(StatefulShards(), batch_size=3, num_workers=2), cut
    )


# --------------------------------------------------------------------------------------------
# The ring: what is delivered is never overwritten, slots come back, sizes grow


def test_batches_kept_by_the_loop_are_never_overwritten() -> None:
    """list(loader) keeps every batch: none is overwritten by later ones (the ring grows)."""
    make_dataset, make_kwargs = SCENARIOS["tensors shuffled"]
    theirs = torch_epochs(make_dataset(), **make_kwargs())[0]
    kept = list(IsolatedLoader(make_dataset(), num_workers=2, prefetch_factor=1, **make_kwargs()))
    assert_epochs_equal(kept, theirs)


class NumpyRows(Dataset[Any]):
    """Item i: ``np.full(4, i)``, C order, or Fortran order for a 2-d item when ``fortran``."""

    def __init__(self, fortran: bool) -> None:
        self.fortran = fortran

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if self.fortran:
            return np.asfortranarray(np.full((2, 3), float(i)))
        return np.full(4, float(i))


@pytest.mark.parametrize("fortran", [False, True], ids=["C order", "Fortran order"])
def test_numpy_arrays_kept_by_the_loop_are_never_overwritten(fortran: bool) -> None:
    """A batch of numpy arrays (a collate_fn that keeps them) views its slot: the slot goes back
    only once no array views it. numpy shortened the arrays' base to the segment's, so the slot
    went back at delivery, and later batches overwrote the kept ones."""
    loader = IsolatedLoader(NumpyRows(fortran), batch_size=2, num_workers=2, collate_fn=keep_list)
    kept = list(loader)
    assert [[float(a.flat[0]) for a in b] for b in kept] == [[2 * k, 2 * k + 1] for k in range(8)]
    assert all(float(a.max()) == float(a.min()) for b in kept for a in b)


def test_slots_return_when_batches_are_dropped() -> None:
    """A loop that drops each batch reuses slots: 100 batches fit in the first slots made."""
    iterator = iter(IsolatedLoader(Ids(400), batch_size=4, num_workers=2))
    for batch in iterator:
        assert batch.shape == (4,)
    segments = iterator._links.links[0].reader._segments.values()  # type: ignore[attr-defined]
    first = next(iter(segments)).count
    # Without reuse, 100 batches would need 100 slots; releases that lag on a loaded machine
    # may add one segment as large as the first.
    assert sum(s.count for s in segments) <= 2 * first < 100


class Growing(Dataset[Any]):
    """Item i: a tensor of i + 1 floats (padded per batch by collate) and a numpy array."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> Any:
        return torch.full((1 + index * 50,), float(index)), np.arange(index, dtype=np.int32)


def pad_and_keep_numpy(items: list[Any]) -> dict[str, Any]:
    """A collate_fn with variable-size tensors (padded) and numpy arrays left as they are."""
    width = max(t.numel() for t, _ in items)
    padded = torch.zeros(len(items), width)
    for row, (t, _) in enumerate(items):
        padded[row, : t.numel()] = t
    return {"x": padded, "x_t": padded.t(), "arrays": [a for _, a in items], "n": len(items)}


def test_batches_larger_than_the_slots_grow_the_ring_and_arrive_intact() -> None:
    """Batches growing past the slot size arrive exactly, numpy leaves and strides included."""
    loader = IsolatedLoader(Growing(), batch_size=4, num_workers=2, collate_fn=pad_and_keep_numpy)
    reference = [
        pad_and_keep_numpy([Growing()[i] for i in range(k, k + 4)]) for k in range(0, 40, 4)
    ]
    for ours, want in zip(loader, reference, strict=True):
        assert torch.equal(ours["x"], want["x"]) and ours["x_t"].stride() == want["x_t"].stride()
        assert ours["n"] == 4
        for a, b in zip(ours["arrays"], want["arrays"], strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def views_and_odd_arrays(items: list[Any]) -> dict[str, Any]:
    """A collate_fn whose leaves share memory, plus a 0-d and a Fortran-ordered array."""
    tokens = torch.tensor([int(i) for i in items])
    return {
        "tokens": tokens,
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "total": np.array(float(sum(int(i) for i in items))),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) + int(items[0])),
    }


@pytest.mark.parametrize("isolation", [None, "process"])
def test_leaves_sharing_memory_still_share_it_and_arrays_keep_their_shape(
    isolation: str | None,
) -> None:
    """Views of one tensor arrive as views of one tensor (an in-place change shows in all, as
    in-process and through torch's workers); a 0-d array stays 0-d, Fortran order stays."""
    loader = ThreadDataLoader(
        Ids(12), batch_size=4, num_workers=2, collate_fn=views_and_odd_arrays, isolation=isolation
    )
    for batch in loader:
        first = int(batch["tokens"][0])
        assert batch["total"].shape == () and float(batch["total"]) == 4 * first + 6
        assert batch["fortran"].flags.f_contiguous and not batch["fortran"].flags.c_contiguous
        assert np.array_equal(batch["fortran"], np.arange(6.0).reshape(2, 3) + first)
        batch["tokens"].mul_(10)
        assert batch["inputs"].tolist() == [10 * (first + k) for k in range(3)]
        assert batch["targets"].tolist() == [10 * (first + k) for k in range(1, 4)]


class PrefixAndWhole(Dataset[Any]):
    """Tensors over two storages starting at one address: ``torch.from_numpy`` of a prefix of
    an array (first, and only 1 byte long) and of the whole array."""

    def __init__(self) -> None:
        self.array = np.arange(64, dtype=np.uint8)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"head": torch.from_numpy(self.array[:1]), "all": torch.from_numpy(self.array)}


@pytest.mark.parametrize("isolation", [None, "process"])
def test_storages_starting_at_one_address_arrive_whole(isolation: str | None) -> None:
    loader = ThreadDataLoader(PrefixAndWhole(), batch_size=None, num_workers=2, isolation=isolation)
    for item in loader:
        assert item["all"].tolist() == list(range(64))
        assert item["head"].tolist() == [0]


def expanded_and_empty(items: list[Any]) -> dict[str, Any]:
    """A collate_fn returning, every other batch from the first on, only empty tensors, and an
    expanded (stride-0) tensor in the others."""
    first = int(items[0])
    if first % 8 == 0:
        return {"empty": torch.zeros(len(items), 0, 3), "none": torch.empty(0)}
    return {"row": torch.tensor([float(first), 1.0]).expand(3, 2)}


@pytest.mark.parametrize("isolation", [None, "process"])
def test_expanded_tensors_and_empty_batches_arrive_as_in_process(isolation: str | None) -> None:
    """An expanded tensor keeps its strides (its elements overlap: a dense copy would let an
    in-place write succeed where torch refuses it); a batch of empty tensors needs no bytes
    (isolation asserted on the missing slot)."""
    loader = ThreadDataLoader(
        Ids(16), batch_size=4, num_workers=2, collate_fn=expanded_and_empty, isolation=isolation
    )
    batches = list(loader)
    assert len(batches) == 4
    for k, batch in enumerate(batches):
        if k % 2 == 0:
            assert tuple(batch["empty"].shape) == (4, 0, 3) and batch["none"].numel() == 0
            continue
        assert batch["row"].stride() == (0, 1)
        assert batch["row"].tolist() == [[4.0 * k, 1.0]] * 3
        with pytest.raises(RuntimeError, match="single memory location"):
            batch["row"].mul_(2)


def test_a_delivered_batch_is_writable_and_its_own() -> None:
    """Writing into a delivered batch changes neither the next batches nor the dataset."""
    iterator = iter(IsolatedLoader(Ids(40), batch_size=4, num_workers=2))
    first = next(iterator)
    first.fill_(-1)
    rest = list(iterator)
    assert [int(x) for b in rest for x in b] == list(range(4, 40))


# --------------------------------------------------------------------------------------------
# Shutdown: the helper process never outlives its use


def test_helper_ends_after_exhaustion() -> None:
    """Iterating to the end ends and joins the helper before StopIteration is raised."""
    iterator = iter(IsolatedLoader(Ids(40), batch_size=4, num_workers=2))
    assert len(_helpers()) == 1
    assert len(list(iterator)) == 10
    assert _helpers() == []


def test_a_process_forked_meanwhile_does_not_hold_the_helper_open() -> None:
    """A process forked while a helper runs (torch's DataLoader workers for a validation pass,
    a user's fork) gets copies of the training process's ends of the helper's pipes; holding
    the control pipe's, it kept the helper from seeing its EOF, and each epoch's end waited
    ``CLOSE_WAIT_S`` (5 s) before killing it. Forked children close their copies at once."""
    iterator = iter(IsolatedLoader(Ids(40), batch_size=4, num_workers=2))
    next(iterator)
    bystander = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    bystander.start()
    try:
        start = time.monotonic()
        assert len(list(iterator)) == 9
        assert time.monotonic() - start < link.CLOSE_WAIT_S / 2
        assert _helpers() == []
    finally:
        bystander.kill()
        bystander.join()


def test_helper_ends_after_break_del_and_garbage_collection() -> None:
    """break, del and a reference cycle collected by gc each end the helper."""
    loader = IsolatedLoader(Ids(400), batch_size=4, num_workers=2)
    for _ in loader:
        break
    assert _helpers() == []
    iterator = iter(loader)
    next(iterator)
    del iterator
    assert _helpers() == []
    iterator = iter(loader)
    next(iterator)
    holder: dict[str, object] = {"it": iterator}
    holder["self"] = holder
    del iterator, holder
    assert len(_helpers()) == 1
    gc.collect()
    assert _helpers() == []


def test_helper_ends_when_the_iterator_is_dropped_after_a_worker_exception() -> None:
    """Leaving the loop through a worker's exception ends the helper."""
    with pytest.raises(ValueError, match="cannot read item 5"):
        for _ in IsolatedLoader(FailsAtFive(), batch_size=2, num_workers=2):
            pass
    assert _helpers() == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_keyboard_interrupt_while_waiting_ends_the_helper() -> None:
    """Ctrl-C while next() waits for a slow batch raises KeyboardInterrupt and ends the helper."""
    iterator = iter(IsolatedLoader(SlowItems(delay=0.2), batch_size=8, num_workers=2))
    pid = iterator.helper_pid  # type: ignore[attr-defined]
    interrupted_next(iterator, after_s=0.3)
    assert _helpers() == [] and _gone(pid)
    with pytest.raises(RuntimeError, match="was closed"):
        next(iterator)


def test_persistent_helper_survives_epochs_and_ends_with_the_loader() -> None:
    """persistent_workers keeps one helper across epochs, also abandoned ones; del ends it."""
    loader = IsolatedLoader(Ids(40), batch_size=4, num_workers=2, persistent_workers=True)
    assert len(list(loader)) == 10
    first = _helpers()
    for _ in range(2):
        for _batch in loader:
            break
        assert _helpers() == first
    assert [int(x) for b in loader for x in b] == list(range(40))  # parked batches given back
    del loader
    gc.collect()
    assert _helpers() == []


_CHILD = """
import os, sys, time, torch
from torch.utils.data import TensorDataset
from threadloader import ThreadDataLoader
from threadloader.isolation.parent import IsolatedDataLoaderIter
loader = ThreadDataLoader(TensorDataset(torch.arange(10_000)), batch_size=2, num_workers=2)
it = IsolatedDataLoaderIter(loader)
next(it)
print(it.helper_pid, flush=True)
{tail}
"""


def _child_tree(tail: str) -> tuple[subprocess.Popen[str], int, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD.format(tail=tail))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.communicate(timeout=30)
    helper = int(line)
    try:
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    return proc, helper, tree


class ShardsInIter(IterableDataset[Any]):
    """``__iter__`` a plain method (not a generator): it shards, and draws from torch's global
    RNG, when ``iter()`` is called on the dataset, at each epoch's start."""

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        ids = range(6) if info is None else range(info.id, 6, info.num_workers)
        offset = int(torch.randint(0, 1000, ()))
        return iter([(i, offset) for i in ids])


def test_persistent_workers_run_each_epochs_iter_as_their_worker() -> None:
    """Every epoch's ``__iter__`` runs as its worker in the helper: sharded, the worker's draws."""
    kwargs: dict[str, Any] = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}
    torch.manual_seed(5)
    theirs = torch_epochs(ShardsInIter(), epochs=3, **kwargs)
    torch.manual_seed(5)
    ours = collect_epochs(ThreadDataLoader(ShardsInIter(), isolation="process", **kwargs), 3)
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], theirs[epoch])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_helper_exits_when_the_training_process_is_sigkilled() -> None:
    """SIGKILL of the training process (no cleanup runs there) still ends the helper."""
    proc, helper, tree = _child_tree("time.sleep(60)")
    assert helper in tree
    proc.kill()
    proc.wait(timeout=10)
    proc.communicate()
    assert _wait_gone([helper, *tree], timeout=10.0) == []


def test_interpreter_exit_with_a_live_iterator_ends_the_helper() -> None:
    """A script ending with an iterator still referenced exits cleanly, helper included."""
    proc, helper, _ = _child_tree("")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stderr == ""
    assert _wait_gone([helper]) == []


@pytest.mark.skipif(
    "spawn" not in multiprocessing.get_all_start_methods(), reason="needs the spawn start method"
)
def test_spawn_context_gives_the_same_batches() -> None:
    """multiprocessing_context='spawn' (the default where there is no forkserver) works too."""
    dataset = torch.utils.data.TensorDataset(torch.arange(46.0).reshape(23, 2))  # torch only
    kwargs = {"batch_size": 5, "shuffle": True}
    theirs = torch_epochs(dataset, generator=torch.Generator().manual_seed(3), **kwargs)[0]
    loader = IsolatedLoader(
        dataset, num_workers=2, multiprocessing_context="spawn",
        generator=torch.Generator().manual_seed(3), **kwargs,
    )  # fmt: skip
    assert_epochs_equal(collect(loader), theirs)


def test_pin_memory_without_accelerator_warns_like_torch_and_gives_the_batches() -> None:
    """pin_memory=True where there is nothing to pin for: torch's warning, the same batches."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: tests/cuda covers pinning")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = collect(IsolatedLoader(Ids(20), batch_size=4, num_workers=2, pin_memory=True))
    assert any("pin_memory" in str(w.message) for w in caught)
    assert [int(x) for b in ours for x in b] == list(range(20))


def test_device_option_drives_the_isolated_epoch() -> None:
    """device= wraps the isolated epoch like any other: the same batches, the helper ended."""
    loader = IsolatedLoader(Ids(40), batch_size=4, num_workers=2, device="cpu")
    assert [int(x) for b in loader for x in b] == list(range(40))
    assert loader.state_dict()["in_progress"] is False


class CountsPickling(Dataset[int]):
    """Counts, in the process that made it, how often it was pickled."""

    pickled = 0

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index

    def __getstate__(self) -> dict[str, Any]:
        type(self).pickled += 1
        return self.__dict__


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_dataset_is_pickled_once_per_helper_whatever_the_workers(persistent_workers: bool) -> None:
    """Three worker threads share one copy: pickled once per helper (once in all if persistent)."""
    CountsPickling.pickled = 0
    loader = IsolatedLoader(
        CountsPickling(),
        batch_size=2,
        num_workers=3,
        persistent_workers=persistent_workers,
        multiprocessing_context=PICKLED,
    )
    for _ in range(2):
        assert [int(x) for b in loader for x in b] == list(range(12))
    assert CountsPickling.pickled == (1 if persistent_workers else 2)
    del loader
    gc.collect()


class MadeWhenPickled(Dataset[Any]):
    """Pickles as a tensor it makes then: nothing else holds it."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> int:
        return self.values[index]

    def __reduce__(self) -> tuple[Any, ...]:
        return _remade, (torch.tensor(self.values),)


def _remade(values: torch.Tensor) -> MadeWhenPickled:
    return MadeWhenPickled(values.tolist())


def test_a_tensor_made_while_pickling_the_dataset_reaches_the_helper() -> None:
    """A tensor travels to a helper as shared memory whose descriptor is sent after pickling:
    one that pickling made, and nothing kept, would close it first (torch's forkserver workers
    exit unexpectedly there)."""
    loader = IsolatedLoader(
        MadeWhenPickled(list(range(8))),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=PICKLED,
    )
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_helper_runs_one_set_of_threads_per_loader() -> None:
    """The helper runs num_workers runner threads (and its main thread); the dataset is loaded once."""
    iterator = iter(IsolatedLoader(ThreadsInHelper(), batch_size=None, num_workers=3))
    names = next(iterator)
    del iterator
    workers = sorted(n for n in names if n.startswith("threadloader-helper-runner"))
    assert workers == [f"threadloader-helper-runner{i}" for i in range(3)]
    assert len(names) == 4  # and the main thread, which waits for the end


class ThreadsInHelper(Dataset[Any]):
    """Item: the names of the threads of the process it is fetched in, once all workers run."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            names = [t.name for t in threading.enumerate()]
            if sum(n.startswith("threadloader-helper-runner") for n in names) == info.num_workers:
                break
            time.sleep(0.01)
        return names


_ = (itertools, IterableDataset, _isolated_worker)
