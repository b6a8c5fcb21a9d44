"""The two bounded hand-offs of an epoch: tasks to one worker, results to the training thread.

Both are a deque under a ``threading.Condition``, with one wake-up per item (``notify()``, never
``notify_all()``): each has exactly one reader. Neither ``put`` ever blocks. Their bound is the
iterator's invariant, checked here: at most ``num_workers * prefetch_factor`` tasks are in flight,
so no queue holds more than that plus the control messages of one epoch change. A put past the
bound is a bug in the dispatcher, and raises instead of growing memory silently.

Correctness never relies on the GIL: every read and write of a deque happens under its lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """Raised by a read from a queue that was closed while (or before) waiting."""


class BoundedQueue(Generic[T]):
    """A single-reader FIFO with a hard capacity and an explicit close.

    Args:
        capacity: most items the queue may hold at once; a put beyond it raises.
        name: used in error messages and ``repr`` so a stack dump reads on its own.
    """

    def __init__(self, capacity: int, name: str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._name = name
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # waits and notifies under `_lock`
        self._waiting = 0  # readers blocked in wait(), counted under the lock
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<BoundedQueue {self._name} {len(self._items)}/{self._capacity} {state}>"

    def __len__(self) -> int:
        """How many items are waiting, without the lock: a hint for statistics, never for logic.

        ``len()`` of a deque is a single atomic read on both GIL and free-threaded builds.
        """
        return len(self._items)

    def put(self, item: T) -> None:
        """Append ``item`` and wake the reader. Items put after ``close()`` are dropped.

        Raises:
            RuntimeError: the queue is full, which means the dispatcher broke its bound.
        """
        with self._lock:
            if self._closed:
                return
            if len(self._items) >= self._capacity:
                raise RuntimeError(f"{self._name}: capacity {self._capacity} exceeded")
            self._items.append(item)
            if self._waiting:  # skip Condition.notify's own bookkeeping when nobody waits
                self._cond.notify()

    def get(self, timeout: float | None = None) -> T:
        """Remove and return the oldest item, waiting for one.

        Args:
            timeout: seconds to wait at most; ``None`` waits until an item or ``close()``.

        Raises:
            TimeoutError: nothing arrived within ``timeout``.
            QueueClosed: the queue was closed and is empty.
        """
        with self._lock:
            if timeout is None:
                while not self._items:
                    if self._closed:
                        raise QueueClosed(self._name)
                    self._wait(None)
            else:
                deadline = time.monotonic() + timeout
                while not self._items:
                    if self._closed:
                        raise QueueClosed(self._name)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(self._name)
                    self._wait(remaining)
            return self._items.popleft()

    def peek(self) -> T:
        """The oldest item, left in place; waits for one.

        Raises:
            QueueClosed: the queue was closed and is empty.
        """
        with self._lock:
            while not self._items:
                if self._closed:
                    raise QueueClosed(self._name)
                self._wait(None)
            return self._items[0]

    def _wait(self, timeout: float | None) -> None:
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def head(self) -> T | None:
        """The oldest item, left in place, or None when empty (a snapshot)."""
        with self._lock:
            return self._items[0] if self._items else None

    def take_head_if(self, wanted: object) -> bool:
        """Remove the oldest item if it ``is`` ``wanted``; return whether it was removed.

        Lets the training thread take a task a worker has not started yet (see _iterator).
        """
        with self._lock:
            if self._items and self._items[0] is wanted:
                self._items.popleft()
                return True
            return False

    def drop_where(self, stale: Callable[[T], bool]) -> None:
        """Drop every unread item for which ``stale(item)`` is true (results of an old epoch)."""
        with self._lock:
            kept = [item for item in self._items if not stale(item)]
            self._items.clear()
            self._items.extend(kept)

    def replace_all(self, make: Callable[[list[T]], T]) -> None:
        """Drop every unread item and put ``make(dropped)`` in their place (an epoch restart),
        as one step: no reader takes an item in between."""
        with self._lock:
            if self._closed:
                return
            dropped = list(self._items)
            self._items.clear()
            self._items.append(make(dropped))
            self._cond.notify()

    def close(self) -> list[T]:
        """Refuse further puts, wake the reader, and return the items that were never read."""
        with self._lock:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left
