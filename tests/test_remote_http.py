"""threadloader's HTTP/1.1 client against scripted loopback servers: framing, keep-alive, errors.

Each test's server answers the requests it receives with the raw bytes the test gives, in order,
so the client meets exactly the responses a test names: chunked bodies, interim answers, bodies
until close, malformed heads, bytes cut short.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from threadloader.remote.http import HTTPConnections, HTTPStatusError
from threadloader.remote.retry import is_transient

pytestmark = pytest.mark.timeout(60)

Answer = bytes | Callable[[socket.socket], None]  # bytes to send, or what to do to the connection
CLOSE = b""  # an answer that closes the connection instead


class ScriptedServer:
    """Answers the n-th request (over all connections) with ``answers[n]``; counts connections.

    An answer is the bytes to send after the request's head arrived, ``CLOSE`` (close the
    connection without answering), or a callable given the connection.
    """

    def __init__(self, answers: list[Answer], wrap: ssl.SSLContext | None = None) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self._wrap = wrap
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="scripted-http", daemon=True)
        self._acceptor.start()

    def url(self, path: str = "obj", scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/{path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._wrap is not None:
                conn = self._wrap.wrap_socket(conn, server_side=True)
            with conn:
                pending = b""
                while True:
                    while b"\r\n\r\n" not in pending:
                        data = conn.recv(65536)
                        if not data:
                            return
                        pending += data
                    head, _, pending = pending.partition(b"\r\n\r\n")
                    with self._lock:
                        self.requests.append(head)
                        answer = self.answers.pop(0)
                    if answer == CLOSE:
                        return
                    if callable(answer):
                        answer(conn)
                        return
                    conn.sendall(answer)
        except OSError:
            return

    def stop(self) -> None:
        """Stop accepting and join every thread (call after the clients closed their sockets)."""
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() does not
        self._listener.close()
        self._acceptor.join(10)
        for t in self._threads:
            t.join(10)
        assert not self._acceptor.is_alive() and not any(t.is_alive() for t in self._threads)


@pytest.fixture
def script() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def make(answers: list[Answer], wrap: ssl.SSLContext | None = None) -> ScriptedServer:
        servers.append(ScriptedServer(answers, wrap))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def client() -> Iterator[HTTPConnections]:
    c = HTTPConnections()
    yield c
    c.close()


def ok(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_a_request_names_the_host_asks_for_identity_and_carries_the_given_headers(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    server = script([ok(b"a")])
    assert client.get(server.url("a/b?x=1&y=2"), 5.0, {"Authorization": "Bearer t"}) == b"a"
    lines = server.requests[0].decode().split("\r\n")
    assert lines[0] == "GET /a/b?x=1&y=2 HTTP/1.1"
    assert sorted(lines[1:]) == sorted(
        [f"Host: 127.0.0.1:{server.port}", "Accept-Encoding: identity", "Authorization: Bearer t"]
    )


def test_given_host_and_accept_encoding_headers_replace_the_defaults(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    server = script([ok(b"a")])
    client.get(server.url(), 5.0, {"host": "example.org", "ACCEPT-ENCODING": "gzip"})
    lines = server.requests[0].decode().split("\r\n")
    assert sorted(lines[1:]) == ["ACCEPT-ENCODING: gzip", "host: example.org"]


def test_responses_on_one_kept_alive_connection_each_get_their_own_body(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    """Content-Length, then a chunked body with an extension and a trailer, then an empty one:
    three reads, one connection."""
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=x\r\nhello\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\nX-Digest: abc\r\n\r\n"
    )
    server = script([ok(b"first"), chunked, ok(b"")])
    assert client.get(server.url("1"), 5.0, {}) == b"first"
    assert client.get(server.url("2"), 5.0, {}) == b"hello" + b"z" * 26
    assert client.get(server.url("3"), 5.0, {}) == b""
    assert server.connections == 1


def test_a_body_of_16_mib_arrives_whole(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    body = bytes(range(256)) * 65536
    server = script([ok(body), ok(b"next")])
    assert client.get(server.url(), 30.0, {}) == body
    assert client.get(server.url(), 5.0, {}) == b"next"
    assert server.connections == 1


def test_a_body_larger_than_one_buffer_arrives_whole_in_parts(
    script: Callable[..., ScriptedServer],
    client: HTTPConnections,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above ``_WHOLE_MAX`` a body is received in parts (here 1 MiB, for a 3.5 MiB body)."""
    import threadloader.remote.http as client_module

    monkeypatch.setattr(client_module, "_WHOLE_MAX", 1 << 20)
    body = bytes(range(256)) * (7 << 11)
    server = script([ok(body), ok(b"next")])
    assert client.get(server.url(), 30.0, {}) == body
    assert client.get(server.url(), 5.0, {}) == b"next"


def test_a_body_cut_short_in_a_later_part_says_what_came_and_what_is_missing(
    script: Callable[..., ScriptedServer],
    client: HTTPConnections,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 MiB announced, 1.5 MiB sent in 1 MiB parts: the error holds all 1.5 MiB that came and
    the 1.5 MiB still owed, not only the last part's count."""
    import threadloader.remote.http as client_module

    monkeypatch.setattr(client_module, "_WHOLE_MAX", 1 << 20)
    sent = b"x" * (3 << 19)

    def cut(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3145728\r\n\r\n" + sent)

    server = script([cut])
    with pytest.raises(http.client.IncompleteRead) as info:
        client.get(server.url(), 30.0, {})
    assert info.value.partial == sent and info.value.expected == (3 << 20) - len(sent)


def test_interim_1xx_answers_are_skipped(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    server = script([interim + ok(b"body")])
    assert client.get(server.url(), 5.0, {}) == b"body"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nab", id="close"
        ),
        pytest.param(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nab", id="http1.0"),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\nab", id="no-length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nab", id="not-chunked"),
        pytest.param(ok(b"ab") + b"HTTP/1.1 200 OK\r\n", id="bytes-after-the-body"),
    ],
)
def test_a_connection_the_response_ends_or_spoils_is_not_used_again(
    script: Callable[..., ScriptedServer], client: HTTPConnections, answer: bytes
) -> None:
    """Bodies framed by the close are read to it; a connection the server will close, or one
    with bytes past the response, is not reused."""

    def send_and_close(conn: socket.socket) -> None:
        conn.sendall(answer)

    server = script([send_and_close, ok(b"second")])
    assert client.get(server.url(), 5.0, {}) == b"ab"
    assert client.get(server.url(), 5.0, {}) == b"second"
    assert server.connections == 2


def test_an_http_1_0_keep_alive_connection_is_used_again(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    answer = b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 1\r\n\r\na"
    server = script([answer, answer])
    assert client.get(server.url(), 5.0, {}) + client.get(server.url(), 5.0, {}) == b"aa"
    assert server.connections == 1


def test_a_relative_redirect_is_followed_on_the_same_connection(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    moved = b"HTTP/1.1 302 Found\r\nLocation: ../new/obj\r\nContent-Length: 5\r\n\r\nmoved"
    server = script([moved, ok(b"here")])
    assert client.get(server.url("old/dir/obj"), 5.0, {}) == b"here"
    assert server.requests[1].startswith(b"GET /old/new/obj HTTP/1.1\r\n")
    assert server.connections == 1


def test_a_sixth_redirect_is_an_error(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    loop = b"HTTP/1.1 301 Moved\r\nLocation: /obj\r\nContent-Length: 0\r\n\r\n"
    server = script([loop] * 6)
    with pytest.raises(HTTPStatusError, match="too many redirects"):
        client.get(server.url(), 5.0, {})


def test_an_error_status_carries_its_retry_after_and_keeps_a_small_page_s_connection(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    busy = b"HTTP/1.1 503 Slow Down\r\nRetry-After: 7\r\nContent-Length: 4\r\n\r\nbusy"
    server = script([busy, ok(b"x")])
    with pytest.raises(HTTPStatusError, match="HTTP 503 Slow Down") as info:
        client.get(server.url(), 5.0, {})
    assert info.value.status == 503 and info.value.retry_after_s == 7.0
    assert client.get(server.url(), 5.0, {}) == b"x"
    assert server.connections == 1


def test_a_large_error_page_is_not_read(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    """A 500 announcing 1 GiB is answered at once, its connection dropped unread."""
    huge = b"HTTP/1.1 500 Oops\r\nContent-Length: 1073741824\r\n\r\n" + b"e" * 1000
    server = script([huge, ok(b"x")])
    with pytest.raises(HTTPStatusError, match="HTTP 500 Oops"):
        client.get(server.url(), 5.0, {})
    assert client.get(server.url(), 5.0, {}) == b"x"
    assert server.connections == 2


def test_a_kept_alive_connection_the_server_closed_is_replaced_without_an_error(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    server = script([ok(b"1"), CLOSE, ok(b"2")])
    assert client.get(server.url(), 5.0, {}) == b"1"
    assert client.get(server.url(), 5.0, {}) == b"2"
    assert server.connections == 2 and len(server.requests) == 3


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (CLOSE, http.client.RemoteDisconnected),
        (b"HTTP/1.1 200 OK\r\nContent-Le", http.client.IncompleteRead),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", http.client.IncompleteRead),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
            http.client.IncompleteRead,
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdeXY",
            http.client.HTTPException,
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n",
            http.client.HTTPException,
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\nabc",
            http.client.IncompleteRead,
        ),
        (b"SPDY/3 200 OK\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 2000 OK\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 2\xb20 OK\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", http.client.HTTPException),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 30000, http.client.LineTooLong),
    ],
    ids=[
        "closed-unanswered",
        "cut-in-head",
        "cut-in-body",
        "cut-in-chunk",
        "chunk-without-crlf",
        "chunk-size-not-hex",
        "a-terabyte-announced",
        "not-http",
        "four-digit-status",
        "superscript-status",
        "superscript-length",
        "two-lengths",
        "negative-length",
        "endless-head",
    ],
)
def test_a_broken_response_raises_an_error_the_retries_take_as_transient(
    script: Callable[..., ScriptedServer], client: HTTPConnections, answer: Answer, error: type
) -> None:
    """On a new connection every failure surfaces (nothing to fall back on) and is retried."""

    def send_and_close(conn: socket.socket) -> None:
        if answer:
            conn.sendall(answer)

    server = script([send_and_close])
    with pytest.raises(error) as info:
        client.get(server.url(), 5.0, {})
    assert is_transient(info.value)
    assert server.connections == 1


@pytest.mark.parametrize(
    ("url", "headers", "error"),
    [
        ("http://127.0.0.1:9/a b", {}, http.client.InvalidURL),
        ("http://127.0.0.1:9/caf\u00e9", {}, http.client.InvalidURL),
        ("http://127.0.0.1:99999/a", {}, http.client.InvalidURL),
        ("http:///no-host", {}, http.client.InvalidURL),
        ("http://127.0.0.1:9/a", {"X-Evil": "a\r\nHost: b"}, ValueError),
    ],
    ids=["space", "non-ascii", "port", "no-host", "header-injection"],
)
def test_a_request_that_cannot_be_sent_as_written_is_refused_before_connecting(
    client: HTTPConnections, url: str, headers: dict[str, str], error: type
) -> None:
    """Port 9 (discard) is never contacted: the request is refused while it is built."""
    with pytest.raises(error) as info:
        client.get(url, 5.0, headers)
    assert not is_transient(info.value)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the HTTPS test makes its certificate with openssl")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_https_reads_verify_the_certificate_and_keep_the_connection(
    script: Callable[..., ScriptedServer],
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server whose certificate the client trusts serves two reads on one TLS connection;
    the same server is refused when the client trusts only the system's authorities."""
    cert, key = certificate
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    server = script([ok(b"one"), ok(b"two")], wrap=served)
    untrusting = HTTPConnections()
    try:
        with pytest.raises(ssl.SSLCertVerificationError) as info:
            untrusting.get(server.url(scheme="https"), 5.0, {})
        assert not is_transient(info.value)
    finally:
        untrusting.close()
    system_default = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda: system_default(cafile=str(cert)))
    trusting = HTTPConnections()
    try:
        assert trusting.get(server.url(scheme="https"), 5.0, {}) == b"one"
        assert trusting.get(server.url(scheme="https"), 5.0, {}) == b"two"
    finally:
        trusting.close()
    assert server.connections == 2  # the refused handshake, then one connection for both reads


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1  200  OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
        b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\ncontent-length:2   \r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\no\n1\r\nk\n0\n\n",
    ],
    ids=[
        "no-reason",
        "runs-of-spaces",
        "bare-lf",
        "line-without-colon",
        "space-before-colon",
        "lower-case-padded",
        "identity-coding",
        "chunked-bare-lf",
    ],
)
def test_responses_http_client_reads_are_read_and_keep_their_connection(
    script: Callable[..., ScriptedServer], client: HTTPConnections, answer: bytes
) -> None:
    """Heads servers send that are not quite RFC 9112 but that ``http.client`` reads."""
    server = script([answer, answer])
    assert client.get(server.url(), 5.0, {}) == b"ok"
    assert client.get(server.url(), 5.0, {}) == b"ok"
    assert server.connections == 1


def test_a_retry_after_that_is_not_a_number_of_seconds_is_ignored(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    busy = "HTTP/1.1 503 Busy\r\nRetry-After: \u00b9\r\nContent-Length: 0\r\n\r\n".encode("latin-1")
    server = script([busy])
    with pytest.raises(HTTPStatusError) as info:
        client.get(server.url(), 5.0, {})
    assert info.value.status == 503 and info.value.retry_after_s is None


def test_an_error_page_of_unknown_size_is_not_read(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    """A chunked 500 page could be endless: the error is answered at once, the connection
    dropped unread."""
    endless = b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n" + b"5\r\nerror\r\n" * 9
    server = script([endless, ok(b"x")])
    with pytest.raises(HTTPStatusError, match="HTTP 500 Oops"):
        client.get(server.url(), 5.0, {})
    assert client.get(server.url(), 5.0, {}) == b"x"
    assert server.connections == 2


def test_a_host_beyond_ascii_is_sent_in_its_idna_form(
    script: Callable[..., ScriptedServer], client: HTTPConnections, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = script([ok(b"a")])
    connect = socket.create_connection
    monkeypatch.setattr(
        socket, "create_connection", lambda _, timeout: connect(("127.0.0.1", server.port), timeout)
    )
    assert client.get("http://b\u00fccher.example/obj", 5.0, {}) == b"a"
    assert b"\r\nHost: xn--bcher-kva.example\r\n" in server.requests[0] + b"\r\n"


def test_header_names_must_be_tokens_and_numbers_are_sent_as_text(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    with pytest.raises(ValueError, match="not an HTTP token"):
        client.get("http://127.0.0.1:9/a", 5.0, {"X Bad": "1"})
    server = script([ok(b"a")])
    assert client.get(server.url(), 5.0, {"X-Count": 3}) == b"a"  # type: ignore[dict-item]
    assert b"\r\nX-Count: 3" in server.requests[0]


def test_idle_connections_the_server_closed_are_dropped_before_a_request(
    script: Callable[..., ScriptedServer], client: HTTPConnections
) -> None:
    """Three reads at once leave three idle connections, which the server then closes (its
    keep-alive timeout): the next read goes out on a new connection and succeeds, without
    spending its one quiet second try on another dead connection."""
    closers: list[socket.socket] = []
    ready = threading.Barrier(3)

    def answer_then_close_later(conn: socket.socket) -> None:
        ready.wait(5)  # all three connections are open before any answer
        conn.sendall(ok(b"a"))
        closers.append(conn)

    server = script([answer_then_close_later] * 3 + [ok(b"fresh")])
    readers = [threading.Thread(target=client.get, args=(server.url(), 5.0, {})) for _ in range(3)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(10)
    assert server.connections == 3
    time.sleep(0.1)  # the server side has closed all three (each _serve returned)
    assert client.get(server.url(), 5.0, {}) == b"fresh"
    assert server.connections == 4 and len(server.requests) == 4


def test_the_tls_handshake_gets_only_what_the_connect_left_of_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connect that takes 1 s (SYN retransmits), then a server that never answers the
    handshake: the read still ends at its 1.5 s deadline, not 1 s + 1.5 s."""
    silent = socket.create_server(("127.0.0.1", 0))
    connect = socket.create_connection

    def slow(address: tuple[str, int], timeout: float) -> socket.socket:
        time.sleep(1.0)
        return connect(silent.getsockname(), timeout)

    monkeypatch.setattr(socket, "create_connection", slow)
    client = HTTPConnections()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.get("https://127.0.0.1:9/obj", 1.5, {})
        assert time.monotonic() - start < 2.1
    finally:
        client.close()
        silent.close()
