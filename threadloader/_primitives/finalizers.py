"""Finalizers that never lose a Ctrl-C: what may run on the training thread when objects die.

Python prints and drops any exception raised in a finalizer ("Exception ignored in: ..."), and a
signal handler raises ``KeyboardInterrupt`` between any two bytecodes of whatever Python code
the main thread runs, finalizers included. So any Python-level finalizer that runs on the
training thread (a batch dropped by the loop, an iterator dropped by ``break``) can swallow the
Ctrl-C that lands while it runs. The rules; where the code disagrees with them, it is wrong:

1. Per-batch finalizers run no Python code. ``DeathNotices`` watches an object with a weak
   reference whose callback is a C method (``deque.append``): the death only records the
   reference, and the owner (the allocator, the ring reader) takes what died the next time it
   needs memory, on its own thread or later on this one, outside any finalizer.
2. Finalizers of owners (an iterator's worker pool, a helper process link, a transfer thread)
   do Python work (joins) and use ``Finalizer``: a ``KeyboardInterrupt`` raised anywhere in it
   is caught, ``on_interrupt`` finishes what must not be left half done without waiting (wake
   the threads, kill the helper), and the interrupt is sent again to the main thread once the
   finalizer has returned (``exit_hook.redeliver_interrupt``).
3. What no ``try`` can cover is left to ``sys.unraisablehook``, installed when the first loader
   is built (``install_hook``) or with the first ``Finalizer``: a ``KeyboardInterrupt`` dropped
   on the main thread by any finalizer, or by an after-fork hook when a loader forks its zygote
   or helpers (``logging``'s), is sent again instead of printed. That covers the bytecode
   boundary before the ``try`` of a ``Finalizer`` (entering the callback; the hook then runs its
   work as point 2 would) and the standard library's own finalizers run when our objects die:
   a thread's ``threading._dangling`` entry, a process's ``multiprocessing.util.Finalize``, a
   ``Connection.__del__``. Any other unraisable exception goes to the hook that was there before.
4. A detached or finished ``Finalizer`` drops its weak reference, so the object's death runs
   nothing at all.
5. Unlike ``weakref.finalize``, nothing runs at interpreter exit: the exit hook
   (``exit_hook``) closes every live worker pool and transfer thread before the interpreter
   joins threads, a live helper process ends when its control pipe does (``isolation.helper``
   point 3; multiprocessing also terminates it, a daemon), and once ``atexit`` runs, an object
   dying (module teardown clears globals) runs nothing.
6. A forked child (torch's own worker processes, a user's ``multiprocessing``) inherits the
   parent's objects but none of its threads or child processes: what they own is the parent's
   to close. Every ``Finalizer`` inherited is detached in the child, so that a collection there
   neither waits for threads that do not exist (``JOIN_TIMEOUT_S`` per pool) nor signals the
   parent's helper processes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from threadloader._primitives import exit_hook

T = TypeVar("T")


class DeathNotices(Generic[T]):
    """Which watched objects died, learnt without running Python code at their death (point 1).

    ``watch(obj, value)`` and ``take()`` are called by the owner, under its own lock when
    several threads use it; the weak-reference callbacks may run in any thread, at any time.
    """

    def __init__(self) -> None:
        self._dead: deque[weakref.ref[Any]] = deque()  # appended to by the callbacks only
        self._watched: dict[int, tuple[weakref.ref[Any], T]] = {}  # by id of the reference

    def __len__(self) -> int:
        """Objects watched whose death was not taken yet (alive, or dead since ``take``)."""
        return len(self._watched)

    def watch(self, obj: object, value: T) -> None:
        """Have ``take`` return ``value`` once ``obj`` has died."""
        ref = weakref.ref(obj, self._dead.append)
        self._watched[id(ref)] = (ref, value)

    def take(self) -> list[T]:
        """The values of the watched objects that died since the last call."""
        out: list[T] = []
        dead = self._dead
        while dead:
            ref = dead.popleft()
            out.append(self._watched.pop(id(ref))[1])
        return out


# Finalizers not yet run nor detached. A weak reference that is itself garbage never calls its
# callback, so each Finalizer (which holds its reference) stays reachable from here.
_registry: dict[int, Finalizer] = {}
_hook_lock = threading.Lock()
_previous_hook: Callable[[Any], object] | None = None


class Finalizer:
    """``func(*args)`` once, when ``obj`` dies or when called, whichever comes first.

    The shape of ``weakref.finalize`` (``alive``, ``detach()``, calling it), but a Ctrl-C is never
    lost when the call comes from ``obj``'s death on the main thread (points 2 to 4). An explicit
    call raises what ``func`` raises, as any call does.

    Args:
        obj: the object whose death runs ``func``; ``func`` and ``args`` must not reference it.
        func: the closer.
        args: its arguments.
        on_interrupt: called (no arguments, never waiting) when a ``KeyboardInterrupt`` stopped
            ``func`` run from the death: finishes what ``func`` may have left half done.
    """

    __slots__ = ("__weakref__", "_args", "_func", "_on_interrupt", "_ref")
    #: Set once ``atexit`` runs (point 5). On the class: module teardown clears the globals.
    exiting = False

    def __init__(
        self,
        obj: object,
        func: Callable[..., object],
        *args: Any,
        on_interrupt: Callable[[], object] | None = None,
    ) -> None:
        install_hook()
        self._func: Callable[..., object] | None = func
        self._args = args
        self._on_interrupt = on_interrupt
        self._ref: weakref.ref[Any] | None = weakref.ref(obj, self._died)
        _registry[id(self)] = self

    def __repr__(self) -> str:
        return f"<Finalizer of {self._func!r}{'' if self.alive else '; dead'}>"

    @property
    def alive(self) -> bool:
        """Whether ``func`` has neither run nor been detached."""
        return self._func is not None

    def detach(self) -> Callable[..., object] | None:
        """Forget ``func`` without calling it; return it, or None if it ran or was detached."""
        func, self._func = self._func, None
        self._ref = None  # point 4: the object's death now runs nothing
        _registry.pop(id(self), None)
        return func

    def __call__(self) -> object:
        """Run ``func`` now unless it ran or was detached; later calls do nothing."""
        func = self.detach()
        return None if func is None else func(*self._args)

    def _died(self, _ref: object) -> None:
        try:
            if self.exiting:
                return
            self()
        except KeyboardInterrupt:
            self._interrupted()

    def _interrupted(self) -> None:
        """A Ctrl-C stopped the finalizer: finish without waiting, send the Ctrl-C again."""
        try:
            func = self.detach()  # not run yet if the Ctrl-C came before the first bytecode
            if func is not None and self._on_interrupt is None:
                func(*self._args)
            if self._on_interrupt is not None:
                self._on_interrupt()
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: the one sent below stands for both
        finally:
            exit_hook.redeliver_interrupt()


def _unraisable(unraisable: Any) -> None:
    """``sys.unraisablehook``: a Ctrl-C a finalizer dropped on the main thread (point 3)."""
    kind = unraisable.exc_type
    if (
        isinstance(kind, type)
        and issubclass(kind, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
    ):
        owner = getattr(unraisable.object, "__self__", None)
        if isinstance(owner, Finalizer):
            owner._interrupted()  # its work, then the Ctrl-C again
        else:
            exit_hook.redeliver_interrupt()
        return
    previous = _previous_hook or sys.__unraisablehook__
    previous(unraisable)


def install_hook() -> None:
    """Route a Ctrl-C that a finalizer or an after-fork hook drops on the main thread to the
    loop (point 3); idempotent."""
    global _previous_hook
    if sys.unraisablehook is _unraisable:
        return
    with _hook_lock:
        if sys.unraisablehook is not _unraisable:
            _previous_hook = sys.unraisablehook
            sys.unraisablehook = _unraisable


def _at_exit() -> None:
    Finalizer.exiting = True
    _registry.clear()


atexit.register(_at_exit)


def _after_fork_in_child() -> None:
    # Point 6. The parent's hook lock may have been held by one of its threads at the fork.
    global _hook_lock
    _hook_lock = threading.Lock()
    for finalizer in list(_registry.values()):
        finalizer.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
