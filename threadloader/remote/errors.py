"""What a remote read can raise, and the counters ``RemoteFiles.stats()`` returns."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


class RemoteReadError(OSError):
    """An object could not be read: permanently, or after every retry.

    Constructed from a message alone too, so that a loader re-raising a worker's exception
    (torch's ``ExceptionWrapper``) raises this type, not a ``RuntimeError``.

    Args:
        message: names the URL, the tries and the last cause.
        url: the object.
        attempts: tries made.
        cause: the last failure (also ``__cause__``).
    """

    def __init__(
        self, message: str, *, url: str = "", attempts: int = 0, cause: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.url, self.attempts, self.cause = url, attempts, cause

    @classmethod
    def _of(cls, url: str, attempts: int, cause: BaseException, gave_up: bool = False) -> Self:
        why = "gave up reading (the dataset was closed)" if gave_up else "could not read"
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        message = f"{why} {url} after {tries}; last error: {type(cause).__name__}: {cause}"
        return cls(message, url=url, attempts=attempts, cause=cause)


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The object does not exist (HTTP 404/410, no such key or file). Never retried."""


class RemoteDecodeError(ValueError):
    """``decode`` raised on an object's bytes.

    Args:
        message: names the URL and what ``decode`` raised.
        url: the object.
        cause: what ``decode`` raised (also ``__cause__``).
    """

    def __init__(self, message: str, *, url: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.url, self.cause = url, cause


class SkipBudgetExceededError(RuntimeError):
    """One more item could not be delivered after ``max_skipped`` items were already skipped."""


@dataclasses.dataclass(frozen=True)
class RemoteStats:
    """A snapshot of one dataset's counters in this process (``RemoteFiles.stats()``)."""

    reads: int
    """Objects read from storage (cache misses that succeeded)."""
    read_bytes: int
    """Bytes of those objects."""
    read_s: float
    """Seconds spent reading from storage, retries included, summed over threads."""
    retries: int
    """Tries beyond the first, over all reads. A request on a kept-alive connection that the
    server had closed meanwhile is re-sent at once on a new one, and not counted."""
    failures: int
    """Items that could not be delivered (read failed for good, or decode raised)."""
    skipped: int
    """Of those, items left out of their batch under ``max_skipped``."""
    cache_hits: int
    cache_misses: int
    cache_hit_bytes: int
    """Bytes served from the caches."""
    cache_stored_bytes: int
    """Bytes in the caches now (the disk cache as this process knows it)."""
    cache_evictions: int
    skipped_urls: tuple[str, ...]
    """The most recently skipped URLs, oldest first (at most 32)."""

    def __add__(self, other: object) -> RemoteStats:
        """Two processes' counters together (``isolation="process"`` with several helpers).

        Returns:
            Every counter summed; the most recent skipped URLs of both, at most 32.
        """
        if not isinstance(other, RemoteStats):
            return NotImplemented
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in dataclasses.fields(self)
            if f.name != "skipped_urls"
        }
        return RemoteStats(**summed, skipped_urls=(self.skipped_urls + other.skipped_urls)[-32:])
