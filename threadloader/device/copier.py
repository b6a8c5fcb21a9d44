"""How the transfer thread moves one batch: to a CUDA device on a side stream, or nowhere (CPU).

A copy is issued with ``non_blocking=True`` from pinned memory and ends at a recorded event; the
consumer's stream waits on that event, and every device tensor is recorded on the consumer's
stream so the caching allocator never hands its memory out too early.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import torch

from threadloader.device.pinned import _DESCEND, BufferPool, _map_batch


@dataclasses.dataclass(frozen=True)
class Moved:
    """A batch on its device, the event its copies completed at, and its device tensors."""

    batch: Any
    event: torch.cuda.Event | None
    tensors: tuple[torch.Tensor, ...]


class CudaCopier:
    """Copies host batches to one CUDA device on one side stream (the transfer thread only)."""

    def __init__(self, device: torch.device, pool: BufferPool | None) -> None:
        self.device = device
        self.pool = pool
        self.stream = torch.cuda.Stream(device=device)
        self.bytes = 0
        self.issue_s = 0.0
        # Host tensors of copies that may still be running, with the event they end at: kept
        # alive until then. Memory from torch's caching host allocator would be safe anyway (the
        # copy recorded its use); pinned memory from elsewhere (cudaHostRegister, from_blob)
        # would not be. Events of one stream complete in order, so the oldest are checked first.
        self._in_flight: deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = deque()

    def enter_thread(self) -> None:
        # Current device and current stream are both per thread. With them set once, every
        # allocation and kernel of this thread lands on our device and our stream: the copies,
        # and any GPU work the source does while producing a batch, which the batch's event
        # then covers too.
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def move(self, host: Any) -> Moved:
        start = time.perf_counter()
        delivered: list[torch.Tensor] = []
        staged: list[torch.Tensor] = []  # host memory the copies read

        def leaf(data: Any) -> Any:
            if not isinstance(data, torch.Tensor):
                return _DESCEND
            if data.device == self.device:
                out = data  # already there (made by the source): no copy, still marked
            elif data.device.type != "cpu" or data.layout != torch.strided:
                out = data.to(self.device, non_blocking=True)  # torch's own path
            else:
                src = data
                if self.pool is not None and not data.is_pinned():
                    # Stage pageable memory through a pooled pinned buffer so that the copy is
                    # truly asynchronous (from pageable memory the host waits for the DMA).
                    src = self.pool.acquire(data.shape, data.dtype)
                    src.copy_(data)
                out = src.to(self.device, non_blocking=True)
                staged.append(src)
                self.bytes += src.nbytes
            delivered.append(out)
            return out

        batch = _map_batch(host, leaf)  # on self.stream: the thread's current stream
        event = torch.cuda.Event()
        event.record(self.stream)
        if self.pool is not None and staged:
            # Pooled buffers are reused only after `event`: the copies above have read them.
            self.pool.release(staged, event)
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        if staged:
            self._in_flight.append((event, staged))
        self.issue_s += time.perf_counter() - start
        return Moved(batch, event, tuple(delivered))

    def deliver(self, moved: Moved) -> Any:
        """Order the consumer's current stream after the copies, without a host synchronize."""
        consumer = torch.cuda.current_stream(self.device)
        if moved.event is not None:
            consumer.wait_event(moved.event)  # a GPU-side wait; returns at once
        for t in moved.tensors:
            # Allocated on the side stream, used on the consumer's: without this the caching
            # allocator could hand the block to the next copy while the consumer's kernels,
            # queued before the batch was dropped, still read it.
            t.record_stream(consumer)
        return moved.batch


class PassThrough:
    """``device="cpu"``: batches are already where they belong."""

    bytes = 0
    issue_s = 0.0
    stream = None

    def enter_thread(self) -> None:
        pass

    def move(self, host: Any) -> Moved:
        return Moved(host, None, ())

    def deliver(self, moved: Moved) -> Any:
        return moved.batch
