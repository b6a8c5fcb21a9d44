"""Tasks that outrun the helper's reading of its task pipe never block the training process.

The training thread writes tasks and reads results on the one thread, and the helper reads its
task pipe only when its runners have nothing to claim. With large index lists in flight (a big
``batch_size``, many workers, a high ``prefetch_factor``) and results larger than the result
socket's buffer (strings are pickled into the result message), a blocking write would wait for
the helper while the helper's runners waited for the training process to read their results.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest
from helpers import assert_epochs_equal
from test_isolation import (
    _fast_helper_starts,  # noqa: F401  # the module's autouse fixtures, here too
    _no_helper_left_behind,  # noqa: F401
)
from torch.utils.data import DataLoader, Dataset

from threadloader import ThreadDataLoader
from threadloader.isolation.task_pipe import TaskPipe, frame


class Texts(Dataset[str]):
    """Distinct 320-byte strings: a batch of them is pickled into its result message."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> str:
        return f"{index:08d}" * 40


def _first_batches(loader: Any, count: int) -> list[Any]:
    iterator = iter(loader)
    try:
        return [next(iterator) for _ in range(count)]
    finally:
        del iterator


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
@pytest.mark.parametrize("helpers", [1, 2])
def test_many_large_tasks_and_large_results_do_not_deadlock(helpers: int) -> None:
    """32 tasks of 2,048 indices (~320 KiB, 5x the task pipe) and 650 KiB results each."""
    kwargs: dict[str, Any] = {"batch_size": 2048, "num_workers": 4, "prefetch_factor": 8}
    ours = _first_batches(
        ThreadDataLoader(Texts(), isolation="process", helpers=helpers, **kwargs), 12
    )
    theirs = _first_batches(DataLoader(Texts(), **kwargs), 12)
    assert_epochs_equal(ours, theirs)


class Sums(Dataset[int]):
    """An index list larger than the task pipe (one task of 40,000 indices, ~170 KiB pickled)."""

    def __len__(self) -> int:
        return 200_000

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [sum(indices)]


def _sum_collate(batch: list[int]) -> int:
    return batch[0]


@pytest.mark.timeout(60)
def test_a_task_larger_than_the_task_pipe_arrives_whole() -> None:
    kwargs: dict[str, Any] = {"batch_size": 40_000, "num_workers": 2, "collate_fn": _sum_collate}
    ours = list(ThreadDataLoader(Sums(), isolation="process", **kwargs))
    assert ours == [sum(range(i, i + 40_000)) for i in range(0, 200_000, 40_000)]


@pytest.mark.timeout(60)
def test_a_helper_killed_while_tasks_wait_for_room_raises_naming_its_pid() -> None:
    loader = ThreadDataLoader(
        Texts(), batch_size=4096, num_workers=4, prefetch_factor=8, isolation="process"
    )
    iterator = iter(loader)
    next(iterator)
    pid = iterator.helper_pid  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"pid\(s\) {pid}\) exited unexpectedly"):
        for _ in range(40):
            next(iterator)


# --------------------------------------------------------------------------------------------
# TaskPipe itself


def test_frames_are_what_connection_send_writes() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    msg = (0, 3, 17, 1, list(range(1000)))
    writer.send(msg)
    written = os.read(reader.fileno(), 1 << 16)
    assert written == frame(msg)
    reader.close()
    writer.close()


def test_send_never_blocks_and_a_reader_gets_every_message_whole_in_order() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    pipe = TaskPipe(writer)
    messages = [(0, i % 3, i, 0, list(range(i * 1000, i * 1000 + 5000))) for i in range(40)]
    for msg in messages:  # ~1 MiB: 16x a pipe's buffer, and nobody reads yet
        pipe.send(msg)
    assert pipe.pending
    received: list[Any] = []

    def read(conn: Connection) -> None:
        for _ in messages:
            received.append(conn.recv())

    thread = threading.Thread(target=read, args=(reader,))
    thread.start()
    while not pipe.flush():
        os.sched_yield()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert received == messages
    assert not pipe.pending
    pipe.close()
    reader.close()


def test_send_to_a_pipe_whose_reader_is_gone_raises_broken_pipe() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    pipe = TaskPipe(writer)
    reader.close()
    with pytest.raises(BrokenPipeError):
        pipe.send((0, 0, 0, 0, [1, 2, 3]))
    pipe.close()
