"""Retrying one read: which failures are worth another try, and how long to wait before it.

A read is retried when its failure is *transient*: the server said so (HTTP 500, 502, 503, 504,
408, 425, 429), the connection broke (reset, refused, closed early, truncated body) or the read
timed out. Anything else (a missing object, a refused permission, another 4xx or 5xx) fails at
once: retrying cannot fix it.
Storage clients wrap their errors differently (s3fs raises ``OSError(EIO)`` with botocore's
``ClientError`` as its cause, aiohttp sets ``.status``), so the whole cause chain is examined.

Delays follow exponential backoff with "full jitter" (a uniform draw below the doubling
ceiling), which spreads the retries of many threads hit by the same outage instead of
synchronising them. A server's ``Retry-After`` raises the delay, within ``max_backoff_s``.
"""

from __future__ import annotations

import dataclasses
import errno
import http.client
import random
import ssl
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: HTTP statuses that mean "try again later" rather than "this request is wrong".
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE, errno.ETIMEDOUT}
)
# Client libraries we do not import (they are optional) but whose errors are transient by type.
_TRANSIENT_TYPE_NAMES = frozenset(
    {
        "HTTPClientError",  # botocore: connection closed, endpoint unreachable, read timeout
        "ResponseParserError",  # botocore: a throttled response with a garbled body
        "ClientPayloadError",  # aiohttp: body ended early
        "ClientConnectionError",  # aiohttp: reset, refused, server disconnected
        "ServerTimeoutError",
    }
)
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    http.client.InvalidURL,  # an HTTPException, but no second try can fix the URL
)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How many times, and how patiently, one failed read is tried again.

    The delay before retry ``k`` (k = 1, 2, ...) is uniform in
    ``[0, min(max_backoff_s, backoff_s * 2 ** (k - 1))]``, raised to a server's ``Retry-After``
    (capped at ``max_backoff_s``).

    Args:
        attempts: tries per read, the first one included; 1 disables retries.
        backoff_s: ceiling of the first retry's delay, in seconds.
        max_backoff_s: largest delay between two tries, in seconds.
        timeout_s: deadline of one try, in seconds: connecting, waiting and reading the body
            (over HTTP, a blocking receive may end up to a tenth of the time then left past it).

    Raises:
        ValueError: if ``attempts < 1``, a delay is negative, or ``timeout_s`` is not positive.
    """

    attempts: int = 5
    backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(
                f"backoff_s and max_backoff_s must be >= 0, got {self.backoff_s}, "
                f"{self.max_backoff_s}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    def delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry).

        Args:
            retry: which retry this is, from 1.
            retry_after_s: the server's ``Retry-After``, if it sent one.

        Returns:
            A jittered delay, at most ``max_backoff_s``.
        """
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1))
        delay = _rng().uniform(0.0, ceiling)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.max_backoff_s))
        return delay


class RetriesExhausted(Exception):
    """Every try of a read failed transiently; ``cause`` is the last failure."""

    def __init__(self, attempts: int, cause: BaseException, stopped: bool = False) -> None:
        super().__init__(attempts, cause, stopped)
        self.attempts = attempts
        self.cause = cause
        self.stopped = stopped  # gave up early: the owner was closed while waiting to retry


_local = threading.local()


def _rng() -> random.Random:
    # One generator per thread: nothing shared between threads, with or without the GIL.
    rng: random.Random | None = getattr(_local, "rng", None)
    if rng is None:
        rng = _local.rng = random.Random()
    return rng


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, in any of the spellings clients use, or None."""
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _transient_here(exc: BaseException) -> bool | None:
    """True/False when this exception alone decides; None to look at its cause."""
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUSES
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, http.client.HTTPException)):
        return True  # includes IncompleteRead, RemoteDisconnected, socket timeouts
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return True  # a TLS connection cut or closed mid-exchange, as a reset is
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(t.__name__ in _TRANSIENT_TYPE_NAMES for t in type(exc).__mro__):
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether trying the same read again may succeed.

    Args:
        exc: what the read raised.

    Returns:
        True for HTTP 500/502/503/504/408/425/429, timeouts, broken connections and truncated bodies,
        found on the exception or anywhere in its ``__cause__``/``__context__`` chain; False
        otherwise (missing object, permission denied, other 4xx, unknown errors).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        verdict = _transient_here(current)
        if verdict is not None:
            return verdict
        current = current.__cause__ or current.__context__
    return False


def retry_after_s(exc: BaseException) -> float | None:
    """The ``Retry-After`` seconds an exception carries (attribute ``retry_after_s``), or None."""
    value = getattr(exc, "retry_after_s", None)
    return float(value) if isinstance(value, (int, float)) else None


def call_with_retries(
    read: Callable[[float], T],
    policy: RetryPolicy,
    stop: threading.Event,
    on_retry: Callable[[BaseException], None],
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """Run ``read(timeout_s)`` until it succeeds, fails permanently, or runs out of tries.

    Args:
        read: one try; receives the per-try deadline in seconds.
        policy: tries, delays and deadline.
        stop: set by the owner on close; a wait for the next try ends at once and gives up.
        on_retry: called with the failure before each retry (counts retries).
        transient: decides which failures are retried.

    Returns:
        What ``read`` returned.

    Raises:
        RetriesExhausted: every try failed transiently, or ``stop`` was set between tries.
        Exception: a permanent failure, as ``read`` raised it, on its first occurrence.
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return read(policy.timeout_s)
        except Exception as e:
            if not transient(e):
                raise
            if attempt == policy.attempts:
                raise RetriesExhausted(attempt, e) from e
            if stop.is_set():
                raise RetriesExhausted(attempt, e, stopped=True) from e
            on_retry(e)
            if stop.wait(policy.delay_s(attempt, retry_after_s(e))):
                raise RetriesExhausted(attempt, e, stopped=True) from e
    raise AssertionError("unreachable: attempts >= 1")
