"""RemoteFiles reads every object exactly once per epoch through real loopback servers.

The servers (tests/remote_servers.py) run in this process on 127.0.0.1 with an ephemeral port,
inject latency, 503s, connection resets and truncated bodies, and are stopped in teardown.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import http.client
import logging
import pickle
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import press_ctrl_c_during
from remote_servers import Faults, FaultyHTTPServer, MotoS3, s3_storage_options
from torch.utils.data import DataLoader

from threadloader import ThreadDataLoader
from threadloader.remote import (
    RemoteDecodeError,
    RemoteFiles,
    RemoteNotFoundError,
    RemoteReadError,
    RemoteStats,
    RetryPolicy,
    SkipBudgetExceededError,
)
from threadloader.remote.retry import is_transient

FAST = RetryPolicy(attempts=12, backoff_s=0.001, max_backoff_s=0.01, timeout_s=5.0)
OBJECTS = {f"obj/{i}": (b"%05d:" % i) * (50 + i) for i in range(96)}


def _list(batch: list[Any]) -> list[Any]:
    return batch


def _pool_threads(ds: RemoteFiles) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(ds._config.name)]


@pytest.fixture
def server() -> Iterator[FaultyHTTPServer]:
    with FaultyHTTPServer(OBJECTS) as s:
        yield s


@pytest.fixture
def files(server: FaultyHTTPServer) -> Iterator[RemoteFiles]:
    ds = RemoteFiles([server.url(k) for k in OBJECTS], retry=FAST)
    yield ds
    ds.close()


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3]:
    pytest.importorskip("s3fs", reason="S3 tests need s3fs")
    pytest.importorskip("moto.server", reason="S3 tests need moto[server]")
    s3 = MotoS3()
    yield s3
    s3.stop()


def test_every_object_arrives_once_per_epoch_despite_503s_resets_and_truncation(
    server: FaultyHTTPServer, files: RemoteFiles
) -> None:
    """Through 10% 503s, 5% resets and 5% truncated bodies, two epochs deliver each object once."""
    server.faults = Faults(error_rate=0.10, reset_rate=0.05, truncate_rate=0.05, seed=1)
    loader = ThreadDataLoader(files, batch_size=16, shuffle=True, num_workers=8, collate_fn=_list)
    for _ in range(2):
        got = Counter(item for batch in loader for item in batch)
        assert got == Counter(OBJECTS.values())
    stats = files.stats()
    assert stats.reads == 2 * len(OBJECTS) and stats.failures == 0 and stats.skipped == 0
    assert stats.retries > 0 and server.injected["503"] > 0 and server.injected["truncate"] > 0


def test_s3_objects_arrive_once_per_epoch_through_a_failing_proxy(moto: MotoS3) -> None:
    """An S3 bucket (moto) behind a proxy answering 10% 503s and 5% resets: each object once."""
    objects = dict(list(OBJECTS.items())[:32])
    bucket = moto.new_bucket(objects)
    faults = Faults(error_rate=0.10, reset_rate=0.05, seed=2)
    with FaultyHTTPServer(upstream=moto.address, faults=faults) as proxy:
        options = s3_storage_options(proxy.url().rstrip("/"))
        ds = RemoteFiles(f"s3://{bucket}/obj/*", storage_options=options, retry=FAST)
        try:
            assert ds.urls == tuple(sorted(f"s3://{bucket}/{k}" for k in objects))
            loader = ThreadDataLoader(ds, batch_size=8, num_workers=4, collate_fn=_list)
            got = Counter(item for batch in loader for item in batch)
            assert got == Counter(objects.values())
            assert ds.stats().retries > 0 and sum(proxy.injected.values()) > 0
        finally:
            ds.close()


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_a_body_shorter_than_its_content_length_is_retried_never_delivered(
    server: FaultyHTTPServer, keep: float
) -> None:
    """Each object's first answer announces its length, sends none (or half), and closes."""
    server.faults = Faults(truncate_first=1, truncate_keep=keep)
    urls = [server.url(f"obj/{i}") for i in range(8)]
    with RemoteFiles(urls, retry=FAST) as ds:
        assert ds.__getitems__(list(range(8))) == [OBJECTS[f"obj/{i}"] for i in range(8)]
        stats = ds.stats()
    assert server.injected["truncate"] == 8
    assert stats.retries == 8 and stats.reads == 8 and stats.failures == 0


def test_answers_to_head_carry_the_length_but_no_body(server: FaultyHTTPServer) -> None:
    """A HEAD's answer, 503 or 200, ends after its headers: a body would be read as the next
    answer on a kept-alive connection. Its Content-Length is the object's, as for a GET."""
    server.faults = Faults(fail_first=1)
    answers = []
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"HEAD /obj/1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers.append(b"".join(iter(lambda s=sock: s.recv(65536), b"")))
    (failed_head, failed_rest), (head, rest) = (a.split(b"\r\n\r\n", 1) for a in answers)
    assert failed_head.startswith(b"HTTP/1.1 503") and failed_rest == b""
    assert head.startswith(b"HTTP/1.1 200") and rest == b""
    assert f"Content-Length: {len(OBJECTS['obj/1'])}".encode() in head


def test_the_proxy_forwards_the_object_size_in_head_answers(moto: MotoS3) -> None:
    """s3fs's info() through the proxy (a HEAD) gives the object's size, not 0."""
    import fsspec

    bucket = moto.new_bucket({"k": b"0123456789"})
    with FaultyHTTPServer(upstream=moto.address) as proxy:
        fs = fsspec.filesystem("s3", **s3_storage_options(proxy.url().rstrip("/")))
        assert fs.info(f"{bucket}/k")["size"] == 10
        assert fs.cat_file(f"{bucket}/k") == b"0123456789"


def test_s3_reads_through_a_truncating_proxy_deliver_whole_objects(moto: MotoS3) -> None:
    """GET bodies cut short (or empty) under their Content-Length never arrive as items."""
    objects = dict(list(OBJECTS.items())[:8])
    bucket = moto.new_bucket(objects)
    faults = Faults(truncate_first=2, truncate_keep=0.0)  # each key: its HEAD, then a cut GET
    with FaultyHTTPServer(upstream=moto.address, faults=faults) as proxy:
        options = s3_storage_options(proxy.url().rstrip("/"))
        with RemoteFiles(f"s3://{bucket}/obj/*", storage_options=options, retry=FAST) as ds:
            assert ds.__getitems__(list(range(8))) == list(objects.values())
        assert proxy.injected["truncate"] >= 8


def test_exhausted_retries_raise_naming_the_url_and_the_last_cause(
    server: FaultyHTTPServer,
) -> None:
    """An object that always answers 503 raises RemoteReadError with its URL after every try."""
    server.faults = Faults(always_fail=frozenset({"obj/3"}))
    policy = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=0.001)
    with RemoteFiles([server.url(k) for k in OBJECTS], retry=policy) as ds:
        loader = ThreadDataLoader(ds, batch_size=4, num_workers=2, collate_fn=_list)
        with pytest.raises(RemoteReadError) as info:
            list(loader)
    assert server.url("obj/3") in str(info.value)
    assert "after 3 attempts" in str(info.value) and "HTTP 503" in str(info.value)
    assert server.requests["obj/3"] == 3


@pytest.mark.parametrize(("status", "error"), [(404, RemoteNotFoundError), (403, RemoteReadError)])
def test_a_permanent_http_error_fails_at_once_without_retrying(
    server: FaultyHTTPServer, files: RemoteFiles, status: int, error: type[Exception]
) -> None:
    """404 and 403 are answers, not outages: one request, then the error names the URL."""
    server.faults = Faults(status_for={"obj/0": status})
    with pytest.raises(error, match=f"HTTP {status}") as info:
        files[0]
    assert info.value.url == server.url("obj/0")  # type: ignore[attr-defined]
    assert server.requests["obj/0"] == 1 and files.stats().retries == 0


def test_a_try_slower_than_its_deadline_times_out_and_is_retried(server: FaultyHTTPServer) -> None:
    """With a 0.1 s deadline against a 30 s server, each try times out and the error says so."""
    server.faults = Faults(latency_s=30.0)
    policy = RetryPolicy(attempts=2, backoff_s=0.001, timeout_s=0.1)
    with RemoteFiles([server.url("obj/1")], retry=policy) as ds:
        start = time.monotonic()
        with pytest.raises(RemoteReadError, match="TimeoutError") as info:
            ds[0]
        assert time.monotonic() - start < 10  # not the server's 30 s: the deadline ended each try
        assert info.value.attempts == 2 and ds.stats().retries == 1


def test_a_body_trickled_byte_by_byte_still_times_out_at_the_deadline() -> None:
    """A server that sends its body 1 byte every 50 ms keeps each receive under the socket
    timeout: the read must still end at its deadline, long before the body is complete."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sent = [0]

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n")
            try:
                for _ in range(60):
                    time.sleep(0.05)
                    conn.sendall(b"x")
                    sent[0] += 1
            except OSError:
                pass  # the reader gave up and closed the connection

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/obj"
    policy = RetryPolicy(attempts=1, timeout_s=0.3)
    with RemoteFiles([url], retry=policy) as ds, pytest.raises(RemoteReadError, match="Timeout"):
        ds[0]
    assert sent[0] < 30  # gave up while the body was still coming (60 bytes take 3 s)
    thread.join(10)
    listener.close()


def test_a_kept_alive_connection_sets_its_socket_timeout_about_once_a_read(
    server: FaultyHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``settimeout`` releases and takes back the GIL: set before every send and receive,
    it slowed 32 reading threads by 12%. Within the 10% slack it is set at most once a read,
    and never to more than 1.1x what is left of the deadline."""
    from threadloader.remote.http import HTTPConnections

    calls: list[float] = []
    settimeout = socket.socket.settimeout

    def counting(sock: socket.socket, value: float | None) -> None:
        calls.append(value if value is not None else float("inf"))
        settimeout(sock, value)

    monkeypatch.setattr(socket.socket, "settimeout", counting)
    connections = HTTPConnections()
    try:
        for i in range(20):
            assert connections.get(server.url(f"obj/{i}"), 5.0, {}) == OBJECTS[f"obj/{i}"]
    finally:
        connections.close()
    assert 1 <= len(calls) <= 20, calls
    assert all(value <= 5.0 for value in calls)


def test_retry_after_sets_the_least_delay_before_the_next_try(server: FaultyHTTPServer) -> None:
    """A 503 with Retry-After: 30 makes the next try wait longer than its backoff, but no
    longer than max_backoff_s."""
    server.faults = Faults(fail_first=1, retry_after="30")
    policy = RetryPolicy(backoff_s=0.01, max_backoff_s=0.3)
    with RemoteFiles([server.url("obj/2")], retry=policy) as ds:
        start = time.monotonic()
        assert ds[0] == OBJECTS["obj/2"]
        assert 0.3 <= time.monotonic() - start < 10  # raised to max_backoff_s, not to 30 s


def test_skipped_items_shorten_the_batch_and_are_counted_and_logged(
    server: FaultyHTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two missing objects under max_skipped=2: the batch has the 6 others, in order."""
    urls = [server.url(f"obj/{i}") for i in range(8)]
    urls[2], urls[5] = server.url("missing/a"), server.url("missing/b")
    with RemoteFiles(urls, max_skipped=2, retry=FAST) as ds:
        with caplog.at_level(logging.WARNING, logger="threadloader.remote.files"):
            batch = ds.__getitems__(list(range(8)))
        assert batch == [OBJECTS[f"obj/{i}"] for i in (0, 1, 3, 4, 6, 7)]
        stats = ds.stats()
    assert stats.skipped == 2 and stats.failures == 2
    assert stats.skipped_urls == (urls[2], urls[5])
    assert urls[2] in caplog.text and urls[5] in caplog.text


def test_the_first_item_past_the_skip_budget_raises(server: FaultyHTTPServer) -> None:
    """With max_skipped=1, a second undeliverable item raises SkipBudgetExceededError."""
    urls = [server.url("obj/0"), server.url("gone/1"), server.url("gone/2")]
    with RemoteFiles(urls, max_skipped=1, retry=FAST) as ds:
        with pytest.raises(SkipBudgetExceededError, match="gone/2") as info:
            ds.__getitems__([0, 1, 2])
        assert isinstance(info.value.__cause__, RemoteNotFoundError)
        assert ds.stats().skipped == 1


def test_getitem_never_skips(server: FaultyHTTPServer) -> None:
    """A single index must give a single item: ds[i] raises even with a skip budget left."""
    with RemoteFiles([server.url("gone")], max_skipped=5, retry=FAST) as ds:
        with pytest.raises(RemoteNotFoundError):
            ds[0]
        assert ds.stats().skipped == 0


def test_a_decode_error_names_the_url_and_can_be_skipped(server: FaultyHTTPServer) -> None:
    """decode raising gives RemoteDecodeError with the URL; under a budget the item is skipped."""

    def decode(data: bytes) -> int:
        if data.startswith(b"00001:"):
            raise ValueError("corrupt")
        return len(data)

    urls = [server.url(f"obj/{i}") for i in range(3)]
    strict = RemoteFiles(urls, decode=decode, retry=FAST)
    with strict, pytest.raises(RemoteDecodeError, match=r"obj/1.*corrupt"):
        strict.__getitems__([0, 1, 2])
    with RemoteFiles(urls, decode=decode, max_skipped=1, retry=FAST) as lenient:
        assert lenient.__getitems__([0, 1, 2]) == [len(OBJECTS["obj/0"]), len(OBJECTS["obj/2"])]


def test_a_batch_reads_its_objects_concurrently_within_max_concurrency(
    server: FaultyHTTPServer,
) -> None:
    """16 reads of a batch are in flight together, at most max_concurrency + 1 at once."""
    server.faults = Faults(latency_s=0.05)
    urls = [server.url(f"obj/{i}") for i in range(16)]
    with RemoteFiles(urls, max_concurrency=7, retry=FAST) as ds:
        assert ds.__getitems__(list(range(16))) == [OBJECTS[f"obj/{i}"] for i in range(16)]
    assert 6 <= server.peak_in_flight <= 8  # at most 7 pool threads and the calling thread


def _readers(names: list[str]) -> Any:
    """A decode that records the name of the thread that read each object (decode runs there)."""

    def decode(data: bytes) -> bytes:
        names.append(threading.current_thread().name)
        return data

    return decode


def test_the_calling_thread_and_the_pool_share_a_batchs_reads(server: FaultyHTTPServer) -> None:
    """16 reads, 4 pool threads and the caller: each takes the next read when free, so none
    reads more than a few (one read per thread and the rest queued would leave the caller 8)."""
    server.faults = Faults(latency_s=0.05)
    urls = [server.url(f"obj/{i}") for i in range(16)]
    names: list[str] = []
    with RemoteFiles(urls, max_concurrency=4, retry=FAST, decode=_readers(names)) as ds:
        assert ds.__getitems__(list(range(16))) == [OBJECTS[f"obj/{i}"] for i in range(16)]
    counts = Counter(names)
    assert len(counts) == 5 and max(counts.values()) <= 6, counts


def test_a_batch_that_found_the_pool_busy_gets_its_threads_once_they_free_up(
    server: FaultyHTTPServer,
) -> None:
    """Batch A takes both pool threads and fills the queue; batch B, asked for meanwhile,
    starts alone, and the pool threads join it when A is done: B's caller reads fewer than all 8."""
    server.faults = Faults(latency_s=0.05)
    urls = [server.url(f"obj/{i}") for i in range(16)]
    names: list[str] = []
    with RemoteFiles(urls, max_concurrency=2, retry=FAST, decode=_readers(names)) as ds:
        got: dict[str, list[Any]] = {}

        def read(name: str, indices: list[int]) -> None:
            threading.current_thread().name = name
            got[name] = ds.__getitems__(indices)

        a = threading.Thread(target=read, args=("batch-a", list(range(8))))
        a.start()
        while server.peak_in_flight < 3:  # A's caller and both pool threads are reading
            time.sleep(0.001)
        b = threading.Thread(target=read, args=("batch-b", list(range(8, 16))))
        b.start()
        a.join(30)
        b.join(30)
    assert got == {
        "batch-a": [OBJECTS[f"obj/{i}"] for i in range(8)],
        "batch-b": [OBJECTS[f"obj/{i}"] for i in range(8, 16)],
    }
    assert 1 <= Counter(names)["batch-b"] < 8, names


class _Abort(BaseException):
    """Not an Exception: what a read lets through rather than turning into a failure."""


def test_what_a_pool_threads_read_raises_reaches_the_batchs_caller(
    server: FaultyHTTPServer,
) -> None:
    """A decode raising a BaseException on a pool thread: the batch raises it, as when the
    caller had read that object itself, instead of giving a None item."""
    caller = threading.current_thread()

    def decode(data: bytes) -> bytes:
        if threading.current_thread() is not caller:
            raise _Abort("decode gave up")
        return data

    server.faults = Faults(latency_s=0.02)
    urls = [server.url(f"obj/{i}") for i in range(8)]
    ds = RemoteFiles(urls, max_concurrency=4, retry=FAST, decode=decode)
    with ds, pytest.raises(_Abort, match="decode gave up"):
        ds.__getitems__(list(range(8)))


def test_a_batch_whose_caller_stopped_is_not_read_on_by_the_pool(
    server: FaultyHTTPServer,
) -> None:
    """A Ctrl-C (here: another BaseException) in the caller's own read ends the batch: the pool
    threads finish the reads they began and take no more of its 16 objects."""
    caller = threading.current_thread()

    def decode(data: bytes) -> bytes:
        if threading.current_thread() is caller:
            raise _Abort("stopped")
        return data

    server.faults = Faults(latency_s=0.05)
    urls = [server.url(f"obj/{i}") for i in range(16)]
    ds = RemoteFiles(urls, max_concurrency=2, retry=FAST, decode=decode)
    with ds:
        with pytest.raises(_Abort):
            ds.__getitems__(list(range(16)))
        time.sleep(0.5)  # the rest would take 0.35 s on two threads
        assert sum(server.requests.values()) <= 6, server.requests


def test_max_concurrency_zero_reads_in_the_calling_thread(server: FaultyHTTPServer) -> None:
    """With max_concurrency=0 a batch is read one object after another and no thread starts."""
    urls = [server.url(f"obj/{i}") for i in range(4)]
    with RemoteFiles(urls, max_concurrency=0, retry=FAST) as ds:
        assert ds.__getitems__([3, 2, 1, 0]) == [OBJECTS[f"obj/{i}"] for i in (3, 2, 1, 0)]
        assert _pool_threads(ds) == []
    assert server.peak_in_flight == 1


def test_close_joins_the_read_threads_and_the_dataset_stays_usable(files: RemoteFiles) -> None:
    """close() joins every pool thread; a later read starts a new pool and succeeds."""
    files.__getitems__(list(range(16)))
    threads = _pool_threads(files)
    assert threads
    files.close()
    files.close()  # idempotent
    assert not any(t.is_alive() for t in threads)
    assert files.__getitems__([0, 1]) == [OBJECTS["obj/0"], OBJECTS["obj/1"]]


def test_dropping_the_dataset_joins_its_read_threads(server: FaultyHTTPServer) -> None:
    """With no close(), garbage collection of the dataset ends its pool threads."""
    ds = RemoteFiles([server.url(k) for k in OBJECTS], retry=FAST)
    ds.__getitems__(list(range(16)))
    threads = _pool_threads(ds)
    assert threads
    del ds
    gc.collect()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_ctrl_c_while_dropping_the_dataset_joins_its_reads_reaches_the_loop(
    server: FaultyHTTPServer,
) -> None:
    """Ctrl-C during the finalizer's join of a read in flight: raised in the loop, reads stopped.

    The finalizer of a dropped dataset waits for its pool's reads. A Ctrl-C then must not be
    printed as "Exception ignored" and lost, nor leave the connections open.
    """
    server.faults = Faults(latency_s=1.5)
    ds = RemoteFiles([server.url(k) for k in OBJECTS], max_concurrency=2, retry=FAST)
    runtime = ds._state.runtime()
    reader = copy.copy(ds)  # a worker's copy: shares the pool, keeps the dataset itself droppable
    read: list[list[bytes]] = []
    thread = threading.Thread(target=lambda: read.append(reader.__getitems__([0, 1, 2])))
    thread.start()
    deadline = time.monotonic() + 5
    while server.in_flight < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    drop = [ds]
    del ds
    # The finalizer joins the pool, for ~1.5 s: the Ctrl-C is raised when pressed, not after.
    assert press_ctrl_c_during(drop.clear, after_s=0.3) < 1.2
    assert runtime.stop.is_set()
    assert runtime.http._closed
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert read == [[OBJECTS[f"obj/{i}"] for i in range(3)]]  # reads that had started finish


def test_exit_during_a_retry_backoff_does_not_wait_for_it(server: FaultyHTTPServer) -> None:
    """An interpreter exiting while reads wait 10 minutes to retry exits at once, quietly."""
    server.faults = Faults(always_fail=frozenset({"obj/0", "obj/1", "obj/2"}))
    code = textwrap.dedent(f"""
        import threading, time
        from threadloader.remote import RemoteFiles, RetryPolicy
        ds = RemoteFiles({[server.url(f"obj/{i}") for i in range(3)]!r},
                         retry=RetryPolicy(attempts=9, backoff_s=600, max_backoff_s=600))
        def read():
            try:
                ds.__getitems__([0, 1, 2])
            except OSError:
                pass
        threading.Thread(target=read, daemon=True).start()
        time.sleep(0.5)
    """)
    proc = subprocess.run(  # a backoff waited for would outlast the timeout: 10 minutes
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=100
    )
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()


def test_64_worker_threads_do_not_warn(files: RemoteFiles) -> None:
    """num_workers=64 is normal for remote reads: no warning, every object delivered."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = ThreadDataLoader(files, batch_size=4, num_workers=64, collate_fn=_list)
        got = [item for batch in loader for item in batch]
    assert sorted(got) == sorted(OBJECTS.values())


def test_process_workers_read_through_their_own_pool(files: RemoteFiles) -> None:
    """After the parent started its pool, forked DataLoader workers still read every object."""
    files.__getitems__([0, 1, 2])  # parent pool and connections exist before the fork
    loader = DataLoader(files, batch_size=16, num_workers=2, collate_fn=_list)
    got = [item for batch in loader for item in batch]
    assert got == list(OBJECTS.values())


def test_a_pickled_copy_reads_with_its_own_pool_and_counters(files: RemoteFiles) -> None:
    """A pickled dataset (spawned workers) reads on its own, with counters starting at zero."""
    files.__getitems__([0, 1])
    copy = pickle.loads(pickle.dumps(files))
    try:
        assert copy.stats().reads == 0
        assert copy.__getitems__([5, 6]) == [OBJECTS["obj/5"], OBJECTS["obj/6"]]
        assert copy.stats().reads == 2 and files.stats().reads == 2
    finally:
        copy.close()


def test_stats_is_a_frozen_snapshot(files: RemoteFiles) -> None:
    """stats() returns a frozen RemoteStats that later reads do not change."""
    files[0]
    before = files.stats()
    files[1]
    assert isinstance(before, RemoteStats) and before.reads == 1 and files.stats().reads == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.reads = 5  # type: ignore[misc]


def test_a_glob_a_directory_and_a_file_url_list_local_objects(tmp_path: Any) -> None:
    """A glob and a directory list their files sorted, as file:// URLs that read back."""
    (tmp_path / "sub").mkdir()
    for name in ("b.bin", "a.bin", "sub/c.bin", "skip.txt"):
        (tmp_path / name).write_bytes(name.encode())
    globbed = RemoteFiles(str(tmp_path / "*.bin"))
    assert [u.rsplit("/", 1)[1] for u in globbed.urls] == ["a.bin", "b.bin"]
    assert globbed.urls[0].startswith("file://") and globbed[1] == b"b.bin"
    assert len(RemoteFiles(str(tmp_path))) == 4
    assert RemoteFiles([f"file://{tmp_path}/sub/c.bin"])[0] == b"sub/c.bin"
    with pytest.raises(ValueError, match="names no objects"):
        RemoteFiles(str(tmp_path / "*.none"))
    assert RemoteFiles(str(tmp_path / "a.bin")).urls[0].endswith("/a.bin")  # one object
    with pytest.raises(ValueError, match="names no objects"):  # a typo, not a 1-object dataset
        RemoteFiles(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ValueError, match="cannot list HTTP"):
        RemoteFiles("http://127.0.0.1:1/*.bin")


def test_errors_survive_a_loader_reraise_with_their_type() -> None:
    """Re-raised from a worker by message alone (torch's ExceptionWrapper), the types hold."""
    for cls in (RemoteReadError, RemoteNotFoundError, RemoteDecodeError):
        assert isinstance(cls("message"), cls)
        assert pickle.loads(pickle.dumps(cls("m", url="u"))).url == "u"  # type: ignore[call-arg]


class _ClientError(Exception):  # botocore's shape: the status is in .response
    def __init__(self, status: int) -> None:
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}}


def _wrapped(cause: BaseException) -> OSError:
    error = OSError(5, "Input/output error")  # s3fs's translation of an unknown ClientError
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (_wrapped(_ClientError(503)), True),
        (_wrapped(_ClientError(429)), True),
        (_wrapped(_ClientError(403)), False),
        (FileNotFoundError(), False),
        (ValueError("bad"), False),
        (http.client.InvalidURL("URL can't contain control characters"), False),
        (http.client.IncompleteRead(b"", 10), True),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), True),  # a TLS reset
        (ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed"), True),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), False),
    ],
)
def test_transient_failures_are_told_from_permanent_ones(
    error: BaseException, transient: bool
) -> None:
    """Outages, throttling and broken connections are retried; answers and bugs are not."""
    assert is_transient(error) is transient


def test_retry_delays_grow_with_full_jitter_and_stay_capped() -> None:
    """Each delay lies in [0, min(cap, base * 2**(k-1))]; Retry-After raises it to the cap."""
    policy = RetryPolicy(backoff_s=0.1, max_backoff_s=0.5)
    for retry, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (6, 0.5)):
        delays = [policy.delay_s(retry) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= ceiling and max(delays) > ceiling / 2
    assert policy.delay_s(1, retry_after_s=60) == 0.5
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
