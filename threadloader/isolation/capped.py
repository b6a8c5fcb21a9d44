"""Pickling with a size limit: refused before anything beyond it is copied."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["Capped", "PayloadTooLarge"]


class PayloadTooLarge(Exception):
    """What a helper would receive pickled is larger than its start may cost."""


class Capped(io.BytesIO):
    """A pickle's bytes, refused beyond ``limit``: each write is checked before it is copied.

    Args:
        limit: the most bytes it holds; None: no limit.

    Raises:
        PayloadTooLarge: from ``write``, when the bytes would exceed ``limit``.
    """

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self._limit = limit

    def write(self, data: Any) -> int:
        if self._limit is not None and self.tell() + memoryview(data).nbytes > self._limit:
            raise PayloadTooLarge(
                f"what a helper would receive pickled exceeds {self._limit / 1e6:.3g} MB"
            )
        return super().write(data)
