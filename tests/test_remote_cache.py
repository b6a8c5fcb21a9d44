"""RemoteFiles' caches: later epochs read locally, the disk stays bounded, no partial file is served."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from remote_servers import FaultyHTTPServer

from threadloader import ThreadDataLoader
from threadloader.remote import RemoteFiles, RetryPolicy
from threadloader.remote.cache import DiskCache, MemoryCache

FAST = RetryPolicy(attempts=5, backoff_s=0.001, max_backoff_s=0.01, timeout_s=5.0)
OBJECTS = {f"obj/{i}": bytes([i]) * (100 + i) for i in range(48)}
BIG = b"0123456789abcdef" * 2**16  # 1 MiB (as spelled in the killed writer's script)


def _list(batch: list[Any]) -> list[Any]:
    return batch


@pytest.fixture
def server() -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer({**OBJECTS, "big": BIG}) as s:
        yield s


def _urls(server: FaultyHTTPServer) -> list[str]:
    return [server.url(k) for k in OBJECTS]


def _epoch(ds: RemoteFiles) -> list[bytes]:
    loader = ThreadDataLoader(ds, batch_size=8, shuffle=True, num_workers=4, collate_fn=_list)
    return sorted(item for batch in loader for item in batch)


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def test_the_second_epoch_reads_from_the_disk_cache(
    server: FaultyHTTPServer, tmp_path: Path
) -> None:
    """Epoch 1 fetches each object once; epoch 2 sends no request and counts only hits."""
    with RemoteFiles(_urls(server), cache_dir=tmp_path, retry=FAST) as ds:
        assert _epoch(ds) == sorted(OBJECTS.values())
        requests = sum(server.requests.values())
        assert _epoch(ds) == sorted(OBJECTS.values())
        stats = ds.stats()
    assert requests == len(OBJECTS) and sum(server.requests.values()) == requests
    assert (stats.reads, stats.cache_misses, stats.cache_hits) == (48, 48, 48)
    assert stats.cache_hit_bytes == stats.cache_stored_bytes == sum(map(len, OBJECTS.values()))


def test_a_new_dataset_on_the_same_directory_starts_warm(
    server: FaultyHTTPServer, tmp_path: Path
) -> None:
    """A second RemoteFiles (a restart, another process) reads what the first one cached."""
    with RemoteFiles(_urls(server), cache_dir=tmp_path, retry=FAST) as first:
        first.__getitems__(list(range(10)))
    with RemoteFiles(_urls(server), cache_dir=tmp_path, retry=FAST) as second:
        second.__getitems__(list(range(10)))
        assert second.stats().cache_hits == 10 and second.stats().reads == 0
    assert sum(server.requests.values()) == 10


def test_the_memory_cache_serves_repeats_and_stays_bounded(server: FaultyHTTPServer) -> None:
    """memory_cache_bytes keeps the most recent objects up to its bound; repeats hit it."""
    urls = _urls(server)[:4]
    bound = sum(len(OBJECTS[f"obj/{i}"]) for i in (2, 3))
    # One read after another: a concurrent batch fills the cache in the order its reads end.
    with RemoteFiles(urls, memory_cache_bytes=bound, max_concurrency=0, retry=FAST) as ds:
        ds.__getitems__([0, 1, 2, 3])
        ds.__getitems__([2, 3])
        stats = ds.stats()
        assert (stats.cache_hits, stats.cache_stored_bytes, stats.cache_evictions) == (2, bound, 2)
        ds.__getitems__([0])
    assert server.requests["obj/0"] == 2


def test_the_disk_cache_evicts_the_least_recently_used_to_stay_bounded(tmp_path: Path) -> None:
    """Past max_bytes the object used longest ago goes; a hit makes an object recent."""
    cache = DiskCache(tmp_path, max_bytes=3000)
    for key in "abc":
        cache.put(key, key.encode() * 1000)
    assert cache.get("a") == b"a" * 1000  # a is now the most recent: b is the oldest
    cache.put("d", b"d" * 1000)
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.usage().stored_bytes == 3000 and cache.usage().evictions == 1
    assert sum(p.stat().st_size for p in _files(tmp_path)) == 3000
    cache.put("huge", b"x" * 3001)  # larger than the whole cache: not stored, nothing evicted
    assert cache.get("huge") is None and cache.usage().entries == 3


def test_an_eviction_never_deletes_an_object_put_again_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread A evicts "a" while thread B puts "a" anew: B's object stays readable (A's unlink
    used to remove B's fresh file, leaving an entry that named no file)."""
    from threadloader.remote import cache as _cache

    cache = DiskCache(tmp_path, max_bytes=2000)
    cache.put("a", b"a" * 1000)
    cache.put("b", b"b" * 1000)
    real_unlink = _cache.os.unlink
    second_put: list[threading.Thread] = []

    def unlink_with_a_put_meanwhile(path: Any) -> None:
        if not second_put:  # A is evicting "a": B puts "a" again, as far as it can get
            thread = threading.Thread(target=cache.put, args=("a", b"A" * 1000))
            second_put.append(thread)
            thread.start()
            thread.join(0.3)
        real_unlink(path)

    monkeypatch.setattr(_cache.os, "unlink", unlink_with_a_put_meanwhile)
    cache.put("c", b"c" * 1000)  # evicts "a", the least recently used
    second_put[0].join()
    monkeypatch.setattr(_cache.os, "unlink", real_unlink)
    assert cache.get("a") == b"A" * 1000
    assert cache.usage().stored_bytes == sum(p.stat().st_size for p in _files(tmp_path))


def test_a_miss_never_forgets_an_object_put_while_it_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader fails to open "a" just before another thread puts "a": the object stays counted
    (the miss used to take the fresh entry for one another process had evicted, so the file
    stayed on disk uncounted and was never evicted)."""
    from threadloader.remote import cache as _cache

    cache = DiskCache(tmp_path, max_bytes=10_000)

    def open_missing_while_put(path: Any, mode: str) -> Any:
        cache.put("a", b"a" * 1000)  # lands between the failed open and the miss's bookkeeping
        raise FileNotFoundError(path)

    monkeypatch.setattr(_cache, "open", open_missing_while_put, raising=False)
    assert cache.get("a") is None
    monkeypatch.delattr(_cache, "open")
    assert cache.usage().entries == 1
    assert cache.usage().stored_bytes == sum(p.stat().st_size for p in _files(tmp_path)) == 1000


def test_use_order_survives_reopening_the_directory(tmp_path: Path) -> None:
    """A reopened cache evicts by the use order the previous one left in file times."""
    cache = DiskCache(tmp_path, max_bytes=3000)
    for key in "abc":
        cache.put(key, key.encode() * 1000)
        time.sleep(0.02)
    cache.get("a")
    reopened = DiskCache(tmp_path, max_bytes=3000)
    assert reopened.usage().stored_bytes == 3000
    reopened.put("d", b"d" * 1000)
    assert reopened.get("b") is None and reopened.get("a") == b"a" * 1000


def test_readers_racing_writers_only_ever_see_whole_objects(tmp_path: Path) -> None:
    """Threads rewriting one key with objects of different sizes never expose a mix or a part."""
    cache = DiskCache(tmp_path, max_bytes=2**26)
    versions = [bytes([v]) * (200_000 + 10_000 * v) for v in range(4)]
    stop = threading.Event()
    seen: set[bytes] = set()  # first byte of each whole version read
    bad: list[int] = []  # lengths of anything else read

    def write(v: int) -> None:
        while not stop.is_set():
            cache.put("k", versions[v])

    def read() -> None:
        while not stop.is_set():
            data = cache.get("k")
            if data is None:
                continue
            if data in versions:
                seen.add(data[:1])
            else:
                bad.append(len(data))

    threads = [threading.Thread(target=write, args=(v,)) for v in range(4)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    deadline = time.monotonic() + 30  # a loaded machine may need longer to show two versions
    while len(seen) < 2 and not bad and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert bad == [] and len(seen) >= 2
    assert [p.name for p in _files(tmp_path) if p.name.startswith(".tmp-")] == []


_DIE_MIDWAY = """
import os, sys
real_write = os.write
def write_half_then_die(fd, data):
    real_write(fd, bytes(data[: len(data) // 2]))
    os._exit(17)  # the writer is killed in the middle of writing the object
os.write = write_half_then_die
"""


def test_a_writer_killed_midway_leaves_nothing_servable(tmp_path: Path) -> None:
    """A process killed halfway through put() leaves only a temp file, never read, later removed."""
    code = (
        "from threadloader.remote.cache import DiskCache\n"  # imports may write (tempfile's probe)
        + _DIE_MIDWAY
        + f"DiskCache({str(tmp_path)!r}, 2**30).put('key', b'0123456789abcdef' * 2**16)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == 17, proc.stderr.decode()
    (partial,) = _files(tmp_path)
    assert partial.name.startswith(".tmp-") and 0 < partial.stat().st_size < len(BIG)
    cache = DiskCache(tmp_path, 2**30)  # opening it removes the dead writer's temp file
    assert cache.get("key") is None and _files(tmp_path) == []


def test_remote_files_refetch_an_object_whose_cache_write_was_killed(
    server: FaultyHTTPServer, tmp_path: Path
) -> None:
    """After a reader process dies while caching an object, the next read fetches it whole."""
    url = server.url("big")
    code = (
        "from threadloader.remote.files import RemoteFiles\n"  # imports may write (tempfile's probe)
        + _DIE_MIDWAY
        + f"RemoteFiles([{url!r}], cache_dir={str(tmp_path)!r})[0]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == 17, proc.stderr.decode()
    assert server.requests["big"] == 1
    with RemoteFiles([url], cache_dir=tmp_path, retry=FAST) as ds:
        assert ds[0] == BIG
        assert (ds.stats().cache_hits, ds.stats().cache_misses) == (0, 1)
        assert ds[0] == BIG and ds.stats().cache_hits == 1
    assert server.requests["big"] == 2


def test_a_failing_cache_write_does_not_fail_the_read(
    server: FaultyHTTPServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk is logged once and the objects are still delivered, uncached."""

    def disk_full(self: DiskCache, key: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskCache, "put", disk_full)
    ds = RemoteFiles(_urls(server)[:4], cache_dir=tmp_path, retry=FAST)
    with ds, caplog.at_level(logging.WARNING, logger="threadloader.remote.files"):
        assert ds.__getitems__([0, 1, 2, 3]) == [OBJECTS[f"obj/{i}"] for i in range(4)]
    assert caplog.text.count("No space left") == 1


def test_memory_cache_evicts_least_recently_used() -> None:
    """MemoryCache drops the least recently used object first and never exceeds its bound."""
    cache = MemoryCache(max_bytes=20)
    for key in "abc":
        cache.put(key, key.encode() * 7)  # 21 bytes for three: "a" goes
    assert cache.get("a") is None and cache.get("b") == b"bbbbbbb"
    cache.put("d", b"d" * 7)  # b was just used: c goes
    assert cache.get("c") is None and cache.usage().stored_bytes == 14


@pytest.mark.parametrize("isolation", [None, "process"])
def test_loader_stats_report_the_datasets_reads_and_cache(
    server: FaultyHTTPServer, tmp_path: Path, isolation: str | None
) -> None:
    """loader.stats() carries RemoteFiles' own counters (cache hits and misses, bytes), also
    with isolation="process", where the helper's copy of the dataset does the reading."""
    with RemoteFiles(_urls(server), cache_dir=tmp_path, retry=FAST) as ds:
        loader = ThreadDataLoader(
            ds, batch_size=8, num_workers=2, collate_fn=_list, isolation=isolation
        )
        assert len([b for b in loader]) == 6
        first = loader.stats().dataset
        assert len([b for b in loader]) == 6
        second = loader.stats().dataset
        report = str(loader.stats())
    assert first.cache_misses == 48 and first.cache_hits == 0
    assert second.cache_hits == 48 and second.cache_hit_bytes == sum(map(len, OBJECTS.values()))
    assert "cache_hits=48" in report
