"""``iter(loader)._workers``: one object per worker, as torch's iterator lists its processes.

torch's ``_MultiProcessingDataLoaderIter._workers`` holds the worker processes, and torch's own
tests and some user code check that each ``is_alive()`` no longer once the epoch ended, or
``join()`` them. Here a worker is a thread (or, with ``isolation="process"``, a thread of the
helper process), so each entry is a small handle with the same methods:

- in-process: worker ``i``'s thread. A pool may start its threads after the first batches (an
  epoch on the lean path, ``threaded`` point 6): until then the handle reports not alive.
- isolation: the helper process, for each of its workers (its threads end with it).

A handle holds the pool or the helper link, never the iterator, so keeping ``it._workers``
does not keep the epoch running: ``del it`` still ends the workers.
"""

from __future__ import annotations

from typing import Any, Protocol


class _Process(Protocol):
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...


class ThreadHandle:
    """Worker ``index`` of a ``WorkerPool``: its thread once started."""

    __slots__ = ("_index", "_pool")

    def __init__(self, pool: Any, index: int) -> None:
        self._pool = pool
        self._index = index

    def __repr__(self) -> str:
        return f"<worker {self._index} thread, {'alive' if self.is_alive() else 'ended'}>"

    def _thread(self) -> Any:
        threads = self._pool._threads
        return threads[self._index] if self._index < len(threads) else None

    @property
    def name(self) -> str:
        thread = self._thread()
        return thread.name if thread is not None else f"{self._pool._name}-worker{self._index}"

    @property
    def exitcode(self) -> int | None:
        """None while the thread runs, then 0 (a worker thread ends only when told to)."""
        return None if self.is_alive() else 0

    def is_alive(self) -> bool:
        thread = self._thread()
        return thread is not None and thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread()
        if thread is not None and thread.ident is not None:
            thread.join(timeout)


class HelperHandle:
    """Worker ``index`` of an isolated epoch: alive while the helper process running it is."""

    __slots__ = ("_index", "_process")

    def __init__(self, process: _Process, index: int) -> None:
        self._process = process
        self._index = index

    def __repr__(self) -> str:
        return f"<worker {self._index} in the helper, {'alive' if self.is_alive() else 'ended'}>"

    @property
    def exitcode(self) -> int | None:
        """None while the helper runs, then its exit code."""
        return getattr(self._process, "exitcode", None) if not self.is_alive() else None

    def is_alive(self) -> bool:
        try:
            return self._process.is_alive()
        except ValueError:  # a closed Process object: it ended long ago
            return False

    def join(self, timeout: float | None = None) -> None:
        try:
            self._process.join(timeout)
        except (AssertionError, ValueError):  # never started, or closed
            pass
