"""Loopback servers for the remote-data tests and benchmarks, with injectable latency and faults.

- :class:`FaultyHTTPServer`: a ``ThreadingHTTPServer`` on ``127.0.0.1`` (ephemeral port) in a
  background thread. It serves objects from a mapping, or forwards every request to an upstream
  server (so it can stand in front of moto's S3 server), after applying :class:`Faults`: a delay
  per request, a share of 503 answers, connection resets, truncated bodies, per-path failures.
- :class:`MotoS3`: moto's ``ThreadedMotoServer`` (S3 API, in memory) with a helper to fill buckets.
- As a script, ``python tests/remote_servers.py --objects N --size BYTES --latency-ms MS`` serves
  synthetic objects ``/obj/<i>`` and prints its port, until stdin closes: ``bench/`` runs it in its
  own process so the server's CPU time and memory are not the loader's.

Everything is started by a test (or fixture) and stopped in its teardown: ``stop()`` shuts the
server down and joins its thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import http.server
import logging
import random
import socket
import struct
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from typing_extensions import Self


class ObjectSource(Protocol):
    def get(self, path: str) -> bytes | None: ...


class SyntheticObjects:
    """``count`` objects ``obj/<i>`` of ``size`` bytes each (``tiny/<i>``: their first 64 bytes),
    made on request: the server holds no data."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size

    def data(self, i: int) -> bytes:
        block = i.to_bytes(8, "little")
        return (block * (self.size // 8 + 1))[: self.size]

    def get(self, path: str) -> bytes | None:
        name, _, number = path.partition("/")  # obj/<i>: `size` bytes; tiny/<i>: 64 bytes
        if name not in ("obj", "tiny") or not number.isdigit() or int(number) >= self.count:
            return None
        data = self.data(int(number))
        return data[:64] if name == "tiny" else data

    def paths(self) -> list[str]:
        return [f"obj/{i}" for i in range(self.count)]


@dataclasses.dataclass
class Faults:
    """What the server does to requests before (or instead of) answering them."""

    latency_s: float = 0.0
    error_rate: float = 0.0  # share of requests answered 503
    reset_rate: float = 0.0  # share of requests whose connection is reset, no answer
    truncate_rate: float = 0.0  # share answered with part of the body, then the connection closed
    truncate_first: int = 0  # the first N requests of every path answer a truncated body
    truncate_keep: float = 0.5  # share of the body a truncated answer sends (0: none of it)
    fail_first: int = 0  # the first N requests of every path answer 503
    always_fail: frozenset[str] = frozenset()  # these paths always answer 503
    status_for: Mapping[str, int] = dataclasses.field(default_factory=dict)  # fixed answers
    retry_after: str | None = None  # Retry-After header on 503 answers
    seed: int = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real object stores
    # Headers and body leave in two writes: with Nagle's algorithm on, the body would wait for
    # the client's delayed ACK of the headers, adding ~40 ms to every request.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.owner.handle(self)

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many keep-alive clients connect at once
    owner: FaultyHTTPServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.owner.errors.append(sys.exc_info()[1])  # a client that went away mid-answer


class FaultyHTTPServer:
    """An HTTP server on loopback that answers from ``objects`` or ``upstream``, with faults.

    Args:
        objects: path (without the leading ``/``) -> bytes, or an :class:`ObjectSource`.
        upstream: ``host:port`` to forward every request to instead (e.g. moto's S3 server).
        faults: what to inject; may be replaced while the server runs.
    """

    def __init__(
        self,
        objects: Mapping[str, bytes] | ObjectSource | None = None,
        upstream: str | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.objects = objects if objects is not None else {}
        self.upstream = upstream
        self.faults = faults or Faults()
        self.requests: Counter[str] = Counter()  # path -> requests received
        self.injected: Counter[str] = Counter()  # fault kind -> times injected
        self.errors: list[BaseException | None] = []
        self.in_flight = 0
        self.peak_in_flight = 0  # most requests being handled at once
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def start(self) -> Self:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="test-http"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _decide(self, path: str) -> str | None:
        f = self.faults
        with self._lock:
            self.requests[path] += 1
            seen = self.requests[path]
            draw = self._rng.random()
        if path in f.status_for:
            return "status"
        if path in f.always_fail or seen <= f.fail_first:
            return "503"
        if seen <= f.fail_first + f.truncate_first:
            return "truncate"
        for kind, rate in (("reset", f.reset_rate), ("503", f.error_rate)):
            if draw < rate:
                return kind
            draw -= rate
        if draw < f.truncate_rate:
            return "truncate"
        return None

    def handle(self, h: _Handler) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            self._handle(h)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _handle(self, h: _Handler) -> None:
        path = h.path.lstrip("/")
        request_body = _read_request_body(h)
        if self.faults.latency_s:
            time.sleep(self.faults.latency_s)
        fault = self._decide(path.split("?")[0])
        if fault is not None:
            with self._lock:
                self.injected[fault] += 1
        if fault == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()  # RST, no answer
            h.close_connection = True
            return
        if fault in ("503", "status"):
            status = self.faults.status_for.get(path, 503)
            body = b"injected failure"
            h.send_response(status)
            if status == 503 and self.faults.retry_after is not None:
                h.send_header("Retry-After", self.faults.retry_after)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if h.command != "HEAD":  # an answer to HEAD has no body, whatever its length says
                h.wfile.write(body)
            return
        status, headers, body = self._answer(h, path, request_body)
        h.send_response(status)
        for name, value in headers:
            h.send_header(name, value)
        h.end_headers()
        if h.command == "HEAD":
            return
        if fault == "truncate" and status == 200 and body:
            # Content-Length announced the whole body: the client must notice the shortfall.
            h.wfile.write(body[: min(int(len(body) * self.faults.truncate_keep), len(body) - 1)])
            h.close_connection = True
            return
        h.wfile.write(body)

    def _answer(
        self, h: _Handler, path: str, request_body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """Status, headers (Content-Length included) and body of the answer to ``h``.

        For HEAD the body is empty but Content-Length is the length a GET would have: the
        object's size, which clients read from it (s3fs's ``info()``), not 0.
        """
        if self.upstream is None:
            data = self.objects.get(path)
            if data is None:
                return 404, [("Content-Length", "9")], b"not found"
            length = ("Content-Length", str(len(data)))
            return 200, [("Content-Type", "application/octet-stream"), length], data
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        try:
            hop = {"connection", "keep-alive", "transfer-encoding", "content-length"}
            headers = {k: v for k, v in h.headers.items() if k.lower() not in hop}
            if request_body or h.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(request_body))  # the body, de-chunked
            conn.request(h.command, h.path, body=request_body or None, headers=headers)
            resp = conn.getresponse()
            body = resp.read()  # de-chunked; empty for HEAD
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in hop | {"date"}]
            if h.command == "HEAD":
                length = resp.getheader("Content-Length")
                if length is not None:
                    kept.append(("Content-Length", length))
            else:
                kept.append(("Content-Length", str(len(body))))
            return resp.status, kept, body
        finally:
            conn.close()


def _read_request_body(h: _Handler) -> bytes:
    """The request's body, whether sent with Content-Length or chunked."""
    if "chunked" not in (h.headers.get("Transfer-Encoding") or "").lower():
        length = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(length) if length else b""
    chunks = []
    while True:
        size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while h.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        chunks.append(h.rfile.read(size))
        h.rfile.readline()  # the CRLF after each chunk


class MotoS3:
    """moto's S3 server on loopback; buckets live in this process's memory."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.address = f"{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def new_bucket(self, objects: Mapping[str, bytes]) -> str:
        """A fresh bucket holding ``objects`` (key -> bytes); returns its name."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=f"http://{self.address}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        for key, data in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=data)
        client.close()
        return bucket


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a loopback endpoint, with botocore's retries off (ours retry).

    s3fs's own loop (``S3FileSystem.retries``, not an option) still retries broken connections
    and truncated bodies inside one of our tries; error statuses (503) reach our retries.
    """
    return {
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--objects", type=int, default=4096)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    args = parser.parse_args()
    server = FaultyHTTPServer(
        SyntheticObjects(args.objects, args.size), faults=Faults(latency_s=args.latency_ms / 1e3)
    )
    server.start()
    print(server.port, flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        server.stop()


if __name__ == "__main__":
    _main()
