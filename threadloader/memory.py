"""Pinned host memory: collate a batch straight into it, or pin a batch into it."""

from threadloader.device.pinned import (
    Allocator,
    BufferPool,
    Event,
    PoolStats,
    pageable_allocator,
    pin_batch,
    pinned_allocator,
    pinned_collate,
    pinning_collate,
)

__all__ = [
    "Allocator",
    "BufferPool",
    "Event",
    "PoolStats",
    "pageable_allocator",
    "pin_batch",
    "pinned_allocator",
    "pinned_collate",
    "pinning_collate",
]
