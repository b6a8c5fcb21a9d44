"""RemoteFiles: a map-style dataset over objects in object storage, on HTTP servers or on disk.

``files`` holds the dataset, ``errors`` what it raises and counts; ``state`` the read pool, counters and caches it
shares between worker copies; ``http`` the HTTP client; ``retry`` the retry policy; ``cache``
the memory and disk caches.
"""

from threadloader.remote.errors import (
    RemoteDecodeError,
    RemoteNotFoundError,
    RemoteReadError,
    RemoteStats,
    SkipBudgetExceededError,
)
from threadloader.remote.files import RemoteFiles, RetryPolicy

__all__ = [
    "RemoteDecodeError",
    "RemoteFiles",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteStats",
    "RetryPolicy",
    "SkipBudgetExceededError",
]
