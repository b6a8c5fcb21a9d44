"""Threads that item code starts belong to its worker, as threads of a worker process do.

A dataset that decodes a batch's files on a ``ThreadPoolExecutor``, or a transform that runs in a
thread, sees the worker's ``get_worker_info()`` there and draws from the worker's global RNGs,
never from the training process's. Every expected value comes from torch's DataLoader.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_batches_equal
from test_isolation import _fast_helper_starts, _no_helper_left_behind  # noqa: F401
from torch.utils.data import DataLoader, Dataset, get_worker_info

from threadloader import ThreadDataLoader


def _in_a_thread() -> tuple[Any, float, float, float]:
    """What a thread the item started sees: its worker, and one draw from each global RNG."""
    info = get_worker_info()
    who = None if info is None else (info.id, info.num_workers, info.seed)
    return who, float(torch.rand(())), random.random(), float(np.random.rand())


class PoolItems(Dataset[Any]):
    """Each item runs its work on a pool of its own (a thread started by the item)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        with ThreadPoolExecutor(1) as pool:
            return i, pool.submit(_in_a_thread).result()


class ThreadItems(Dataset[Any]):
    """Each item starts a plain ``threading.Thread`` subclass and joins it."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        out: list[Any] = []

        class Transform(threading.Thread):
            def run(self) -> None:
                out.append(_in_a_thread())

        t = Transform()
        t.start()
        t.join()
        return i, out[0]


def _run(cls: type, dataset: Dataset[Any], **kwargs: Any) -> tuple[list[Any], float]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    batches = list(cls(dataset, batch_size=None, num_workers=2, **kwargs))
    return batches, float(torch.rand(()))  # the training process's generator afterwards


@pytest.mark.parametrize("dataset", [PoolItems(), ThreadItems()], ids=["pool", "thread"])
@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_thread_an_item_starts_sees_its_worker_and_draws_from_its_rngs(
    dataset: Dataset[Any], isolation: str
) -> None:
    ours, our_after = _run(ThreadDataLoader, dataset, isolation=isolation)
    theirs, their_after = _run(DataLoader, dataset)
    assert_batches_equal(ours, theirs)
    assert all(who is not None for _, (who, *_) in ours)
    assert our_after == their_after  # the training process's generator was not drawn from


def test_a_thread_started_outside_the_workers_is_untouched() -> None:
    list(ThreadDataLoader(PoolItems(), batch_size=None, num_workers=2))  # the patch is in
    torch.manual_seed(5)
    expected = float(torch.rand(()))
    torch.manual_seed(5)
    with ThreadPoolExecutor(1) as pool:
        who, draw, *_ = pool.submit(_in_a_thread).result()
    assert who is None
    assert draw == expected  # the process's own generator


class LibraryThreadItems(Dataset[Any]):
    """Each item starts a thread named as threadloader's own (the remote read pool's)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(get_worker_info()), name="threadloader-x")
        t.start()
        t.join()
        return out[0] is None


def test_the_librarys_own_threads_never_join_a_worker() -> None:
    """RemoteFiles' read pool serves every worker of the process: none is its worker."""
    assert list(ThreadDataLoader(LibraryThreadItems(), batch_size=None, num_workers=2)) == [
        True,
        True,
    ]


class SharedPoolItems(Dataset[Any]):
    """A pool made in ``__init__``: every worker's shallow copy shares it here, where each
    worker process forks a pool of its own (threads not started yet)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return i, self.pool.submit(_in_a_thread).result()


def test_work_a_worker_submits_to_a_shared_pool_runs_as_that_worker() -> None:
    ours, our_after = _run(ThreadDataLoader, SharedPoolItems())
    theirs, their_after = _run(DataLoader, SharedPoolItems())
    assert_batches_equal(ours, theirs)
    assert our_after == their_after


class LazyPoolItems(Dataset[int]):
    """Each worker's copy makes a pool on first use (as fork-safe datasets do), noting itself."""

    pool: ThreadPoolExecutor | None = None

    def __init__(self, copies: list[Any]) -> None:
        self.copies = copies

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(2)
            self.copies.append(weakref.ref(self))
        return sum(self.pool.map(abs, range(i, i + 4)))


def test_threads_a_worker_started_keep_neither_its_dataset_copy_nor_its_pool_alive() -> None:
    """A pool's threads hold their pool weakly: if they held the worker's info, which holds
    its dataset copy, which holds the pool, every epoch would leak a copy and its threads."""
    copies: list[Any] = []
    before = threading.active_count()
    loader = ThreadDataLoader(LazyPoolItems(copies), batch_size=4, num_workers=2)
    for _ in range(3):
        list(loader)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()
        if not any(ref() is not None for ref in copies) and threading.active_count() <= before:
            break
        time.sleep(0.05)
    assert len(copies) == 6  # two workers' copies in each of three epochs
    assert [ref() for ref in copies] == [None] * 6
    assert threading.active_count() <= before
