"""Each worker thread sees its own copy of the dataset object, as each worker process does.

Every expected value comes from torch's DataLoader with worker processes on the same dataset.
"""

from __future__ import annotations

import gc
import time
import warnings
import weakref
from typing import Any

import pytest
import torch
from helpers import assert_batches_equal, collect, collect_epochs
from torch.utils.data import DataLoader, Dataset, get_worker_info

from threadloader import ThreadDataLoader


class Tagged(Dataset[torch.Tensor]):
    """Item i: i, the worker id cached on ``self`` at the worker's first item, the tag a
    worker_init_fn set on its dataset, and ``epoch_tag`` as the worker's copy sees it."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.epoch_tag = 0
        self.big = list(range(1000))  # referenced, not copied

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not hasattr(self, "cached_id"):
            self.cached_id = get_worker_info().id
        time.sleep(0.0005)
        return torch.tensor([i, self.cached_id, getattr(self, "tag", -1), self.epoch_tag])


def _tag_worker(worker_id: int) -> None:
    get_worker_info().dataset.tag = 100 + worker_id


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("isolation", [None, "process"])
def test_what_a_worker_sets_on_its_dataset_is_its_own(
    num_workers: int, isolation: str | None
) -> None:
    """An attribute a worker_init_fn sets on get_worker_info().dataset, and a worker id an item
    caches on self, belong to that worker; the user's dataset object is untouched."""
    dataset = Tagged()
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers}
    theirs = collect(DataLoader(dataset, worker_init_fn=_tag_worker, **kwargs))
    ours = collect(
        ThreadDataLoader(dataset, worker_init_fn=_tag_worker, isolation=isolation, **kwargs)
    )
    assert_batches_equal(ours, theirs)
    assert not hasattr(dataset, "tag") and not hasattr(dataset, "cached_id")


class Changing(Tagged):
    pass


def test_persistent_workers_keep_the_copy_they_started_with() -> None:
    """Changes the training loop makes to the dataset between epochs are not seen by persistent
    workers (their copy was made when they started), as with torch's."""

    def two_epochs(loader_class: Any) -> list[list[Any]]:
        dataset = Changing(8)
        loader = loader_class(dataset, batch_size=2, num_workers=2, persistent_workers=True)
        epochs = collect_epochs(loader, 1)
        dataset.epoch_tag = 1
        return epochs + collect_epochs(loader, 1)

    ours, theirs = two_epochs(ThreadDataLoader), two_epochs(DataLoader)
    assert_batches_equal(ours, theirs)
    assert all(int(batch[0, 3]) == 0 for epoch in ours for batch in epoch)


def test_a_worker_copy_shares_the_data_it_references() -> None:
    """The copy is shallow: the arrays and lists the dataset holds are the same objects."""
    dataset = Tagged(4)
    seen: list[Any] = []

    def record(worker_id: int) -> None:
        seen.append(get_worker_info().dataset)

    collect(ThreadDataLoader(dataset, num_workers=2, worker_init_fn=record))
    assert len(seen) == 2 and seen[0] is not seen[1] and dataset not in seen
    assert all(copy_.big is dataset.big for copy_ in seen)


class Uncopyable(Dataset[int]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        return i

    def __copy__(self) -> Uncopyable:
        raise TypeError("no copies of this one")


def test_a_dataset_that_cannot_be_copied_is_shared_with_one_warning() -> None:
    dataset = Uncopyable()
    seen: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = ThreadDataLoader(
            dataset, num_workers=2, worker_init_fn=lambda _: seen.append(get_worker_info().dataset)
        )
        assert [int(b) for b in collect(loader)] == list(range(6))
        collect(loader)
    messages = [str(w.message) for w in caught if "cannot copy Uncopyable" in str(w.message)]
    assert len(messages) == 1 and "no copies of this one" in messages[0]
    assert all(s is dataset for s in seen)


class WhoMadeIt(Dataset[torch.Tensor]):
    def __init__(self, slow: int | None = None) -> None:
        self.slow = slow

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            time.sleep(1.0)
        return torch.tensor([i, get_worker_info().id])


@pytest.mark.parametrize("num_workers", [2, 3])
def test_in_order_batch_i_is_made_by_worker_i_mod_n(num_workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers}
    theirs = collect(DataLoader(WhoMadeIt(), **kwargs))
    ours = collect(ThreadDataLoader(WhoMadeIt(), **kwargs))
    assert_batches_equal(ours, theirs)
    assert [int(b[0, 1]) for b in ours] == [i % num_workers for i in range(len(ours))]


def test_out_of_order_batches_come_as_torchs_per_worker_queues_give_them() -> None:
    """in_order=False, one slow item: the slow worker keeps the prefetch_factor tasks it was
    sent, the other worker makes every later batch, as with torch's worker processes."""
    kwargs: dict[str, Any] = {"batch_size": 1, "num_workers": 2, "in_order": False}
    theirs = [b.tolist() for b in DataLoader(WhoMadeIt(slow=0), **kwargs)]
    ours = [b.tolist() for b in ThreadDataLoader(WhoMadeIt(slow=0), **kwargs)]
    assert ours == theirs


class _RecordsItsCopies(Dataset[int]):
    """Each copy that makes an item records a weak reference to itself (an open file, in a real
    dataset, that should close when the copy goes)."""

    copies: list[Any] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if not any(ref() is self for ref in self.copies):
            self.copies.append(weakref.ref(self))
        return i


@pytest.mark.parametrize("isolation", ["threads", "auto"])
def test_an_epochs_dataset_copies_are_freed_without_the_cyclic_gc(isolation: str) -> None:
    """Once an epoch without persistent workers ends, its workers' copies go at once, as a worker
    process's do when it exits: a file a copy opened closes then, not at some later GC pass
    (``python -X dev`` would warn of it unclosed)."""
    dataset = _RecordsItsCopies()
    _RecordsItsCopies.copies = []
    loader = ThreadDataLoader(dataset, batch_size=4, num_workers=2, isolation=isolation)
    gc.disable()
    try:
        assert sorted(i for batch in loader for i in batch.tolist()) == list(range(16))
        deadline = time.monotonic() + 10
        while any(ref() is not None for ref in _RecordsItsCopies.copies):
            assert time.monotonic() < deadline, "a worker's copy outlived its epoch"
            time.sleep(0.01)
    finally:
        gc.enable()
    assert _RecordsItsCopies.copies, "no worker made an item: the scenario is wrong"
