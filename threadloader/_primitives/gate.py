"""The gate that lets at most ``limit`` worker threads fetch at once; the limit may change any time."""

from __future__ import annotations

import threading


class Gate:
    """Lets at most ``limit`` worker threads run a task at once; the limit may change any time.

    Args:
        limit: initial number of concurrent tasks allowed.
    """

    def __init__(self, limit: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._limit = limit
        self._active = 0
        self._closed = False

    @property
    def limit(self) -> int:
        return self._limit

    def active(self) -> int:
        """How many threads hold a slot now (a snapshot, read without the lock)."""
        return self._active

    def enter(self) -> bool:
        """Wait for a free slot and take it; False (no slot taken) once the gate is closed."""
        with self._cond:
            while self._active >= self._limit and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._active += 1
            return True

    def wait_open(self) -> bool:
        """Wait while the limit is 0, without taking a slot; False once the gate is closed.

        Idle workers park here rather than on their task queue, so that while the training
        thread runs every batch itself, dispatching a task wakes no thread.
        """
        with self._cond:
            while self._limit == 0 and not self._closed:
                self._cond.wait()
            return not self._closed

    def exit(self) -> None:
        """Give back a slot taken by ``enter``."""
        with self._cond:
            self._active -= 1
            self._cond.notify()

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def close(self) -> None:
        """Release every thread waiting in ``enter`` (it returns False)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
