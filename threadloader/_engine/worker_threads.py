"""Threads a worker starts belong to that worker, as the threads of a worker process do.

In a torch worker process every thread sees the worker's ``get_worker_info()`` and draws from
the process's global RNGs, which are the worker's. Item code or ``worker_init_fn`` that starts
threads of its own (a ``ThreadPoolExecutor`` decoding a batch's files, a prefetching thread)
gets the same here. Where the code disagrees with these rules, the code is wrong.

1. ``threading.Thread.start`` is patched once, when the first worker is made (``install``). A
   thread started by a thread acting as a worker (its worker thread, or the training thread
   while it makes one of that worker's batches) runs as part of that worker for its whole life:
   the same ``WorkerInfo`` (``worker_info``) and the same global RNG objects
   (``worker_globals``), one stream for all of the worker's threads, as one process's threads
   share its global generators.
2. A thread started by any other thread is untouched: it runs as it would without threadloader.
   So are the library's own threads (named ``threadloader-...``): worker threads set up their
   own worker, and ``RemoteFiles``' read pool serves every worker of the process.
3. A thread that outlives its worker's epoch (a pool the dataset keeps) keeps that worker, as a
   pool in a worker process lives as long as the process; its draws then come from generators
   nothing else draws from, never from the training process's.
4. Work a worker submits to a ``concurrent.futures.ThreadPoolExecutor`` runs as that worker,
   whichever pool thread takes it: a pool the dataset made in ``__init__`` is shared by every
   worker's shallow copy here, where each worker process has a pool of its own. The library's
   own pools (``thread_name_prefix`` ``threadloader-...``) are left out.
5. The patches stay once made: removing them while another loader's workers start threads would
   race. ``_thread.start_new_thread`` is not covered.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from threadloader._engine import worker_info
from threadloader._primitives import worker_globals

__all__ = ["install"]

#: The start of the names of threadloader's own threads, which never join a worker (point 2).
LIBRARY_PREFIX = "threadloader-"

_install_lock = threading.Lock()
_original_start: Callable[[threading.Thread], None] | None = None
_original_submit: Callable[..., Future[Any]] | None = None


def install() -> None:
    """Make threads started by a worker, and work it submits to a thread pool, part of it
    (points 1 and 4). Idempotent and thread-safe."""
    global _original_start, _original_submit
    with _install_lock:
        if _original_start is not None:
            return
        _original_submit = ThreadPoolExecutor.submit
        ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign, assignment]
        _original_start = threading.Thread.start
        threading.Thread.start = _start  # type: ignore[method-assign]


def _submit(
    self: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Future[Any]:
    info, rngs = worker_info.current(), worker_globals.current()
    own = getattr(self, "_thread_name_prefix", "").startswith(LIBRARY_PREFIX)
    if (info is not None or rngs is not None) and not own:
        call = functools.partial(fn, *args, **kwargs)
        fn, args, kwargs = functools.partial(_run_as_worker, call, info, rngs), (), {}
    assert _original_submit is not None
    return _original_submit(self, fn, *args, **kwargs)


def _start(self: threading.Thread) -> None:
    info, rngs = worker_info.current(), worker_globals.current()
    if (info is not None or rngs is not None) and not self.name.startswith(LIBRARY_PREFIX):
        # The thread may outlive the epoch (point 3): it keeps the worker's info weakly, or
        # it would keep the worker's dataset copy (and a pool the copy made) alive.
        # An attribute of this thread object shadows its class's run(): the thread's own
        # Thread.run or a subclass's override, bound now, runs inside the worker's context.
        weak = worker_info.weakly(info)
        self.run = functools.partial(_run_as_worker, self.run, weak, rngs)  # type: ignore[method-assign]
    assert _original_start is not None
    _original_start(self)


def _run_as_worker(run: Callable[[], Any], info: Any, rngs: Any) -> Any:
    outer_info = worker_info.swap(info)
    outer_rngs = worker_globals.swap(rngs)
    try:
        return run()
    finally:
        worker_globals.swap(outer_rngs)
        worker_info.swap(outer_info)
