"""BufferPool: staging buffers recycled once an event says the copy reading them finished.

Why a pool as well: batches handed to the user may live as long as the user likes, so they come
from torch's allocator (``memory.pinned_allocator``). Staging buffers that never leave the
library (the host side of a ``DevicePrefetcher`` copy) can instead be recycled by ``BufferPool``
as soon as the copy that reads them has finished, which it learns from an event (a CUDA event on
a GPU host, a fake in tests): no allocator call and no lookup among unrelated block sizes in the
steady state.

How the pool behaves; where the code disagrees with this, the code is wrong: a ``BufferPool``
buffer goes back to the pool only once the event given with it completes; the pool keeps at most
``max_buffers`` (and ``max_bytes``) buffers, and forgets shapes that stopped being requested.

The public names are re-exported by ``threadloader.memory``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch


class Event(Protocol):
    """What the pool needs from an event: a ``torch.cuda.Event`` has exactly this shape."""

    def query(self) -> bool:
        """Return True once the work recorded before the event has completed; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block until the work recorded before the event has completed."""
        ...


#: Handed-out buffers tracked before the dead ones among them are pruned (then twice the live).
PRUNE_AT = 256

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]
PoolAllocate = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""``allocate(shape, dtype, device)``: where a ``BufferPool`` gets a buffer on a miss."""


def _default_allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if device.type == "cpu":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a ``BufferPool``; a new one per ``stats()`` call."""

    hits: int  # acquire() served by a recycled buffer
    misses: int  # acquire() that had to allocate
    evicted: int  # buffers dropped: over the bounds, or of a shape no longer requested
    free: int  # buffers ready for reuse
    free_bytes: int
    pending: int  # buffers released whose event has not completed yet
    outstanding: int  # buffers handed out, not released, still alive


def _key_of(tensor: torch.Tensor) -> _Key:
    return (tuple(tensor.shape), tensor.dtype, tensor.device)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class BufferPool:
    """Recycles buffers by (shape, dtype, device), each one only after its copy has finished.

    ``acquire`` hands out a buffer: a recycled one of the same key when there is one, else a new
    one from ``allocate``. ``release(tensors, event)`` takes back those of ``tensors`` that this
    pool handed out (others are ignored, so a whole batch can be passed) and makes them
    available again once ``event.query()`` is True: a buffer that an asynchronous copy still
    reads is never handed out twice. A pool is itself an ``Allocator`` (``pool(shape, dtype)``
    acquires on ``device``), so ``pinned_collate(batch, pool)`` collates into pooled buffers.

    Bounds: the pool retains at most ``max_buffers`` buffers (ready plus awaiting their event)
    and at most ``max_bytes`` bytes of ready ones; past that the least recently requested shape
    loses its buffers first, and then the oldest buffers awaiting an event are forgotten (not
    reused, so always safe; torch's caching host allocator frees pinned memory only when the
    copies it saw have completed). A key nobody requested in the last ``stale_after``
    acquisitions loses its buffers too, so the pool shrinks when shapes change (a new image
    size, a different sequence length) instead of holding the old ones forever.

    Thread-safe: workers acquire while the transfer thread releases.

    Args:
        allocate: ``allocate(shape, dtype, device)`` on a miss; by default pinned host memory
            for CPU keys (``torch.empty(..., pin_memory=True)``) and plain device memory else.
        device: the device of ``pool(shape, dtype)`` and of ``acquire`` without one.
        max_buffers: most buffers retained.
        max_bytes: most bytes of ready buffers retained; None: no byte bound.
        stale_after: acquisitions after which a key not requested loses its buffers.

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(
        self,
        allocate: PoolAllocate | None = None,
        *,
        device: str | torch.device = "cpu",
        max_buffers: int = 64,
        max_bytes: int | None = None,
        stale_after: int = 256,
    ) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        if stale_after < 1:
            raise ValueError(f"stale_after must be >= 1, got {stale_after}")
        self._allocate = allocate if allocate is not None else _default_allocate
        self.device = torch.device(device)
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes
        self.stale_after = stale_after
        self._lock = threading.Lock()
        self._free: dict[_Key, list[torch.Tensor]] = {}  # key -> ready buffers, oldest first
        self._free_count = 0
        self._free_bytes = 0
        self._last_request: dict[_Key, int] = {}  # key -> tick of its latest acquire()
        self._tick = 0
        # Released buffers waiting for their event, oldest first.
        self._pending: collections.deque[tuple[Event, list[torch.Tensor]]] = collections.deque()
        self._pending_count = 0
        # Handed out and not released, by storage address: weak, so a buffer the caller drops
        # (an abandoned batch) is simply freed, and views of a buffer find it. Plain references
        # with no callback (a buffer dropped by the training loop runs no Python code as it
        # dies, which could lose a Ctrl-C: _finalizers point 1); dead ones are pruned as the
        # dict grows.
        self._outstanding: dict[int, weakref.ref[torch.Tensor]] = {}
        self._prune_at = PRUNE_AT
        self._hits = 0
        self._misses = 0
        self._evicted = 0

    def __repr__(self) -> str:
        return (
            f"<BufferPool {self._free_count} free, {self._pending_count} pending, "
            f"hits={self._hits} misses={self._misses}>"
        )

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``acquire(shape, dtype)`` on the pool's device: the pool as an ``Allocator``."""
        return self.acquire(shape, dtype)

    def acquire(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: str | torch.device | None = None,
    ) -> torch.Tensor:
        """Return a contiguous buffer of this shape, dtype and device; its contents are garbage.

        Args:
            shape: the buffer's shape.
            dtype: the buffer's dtype.
            device: the buffer's device; None for the pool's. Keys compare ``torch.device``s,
                so ``"cuda"`` and ``"cuda:0"`` are different keys: pass resolved devices.

        Returns:
            A buffer nobody else uses until it is given to ``release``.
        """
        dev = self.device if device is None else torch.device(device)
        key: _Key = (tuple(int(s) for s in shape), dtype, dev)
        buf: torch.Tensor | None = None
        with self._lock:
            self._tick += 1
            self._last_request[key] = self._tick
            self._reclaim_locked()
            ready = self._free.get(key)
            if ready:
                buf = ready.pop()
                self._free_count -= 1
                self._free_bytes -= buf.nbytes
                self._hits += 1
            else:
                self._misses += 1
                # A miss is when shapes change; a periodic pass catches keys that just stop.
                self._drop_stale_locked()
            if self._tick % self.stale_after == 0:
                self._drop_stale_locked()
        if buf is None:
            buf = self._allocate(key[0], dtype, dev)  # outside the lock: may be slow
        if buf.numel() > 0:  # empty tensors share address 0 and cost nothing to make
            with self._lock:
                if len(self._outstanding) >= self._prune_at:
                    self._prune_outstanding_locked()
                self._outstanding[_storage_ptr(buf)] = weakref.ref(buf)
        return buf

    def release(self, tensors: Iterable[torch.Tensor], event: Event | None = None) -> int:
        """Give back the buffers among ``tensors`` that this pool handed out.

        Args:
            tensors: any tensors, e.g. every host tensor of a batch that was just copied; those
                the pool did not hand out (or already took back) are ignored. A view of a
                buffer returns the buffer.
            event: completes once nothing reads the buffers any more (the copy's CUDA event);
                None if nothing does now.

        Returns:
            How many buffers were taken back.
        """
        with self._lock:
            taken: list[torch.Tensor] = []
            for t in tensors:
                if t.layout != torch.strided or t.numel() == 0:
                    continue  # never one of ours
                ref = self._outstanding.pop(_storage_ptr(t), None)
                buf = ref() if ref is not None else None
                if buf is not None:
                    taken.append(buf)
            if not taken:
                return 0
            if event is None:
                self._add_free_locked(taken)
            else:
                self._pending.append((event, taken))
                self._pending_count += len(taken)
            self._reclaim_locked()
            return len(taken)

    def wait_pending(self) -> None:
        """Block until every released buffer's event completed, then make them all reusable."""
        with self._lock:
            events = [event for event, _ in self._pending]
        for event in events:  # outside the lock: synchronize() may take as long as a copy
            event.synchronize()
        with self._lock:
            self._reclaim_locked()

    def clear(self) -> None:
        """Forget every buffer (ready, pending and handed out): the pool starts empty."""
        with self._lock:
            self._free.clear()
            self._pending.clear()
            self._outstanding.clear()
            self._last_request.clear()
            self._free_count = self._free_bytes = self._pending_count = 0

    def stats(self) -> PoolStats:
        """Return a snapshot of the pool's counters."""
        with self._lock:
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                evicted=self._evicted,
                free=self._free_count,
                free_bytes=self._free_bytes,
                pending=self._pending_count,
                outstanding=sum(ref() is not None for ref in self._outstanding.values()),
            )

    def _prune_outstanding_locked(self) -> None:
        dead = [ptr for ptr, ref in self._outstanding.items() if ref() is None]
        for ptr in dead:
            del self._outstanding[ptr]
        self._prune_at = max(PRUNE_AT, 2 * len(self._outstanding))

    def _reclaim_locked(self) -> None:
        """Move buffers whose event completed to the ready lists, then enforce the bounds.

        All pending events are queried, not just the oldest: events from one CUDA stream
        complete in order, but the pool does not assume where its events come from.
        """
        if self._pending:
            still: collections.deque[tuple[Event, list[torch.Tensor]]] = collections.deque()
            for event, bufs in self._pending:
                if event.query():
                    self._pending_count -= len(bufs)
                    self._add_free_locked(bufs)
                else:
                    still.append((event, bufs))
            self._pending = still
        self._enforce_bounds_locked()

    def _add_free_locked(self, bufs: list[torch.Tensor]) -> None:
        for buf in bufs:
            key = _key_of(buf)
            self._free.setdefault(key, []).append(buf)
            self._free_count += 1
            self._free_bytes += buf.nbytes
            if key not in self._last_request:
                self._last_request[key] = self._tick

    def _enforce_bounds_locked(self) -> None:
        def over() -> bool:
            if self._free_count + self._pending_count > self.max_buffers:
                return True
            return self.max_bytes is not None and self._free_bytes > self.max_bytes

        while over() and self._free_count:
            key = min(self._free, key=lambda k: self._last_request.get(k, 0))
            self._evict_one_locked(key)
        while self._free_count + self._pending_count > self.max_buffers and self._pending:
            _, bufs = self._pending.popleft()
            self._pending_count -= len(bufs)
            self._evicted += len(bufs)

    def _evict_one_locked(self, key: _Key) -> None:
        bufs = self._free[key]
        buf = bufs.pop(0)  # the longest-idle buffer of that key
        self._free_count -= 1
        self._free_bytes -= buf.nbytes
        self._evicted += 1
        if not bufs:
            del self._free[key]

    def _drop_stale_locked(self) -> None:
        horizon = self._tick - self.stale_after
        for key in [k for k, t in self._last_request.items() if t < horizon]:
            del self._last_request[key]
            for buf in self._free.pop(key, ()):
                self._free_count -= 1
                self._free_bytes -= buf.nbytes
                self._evicted += 1
