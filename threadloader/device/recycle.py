"""Pageable memory for collated batches, reused once the batch that used it is garbage.

Why: stacking a large batch into fresh memory costs more than the copy itself. A 16x3x512x512
float32 batch is 48 MiB; memory that large comes from ``mmap`` and goes back with ``munmap``, so
every batch pays a page fault and a page of zeroes per 4 KiB, twice the cost of the copy
(measured on 2 cores: ~19 ms to stack 48 MiB into new memory, ~6 ms into reused memory; two
worker threads delivered 11-15% more of these batches with reused memory). torch's worker
processes pay the same, into new shared-memory files.

How it stays safe: a batch handed to the user may live as long as the user likes, so memory is
reused only when nothing can reach it any more. Each buffer is a numpy array ``base`` that the
allocator keeps; the tensor it returns is ``torch.from_numpy`` of a fresh view ``owner`` of
``base``, and torch's storage holds ``owner`` until the last tensor sharing that storage (slices,
``.view()``, ``.numpy()`` of them included) is freed. The death of ``owner`` then makes ``base``
reusable. What can reach the memory is exactly what keeps ``owner`` alive.

Where the code disagrees with these points, the code is wrong:

1. A tensor from ``__call__`` never shares memory with any other tensor from ``__call__`` that
   is still reachable.
2. Buffers below ``min_bytes`` are not pooled (``torch.empty``): malloc recycles small blocks well,
   and a finalizer per small batch would cost more than it saves.
3. At most ``max_free`` unused buffers are kept (the oldest go first), so the pool holds at most
   that many batches' worth of memory beyond what is in use.
4. The death of a batch runs no Python code (``_finalizers.DeathNotices``): it happens on the
   training thread whenever the loop drops a batch, and a Ctrl-C landing in Python code run
   there would be lost. The buffers of dead batches join the free list at the next allocation
   (or ``free_buffers()``), so until then they are held beyond ``max_free``: at most the batches
   that died since the last allocation.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from threadloader._primitives.finalizers import DeathNotices
from threadloader.device.gathered import Gathered, mark_default_collate
from threadloader.device.pinned import pinned_collate

#: Smallest batch tensor worth pooling (see point 2).
MIN_BYTES = 1 << 20
#: Alignment of pooled memory, as torch's own CPU allocator aligns (vectorised kernels).
ALIGN = 64


class RecyclingAllocator:
    """``allocator(shape, dtype)`` for ``pinned_collate``: pageable memory, recycled safely.

    Args:
        max_free: most unused buffers kept for reuse (point 3).
        min_bytes: smaller tensors come from ``torch.empty`` (point 2).

    Attributes:
        stacks_only: tells ``pinned_collate`` that only the tensors it stacks need this memory;
            what torch's collate functions build otherwise (numbers, user types) is already
            ordinary memory and is kept as built, not copied.
        fresh_below: ``min_bytes``: ``pinned_collate`` may let torch allocate smaller tensors.
        hits: allocations served from a reused buffer.
        misses: allocations that needed new memory.
    """

    stacks_only = True

    def __init__(self, max_free: int, min_bytes: int = MIN_BYTES) -> None:
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self._max_free = max_free
        self._min_bytes = self.fresh_below = min_bytes
        self._lock = threading.Lock()
        self._free: deque[np.ndarray] = deque()  # under _lock
        self._in_use: DeathNotices[np.ndarray] = DeathNotices()  # under _lock
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return (
            f"<RecyclingAllocator free={len(self._free)}/{self._max_free} "
            f"hits={self.hits} misses={self.misses}>"
        )

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self._min_bytes:
            return torch.empty(shape, dtype=dtype)
        base = self._take(nbytes)
        if base is None:
            base = np.empty(nbytes + ALIGN, dtype=np.uint8)
        start = -base.ctypes.data % ALIGN
        owner = base[start : start + nbytes]  # a new array object: lives as long as the batch
        with self._lock:
            self._in_use.watch(owner, base)
        return torch.from_numpy(owner).view(dtype).view(shape)

    def free_buffers(self) -> int:
        """How many unused buffers are kept now (after taking in those returned since)."""
        with self._lock:
            self._drain_locked()
            return len(self._free)

    def _take(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            self._drain_locked()
            for i, base in enumerate(self._free):
                if base.nbytes == nbytes + ALIGN:
                    del self._free[i]
                    self.hits += 1
                    return base
            self.misses += 1
            return None

    def _drain_locked(self) -> None:
        self._free.extend(self._in_use.take())
        while len(self._free) > self._max_free:
            self._free.popleft()


def _sample_bytes(sample: Any) -> int:
    """Bytes of the tensors and arrays at the top level of one sample (a cheap lower bound).

    Runs once per batch: exact types first (a tensor, a tuple or list of them), the abstract
    ones (``Mapping``, ``Sequence``: slower ``isinstance``) only when those fail. Sparse and
    nested tensors (no ``nbytes``) count as 0: collation then reports them as torch does.
    """
    kind = type(sample)
    if kind is torch.Tensor or kind is np.ndarray:
        return _bytes(sample)
    if kind is tuple or kind is list:
        values = sample
    elif isinstance(sample, (torch.Tensor, np.ndarray)):
        return _bytes(sample)
    elif isinstance(sample, Mapping):
        values = list(sample.values())
    elif isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        values = sample
    else:
        return 0
    total = 0
    for value in values:
        if isinstance(value, (torch.Tensor, np.ndarray)):
            total += _bytes(value)
    return total


def _bytes(value: torch.Tensor | np.ndarray) -> int:
    if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.is_nested):
        return 0
    return int(value.nbytes)


class RecyclingCollate:
    """``default_collate``, stacking large batches into recycled memory.

    In the training thread (``num_workers=0``, ``as_worker=False``) a batch whose tensors come to
    less than ``min_bytes`` (judged from its first sample's top level) goes to torch's
    ``default_collate`` as it is: for small batches the dispatch in Python of ``pinned_collate``
    costs more (measured: +4 us on a 16 x 2049 int64 batch, 3% of a token-window batch) than
    fresh memory does. In worker threads every batch goes through ``pinned_collate`` with
    ``as_worker=True``: torch's workers stack into a contiguous tensor of the first sample's
    dtype, which torch's ``default_collate`` does only where it sees worker info, and then in
    shared memory (below ``min_bytes``, ``fresh_below``, a plain stack checked to be that result).

    Args:
        allocator: the loader's ``RecyclingAllocator``.
        as_worker: collate as a DataLoader worker does (``memory.pinned_collate``).
    """

    def __init__(self, allocator: RecyclingAllocator, as_worker: bool = False) -> None:
        self.allocator = allocator
        self.as_worker = as_worker
        mark_default_collate(self, allocator, as_worker)

    def __repr__(self) -> str:
        return f"<default_collate into {self.allocator!r}{' as a worker' * self.as_worker}>"

    def __call__(self, batch: Any) -> Any:
        # Stacked batches come only to a worker's collate (stack_into): the first test.
        if self.as_worker or type(batch) is Gathered:
            return pinned_collate(batch, self.allocator, as_worker=self.as_worker)
        if (
            isinstance(batch, Sequence)
            and batch
            and len(batch) * _sample_bytes(batch[0]) >= self.allocator._min_bytes
        ):
            return pinned_collate(batch, self.allocator)
        return default_collate(batch)  # small batches, and torch's own errors for odd ones
