"""A small HTTP/1.1 client: keep-alive connections shared by threads, one GET within a deadline.

GET is all ``RemoteFiles`` asks of HTTP(S), so it speaks just that part of HTTP/1.1 itself, on
the standard library's sockets and TLS, with keep-alive connections reused across threads and
epochs: no event loop, no extra dependency, and every failure mode in reach of the retry logic
(``retry``). ``http.client`` parses each response's headers through the ``email`` package, which
held the GIL for most of a read's CPU time: 114 us a 16 KiB read against 44 us with the parsing
here, measured one read after another on the loopback server of ``bench/bench_remote.py``.

What a GET does:

1. One GET, its redirects (up to 5) and the whole body included, runs within one deadline; a
   blocking call that it lets run out ends at most 10% of the time then left past it
   (``TIMEOUT_SLACK``).
2. The body is framed as RFC 9112 says: none for 1xx (skipped), 204 and 304; ``chunked``
   transfer coding; ``Content-Length``; else until the server closes. A body cut short raises
   ``http.client.IncompleteRead``, a malformed head an ``http.client.HTTPException``, a status
   other than 200 ``HTTPStatusError``; all are ``OSError`` or ``HTTPException``, which ``retry``
   classifies.
3. A connection is kept for the next read unless the server said ``Connection: close``
   (or spoke HTTP/1.0 without ``keep-alive``), the body ran until close, or bytes came after the
   response. An error page of at most 64 KiB is read to keep its connection; a larger one closes
   it.
4. A request on a kept-alive connection that the server closed meanwhile is sent again at once
   on a new connection.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urljoin, urlsplit

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_MAX_IDLE_PER_HOST = 256  # keep-alive connections kept per host; more are closed on release
_MAX_HEAD = 65536 + 100 * 1024  # status line and headers; http.client allows 100 lines of 64 KiB
_MAX_ERROR_BODY = 65536  # an error page up to this size is read to keep the connection
#: Bytes asked of one receive while looking for the end of a head or a chunk-size line: enough
#: for a head and the start of a small body. A body of known size is received straight into its
#: own buffer; only a body read to the close takes receives of ``_RECV_BODY``. Receiving 64 KiB
#: for every head left each reading thread's malloc arena holding the unused rest: with 64
#: worker threads and a 32-thread pool, 15 MB above the dataset against 10 MB with 8 KiB.
_RECV_HEAD = 1 << 13
_RECV_BODY = 1 << 16
#: A connected socket's timeout is set again only once it exceeds what is left of the deadline
#: by more than this factor, so one blocking call ends at most 10% of the time then left past
#: the deadline. ``settimeout`` releases and takes back the GIL (two ``fcntl`` calls); set before
#: every send and receive, with 32 threads reading 16 KiB objects on 2 cores, it cost 12% of the
#: reads per second (1,923 against 2,184, medians of 9 interleaved rounds, with 14,900 against
#: 10,600 voluntary context switches per 1,024 reads).
TIMEOUT_SLACK = 1.1

_Key = tuple[str, str, int]  # scheme, host, port


class HTTPStatusError(OSError):
    """An HTTP response other than success; ``status`` decides whether it is retried."""

    def __init__(self, url: str, status: int, reason: str, retry_after_s: float | None) -> None:
        super().__init__(f"HTTP {status} {reason} for {url}")
        self.status, self.retry_after_s = status, retry_after_s


class _Response(NamedTuple):
    status: int
    reason: str
    headers: dict[str, str]  # names in lower case; repeated fields joined with ", "
    body: bytes


class _Connection:
    """One HTTP/1.1 connection: its socket and the bytes received past the last response."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout  # the socket's timeout as last set
        self.pending = bytearray()

    def close(self) -> None:
        self.sock.close()

    def set_timeout(self, deadline: float) -> None:
        """Give the next blocking call what is left of ``deadline`` (``TIMEOUT_SLACK``).

        Raises:
            TimeoutError: the deadline passed.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the read's deadline passed")
        if not remaining <= self.timeout <= remaining * TIMEOUT_SLACK:
            self.timeout = remaining
            self.sock.settimeout(remaining)

    def receive(self, deadline: float, size: int = _RECV_HEAD) -> bool:
        """Append what the next receive brings to ``pending``; False when the server closed."""
        self.set_timeout(deadline)
        chunk = self.sock.recv(size)
        self.pending += chunk
        return bool(chunk)

    def read_line(self, deadline: float, limit: int) -> bytes:
        """One CRLF-ended line without its end (chunked framing).

        Raises:
            http.client.IncompleteRead: the server closed first.
            http.client.LineTooLong: no line end within ``limit`` bytes.
        """
        while (end := self.pending.find(b"\r\n", 0, limit + 2)) < 0:
            if len(self.pending) > limit:
                raise http.client.LineTooLong("chunk size or trailer line")
            if not self.receive(deadline):
                raise http.client.IncompleteRead(bytes(self.pending))
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def read_exactly(self, n: int, deadline: float) -> bytes:
        """The next ``n`` bytes.

        Raises:
            http.client.IncompleteRead: the server closed first (with the bytes that came).
        """
        if len(self.pending) >= n:
            out = bytes(self.pending[:n])
            del self.pending[:n]
            return out
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = len(self.pending)
        view[:got] = self.pending
        self.pending.clear()
        while got < n:
            # One receive at a time, each under what is left of the whole read's deadline: a
            # server trickling bytes cannot hold the read past it.
            self.set_timeout(deadline)
            count = self.sock.recv_into(view[got:])
            if not count:
                raise http.client.IncompleteRead(bytes(buffer[:got]), n - got)
            got += count
        return bytes(buffer)

    def read_to_close(self, deadline: float) -> bytes:
        while self.receive(deadline, _RECV_BODY):
            pass
        out = bytes(self.pending)
        self.pending.clear()
        return out


class HTTPConnections:
    """Keep-alive HTTP(S) connections by (scheme, host, port); each used by one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[_Key, list[_Connection]] = {}
        self._closed = False
        self._ssl: ssl.SSLContext | None = None

    def close(self) -> None:
        """Close idle connections now; connections in use are closed when released."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def get(self, url: str, timeout_s: float, headers: Mapping[str, str]) -> bytes:
        """GET ``url`` within ``timeout_s`` in all, following up to 5 redirects.

        Raises:
            HTTPStatusError: on a status other than 200 (after redirects).
            TimeoutError, ConnectionError, http.client.HTTPException: as the exchange failed.
            http.client.InvalidURL: the URL has no host, or characters a request line cannot
                carry.
        """
        deadline = time.monotonic() + timeout_s
        for _ in range(_MAX_REDIRECTS + 1):
            resp = self._exchange(url, deadline, headers)
            if resp.status == 200:
                return resp.body
            location = resp.headers.get("location")
            if resp.status in _REDIRECTS and location:
                url = urljoin(url, location)
                continue
            retry_after = resp.headers.get("retry-after")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            raise HTTPStatusError(url, resp.status, resp.reason, seconds)
        raise HTTPStatusError(url, resp.status, "(too many redirects)", None)

    def _exchange(self, url: str, deadline: float, headers: Mapping[str, str]) -> _Response:
        key, request = _request(url, headers)
        for first_try in (True, False):
            conn, reused = self._acquire(key, deadline)
            try:
                conn.set_timeout(deadline)
                conn.sock.sendall(request)
                resp, keep = _read_response(conn, deadline)
            except ConnectionError:
                conn.close()
                if reused and first_try:
                    continue  # the server closed an idle keep-alive connection: not a failure
                raise
            except BaseException:
                conn.close()
                raise
            if keep:
                self._release(key, conn)
            else:
                conn.close()
            return resp
        raise AssertionError("unreachable")

    def _acquire(self, key: _Key, deadline: float) -> tuple[_Connection, bool]:
        with self._lock:
            conns = self._idle.get(key)
            if conns:
                return conns.pop(), True
            if key[0] == "https" and self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        scheme, host, port = key
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the read's deadline passed")
        sock = socket.create_connection((host, port), timeout=remaining)
        try:
            if scheme == "https":
                assert context is not None
                sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, remaining), False

    def _release(self, key: _Key, conn: _Connection) -> None:
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if not self._closed and len(conns) < _MAX_IDLE_PER_HOST:
                conns.append(conn)
                return
        conn.close()


def _request(url: str, headers: Mapping[str, str]) -> tuple[_Key, bytes]:
    """The connection key and the bytes of a GET of ``url``.

    Raises:
        http.client.InvalidURL: no host, or a character a request line cannot carry.
        ValueError: a header with a line break.
    """
    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as e:
        raise http.client.InvalidURL(f"{e}: {url!r}") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not host or not target.isascii() or any(c <= " " or c == "\x7f" for c in target):
        raise http.client.InvalidURL(f"a request line cannot carry the URL {url!r}")
    name = f"[{host}]" if ":" in host else host
    if port != (443 if scheme == "https" else 80):
        name = f"{name}:{port}"
    lines = [f"GET {target} HTTP/1.1"]
    given = {k.lower() for k in headers}
    if "host" not in given:
        lines.append(f"Host: {name}")
    if "accept-encoding" not in given:
        lines.append("Accept-Encoding: identity")  # the bytes as stored, never recompressed
    for k, v in headers.items():
        if any(c in k or c in v for c in "\r\n\0") or not k or ":" in k:
            raise ValueError(f"header {k!r}: {v!r} cannot be sent (line break, NUL or colon)")
        lines.append(f"{k}: {v}")
    return (scheme, host, port), ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _read_response(conn: _Connection, deadline: float) -> tuple[_Response, bool]:
    """The response to the request just sent, and whether the connection can be kept."""
    while True:
        version, status, reason, headers = _read_head(conn, deadline)
        if not 100 <= status < 200:
            break  # 1xx answers are interim: the real one follows
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens and (version != "HTTP/1.0" or "keep-alive" in tokens)
    coding = headers.get("transfer-encoding")
    length = headers.get("content-length")
    if status in (204, 304):
        body = b""
    elif coding is not None:
        if coding.split(",")[-1].strip().lower() != "chunked":
            return _Response(status, reason, headers, conn.read_to_close(deadline)), False
        body = _read_chunked(conn, deadline)
    elif length is not None:
        size = _content_length(length)
        if status != 200 and size > _MAX_ERROR_BODY:
            return _Response(status, reason, headers, b""), False  # not worth reading
        body = conn.read_exactly(size, deadline)
    else:
        return _Response(status, reason, headers, conn.read_to_close(deadline)), False
    return _Response(status, reason, headers, body), keep and not conn.pending


def _read_head(conn: _Connection, deadline: float) -> tuple[str, int, str, dict[str, str]]:
    """Status line and headers of the next response.

    Raises:
        http.client.RemoteDisconnected: the server closed before sending anything.
        http.client.IncompleteRead: it closed within the head.
        http.client.BadStatusLine, http.client.LineTooLong, http.client.HTTPException: a
            malformed or oversized head.
    """
    start = 0
    while (end := conn.pending.find(b"\r\n\r\n", start)) < 0:
        if len(conn.pending) > _MAX_HEAD:
            raise http.client.LineTooLong("response head")
        start = max(0, len(conn.pending) - 3)
        if not conn.receive(deadline):
            if not conn.pending:
                raise http.client.RemoteDisconnected("the server closed without a response")
            raise http.client.IncompleteRead(bytes(conn.pending))
    lines = conn.pending[:end].decode("latin-1").split("\r\n")
    del conn.pending[: end + 4]
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/") or len(code) != 3 or not code.isdigit():
        raise http.client.BadStatusLine(lines[0])
    headers: dict[str, str] = {}
    last = ""
    for line in lines[1:]:
        if line[:1] in (" ", "\t") and last:  # obsolete line folding: continues the last field
            headers[last] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise http.client.HTTPException(f"malformed header line {line!r}")
        last = name.lower()
        value = value.strip()
        headers[last] = f"{headers[last]}, {value}" if last in headers else value
    return version, int(code), reason.strip(), headers


def _content_length(value: str) -> int:
    sizes = {v.strip() for v in value.split(",")}  # a repeated field must repeat one size
    if len(sizes) != 1 or not (size := sizes.pop()).isdigit():
        raise http.client.HTTPException(f"invalid Content-Length {value!r}")
    return int(size)


def _read_chunked(conn: _Connection, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        line = conn.read_line(deadline, _RECV_HEAD)
        size_text = line.split(b";", 1)[0].strip()  # extensions after ';' are ignored
        if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
            raise http.client.HTTPException(f"invalid chunk size line {line!r}")
        size = int(size_text, 16)
        if size == 0:
            while conn.read_line(deadline, _RECV_HEAD):  # trailer fields, up to an empty line
                pass
            return b"".join(chunks)
        chunks.append(conn.read_exactly(size, deadline))
        if conn.read_exactly(2, deadline) != b"\r\n":
            raise http.client.HTTPException("a chunk did not end with CRLF")
