"""Close every live thread owner before the interpreter joins its threads.

``threading._register_atexit`` runs its callbacks inside ``threading._shutdown()``, *before*
the interpreter joins non-daemon threads, in reverse order of registration; a plain ``atexit``
hook runs after that join, i.e. too late to matter. Private API (bpo-39812), pinned by
tests/test_shutdown.py. One hook serves every owner: worker pools, transfer stages, the read
pools of remote datasets. It is registered on first use, after ``concurrent.futures`` (imported
by then) registered its own, so it runs first: a read waiting to retry gives up before that
pool is joined.

A non-daemon thread still iterating a loader when the main thread ends finds it closed (its
``next()`` raises), as ``concurrent.futures`` refuses work then: waiting for such threads here
would hang on idle executor threads, which only end after this hook (torch's loaders serve them).

Joins run from finalizers (``break``, ``del``, garbage collection), which print and drop any
exception, so a Ctrl-C pressed during one would be lost: :func:`redeliver_interrupt` hands it
back to the main thread.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


# Owners by id, held weakly. Plain references with no callback: an owner dropped on the
# training thread must run no Python code as it dies (a Ctrl-C landing in a WeakSet's callback
# would be lost: _finalizers point 1). Dead entries are pruned as the dict grows.
_lock = threading.Lock()
_live: dict[int, weakref.ref[Closable]] = {}
_prune_at = 64
_registered = False


def tracked() -> list[Closable]:
    """The owners the exit hook would close now."""
    with _lock:
        return [owner for ref in _live.values() if (owner := ref()) is not None]


def _close_all() -> None:
    for owner in tracked():
        owner.close()


def track(owner: Closable) -> None:
    """Close ``owner`` at interpreter exit unless it was closed (or collected) before."""
    global _registered, _prune_at
    with _lock:
        if len(_live) >= _prune_at:
            for key in [key for key, ref in _live.items() if ref() is None]:
                del _live[key]
            _prune_at = max(64, 2 * len(_live))
        _live[id(owner)] = weakref.ref(owner)
        if _registered:
            return
        try:
            threading._register_atexit(_close_all)  # type: ignore[attr-defined]
        except RuntimeError:
            return  # already shutting down: nothing will run after this anyway
        _registered = True


def untrack(owner: Closable) -> None:
    """``owner`` closed itself: nothing to do for it at exit.

    Never waits: it runs from finalizers, which the garbage collector may call on a thread that
    holds ``_lock`` already (an allocation inside ``track``). If the lock is busy the owner
    stays in the set until it is collected; closing it again at exit is a no-op.
    """
    if not _lock.acquire(blocking=False):
        return
    try:
        ref = _live.get(id(owner))
        if ref is not None and ref() is owner:
            del _live[id(owner)]
    finally:
        _lock.release()


#: How long after a swallowed Ctrl-C it is sent again: the finalizer it was caught in has
#: returned by then (microseconds), so the main thread raises it in the user's code.
REDELIVER_DELAY_S = 0.05


def redeliver_interrupt() -> None:
    """Send a Ctrl-C caught while joining to the main thread again, once the finalizer is done.

    Call it from an ``except KeyboardInterrupt`` around a join that may run in a finalizer.
    Raising it again there would be dropped too (so would ``_thread.interrupt_main()``, which
    raises at once); a timer thread sends SIGINT shortly after instead, which also interrupts a
    ``time.sleep`` the loop is in, and goes through the user's SIGINT handler as a real Ctrl-C.
    """
    main = threading.main_thread()
    if threading.current_thread() is not main or main.ident is None:
        return  # Python raises KeyboardInterrupt only in the main thread
    send: Callable[[], object] = _thread.interrupt_main
    if hasattr(signal, "pthread_kill"):
        send = functools.partial(signal.pthread_kill, main.ident, signal.SIGINT)
    threading.Timer(REDELIVER_DELAY_S, send).start()  # ends with the send; joined at exit


def _after_fork_in_child() -> None:
    # The parent's threads do not exist in a forked child and its lock may have been held by one
    # of them: the child starts with nothing to close.
    global _lock
    _lock = threading.Lock()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
