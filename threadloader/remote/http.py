"""A small HTTP(S) client: keep-alive connections shared by threads, one GET within a deadline.

HTTP(S) is read with the standard library (``http.client``), with keep-alive connections reused
across threads and epochs: no event loop, no extra dependency, and every failure mode in reach
of the retry logic (``retry``). One GET, its redirects (up to 5) and the whole body included,
runs within one deadline (a blocking call that it lets run out ends at most 10% of the time then
left past it: ``TIMEOUT_SLACK``). A body cut short raises ``http.client.IncompleteRead``, a
status other than 200 ``HTTPStatusError``. A request on a kept-alive connection that the server
closed meanwhile is sent again at once on a new connection.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from collections.abc import Mapping
from urllib.parse import urljoin, urlsplit

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_MAX_IDLE_PER_HOST = 256  # keep-alive connections kept per host; more are closed on release
_BODY_CHUNK = 1 << 18
#: A connected socket's timeout is set again only once it exceeds what is left of the deadline
#: by more than this factor, so one blocking call ends at most 10% of the time then left past
#: the deadline. ``settimeout`` releases and takes back the GIL (two ``fcntl`` calls); set before
#: every send and receive, with 32 threads reading 16 KiB objects on 2 cores, it cost 12% of the
#: reads per second (1,923 against 2,184, medians of 9 interleaved rounds, with 14,900 against
#: 10,600 voluntary context switches per 1,024 reads).
TIMEOUT_SLACK = 1.1


class HTTPStatusError(OSError):
    """An HTTP response other than success; ``status`` decides whether it is retried."""

    def __init__(self, url: str, status: int, reason: str, retry_after_s: float | None) -> None:
        super().__init__(f"HTTP {status} {reason} for {url}")
        self.status, self.retry_after_s = status, retry_after_s


class HTTPConnections:
    """Keep-alive HTTP(S) connections by (scheme, host, port); each used by one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
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

    def _acquire(self, key: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            conns = self._idle.get(key)
            if conns:
                return conns.pop(), True
            if key[0] == "https" and self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        scheme, host, port = key
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, context=context), False
        return http.client.HTTPConnection(host, port), False

    def _release(self, key: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            conns = self._idle.setdefault(key, [])
            if not self._closed and len(conns) < _MAX_IDLE_PER_HOST:
                conns.append(conn)
                return
        conn.close()

    def get(self, url: str, timeout_s: float, headers: Mapping[str, str]) -> bytes:
        """GET ``url`` within ``timeout_s`` in all, following up to 5 redirects.

        Raises:
            HTTPStatusError: on a status other than 200 (after redirects).
            TimeoutError, ConnectionError, http.client.HTTPException: as the exchange failed.
        """
        deadline = time.monotonic() + timeout_s
        for _ in range(_MAX_REDIRECTS + 1):
            resp, body = self._exchange(url, deadline, headers)
            if resp.status == 200:
                return body
            location = resp.getheader("Location")
            if resp.status in _REDIRECTS and location:
                url = urljoin(url, location)
                continue
            retry_after = resp.getheader("Retry-After")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            raise HTTPStatusError(url, resp.status, resp.reason, seconds)
        raise HTTPStatusError(url, resp.status, "(too many redirects)", None)

    def _exchange(
        self, url: str, deadline: float, headers: Mapping[str, str]
    ) -> tuple[http.client.HTTPResponse, bytes]:
        parts = urlsplit(url)
        scheme, host = parts.scheme.lower(), parts.hostname or ""
        key = (scheme, host, parts.port or (443 if scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for first_try in (True, False):
            conn, reused = self._acquire(key)
            try:
                _set_timeout(conn, deadline)
                conn.request("GET", target, headers={"Accept-Encoding": "identity", **headers})
                resp = conn.getresponse()
                if resp.status == 200:
                    body = _read_body(resp, conn, deadline)
                elif resp.length is not None and resp.length <= 65536:
                    # A small error page: read it to keep the connection.
                    body = _read_body(resp, conn, deadline)
                else:
                    resp.will_close = True
                    body = b""
            except ConnectionError:
                conn.close()
                if reused and first_try:
                    continue  # the server closed an idle keep-alive connection: not a failure
                raise
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self._release(key, conn)
            return resp, body
        raise AssertionError("unreachable")


def _set_timeout(conn: http.client.HTTPConnection, deadline: float) -> None:
    """Give the connection's next blocking call what is left of ``deadline`` (``TIMEOUT_SLACK``).

    Raises:
        TimeoutError: the deadline passed.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the read's deadline passed")
    current = conn.timeout
    if (
        conn.sock is not None
        and isinstance(current, float)
        and remaining <= current <= remaining * TIMEOUT_SLACK
    ):
        return
    conn.timeout = remaining
    if conn.sock is not None:
        conn.sock.settimeout(remaining)


def _read_body(
    resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, deadline: float
) -> bytes:
    chunks = []
    while resp.length != 0:  # None (chunked, or until close) or bytes still to come
        _set_timeout(conn, deadline)  # the whole body within the deadline, not each recv
        # read1: one receive at most. read(n) keeps receiving until n bytes or the end, each
        # receive under the timeout set before it, so a server trickling bytes held one read
        # for many times its deadline.
        chunk = resp.read1(_BODY_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
    if resp.length:  # the connection ended before Content-Length bytes arrived
        raise http.client.IncompleteRead(b"".join(chunks), resp.length)
    resp.read()  # nothing left: marks the response complete, so the connection can be reused
    return b"".join(chunks)
