"""Datasets that keep their own state resume as with torchdata's StatefulDataLoader.

torchdata's protocol: a dataset (map-style or iterable) with ``state_dict``/``load_state_dict``,
and the iterator an IterableDataset's ``__iter__`` returns when that one is stateful, are saved per
worker and restored in StatefulDataLoader's order (dataset, then ``iter()``, then iterator). Each
case runs the same datasets through both loaders, cut at the same points, and compares what the
resumed loaders deliver with an uninterrupted run.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

from threadloader import ThreadDataLoader


class CountingMap(Dataset[torch.Tensor]):
    """Map-style; item i comes with how many items this copy served before it (its state)."""

    def __init__(self) -> None:
        self.served = 0

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        self.served += 1
        return torch.tensor([i, self.served])

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.served = state["served"]


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class OwnIterator(IterableDataset[torch.Tensor]):
    """``__iter__`` returns the dataset itself and rewinds it there: its state must be loaded
    after ``iter()``. Each epoch is numbered, so an epoch counter is part of the state too."""

    def __init__(self) -> None:
        self.pos = 0
        self.epoch = -1

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.pos = 0
        self.epoch += 1
        return self

    def __next__(self) -> torch.Tensor:
        worker, workers = _shard()
        index = worker + self.pos * workers
        if index >= 18:
            raise StopIteration
        self.pos += 1
        return torch.tensor([index, self.epoch])

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


class _Cursor:
    """A stateful iterator: torchdata saves it separately from its dataset."""

    def __init__(self, dataset: ShuffledStream, values: list[int]) -> None:
        self.dataset, self.values, self.at = dataset, values, 0

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> torch.Tensor:
        if self.at >= len(self.values):
            self.dataset.epochs += 1  # the epoch is over: the next one shuffles anew
            raise StopIteration
        self.at += 1
        return torch.tensor([self.values[self.at - 1], self.dataset.epochs])

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class ShuffledStream(IterableDataset[torch.Tensor]):
    """Counts its finished epochs (the dataset's state, loaded before ``iter()``) and shuffles
    each from that count; the position is the iterator's state (loaded after ``iter()``)."""

    def __init__(self) -> None:
        self.epochs = 0

    def __iter__(self) -> _Cursor:
        worker, workers = _shard()
        order = torch.randperm(18, generator=torch.Generator().manual_seed(self.epochs)).tolist()
        return _Cursor(self, order[worker::workers])

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epochs = state["epochs"]


DATASETS: dict[str, Callable[[], Any]] = {
    "map": CountingMap,
    "own-iterator": OwnIterator,
    "stateful-iterator": ShuffledStream,
}


def _run(
    loader_class: Any, make: Callable[[], Any], cut: int | str | None, **kwargs: Any
) -> list[Any]:
    """Two epochs; with ``cut``, the loader is saved after ``cut`` batches (counted over both
    epochs), ``"between"`` the epochs (after the first one's ``StopIteration``), or once the
    ``"second iter"`` began, before its first batch; and a new
    loader on a new dataset finishes the two epochs from that state."""
    loader = loader_class(make(), batch_size=2, **kwargs)
    if cut is None:
        return [b.tolist() for epoch in range(2) for b in loader]
    if cut in ("between", "second iter"):
        first = [b.tolist() for b in loader]
        second = iter(loader) if cut == "second iter" else None  # started, nothing taken
        resumed = loader_class(make(), batch_size=2, **kwargs)
        resumed.load_state_dict(loader.state_dict())
        del second
        return first + [b.tolist() for b in resumed]
    got: list[Any] = []
    epochs_left = 2
    it = iter(loader)
    while len(got) < int(cut):
        try:
            got.append(next(it).tolist())
        except StopIteration:
            epochs_left -= 1
            it = iter(loader)
    state = loader.state_dict()
    del it
    resumed = loader_class(make(), batch_size=2, **kwargs)
    resumed.load_state_dict(state)
    first = list(resumed)
    got += [b.tolist() for b in first]
    if epochs_left == 2:
        got += [b.tolist() for b in resumed]
    return got


@pytest.mark.parametrize("cut", [0, 1, 4, 9, "between", "second iter"])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("name", DATASETS)
def test_a_stateful_dataset_resumes_to_the_uninterrupted_batches_as_with_statefuldataloader(
    name: str, num_workers: int, cut: int | str
) -> None:
    """Saved before the first batch, mid-epoch, at the last batch of an iterable's epoch (9),
    between epochs, and at the start of the second epoch, before its first batch."""
    make = DATASETS[name]
    ours_full = _run(ThreadDataLoader, make, None, num_workers=num_workers)
    theirs_full = _run(StatefulDataLoader, make, None, num_workers=num_workers)
    assert ours_full == theirs_full
    ours = _run(ThreadDataLoader, make, cut, num_workers=num_workers)
    assert ours == _run(StatefulDataLoader, make, cut, num_workers=num_workers)
    assert ours == ours_full


@pytest.mark.parametrize("cut", [1, 4])
@pytest.mark.parametrize("name", DATASETS)
def test_a_stateful_dataset_resumes_exactly_with_isolation(name: str, cut: int) -> None:
    make = DATASETS[name]
    full = _run(ThreadDataLoader, make, None, num_workers=3)
    assert _run(ThreadDataLoader, make, cut, num_workers=3, isolation="process") == full


def test_statefuldataloaders_extra_argument_is_accepted() -> None:
    loader = ThreadDataLoader(CountingMap(), batch_size=4, snapshot_every_n_steps=10)
    assert loader.snapshot_every_n_steps == 10
    assert len(list(itertools.islice(loader, 2))) == 2


class Positioned(IterableDataset[int]):
    """Keeps its position on the dataset; ``__iter__`` returns a generator reading it."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        while self.pos < 12:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_state_saved_with_raw_dataset_states_still_resumes(num_workers: int) -> None:
    """States written before the per-worker {"dataset", "iterator"} form held each worker's
    raw dataset state: they load as before."""
    full = [b.tolist() for b in ThreadDataLoader(Positioned(), batch_size=2)]
    loader = ThreadDataLoader(Positioned(), batch_size=2, num_workers=num_workers)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    assert state.pop("worker_state_form") == 2
    state["worker_states"] = [s["dataset"] for s in state["worker_states"]]
    resumed = ThreadDataLoader(Positioned(), batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full


class RecordsWhoSaves(CountingMap):
    seen: list[Any] = []

    def state_dict(self) -> dict[str, int]:
        RecordsWhoSaves.seen.append(get_worker_info())
        return super().state_dict()


def test_a_dataset_state_is_taken_as_its_worker() -> None:
    """state_dict() runs as the worker that made the batch, wherever it runs (also when the
    training thread made it), as torchdata's worker processes call it."""
    RecordsWhoSaves.seen = []
    loader = ThreadDataLoader(RecordsWhoSaves(), batch_size=2, num_workers=2)
    assert len(list(loader)) == 12
    assert len(RecordsWhoSaves.seen) == 12 and all(i is not None for i in RecordsWhoSaves.seen)


class EndsAndRestarts(IterableDataset[int]):
    """A generator over its worker's shard from a saved position; at its end the position goes
    back to 0 (the next epoch starts at the beginning) and the epoch count goes up."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.epochs = n, 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = get_worker_info()
        ids = list(range(self.n))[info.id :: info.num_workers] if info else list(range(self.n))
        start, self.pos = self.pos, 0
        for k in range(start, len(ids)):
            self.pos = k + 1
            yield ids[k], self.epochs
        self.pos = 0
        self.epochs += 1

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.epochs = state["pos"], state["epochs"]


def _plain(batch: list[torch.Tensor]) -> list[list[int]]:
    return [t.tolist() for t in batch]


def _epochs_after_a_cut(loader_cls: Any, cut: int | None, epochs: int, **kwargs: Any) -> Any:
    """The batches of ``epochs`` epochs: the first cut after ``cut`` batches (None: after its
    ``StopIteration``) and resumed by a new loader, which gives the rest."""
    make = functools.partial(loader_cls, EndsAndRestarts(5), batch_size=2, **kwargs)
    loader = make()
    it = iter(loader)
    head = [_plain(b) for b in itertools.islice(it, cut)]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [[_plain(b) for b in resumed] for _ in range(epochs)]
    return [head + rest[0], *rest[1:]] if cut is not None else [head, *rest[: epochs - 1]]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_state_taken_after_a_persistent_epoch_ended_resumes_every_item(
    num_workers: int, drop_last: bool
) -> None:
    """The last batch was partial (or dropped): the worker's iterator had already run to its
    end when its state was taken, and a resume must not take the next epoch's first item."""
    kwargs: dict[str, Any] = {
        "num_workers": num_workers, "persistent_workers": True, "drop_last": drop_last
    }  # fmt: skip
    uninterrupted = ThreadDataLoader(EndsAndRestarts(5), batch_size=2, **kwargs)
    expected = [[_plain(b) for b in uninterrupted] for _ in range(3)]
    assert _epochs_after_a_cut(ThreadDataLoader, None, 3, **kwargs) == expected


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_state_taken_after_an_iterable_epochs_last_batch_resumes_its_empty_rest(
    num_workers: int, persistent_workers: bool
) -> None:
    """Cut after the last (partial) batch, before ``StopIteration``: the resumed epoch ends at
    once, as the uninterrupted one did, and the next is the uninterrupted next epoch."""
    kwargs: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        kwargs["persistent_workers"] = persistent_workers
    uninterrupted = ThreadDataLoader(EndsAndRestarts(5), batch_size=2, **kwargs)
    expected = [[_plain(b) for b in uninterrupted] for _ in range(3)]
    assert _epochs_after_a_cut(ThreadDataLoader, len(expected[0]), 3, **kwargs) == expected


def _break_then_state_at_the_next_epochs_start(loader_cls: Any, num_workers: int) -> Any:
    """Epoch 0 left after 2 batches; ``state_dict()`` right after the next ``iter()``: the rest
    of that epoch and one more, from the original loader and from a resumed one."""
    make = functools.partial(
        loader_cls,
        EndsAndRestarts(16),
        batch_size=2,
        num_workers=num_workers,
        persistent_workers=True,
        collate_fn=list,
    )
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    del it  # break: each persistent worker drops its iterator where it stood
    it = iter(loader)
    state = loader.state_dict()
    original = [list(it), list(loader)]
    resumed = make()
    resumed.load_state_dict(state)
    return head, original, [list(resumed), list(resumed)]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_state_at_the_start_of_the_epoch_after_a_break_resumes_where_each_worker_left_its_copy(
    num_workers: int,
) -> None:
    """The workers had read ahead of the break, and their copies kept those positions: the
    resumed epoch starts there, as the original did, without asking the dropped iterators for
    one more item (running them to their end is for an epoch that ended)."""
    head, original, resumed = _break_then_state_at_the_next_epochs_start(
        ThreadDataLoader, num_workers
    )
    assert resumed == original
    assert original[0][0][0][0] > head[-1][-1][0] + 1  # the epoch starts past what was read ahead
    reference = _break_then_state_at_the_next_epochs_start(StatefulDataLoader, num_workers)
    assert (head, original, resumed) == reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloader_state_is_refused_naming_it(num_workers: int) -> None:
    """Switching loaders mid-training with a StatefulDataLoader checkpoint fails at the load,
    saying the state is not ours, rather than resuming somewhere else."""
    theirs = StatefulDataLoader(list(range(10)), batch_size=2, num_workers=num_workers)
    iterator = iter(theirs)
    next(iterator)
    state = theirs.state_dict()
    del iterator
    loader = ThreadDataLoader(list(range(10)), batch_size=2, num_workers=num_workers)
    with pytest.raises(ValueError, match="not a ThreadDataLoader state"):
        loader.load_state_dict(state)
