"""Make torch's own ``get_worker_info()`` answer per thread.

torch 2.13's ``get_worker_info()`` returns a module global, ``worker_info``, which a worker
*process* sets once for itself. Worker *threads* share that global, so each needs its own answer.
Every way a user reaches the function (``torch.utils.data.get_worker_info``, the
``dataloader`` alias, ``from ... import get_worker_info`` done before threadloader was imported,
``torch.random.thread_safe_generator()``) holds the same function object, so we swap that
object's code once for code that first consults a ``threading.local`` and otherwise falls back to
the global exactly as before. Processes and the main thread see no change.

One torch caller must *not* see a thread's info: ``collate_tensor_fn`` (the tensor case of
``default_collate``) stacks into a fresh shared-memory file whenever it sees worker info, which
only helps a batch that crosses a process boundary. Threads share memory, so for that one caller
the patched function answers ``None`` and collation stays an ordinary ``torch.stack``. (The
loader's own default collation does not come here: ``memory.pinned_collate(as_worker=True)``
gives torch's worker results without shared memory. This answer serves a user's ``collate_fn``
that calls ``default_collate`` itself.)

A thread that a worker started (``worker_threads``) holds its worker's info by weak reference
(``weakly``): a long-lived thread (a library's IO loop) must not keep the worker's dataset copy
alive once the epoch dropped it; it then answers as a thread of no worker.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

from torch.utils.data._utils import collate as _torch_collate
from torch.utils.data._utils import worker as _torch_worker
from torch.utils.data._utils.worker import WorkerInfo as _TorchWorkerInfo

# Names injected into torch's worker module; the replacement code resolves them there.
_LOCAL_NAME = "_threadloader_local"
_WEAKREF_NAME = "_threadloader_weakref"
_GETFRAME_NAME = "_threadloader_getframe"
_SKIP_CODE_NAME = "_threadloader_no_info_for"

_local = threading.local()
_install_lock = threading.Lock()


def _thread_aware_get_worker_info() -> object:  # its code runs with torch's module globals
    info: Any = getattr(_threadloader_local, "info", None)  # type: ignore[name-defined]  # noqa: F821
    if type(info) is _threadloader_weakref:  # type: ignore[name-defined]  # noqa: F821
        info = info()  # a thread a worker started: its worker's, while the worker lives
    if info is None:
        return _worker_info  # type: ignore[name-defined]  # noqa: F821
    if _threadloader_getframe(1).f_code is _threadloader_no_info_for:  # type: ignore[name-defined]  # noqa: F821
        return None
    return info


def install() -> None:
    """Patch ``torch.utils.data.get_worker_info`` to return the calling thread's WorkerInfo.

    Idempotent and thread-safe. Called when threadloader is imported.

    Raises:
        RuntimeError: torch's ``get_worker_info`` no longer has the shape this patch expects
            (a closure-free function reading the module global ``worker_info``).
    """
    target = _torch_worker.get_worker_info
    with _install_lock:
        if getattr(_torch_worker, _LOCAL_NAME, None) is _local:
            return
        if target.__code__.co_freevars or "_worker_info" not in target.__code__.co_names:
            raise RuntimeError(
                "threadloader cannot make torch.utils.data.get_worker_info thread-aware: "
                "its implementation changed in this torch version"
            )
        setattr(_torch_worker, _LOCAL_NAME, _local)
        setattr(_torch_worker, _WEAKREF_NAME, weakref.ref)
        setattr(_torch_worker, _GETFRAME_NAME, sys._getframe)
        setattr(_torch_worker, _SKIP_CODE_NAME, _torch_collate.collate_tensor_fn.__code__)
        target.__code__ = _thread_aware_get_worker_info.__code__


class WorkerInfo(_TorchWorkerInfo):
    """torch's ``WorkerInfo`` (its fields, repr, equality and freezing), which a weak reference
    can point to: torch's is a slots dataclass, and a thread a worker started must not keep the
    worker's dataset copy alive (``weakly``)."""


def current() -> _TorchWorkerInfo | None:
    """The WorkerInfo installed for the calling thread, if any."""
    info: Any = getattr(_local, "info", None)
    if type(info) is weakref.ref:
        info = info()
    return info


def swap(info: Any) -> Any:
    """Install ``info`` (a ``WorkerInfo``, None, or what ``swap`` or ``weakly`` returned) for
    the calling thread and return what was installed before, for a ``swap`` back."""
    previous = getattr(_local, "info", None)
    _local.info = info
    return previous


def weakly(info: _TorchWorkerInfo | None) -> Any:
    """What ``swap`` installs for a thread to answer with ``info`` while something else keeps
    it (its worker's epoch), and as a thread of no worker after: a weak reference (``info``
    itself where it is torch's own class, which has none)."""
    if info is None:
        return None
    try:
        return weakref.ref(info)
    except TypeError:
        return info


def _after_fork_in_child() -> None:
    # A process forked from a worker thread (a dataset starting torch's DataLoader workers, or
    # a multiprocessing pool) is no worker of ours: torch's module global answers there.
    _local.info = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
