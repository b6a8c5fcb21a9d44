"""Which of the isolation helper's threads runs which task: any thread, in batch order.

The training process sends the helper one stream of messages on one pipe: tasks in batch order,
each for the worker torch's round robin chose, and epoch restarts. The helper's runner threads
take them from this board and run each as its worker (that worker's ``WorkerInfo`` installed).

Why not one thread per worker, each reading its own pipe: when the dataset holds the GIL, the
pacer lets one thread fetch at a time, and consecutive batches belong to different workers, so
every batch moved the work to another thread while the previous one was still sending its result
and reading its next task: the two took turns at the GIL many times per batch. Measured on 2
cores, token windows: 22k samples/s with two workers, 41k with one. Here one runner makes every
batch while the others sleep, and the number of workers changes nothing but the workers' ids.

The rules; where the code disagrees with them, the code is wrong:

1. A runner claims the oldest message whose worker no other runner holds, and holds that worker
   until it asks for its next message. So one worker's messages run one at a time and in the
   order sent (its IterableDataset iterator, generators and state advance as in torch), and with
   one runner allowed, batches are made in batch order.
2. At most ``limit`` runners hold a worker at once (the pacer's number); the others wait on a
   condition, without asking for the GIL.
3. One runner at a time reads the pipe, and only when nothing can be claimed. It reads
   everything already waiting, so an epoch restart drops the earlier epochs' tasks queued
   before it instead of running them. A persistent epoch's restart finds none of a live
   worker's tasks there (the training process waited for every batch of the abandoned epoch,
   as torch's ``_reset`` does); a redispatch's (a live change of the index stream) were drawn
   from the stream it rewound.
4. A runner that finishes looks for its next message itself; a waiting runner is woken only when
   there may be work for it (new messages, a higher limit, the end).
5. The pipe's end (the training process closed it or died) ends every runner: ``take`` returns
   None.
"""

from __future__ import annotations

import select
import threading
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

# Message tags, training process -> helper, on the task pipe:
TASK = 0  # (TASK, worker_id, idx, generation, index)
EPOCH = 1  # (EPOCH, generation, seed, rewind): workers start over; one per worker here


class TaskBoard:
    """The helper's queue of tasks, claimed by runner threads in order (module docstring).

    Args:
        conn: read end of the task pipe.
        worker_ids: the workers messages are addressed to (this helper's).
        limit: runners that may hold a worker at once, at first.
    """

    def __init__(self, conn: Connection, worker_ids: Sequence[int], limit: int) -> None:
        self._conn = conn
        self._worker_ids = tuple(worker_ids)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[tuple[Any, ...]] = deque()  # per-worker messages, in order sent
        self._held: set[int] = set()  # workers a runner holds
        self._limit = limit
        self._reading = False
        self._closed = False
        self._generation = 0  # the latest epoch announced
        self._waiting = select.poll()  # Connection.poll(0) builds a selector per call: 10x this
        self._waiting.register(conn.fileno(), select.POLLIN)

    @property
    def limit(self) -> int:
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Let ``limit`` runners hold a worker at once (from their next message on)."""
        with self._cond:
            raised = limit > self._limit
            self._limit = limit
            if raised:
                self._cond.notify_all()

    def take(self, done: int | None) -> tuple[Any, ...] | None:
        """Release worker ``done`` (the caller's previous message's) and claim the next message.

        Args:
            done: the worker the caller held, or None on its first call.

        Returns:
            ``(TASK, worker_id, idx, generation, index)`` or
            ``(EPOCH, worker_id, generation, seed, rewind)``, the caller now holding
            ``worker_id``; None once the pipe has ended.

        Raises:
            Exception: whatever reading the pipe raises besides its end (a message that cannot
                be unpickled): the helper reports it and exits.
        """
        with self._cond:
            if done is not None:
                self._held.discard(done)
            while not self._closed:
                if len(self._held) < self._limit:
                    msg = self._claim()
                    if msg is not None:
                        if len(self._held) < self._limit and self._claimable():
                            self._cond.notify()  # rule 4: room and work for one more runner
                        return msg
                    if not self._reading:
                        self._read()
                        continue
                self._cond.wait()
            return None

    def _claimable(self) -> bool:
        return any(msg[1] not in self._held for msg in self._queue)

    def _claim(self) -> tuple[Any, ...] | None:
        for i, msg in enumerate(self._queue):
            if msg[1] not in self._held:
                del self._queue[i]
                self._held.add(msg[1])
                return msg
        return None

    def _read(self) -> None:
        """Read what the pipe holds (waiting for one message), without holding the lock."""
        self._reading = True
        self._lock.release()
        received: list[tuple[Any, ...]] = []
        ended = False
        try:
            received.append(self._conn.recv())
            while self._waiting.poll(0):
                received.append(self._conn.recv())
        except (EOFError, OSError):
            ended = True
        finally:
            self._lock.acquire()
            self._reading = False
        self._closed = self._closed or ended
        for msg in received:
            self._add(msg)
        if self._closed:
            self._cond.notify_all()
        # Otherwise the reader claims next, and wakes one more runner if there is room (rule 4).

    def _add(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == EPOCH:
            generation, seed, rewind = msg[1], msg[2], msg[3]
            self._generation = generation
            # Rule 3: the earlier epochs' tasks not started yet are dropped.
            self._queue = deque(m for m in self._queue if m[0] != TASK or m[3] >= generation)
            self._queue.extend((EPOCH, w, generation, seed, rewind) for w in self._worker_ids)
        elif msg[3] >= self._generation:
            self._queue.append(msg)
