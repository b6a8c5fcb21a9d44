"""What a ``RemoteFiles`` holds in one process: its read pool, connections, counters and caches.

A dataset keeps its configuration (``Config``, pickled with it) apart from its ``State`` in this
process: counters, caches, and a ``Runtime`` (the read pool, the HTTP connections, the fsspec
filesystems), each made on first use. ``State.close()`` closes the runtime; the next read makes a
new one. The read pool's queue is bounded: with ``2 * max_concurrency`` reads queued or running,
``Runtime.submit`` declines and the caller reads itself. The exit hook closes every live runtime
before the interpreter joins threads.

A forked child (a DataLoader worker process) resets every live state, so that it starts with its
own empty pool, connections, counters and caches, and closes nothing of the parent's.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from threadloader._primitives import exit_hook
from threadloader.remote.cache import ByteCache, DiskCache, MemoryCache
from threadloader.remote.http import HTTPConnections
from threadloader.remote.retry import RetryPolicy

_RECENT_SKIPS = 32


class Counters:
    """The numbers behind ``RemoteStats``; every update under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        names = "reads read_bytes retries failures skipped cache_hits cache_misses cache_hit_bytes"
        self._n = dict.fromkeys(names.split(), 0)
        self._read_s = 0.0
        self._skipped_urls: deque[str] = deque(maxlen=_RECENT_SKIPS)

    def add(self, read_s: float = 0.0, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._n[key] += value
            self._read_s += read_s

    def try_skip(self, url: str, budget: int) -> int | None:
        """Count a skip if the budget allows it: the skip's number, else None."""
        with self._lock:
            if self._n["skipped"] >= budget:
                return None
            self._n["skipped"] += 1
            self._skipped_urls.append(url)
            return self._n["skipped"]

    def snapshot(self, caches: Sequence[ByteCache]) -> dict[str, Any]:
        """The fields of a ``RemoteStats``, as one consistent snapshot."""
        usage = [c.usage() for c in caches]
        with self._lock:
            return {
                **self._n,
                "read_s": self._read_s,
                "cache_stored_bytes": sum(u.stored_bytes for u in usage),
                "cache_evictions": sum(u.evictions for u in usage),
                "skipped_urls": tuple(self._skipped_urls),
            }


class Runtime:
    """The read pool and connections of one dataset in one process, until ``close()``.

    Holds no reference to the dataset, so dropping the dataset can close it (finalizer).
    """

    def __init__(self, max_concurrency: int, name: str) -> None:
        self.name = name
        self.stop = threading.Event()  # set on close: retries give up instead of waiting
        self.http = HTTPConnections()
        self.filesystems: dict[str, Any] = {}  # fsspec protocol -> filesystem
        self._max_concurrency = max_concurrency
        # Reads queued or running in the pool; bounds the executor's (otherwise unbounded) queue.
        self._slots = threading.BoundedSemaphore(max(1, 2 * max_concurrency))
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        exit_hook.track(self)

    def __repr__(self) -> str:
        return f"<Runtime {self.name} pool={self._pool is not None} closed={self._closed}>"

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Queue ``fn(*args)`` on the pool; None when the caller should run it itself."""
        if not self._max_concurrency or not self._slots.acquire(blocking=False):
            return None
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("closed")
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self._max_concurrency, thread_name_prefix=self.name
                    )
                future = self._pool.submit(fn, *args)
        except RuntimeError:  # closed, or the interpreter is shutting down
            self._slots.release()
            return None
        future.add_done_callback(self._release_slot)
        return future

    def _release_slot(self, _: Future[Any]) -> None:
        self._slots.release()

    def filesystem(self, url: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
        """The fsspec filesystem for ``url``'s protocol, and the path within it."""
        import fsspec  # only for non-HTTP URLs; installed with torch

        protocol = fsspec.core.split_protocol(url)[0] or "file"
        with self._lock:
            fs = self.filesystems.get(protocol)
        if fs is None:
            fs = fsspec.filesystem(protocol, **storage_options)
            with self._lock:
                fs = self.filesystems.setdefault(protocol, fs)
        return fs, fs._strip_protocol(url)

    def close(self) -> None:
        """Stop retries, cancel queued reads, join the pool, close connections.

        Idempotent, and complete even when interrupted: a Ctrl-C while joining the pool still
        closes the connections, and a later call (the exit hook's) joins the pool again.

        Raises:
            KeyboardInterrupt: Ctrl-C while joining the pool.
        """
        with self._lock:
            self._closed = True
            pool = self._pool
        self.stop.set()
        try:
            if pool is not None:
                # GC can run this on one of the pool's own threads, which cannot join itself.
                own = threading.current_thread().name.startswith(f"{self.name}_")
                pool.shutdown(wait=not own, cancel_futures=True)
                with self._lock:
                    if self._pool is pool:
                        self._pool = None
        finally:
            self.http.close()
        exit_hook.untrack(self)

    def abandon(self) -> None:
        """``close`` without waiting: stop retries, cancel queued reads, close connections.

        What a Ctrl-C that stopped ``close`` run from a finalizer leaves to do
        (``_primitives.finalizers`` point 2); the exit hook still joins the pool.
        """
        with self._lock:
            self._closed = True
            pool = self._pool
        self.stop.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


# States by id, held weakly: plain references with no callback, so a dataset dropped on the
# training thread runs no Python code here as it dies (_finalizers point 1). Dead entries are
# pruned as the dict grows; every change and every walk happens under the lock.
_registry_lock = threading.Lock()
_live_states: dict[int, weakref.ref[State]] = {}
_prune_at = 64


def _track_state(state: State) -> None:
    global _prune_at
    with _registry_lock:
        if len(_live_states) >= _prune_at:
            for key in [key for key, ref in _live_states.items() if ref() is None]:
                del _live_states[key]
            _prune_at = max(64, 2 * len(_live_states))
        _live_states[id(state)] = weakref.ref(state)


def _after_fork_in_child() -> None:
    # The parent's pool threads do not exist here, its locks may have been held by them, and its
    # sockets are shared with the parent: a child starts afresh, closing nothing of the parent's.
    global _registry_lock
    _registry_lock = threading.Lock()
    for ref in list(_live_states.values()):
        state = ref()
        if state is not None:
            state.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclasses.dataclass(frozen=True)
class Config:
    max_concurrency: int
    retry: RetryPolicy
    max_skipped: int
    cache_dir: str | None
    cache_max_bytes: int
    memory_cache_bytes: int
    storage_options: Mapping[str, Any]
    name: str


class State:
    """What one dataset holds in one process: counters, caches and the runtime (made lazily)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reset()
        _track_state(self)

    def reset(self) -> None:
        """Forget everything (a new process): new lock, counters, caches and runtime."""
        self.lock = threading.Lock()
        self.counters = Counters()
        self._runtime: Runtime | None = None
        self._closing: Runtime | None = None  # the runtime ``close`` is closing
        self._caches: list[ByteCache] | None = None
        self.warned_cache_write = False

    def runtime(self) -> Runtime:
        with self.lock:
            if self._runtime is None:
                self._runtime = Runtime(self.config.max_concurrency, self.config.name)
            return self._runtime

    def caches(self) -> list[ByteCache]:
        caches = self._caches
        if caches is not None:
            return caches
        with self.lock:
            if self._caches is None:
                made: list[ByteCache] = []
                if self.config.memory_cache_bytes:
                    made.append(MemoryCache(self.config.memory_cache_bytes))
                if self.config.cache_dir is not None:
                    made.append(DiskCache(self.config.cache_dir, self.config.cache_max_bytes))
                self._caches = made
            return self._caches

    def close(self) -> None:
        """Close the runtime (``Runtime.close``); the next read makes a new one.

        Raises:
            KeyboardInterrupt: Ctrl-C while joining the read pool.
        """
        with self.lock:
            runtime, self._runtime = self._runtime, None
            self._closing = runtime
        if runtime is not None:
            runtime.close()
        self._closing = None

    def abandon(self) -> None:
        """Stop the runtime that ``close`` was closing, or was about to, waiting for nothing."""
        runtime = self._closing or self._runtime  # no lock: this runs when close was stopped
        if runtime is not None:
            runtime.abandon()
