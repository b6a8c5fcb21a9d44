"""The misses of one batch, read by the calling worker and the read pool's threads together.

A worker thread asking for a batch puts its misses in one ``SharedBatch`` and offers the pool
one helper task per miss but the first: every thread that joins, the caller included, takes the
next miss until none is left. A pool thread free early keeps reading for the batch; a helper
that starts after the batch ran out takes nothing and returns at once. So a batch is read by as
many threads as are free when it needs them, and never waits on a helper the pool has not
started: the caller waits only for reads that are in progress. The pool runs helpers in the
order batches offered them, so an earlier batch, which the loop needs first, is served first.

With ``stop`` set (``close()``), no thread takes another miss: the misses left untaken come out
as cancelled, as queued reads do.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class SharedBatch:
    """Misses ``(position, url)`` taken one at a time by whichever thread asks next.

    Args:
        misses: the batch positions to read and their URLs, in batch order.
        stop: when set, no miss is taken any more.
    """

    def __init__(self, misses: list[tuple[int, str]], stop: threading.Event) -> None:
        self._todo = deque(misses)
        self._stop = stop
        self._cond = threading.Condition(threading.Lock())
        self._reading = 0  # misses taken and not done yet
        self.results: dict[int, Any] = {}

    def left(self) -> int:
        """Misses not taken yet."""
        with self._cond:
            return len(self._todo)

    def read_all(
        self, read: Callable[[str], Any], before_each: Callable[[], None] | None = None
    ) -> None:
        """Take and read misses until none is left (or ``stop`` is set).

        Args:
            read: reads one URL; never raises an ``Exception`` (failures are its return values).
            before_each: called before each take (the caller offers the pool more helpers).
        """
        while True:
            if before_each is not None:
                before_each()
            with self._cond:
                if not self._todo or self._stop.is_set():
                    return
                position, url = self._todo.popleft()
                self._reading += 1
            out: Any = None
            try:
                out = read(url)
            except BaseException as e:  # the caller raises it (``wait``)
                out = _Raised(e)
                raise
            finally:
                with self._cond:
                    self.results[position] = out
                    self._reading -= 1
                    if not self._reading:
                        self._cond.notify_all()

    def abandon(self) -> None:
        """Leave the misses not taken yet to nobody: the caller stopped (a Ctrl-C in its read),
        and helpers would read for a batch nobody will ask for."""
        with self._cond:
            self._todo.clear()

    def wait(self) -> list[tuple[int, str]]:
        """Block until no read is in progress, after ``read_all`` returned in the caller.

        Returns:
            The misses nobody took (``stop`` was set), in batch order.

        Raises:
            BaseException: the first (in batch order) that a ``read`` in a pool thread raised
                instead of returning: the caller's own, as it would be had it read that miss.
        """
        with self._cond:
            while self._reading:
                self._cond.wait()
            left = list(self._todo)
            self._todo.clear()
        for position in sorted(self.results):
            out = self.results[position]
            if isinstance(out, _Raised):
                raise out.error
        return left


class _Raised:
    """What a ``read`` raised, kept in place of its result."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error
