"""RemoteFiles: a map-style dataset over objects in object storage, on HTTP servers or on disk.

Reading remote objects is waiting, not computing, which is where worker threads beat worker
processes: a thread costs kilobytes, a process hundreds of megabytes, so a loader can keep dozens
of reads in flight. ``RemoteFiles`` adds what such reads need: batch reads issued concurrently,
retries, a skip budget for bad objects, and a local cache.

How a read behaves; where the code disagrees with this, the code is wrong.

1. Caches first: the memory cache, then the disk cache. A hit is served by the calling thread.
2. The misses of one ``__getitems__`` (one batch) are read concurrently: the calling thread and
   the dataset's read pool (``max_concurrency`` threads, shared by every loader worker, started
   on first use) take them one at a time until none is left (``batch_reads``), so a batch gets
   every pool thread free while it is read. The pool's queue is bounded: with
   ``2 * max_concurrency`` helper tasks queued or running, no more are offered.
3. A read is retried on transient failures (HTTP 500/502/503/504/408/425/429, reset or refused
   connections, truncated bodies, timeouts) with exponential backoff and jitter; each try has a
   deadline (``RetryPolicy``). A good read fills the caches, then is decoded in the thread that read it.
4. An item that cannot be delivered (missing object, permanent error, retries exhausted, decode
   error) raises ``RemoteReadError`` / ``RemoteDecodeError`` naming its URL and the last cause,
   unless ``max_skipped`` allows skipping it: then ``__getitems__`` leaves it out, so the batch is
   *shorter* (never padded with another item; possibly empty, which ``default_collate``
   rejects: give the loader a ``collate_fn`` that accepts it if a whole batch may be skipped),
   ``stats().skipped`` counts it, and it is logged with its URL. The item after the budget raises ``SkipBudgetExceededError``. ``__getitem__``
   never skips: one index must give one item.
5. ``close()`` (also run at garbage collection and interpreter exit) stops retrying, cancels
   queued reads, joins the pool's threads and closes connections; reads in progress finish their
   current try. Using the dataset afterwards starts a new pool. A forked child (DataLoader worker
   process) starts with its own empty pool, connections and counters.

HTTP(S) is read by a small HTTP/1.1 client on the standard library's sockets (``http``); every
other scheme (``s3://``, ``gs://``, ``file://``, ...) goes through fsspec, whose async backends
run on fsspec's own event-loop thread. The read pool, connections, counters and caches of a dataset in one process live in
``state``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from threadloader._primitives.finalizers import Finalizer
from threadloader.remote.batch_reads import SharedBatch
from threadloader.remote.cache import ByteCache
from threadloader.remote.errors import (
    RemoteDecodeError,
    RemoteNotFoundError,
    RemoteReadError,
    RemoteStats,
    SkipBudgetExceededError,
)
from threadloader.remote.retry import RetriesExhausted, RetryPolicy, call_with_retries, http_status
from threadloader.remote.state import Config, Runtime, State

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "RemoteDecodeError",
    "RemoteFiles",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteStats",
    "RetryPolicy",
    "SkipBudgetExceededError",
]

logger = logging.getLogger(__name__)

_HTTP = ("http://", "https://")
#: ``cache_max_bytes`` when ``cache_dir`` is given without it.
DEFAULT_CACHE_MAX_BYTES = 10 * 2**30


_MISS = object()  # not in any cache (an item may legitimately decode to None)


class _Failure:
    """An item that could not be delivered, carried back to the batch as a value."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class RemoteFiles(Dataset[Any]):
    """A map-style dataset of remote objects: item ``i`` is ``decode(bytes of urls[i])``.

    Use it with ``ThreadDataLoader(..., num_workers=32)`` or more: workers mostly wait, and a
    thread costs little. Each batch's reads are issued concurrently (see the module docstring
    for the full behaviour, including what a skipped item does to its batch).

    Example::

        ds = RemoteFiles("s3://bucket/train/*.jpg", decode=decode_jpeg, cache_dir="/tmp/c")
        loader = ThreadDataLoader(ds, batch_size=16, num_workers=32)

    Args:
        urls: the objects, in item order: a sequence of URLs or local paths (``s3://``,
            ``gs://``, ``http(s)://``, ``file://``, any fsspec protocol), or one string: a glob
            pattern, a directory/prefix to list recursively, or a single object. Listings are
            sorted. HTTP locations cannot be listed.
        decode: turns an object's bytes into the item; raw ``bytes`` when None. Runs in the
            thread that read the object (a pool thread on a cache miss).
        storage_options: passed to fsspec for non-HTTP URLs (credentials, endpoint, ...); for
            HTTP(S) only ``headers`` (a mapping) is used.
        max_concurrency: threads in the read pool shared by all loader workers; 0 reads each
            batch one object after another in the calling thread.
        retry: tries, backoff and per-try deadline (``RetryPolicy()``: 5 tries, 30 s each).
        max_skipped: items that may be left out of their batch when they cannot be delivered,
            over the dataset's life in this process; 0 raises on the first.
        cache_dir: keep fetched objects on local disk here, for later epochs and processes.
        cache_max_bytes: bound of the disk cache; least recently used objects are evicted.
            ``None`` (default): 10 GiB with ``cache_dir``. Needs ``cache_dir``.
        memory_cache_bytes: keep up to this many bytes of objects in memory (0: no memory cache).

    Raises:
        ValueError: on an empty listing, an HTTP pattern, or a negative number; for an option
            that would do nothing: ``cache_max_bytes`` without ``cache_dir``, or
            ``storage_options`` other than ``headers`` when every URL is HTTP(S).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        decode: Callable[[bytes], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_concurrency: int = 32,
        retry: RetryPolicy | None = None,
        max_skipped: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | None = None,
        memory_cache_bytes: int = 0,
    ) -> None:
        if cache_max_bytes is not None and cache_dir is None:
            raise ValueError(
                f"cache_max_bytes={cache_max_bytes!r} bounds the disk cache, so it needs "
                "cache_dir= (without it nothing is cached on disk)"
            )
        for arg, value in (
            ("max_concurrency", max_concurrency),
            ("max_skipped", max_skipped),
            ("cache_max_bytes", cache_max_bytes or 0),
            ("memory_cache_bytes", memory_cache_bytes),
        ):
            if value < 0:
                raise ValueError(f"{arg} must be >= 0, got {value}")
        options = dict(storage_options or {})
        self.urls: tuple[str, ...] = tuple(
            _list(urls, options) if isinstance(urls, str) else (os.fspath(u) for u in urls)
        )
        unused = sorted(set(options) - {"headers"})
        if unused and self.urls and all(u.startswith(_HTTP) for u in self.urls):
            raise ValueError(
                f"storage_options {unused} would be ignored: HTTP(S) URLs are read by "
                "threadloader's own HTTP client, which takes only 'headers'"
            )
        self.decode = decode
        self._headers: dict[str, str] = dict(options.get("headers") or {})
        self._config = Config(
            max_concurrency=max_concurrency,
            retry=retry if retry is not None else RetryPolicy(),
            max_skipped=max_skipped,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
            cache_max_bytes=DEFAULT_CACHE_MAX_BYTES if cache_max_bytes is None else cache_max_bytes,
            memory_cache_bytes=memory_cache_bytes,
            storage_options=options,
            name=f"threadloader-remote-{id(self):x}",
        )
        self._start()

    def _start(self) -> None:
        self._state = State(self._config)
        # The finalizer holds the state, never self: dropping the dataset joins its threads. A
        # Ctrl-C during that join stops the reads without waiting and reaches the loop; nothing
        # runs at interpreter exit (the exit hook closes runtimes earlier than atexit would).
        self._finalizer = Finalizer(self, self._state.close, on_interrupt=self._state.abandon)

    def __copy__(self) -> RemoteFiles:
        """A copy sharing this one's read pool, caches and counters (a worker thread's copy).

        Copying by ``__getstate__`` would start a read pool per copy and split the counters
        that ``stats()`` adds up; a copy in another process starts its own, as pickling does.
        """
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_state"], state["_finalizer"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    def __repr__(self) -> str:
        c = self._config
        first = f", first {self.urls[0]!r}" if self.urls else ""
        cache = f", cache_dir={c.cache_dir!r}" if c.cache_dir else ""
        n, conc = len(self.urls), c.max_concurrency
        return f"RemoteFiles({n} objects{first}, max_concurrency={conc}{cache})"

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> Any:
        """Item ``index``: read (or taken from a cache) and decoded, in the calling thread.

        Raises:
            IndexError: if ``index`` is out of range.
            RemoteNotFoundError: if the object does not exist.
            RemoteReadError: if it cannot be read, after retries for transient failures.
            RemoteDecodeError: if ``decode`` raised.
        """
        url = self.urls[index]
        caches = self._state.caches()
        out = self._cached(url, caches)
        if out is _MISS:
            out = self._fetch(url, self._state.runtime(), caches)
        if isinstance(out, _Failure):
            raise out.error
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items of one batch, in order, their reads issued concurrently.

        Returns:
            One item per index, except items skipped under ``max_skipped``, which are left out:
            the list is then shorter than ``indices`` (possibly empty).

        Raises:
            IndexError: if an index is out of range.
            RemoteNotFoundError, RemoteReadError, RemoteDecodeError: for the first item (in
                batch order) that cannot be delivered, when ``max_skipped`` is 0.
            SkipBudgetExceededError: for the first such item past the ``max_skipped`` budget.
        """
        urls = [self.urls[i] for i in indices]
        caches = self._state.caches()
        results: list[Any] = [self._cached(url, caches) for url in urls]
        misses = [pos for pos, r in enumerate(results) if r is _MISS]
        if misses:
            runtime = self._state.runtime()
            shared = SharedBatch([(pos, urls[pos]) for pos in misses], runtime.stop)

            def read(url: str) -> Any:
                return self._fetch(url, runtime, caches)

            helpers: list[Future[Any]] = []

            def offer() -> None:
                # One helper per miss left but the one the caller takes next, while the pool's
                # queue has room; tried again before each of the caller's reads, as room frees up.
                while len(helpers) < shared.left() - 1:
                    future = runtime.submit(shared.read_all, read)
                    if future is None:
                        return
                    helpers.append(future)

            try:
                shared.read_all(read, offer)  # the calling thread would only wait: it reads too
            except BaseException:
                shared.abandon()
                raise
            finally:
                for future in helpers:
                    future.cancel()  # a helper not started yet would find nothing left to read
            for pos, url in shared.wait():
                gave_up = CancelledError("the dataset was closed before this object was read")
                shared.results[pos] = _Failure(RemoteReadError._of(url, 0, gave_up, gave_up=True))
            for pos, out in shared.results.items():
                results[pos] = out
        items = []
        for url, out in zip(urls, results, strict=True):
            if isinstance(out, _Failure):
                self._skip_or_raise(url, out.error)
            else:
                items.append(out)
        return items

    def stats(self) -> RemoteStats:
        """A snapshot of this dataset's counters in this process.

        Returns:
            Reads, retries, failures, skips and cache figures since the dataset was created
            (or since this process was forked from the one that created it).
        """
        return RemoteStats(**self._state.counters.snapshot(self._state.caches()))

    def close(self) -> None:
        """Join the read pool's threads and close connections now. Idempotent.

        Queued reads are cancelled and reads waiting to retry give up; a read in progress
        finishes its current try. The dataset stays usable: the next read starts a new pool.
        """
        self._state.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _cached(self, url: str, caches: list[ByteCache]) -> Any:
        """The decoded item (or a _Failure) from the first cache that has it, else _MISS."""
        if not caches:
            return _MISS
        counters = self._state.counters
        for level, cache in enumerate(caches):
            data = cache.get(url)
            if data is not None:
                for faster in caches[:level]:
                    faster.put(url, data)
                counters.add(cache_hits=1, cache_hit_bytes=len(data))
                return self._decode(url, data)
        counters.add(cache_misses=1)
        return _MISS

    def _fetch(self, url: str, runtime: Runtime, caches: list[ByteCache]) -> Any:
        """Read ``url`` with retries, fill the caches, decode: the item or a _Failure."""
        counters = self._state.counters
        start = time.monotonic()
        try:
            data = call_with_retries(
                lambda timeout_s: self._read_once(url, runtime, timeout_s),
                self._config.retry,
                runtime.stop,
                on_retry=lambda _: counters.add(retries=1),
            )
        except RetriesExhausted as e:
            error = RemoteReadError._of(url, e.attempts, e.cause, gave_up=e.stopped)
            return self._failed(error, e.cause, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001  # goes to the batch as a value
            not_found = isinstance(e, FileNotFoundError) or http_status(e) in (404, 410)
            error = (RemoteNotFoundError if not_found else RemoteReadError)._of(url, 1, e)
            return self._failed(error, e, time.monotonic() - start)
        counters.add(time.monotonic() - start, reads=1, read_bytes=len(data))
        for cache in caches:
            try:
                cache.put(url, data)
            except OSError as e:  # a full disk must not fail the read
                if not self._state.warned_cache_write:
                    self._state.warned_cache_write = True
                    logger.warning("cannot write to the cache (%s); reading on without it", e)
        return self._decode(url, data)

    def _failed(self, error: Exception, cause: BaseException, seconds: float) -> _Failure:
        error.__cause__ = cause
        self._state.counters.add(seconds, failures=1)
        return _Failure(error)

    def _read_once(self, url: str, runtime: Runtime, timeout_s: float) -> bytes:
        if url.startswith(_HTTP):
            return runtime.http.get(url, timeout_s, self._headers)
        fs, path = runtime.filesystem(url, self._config.storage_options)
        if getattr(fs, "async_impl", False):  # fsspec enforces the deadline on its loop
            return bytes(fs.cat_file(path, timeout=timeout_s))
        return bytes(fs.cat_file(path))

    def _decode(self, url: str, data: bytes) -> Any:
        if self.decode is None:
            return data
        try:
            return self.decode(data)
        except Exception as e:  # noqa: BLE001  # raised or skipped by the batch
            message = f"decode failed for {url}: {type(e).__name__}: {e}"
            return self._failed(RemoteDecodeError(message, url=url, cause=e), e, 0.0)

    def _skip_or_raise(self, url: str, error: Exception) -> None:
        budget = self._config.max_skipped
        if budget:
            number = self._state.counters.try_skip(url, budget)
            if number is not None:
                logger.warning("skipped %s (%d of max_skipped=%d): %s", url, number, budget, error)
                return
            raise SkipBudgetExceededError(
                f"{url} could not be delivered and the skip budget is spent ({budget} items "
                f"skipped, max_skipped={budget}): {error}"
            ) from error
        raise error


def _list(pattern: str, storage_options: Mapping[str, Any]) -> list[str]:
    """The objects a glob, a prefix/directory or a single URL names, as sorted URLs."""
    if pattern.startswith(_HTTP):
        raise ValueError(f"cannot list HTTP locations: pass a list of URLs, not {pattern!r}")
    import fsspec

    fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
    if any(ch in path for ch in "*?["):
        paths = [p for p, info in fs.glob(path, detail=True).items() if info["type"] == "file"]
    elif fs.isdir(path):
        paths = fs.find(path)
    elif fs.exists(path):
        paths = [path]
    else:
        paths = []  # a typo would otherwise be a one-object dataset that fails on its first read
    if not paths:
        raise ValueError(f"{pattern!r} names no objects (no such object, prefix or directory)")
    return sorted(fs.unstrip_protocol(p) for p in paths)
