"""The isolation helper's task board: which runner thread runs which task, and in what order."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe
from typing import Any

import pytest

from threadloader.isolation.task_board import EPOCH, TASK, TaskBoard


class Runners:
    """``n`` runner threads taking from ``board``; each task's run is logged (start, end).

    A task takes ``work_s``, or, with ``hold``, lasts until ``hold`` is set.
    """

    def __init__(
        self,
        board: TaskBoard,
        n: int,
        work_s: float = 0.002,
        hold: threading.Event | None = None,
    ) -> None:
        self.board = board
        self.log: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._work_s = work_s
        self._hold = hold
        self.running: dict[int, int] = {}  # worker -> runners running it now (must stay <= 1)
        self.max_parallel = 0
        self._active = 0
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, me: int) -> None:
        done = None
        while True:
            msg = self.board.take(done)
            if msg is None:
                return
            worker = msg[1]
            done = worker
            with self._lock:
                self.running[worker] = self.running.get(worker, 0) + 1
                assert self.running[worker] == 1, f"worker {worker} run by two runners at once"
                self._active += 1
                self.max_parallel = max(self.max_parallel, self._active)
                self.log.append(("start", me, *msg))
            if self._hold is not None:
                self._hold.wait(60)
            else:
                time.sleep(self._work_s)
            with self._lock:
                self.running[worker] -= 1
                self._active -= 1
                self.log.append(("end", me, *msg))

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
            assert not t.is_alive(), "a runner did not end with the pipe"

    def started(self) -> list[tuple[Any, ...]]:
        return [entry[2:] for entry in self.log if entry[0] == "start"]

    def wait_started(self, count: int, timeout: float = 10.0) -> None:
        """Return once ``count`` messages started (or after ``timeout``: the asserts then say)."""
        deadline = time.monotonic() + timeout
        while len(self.started()) < count and time.monotonic() < deadline:
            time.sleep(0.005)


def _tasks(n: int, workers: int, generation: int = 0) -> list[tuple[Any, ...]]:
    return [(TASK, i % workers, i, generation, [i]) for i in range(n)]


def _send_and_end(ours: Any, runners: Runners, sent: list[tuple[Any, ...]]) -> None:
    """Send ``sent``, wait until every message started, end the pipe and join the runners."""
    for msg in sent:
        ours.send(msg)
    runners.wait_started(len(sent))
    ours.close()
    runners.join()


@pytest.mark.timeout(30)
def test_one_runner_at_a_time_makes_batches_in_the_order_sent() -> None:
    """limit 1: three runners, three workers; tasks run one at a time, in batch order."""
    theirs, ours = Pipe(duplex=False)
    board = TaskBoard(theirs, worker_ids=range(3), limit=1)
    runners = Runners(board, 3)
    sent = _tasks(30, workers=3)
    _send_and_end(ours, runners, sent)
    assert runners.started() == sent
    assert runners.max_parallel == 1


@pytest.mark.timeout(30)
def test_runners_share_the_limit_and_never_run_one_worker_twice_at_once() -> None:
    """limit 2: two tasks run at once, never two of one worker; each worker's in the order sent."""
    theirs, ours = Pipe(duplex=False)
    board = TaskBoard(theirs, worker_ids=range(2), limit=2)
    runners = Runners(board, 3, work_s=0.01)
    sent = _tasks(20, workers=2) + [(TASK, 0, 20 + i, 0, [20 + i]) for i in range(6)]
    _send_and_end(ours, runners, sent)
    started = runners.started()
    assert sorted(started, key=lambda m: m[2]) == sent  # each exactly once
    for worker in (0, 1):
        mine = [m[2] for m in started if m[1] == worker]
        assert mine == sorted(mine)
    assert runners.max_parallel == 2


@pytest.mark.timeout(30)
def test_an_epoch_restart_drops_the_earlier_epochs_queued_tasks() -> None:
    """Tasks of an earlier epoch not started are dropped; each worker restarts before its new
    tasks. (A persistent epoch's restart finds none of a live worker's tasks queued: the
    training process waited for them; a redispatch's were drawn from a rewound stream.)"""
    theirs, ours = Pipe(duplex=False)
    board = TaskBoard(theirs, worker_ids=range(2), limit=1)
    for msg in _tasks(6, workers=2):  # all queued before any runner reads
        ours.send(msg)
    ours.send((EPOCH, 1, 42, None))
    new = _tasks(4, workers=2, generation=1)
    for msg in new:
        ours.send(msg)
    # One read takes everything waiting: the epoch drops the six old tasks, none started.
    got = [board.take(None)]
    while len(got) < 2 + len(new):
        msg = board.take(got[-1][1])
        assert msg is not None
        got.append(msg)
    assert got[:2] == [(EPOCH, 0, 1, 42, None), (EPOCH, 1, 1, 42, None)]
    assert got[2:] == new
    ours.close()
    assert board.take(got[-1][1]) is None


@pytest.mark.timeout(30)
def test_raising_the_limit_wakes_a_waiting_runner() -> None:
    """A runner waiting under limit 1 starts a second worker's task once the limit is 2."""
    theirs, ours = Pipe(duplex=False)
    board = TaskBoard(theirs, worker_ids=range(2), limit=1)
    hold = threading.Event()
    runners = Runners(board, 2, hold=hold)
    ours.send((TASK, 0, 0, 0, [0]))
    ours.send((TASK, 1, 1, 0, [1]))
    runners.wait_started(1)
    time.sleep(0.05)
    assert len(runners.started()) == 1  # the second waits for the first (held)
    board.set_limit(2)
    runners.wait_started(2)
    assert len(runners.started()) == 2
    assert runners.max_parallel == 2  # both run at once: the first is still held
    hold.set()
    ours.close()
    runners.join()


@pytest.mark.timeout(30)
def test_the_pipe_ending_ends_every_runner() -> None:
    """The training process closing the pipe (or dying) ends the reader and every waiting runner."""
    theirs, ours = Pipe(duplex=False)
    board = TaskBoard(theirs, worker_ids=range(2), limit=1)
    runners = Runners(board, 3)
    time.sleep(0.05)  # one runner blocks reading the pipe, the others wait on the board
    ours.close()
    runners.join()
    assert runners.started() == []
    assert board.take(None) is None
