"""A small HTTP/1.1 client: keep-alive connections shared by threads, one GET within a deadline.

GET is all ``RemoteFiles`` asks of HTTP(S), so it speaks just that part of HTTP/1.1 itself, on
the standard library's sockets and TLS, with keep-alive connections reused across threads and
epochs: no event loop, no extra dependency, and every failure mode in reach of the retry logic
(``retry``). ``http.client`` parses each response's head through the ``email`` package, which
holds the GIL: a 16 KiB read, one after another on the loopback server of
``bench/bench_remote.py``, took 132 us of CPU here against 217 us with ``http.client`` (medians
of 5 interleaved rounds of 100 reads, on a loaded 2-core machine); most of what is left is the
kernel's loopback work in ``sendall`` and ``recv``.

What a GET does:

1. One GET, its redirects (up to 5) and the whole body included, runs within one deadline; a
   blocking call that it lets run out ends at most 10% of the time then left past it
   (``TIMEOUT_SLACK``). Connect and TLS handshake share it too.
2. The body is framed as RFC 9112 says: none for 1xx (skipped), 204 and 304; ``chunked``
   transfer coding; ``Content-Length``; else until the server closes. Heads are read as
   ``http.client`` reads them: lines may end in a bare LF, lines that are not fields are
   skipped, ``Transfer-Encoding: identity`` is no coding. A body cut short raises
   ``http.client.IncompleteRead``, a malformed head an ``http.client.HTTPException``, a
   status other than 200 ``HTTPStatusError``; all are ``OSError`` or ``HTTPException``, which
   ``retry`` classifies.
3. A connection is kept for the next read unless the server said ``Connection: close``
   (or spoke HTTP/1.0 without ``keep-alive``), the body ran until close, or bytes came after the
   response. An error page of at most 64 KiB is read to keep its connection; a larger one, or
   one of unknown size, closes it unread.
4. An idle connection with anything to read (the server closed or reset it while idle) is
   dropped before a request. A request on a kept-alive connection that fails as closed anyway
   is sent again at once on a new connection.
"""

from __future__ import annotations

import http.client
import re
import select
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
#: A body of known size up to this is received into one buffer of its size; a larger one in
#: parts of it, so a ``Content-Length`` no body will fill allocates no more than this at once.
_WHOLE_MAX = 1 << 26
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
        """One line without its end, CRLF or a bare LF (chunked framing, as ``http.client``).

        Raises:
            http.client.IncompleteRead: the server closed first.
            http.client.LineTooLong: no line end within ``limit`` bytes.
        """
        while (end := self.pending.find(b"\n", 0, limit + 2)) < 0:
            if len(self.pending) > limit:
                raise http.client.LineTooLong("chunk size or trailer line")
            if not self.receive(deadline):
                raise http.client.IncompleteRead(bytes(self.pending))
        line = bytes(self.pending[:end]).removesuffix(b"\r")
        del self.pending[: end + 1]
        return line

    def read_exactly(self, n: int, deadline: float) -> bytes:
        """The next ``n`` bytes.

        Raises:
            http.client.IncompleteRead: the server closed first (with the bytes that came).
        """
        if n > _WHOLE_MAX:  # in parts: a length that is a lie must not allocate all of it
            parts: list[bytes] = []
            got = 0
            while got < n:
                try:
                    parts.append(self.read_exactly(min(n - got, _WHOLE_MAX), deadline))
                except http.client.IncompleteRead as e:
                    partial = b"".join(parts) + e.partial
                    raise http.client.IncompleteRead(partial, n - len(partial)) from None
                got += len(parts[-1])
            return b"".join(parts)
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
            seconds = float(retry_after) if retry_after and _is_number(retry_after) else None
            raise HTTPStatusError(url, resp.status, resp.reason, seconds)
        raise HTTPStatusError(url, resp.status, "(too many redirects)", None)

    def _exchange(self, url: str, deadline: float, headers: Mapping[str, str]) -> _Response:
        key, request = _request(url, headers)
        for first_try in (True, False):
            conn, reused = self._acquire(key, deadline, fresh=not first_try)
            try:
                conn.set_timeout(deadline)
                conn.sock.sendall(request)
                resp, keep = _read_response(conn, deadline)
            except (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
                conn.close()
                if reused and first_try:
                    # The server closed (or reset) an idle keep-alive connection between our
                    # check and the request: not a failure; sent again on a new connection.
                    continue
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

    def _acquire(self, key: _Key, deadline: float, fresh: bool) -> tuple[_Connection, bool]:
        """An idle connection to ``key`` that still looks open, or (``fresh``, or none) a new
        one; and whether it was idle."""
        while not fresh:
            with self._lock:
                conns = self._idle.get(key)
                conn = conns.pop() if conns else None
            if conn is None:
                break
            if _still_open(conn):
                return conn, True
            conn.close()  # closed by the server while idle (or it sent something unasked)
        with self._lock:
            if key[0] == "https" and self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        scheme, host, port = key
        sock = socket.create_connection((host, port), timeout=_left(deadline))
        try:
            if scheme == "https":
                assert context is not None
                sock.settimeout(_left(deadline))  # the handshake gets what the connect left
                sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, sock.gettimeout() or 0.0), False

    def _release(self, key: _Key, conn: _Connection) -> None:
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if not self._closed and len(conns) < _MAX_IDLE_PER_HOST:
                conns.append(conn)
                return
        conn.close()


def _left(deadline: float) -> float:
    """Seconds left before ``deadline``.

    Raises:
        TimeoutError: none are.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the read's deadline passed")
    return remaining


def _still_open(conn: _Connection) -> bool:
    """Whether an idle connection can carry a request: nothing to read on it, which would be
    the server's close (or reset, or an answer nobody asked for)."""
    if conn.pending:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):  # closed, or a descriptor select cannot watch
        return False
    return not readable


#: RFC 9110's token: what a header field name may hold.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _is_number(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes superscripts, which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


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
    try:
        name = host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError as e:
        raise http.client.InvalidURL(f"{e}: {url!r}") from None
    name = f"[{name}]" if ":" in name else name
    if port != (443 if scheme == "https" else 80):
        name = f"{name}:{port}"
    lines = [f"GET {target} HTTP/1.1"]
    given = {k.lower() for k in headers}
    if "host" not in given:
        lines.append(f"Host: {name}")
    if "accept-encoding" not in given:
        lines.append("Accept-Encoding: identity")  # the bytes as stored, never recompressed
    for k, v in headers.items():
        value = str(v) if isinstance(v, int) else v  # as http.client sends a number
        if not isinstance(k, str) or not _TOKEN.fullmatch(k):
            raise ValueError(f"header name {k!r} cannot be sent: not an HTTP token")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise ValueError(f"header {k}: {v!r} cannot be sent (not text, or a line break)")
        lines.append(f"{k}: {value}")
    try:
        return (scheme, host, port), ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError as e:
        raise ValueError(f"a header cannot be sent: {e}") from None


def _read_response(conn: _Connection, deadline: float) -> tuple[_Response, bool]:
    """The response to the request just sent, and whether the connection can be kept."""
    while True:
        version, status, reason, headers = _read_head(conn, deadline)
        if not 100 <= status < 200:
            break  # 1xx answers are interim: the real one follows
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens and (version != "HTTP/1.0" or "keep-alive" in tokens)
    coding = headers.get("transfer-encoding", "").strip().lower()
    length = headers.get("content-length")
    if status in (204, 304):
        body = b""
    elif status != 200 and (coding not in ("", "identity") or length is None):
        return _Response(status, reason, headers, b""), False  # an error page of unknown size
    elif coding not in ("", "identity"):  # RFC 9112 drops 'identity'; http.client ignores it
        if coding.split(",")[-1].strip() != "chunked":
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
    while (end := _head_end(conn.pending, start)) is None:
        if len(conn.pending) > _MAX_HEAD:
            raise http.client.LineTooLong("response head")
        start = max(0, len(conn.pending) - 3)
        if not conn.receive(deadline):
            if not conn.pending:
                raise http.client.RemoteDisconnected("the server closed without a response")
            raise http.client.IncompleteRead(bytes(conn.pending))
    head_end, body_start = end
    lines = conn.pending[:head_end].decode("latin-1").split("\n")
    del conn.pending[:body_start]
    lines = [line.removesuffix("\r") for line in lines]
    parts = lines[0].split(None, 2)  # as http.client: runs of spaces, no reason at all
    version, code = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
    if not version.startswith("HTTP/") or len(code) != 3 or not _is_number(code):
        raise http.client.BadStatusLine(lines[0])
    reason = parts[2].strip() if len(parts) == 3 else ""
    headers: dict[str, str] = {}
    last = ""
    for line in lines[1:]:
        if line[:1] in (" ", "\t") and last:  # obsolete line folding: continues the last field
            headers[last] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        last = name.strip().lower()
        if not colon or not last:
            last = ""
            continue  # not a field: skipped, as http.client's parser does
        value = value.strip()
        headers[last] = f"{headers[last]}, {value}" if last in headers else value
    return version, int(code), reason, headers


def _head_end(pending: bytearray, start: int) -> tuple[int, int] | None:
    """Where the head in ``pending`` ends and its body starts: at the first empty line, ended
    by CRLF or a bare LF (as ``http.client`` reads); None while no empty line has come."""
    lf = pending.find(b"\n\n", start)
    crlf = pending.find(b"\r\n\r\n", start)
    mixed = pending.find(b"\n\r\n", start)  # a CRLF line, then an LF-ended empty line...
    found = [(at, at + n) for at, n in ((crlf, 4), (lf, 2), (mixed, 3)) if at >= 0]
    return min(found) if found else None


def _content_length(value: str) -> int:
    sizes = {v.strip() for v in value.split(",")}  # a repeated field must repeat one size
    if len(sizes) != 1 or not _is_number(size := sizes.pop()):
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
        if conn.read_line(deadline, 1):  # CRLF or a bare LF, nothing before it
            raise http.client.HTTPException("a chunk did not end where its size said")
