"""Caches of fetched objects by URL: on local disk or in memory, bounded, least recently used.

The disk cache never serves a partial object. An object is written to a temporary file in the
directory it will live in and renamed over its final name (``os.replace``, atomic on POSIX and
Windows) only once every byte is written, so a reader sees either no file or the whole one: a
writer killed midway leaves only a temporary file, which no read ever opens and which the next
cache opened on the directory deletes once its writer is gone. (This protects against crashes
of the process, not against power loss: there is no ``fsync``.)

Several processes may share a directory (DataLoader worker processes, ranks of one node): each
reads what the others wrote, and each keeps the directory within ``max_bytes`` as far as it
knows; objects another process wrote count once this process has read them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from typing import Protocol

_TMP_PREFIX = ".tmp-"
_WRITE_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class CacheUsage:
    """What a cache holds now, and how many objects it has evicted so far."""

    entries: int
    stored_bytes: int
    evictions: int


class ByteCache(Protocol):
    """A cache of immutable objects by key; safe to call from any number of threads."""

    def get(self, key: str) -> bytes | None:
        """The whole object stored under ``key``, or None."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, evicting the least recently used objects to fit."""
        ...

    def usage(self) -> CacheUsage:
        """Entries, bytes stored and evictions so far."""
        ...


def _check_max_bytes(max_bytes: int) -> None:
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")


class MemoryCache:
    """An in-memory LRU cache of at most ``max_bytes`` of object data.

    Args:
        max_bytes: bound on the summed size of the stored objects; larger objects are not stored.

    Raises:
        ValueError: if ``max_bytes`` is negative.
    """

    def __init__(self, max_bytes: int) -> None:
        _check_max_bytes(max_bytes)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._stored = 0
        self._evictions = 0

    def __repr__(self) -> str:
        return f"MemoryCache({len(self._items)} objects, {self._stored}/{self.max_bytes} bytes)"

    def get(self, key: str) -> bytes | None:
        """The object stored under ``key``, or None; a hit makes it the most recently used."""
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, evicting least recently used objects to fit."""
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._stored += len(data) - (len(old) if old is not None else 0)
            self._items[key] = data
            while self._stored > self.max_bytes:
                _, victim = self._items.popitem(last=False)
                self._stored -= len(victim)
                self._evictions += 1

    def usage(self) -> CacheUsage:
        """Entries, bytes stored and evictions so far."""
        with self._lock:
            return CacheUsage(len(self._items), self._stored, self._evictions)


class DiskCache:
    """A directory of whole objects, at most ``max_bytes`` in all, least recently used evicted.

    Objects live in ``<directory>/<h[:2]>/<h>`` where ``h`` is the SHA-256 of the key. Use
    order survives a restart through the files' modification times, which a hit refreshes.
    Opening the cache scans the directory once and deletes temporary files whose writing
    process no longer exists.

    Args:
        directory: where the objects live; created if missing. Local disk: a writer's liveness
            is judged by its process id on this machine.
        max_bytes: bound on the summed size of the stored objects; larger objects are not stored.

    Raises:
        ValueError: if ``max_bytes`` is negative.
        OSError: if the directory cannot be created or scanned.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        _check_max_bytes(max_bytes)
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, LRU first
        self._stored = 0
        self._evictions = 0
        os.makedirs(self.directory, exist_ok=True)
        for name, size in self._scan():
            self._index[name] = size
            self._stored += size
        with self._lock:
            self._evict_locked()

    def __repr__(self) -> str:
        return (
            f"DiskCache({self.directory!r}, {len(self._index)} objects, "
            f"{self._stored}/{self.max_bytes} bytes)"
        )

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name[:2], name)

    def _scan(self) -> list[tuple[str, int]]:
        """Stored objects as (name, size), least recently used first; orphans deleted."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.directory) as top:
            subdirs = [e.path for e in top if len(e.name) == 2 and e.is_dir()]
        for sub in subdirs:
            with os.scandir(sub) as entries:
                for e in entries:
                    if e.name.startswith(_TMP_PREFIX):
                        _remove_orphan(e.path, e.name)
                    elif len(e.name) == 64 and e.is_file():
                        st = e.stat()
                        found.append((st.st_mtime, e.name, st.st_size))
        found.sort()
        return [(name, size) for _, name, size in found]

    def get(self, key: str) -> bytes | None:
        """The whole object stored under ``key`` (by any process), or None."""
        name = _name(key)
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            with self._lock:
                # Evicted by another process sharing the directory; unless a put() of this
                # process named the file since the open failed (it renames under this lock).
                size = None if os.path.exists(path) else self._index.pop(name, None)
                if size is not None:
                    self._stored -= size
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            elif os.path.exists(path):  # written by another process (not evicted meanwhile)
                self._index[name] = len(data)
                self._stored += len(data)
                self._evict_locked()
        with contextlib.suppress(OSError):
            os.utime(path)  # use order for the next process that opens this directory
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically, evicting least recently used objects to fit.

        Raises:
            OSError: if the object cannot be written (disk full, permissions); nothing is left
                behind under its final name.
        """
        if len(data) > self.max_bytes:
            return
        name = _name(key)
        path = self._path(name)
        subdir = os.path.dirname(path)
        os.makedirs(subdir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=subdir)
        try:
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view[:_WRITE_CHUNK])
                    view = view[written:]
            finally:
                os.close(fd)
            # Naming, indexing and evicting under one lock: an eviction's unlink must not
            # remove a file another thread has just put under the same name (its entry would
            # then name no file). Renames and unlinks are quick; the write above is not locked.
            with self._lock:
                os.replace(tmp, path)  # the only way an object gets its final name
                old = self._index.pop(name, None)
                self._stored += len(data) - (old or 0)
                self._index[name] = len(data)
                self._evict_locked()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _evict_locked(self) -> None:
        """Delete least recently used objects until the cache fits (holding ``_lock``)."""
        while self._stored > self.max_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._stored -= size
            self._evictions += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(name))

    def usage(self) -> CacheUsage:
        """Entries, bytes stored and evictions so far, as this process knows them."""
        with self._lock:
            return CacheUsage(len(self._index), self._stored, self._evictions)


def _name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _remove_orphan(path: str, name: str) -> None:
    """Delete a temporary file whose writer (pid in its name) has died; keep live writers'."""
    try:
        pid = int(name[len(_TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return
    if pid == os.getpid() or _pid_alive(pid):
        return
    with contextlib.suppress(OSError):
        os.unlink(path)


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would signal the process there, not probe it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    except OSError:
        return True  # cannot tell (e.g. Windows semantics): keep the file
    return True
