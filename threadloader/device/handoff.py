"""The bounded hand-off between the transfer thread and the consumer, and how a failure rides it.

At most ``depth`` batches are pulled from the source and not yet delivered; an exception from
the source or a copy is delivered at its position, with the locals of its frames cleared.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import traceback
from collections import deque
from typing import Any


class HandoffState(enum.IntEnum):
    RUNNING = 0
    DRAINED = 1  # StopIteration delivered; the thread has exited and was joined
    CLOSED = 2  # ended early: close(), break, del, GC or exit


class HandoffClosed(Exception):
    """Raised by a read from a closed hand-off."""


class Handoff:
    """The bounded hand-off from the transfer thread to the consumer.

    A slot is taken *before* the thread pulls a batch from the source and given back when the
    consumer takes that batch, so at most ``depth`` batches are pulled and not yet delivered:
    the bound covers the batch being copied, not only the queued ones. Invariant: the thread
    waits only when all ``depth`` slots hold queued batches, and the consumer only when none
    does, so the two never wait at once and ``notify()`` wakes the right one.
    """

    def __init__(self, depth: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[Any] = deque()
        self.depth = depth
        self._used = 0
        self._closed = False

    def take_slot(self) -> bool:
        """Wait for a free slot and take it; False (no slot taken) once closed."""
        with self._cond:
            while self._used >= self.depth and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._used += 1
            return True

    def put(self, item: Any) -> None:
        """Queue ``item`` in the slot taken for it; dropped if closed meanwhile."""
        with self._cond:
            if self._closed:
                return
            self._items.append(item)
            self._cond.notify()

    def get(self) -> Any:
        """Remove and return the oldest item, waiting for one.

        Raises:
            HandoffClosed: the hand-off was closed.
        """
        with self._cond:
            while not self._items:
                if self._closed:
                    raise HandoffClosed
                self._cond.wait()
            self._used -= 1
            self._cond.notify()
            return self._items.popleft()

    def close(self) -> list[Any]:
        """Refuse further items, wake both sides, and return the items never delivered."""
        with self._cond:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return left


END = object()  # the source is exhausted


@dataclasses.dataclass(frozen=True)
class Failure:
    """An exception raised by the source or by a copy, delivered at its position."""

    exc: BaseException


def failure(exc: BaseException) -> Failure:
    """Wrap ``exc`` for delivery, with the local variables of its finished frames cleared.

    The frames stay (the traceback prints as before); their locals go, as a worker process's
    would. Otherwise a source that holds its owner weakly (a loader epoch) would be kept alive by
    its own frames in an exception waiting in the hand-off, which the running thread holds: the
    owner's finalizer, the one thing that stops the thread, could then never run.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running (this thread's)
        pending += [e.__cause__, e.__context__]
    return Failure(exc)
