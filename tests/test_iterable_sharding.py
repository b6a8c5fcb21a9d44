"""IterableDatasets sharded with get_worker_info() come out in the order torch's process loader gives.

The reference is torch's DataLoader with the same num_workers as *processes*: it deals batches to
workers round-robin and skips workers that ran out, and ThreadDataLoader must interleave the same
way, including workers that yield fewer items than the others or none at all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_epochs_equal, collect, collect_epochs, torch_epochs, torch_loader
from torch.utils.data import IterableDataset

from threadloader import ThreadDataLoader


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Interleaved(IterableDataset[Any]):
    """Worker w of N yields w, w + N, w + 2N, ... below 17: every item exactly once overall."""

    def __iter__(self) -> Iterator[int]:
        worker, workers = _worker()
        return iter(range(worker, 17, workers))


class Uneven(IterableDataset[Any]):
    """Worker w yields w + 1 items, so lower workers run out first."""

    def __iter__(self) -> Iterator[Any]:
        worker, _ = _worker()
        for k in range(worker + 1):
            yield (100 * worker + k, f"w{worker}")


class FirstWorkerEmpty(IterableDataset[Any]):
    """Worker 0 yields nothing; worker w > 0 yields 2 + 2w items."""

    def __iter__(self) -> Iterator[int]:
        worker, _ = _worker()
        return iter([] if worker == 0 else range(100 * worker, 100 * worker + 2 + 2 * worker))


class MiddleWorkerEmpty(IterableDataset[Any]):
    """Worker 1 yields nothing; the others yield 5 items each, as dicts."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker, _ = _worker()
        for k in range(0 if worker == 1 else 5):
            yield {"value": torch.tensor([worker, k]), "worker": worker}


class Replicated(IterableDataset[Any]):
    """Ignores workers: each worker yields the same 7 items (torch duplicates them)."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(7))


DATASETS = {
    "interleaved": Interleaved,
    "uneven": Uneven,
    "first worker empty": FirstWorkerEmpty,
    "middle worker empty": MiddleWorkerEmpty,
    "replicated": Replicated,
}
BATCHING = {
    "batch_size 2": {"batch_size": 2},
    "batch_size 3": {"batch_size": 3},
    "batch_size 3 drop_last": {"batch_size": 3, "drop_last": True},
    "batch_size None": {"batch_size": None},
}


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("dataset", DATASETS)
def test_sharded_iterable_order_matches_process_dataloader(
    dataset: str, batching: str, num_workers: int
) -> None:
    """Batches of a sharded IterableDataset equal torch's process loader's, in the same order."""
    kwargs = {**BATCHING[batching], "num_workers": num_workers}
    theirs = torch_epochs(DATASETS[dataset](), **kwargs)[0]
    ours = collect(ThreadDataLoader(DATASETS[dataset](), **kwargs))
    assert_epochs_equal(ours, theirs)


@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("dataset", DATASETS)
def test_iterable_without_workers_matches_dataloader(dataset: str, batching: str) -> None:
    """With num_workers=0 an IterableDataset yields torch's batches (get_worker_info() is None)."""
    theirs = torch_epochs(DATASETS[dataset](), **BATCHING[batching])[0]
    ours = collect(ThreadDataLoader(DATASETS[dataset](), **BATCHING[batching]))
    assert_epochs_equal(ours, theirs)


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("num_workers", [2, 3])
def test_sharded_iterable_epochs_match_process_dataloader(
    num_workers: int, persistent_workers: bool
) -> None:
    """Every epoch of a sharded IterableDataset restarts each shard, as torch's loader does."""
    kwargs = {"batch_size": 2, "num_workers": num_workers, "persistent_workers": persistent_workers}
    theirs = torch_epochs(Uneven(), epochs=3, **kwargs)
    ours = collect_epochs(ThreadDataLoader(Uneven(), **kwargs), 3)
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], theirs[epoch])


class CopyRecorder(IterableDataset[Any]):
    """Records which dataset object each worker iterates, and the WorkerInfo's dataset."""

    seen: list[tuple[int, Any, Any, int]] = []  # on the class: every copy records here
    lock = threading.Lock()

    def __init__(self) -> None:
        self.payload = list(range(1000))
        self.array = np.arange(100_000)
        self.array.flags.writeable = False  # read-only: shared by the copies
        self.scratch = np.zeros(1000)  # writeable: each copy has its own
        CopyRecorder.seen = []

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        with CopyRecorder.lock:
            self.seen.append((-1 if info is None else info.id, self, info, threading.get_ident()))
        worker, workers = _worker()
        return iter(range(worker, 9, workers))


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_each_worker_iterates_its_own_independent_copy(num_workers: int) -> None:
    """Each worker's __iter__ runs on its own copy, its WorkerInfo.dataset, sharing no mutable
    member with the others or the user's dataset (as a spawned worker process's unpickled
    copy); large arrays are not duplicated."""
    dataset = CopyRecorder()
    batches = collect(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    assert sorted(torch.cat(batches).tolist()) == list(range(9))
    assert sorted(worker for worker, *_ in dataset.seen) == list(range(num_workers))
    copies = [copy for _, copy, _, _ in dataset.seen]
    assert len({id(copy) for copy in copies}) == num_workers
    assert len({id(copy.payload) for copy in copies} | {id(dataset.payload)}) == num_workers + 1
    for _, copy, info, ident in dataset.seen:
        assert copy is not dataset
        assert type(copy) is CopyRecorder
        assert info.dataset is copy
        assert copy.payload == dataset.payload
        assert copy.array is dataset.array  # read-only data is shared
        assert copy.scratch is not dataset.scratch
        assert ident != threading.get_ident()


def test_without_workers_the_dataset_itself_is_iterated() -> None:
    """With num_workers=0, __iter__ runs on the loader's own dataset in the calling thread."""
    dataset = CopyRecorder()
    collect(ThreadDataLoader(dataset, batch_size=2))
    assert [(w, c, i, t) for w, c, i, t in dataset.seen] == [
        (-1, dataset, None, threading.get_ident())
    ]


class ShuffledInPlace(IterableDataset[int]):
    """Each worker shuffles its copy's order array in place, then reads its share of it."""

    def __init__(self) -> None:
        self.order = np.arange(64)

    def __iter__(self) -> Iterator[int]:
        worker, workers = _worker()
        np.random.default_rng(0).shuffle(self.order)  # the same permutation in every worker
        return iter(int(i) for i in self.order[worker::workers])


def test_a_writeable_array_is_each_workers_own() -> None:
    """Shared, the workers' in-place shuffles raced: items were lost and repeated, and the
    user's dataset changed. As with worker processes, each copy has its own array."""
    dataset = ShuffledInPlace()
    ours = sorted(int(x) for x in ThreadDataLoader(dataset, batch_size=None, num_workers=4))
    theirs = sorted(int(x) for x in torch_loader(ShuffledInPlace(), batch_size=None, num_workers=4))
    assert ours == theirs == list(range(64))
    assert np.array_equal(dataset.order, np.arange(64))
