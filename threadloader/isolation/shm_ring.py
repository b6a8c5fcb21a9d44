"""The shared-memory slot ring between the isolation helper process and the training process.

A batch made in the helper reaches the training process without being pickled: its tensors are
written into a *slot* of shared memory, and only a small message crosses the pipe (the slot,
the batch's structure pickled with each tensor replaced by ``(offset, dtype, shape, stride)``,
and the small non-tensor leaves). torch's DataLoader instead creates one shared-memory file per
tensor per batch and passes its descriptor, which for cheap items costs more than the item.

How the ring behaves; where the code disagrees with this, the code is wrong.

1. Memory. A *segment* is one anonymous shared-memory file (``memfd_create``; elsewhere a temp
   file unlinked at once) split into ``count`` equal slots. The helper creates segments and
   sends their descriptors over the result socket (``SCM_RIGHTS``); nothing has a name, so
   nothing is left behind when either process dies, even by SIGKILL. Pages are allocated on
   first touch and free slots are reused last-freed-first, so spare slots cost address space,
   not memory.
2. Sizing. Slots are sized from the first batch (collated into ordinary memory, then copied into
   the first segment, with ``HEADROOM``). A later batch that does not fit makes a segment of
   bigger slots; segments of smaller slots are retired and unmapped once their slots come back.
   When every slot is in use a segment as large as all live ones is added, so a training loop
   that keeps batches (``list(loader)``) never blocks the helper.
3. Collate into the slot. For ``default_collate`` the helper takes a slot *before* collating and
   stacks each tensor straight into it (``SlotAllocator`` with ``memory.pinned_collate``): one
   copy, as in-process. Other collate functions run as written and their tensors are copied in.
4. Ownership: return-on-release, not copy-out. A slot handed to the training process belongs to
   it until every tensor (and numpy array) viewing it is gone: each delivery wraps its slot in a
   fresh numpy array that all of the batch's views keep alive (``torch.from_numpy``), and a weak
   reference to that array tells the reader when the last view died. Only then is the slot
   given back to the helper (``take_released``). So a delivered batch never aliases memory the
   helper may overwrite, and costs no copy in the training thread, whose time is what isolation
   exists to protect. (Copy-out would cost a memcpy per batch in the training thread, ~5 ms for
   a 50 MB batch; with ``pin_memory`` the batch is copied into page-locked memory anyway, and
   that copy releases the slot at once.)
5. Released slots travel back through a *mailbox*: a non-blocking pipe of fixed-size records
   that no thread waits on. The training process writes to it when it sends a task; the helper
   reads it when it takes a slot. So a release wakes no thread (a wake-up per batch costs a GIL
   hand-off in the helper), reaches the ring exactly when a slot is needed, and the pipe's
   syscalls order the training process's last reads of a slot before the helper's next write.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

#: Tensors start at multiples of this many bytes inside a slot (cache line; any dtype's size).
ALIGN = 64
#: A slot is this much larger than the batch it was sized from, so small variations still fit.
HEADROOM = 1.25
#: Slot sizes are multiples of the page size.
PAGE = mmap.PAGESIZE

SlotKey = tuple[int, int]  # (segment id, slot number)
#: One released slot in the mailbox. Writes of at most ``PIPE_BUF`` bytes (>= 512 on POSIX) are
#: atomic, so the pipe only ever holds whole records.
RECORD = struct.Struct("<ii")
RECORDS_PER_WRITE = 512 // RECORD.size


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _anonymous_file(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of shared memory that has no name anywhere."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("threadloader-ring", os.MFD_CLOEXEC)
    else:  # macOS and other POSIX systems: a temp file unlinked at once
        fd, path = tempfile.mkstemp(prefix="threadloader-ring-")
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(eq=False)
class Segment:
    """One shared-memory file split into ``count`` slots of ``slot_bytes`` each.

    Attributes:
        seg_id: number of this segment in its ring, unique for the ring's life.
        slot_bytes: size of each slot, a multiple of the page size.
        count: number of slots.
        mm: the mapping; unmapped when the last view of it is gone.
    """

    seg_id: int
    slot_bytes: int
    count: int
    mm: mmap.mmap
    in_use: int = 0  # helper side: slots handed out and not yet released
    retired: bool = False  # helper side: no slot of it will be handed out again
    u8: torch.Tensor = field(init=False)  # the whole segment as bytes (helper side)
    views: list[torch.Tensor | None] = field(init=False)  # each slot's bytes, made on first use
    array: np.ndarray[Any, np.dtype[np.uint8]] = field(init=False)  # (training side)

    @classmethod
    def map(cls, seg_id: int, slot_bytes: int, count: int, fd: int) -> Segment:
        """Map an existing segment file; ``fd`` may be closed afterwards."""
        mm = mmap.mmap(fd, slot_bytes * count, flags=mmap.MAP_SHARED)
        return cls(seg_id, slot_bytes, count, mm)


class Slot(NamedTuple):
    """One slot of a segment, held by whoever acquired it until released."""

    segment: Segment
    number: int

    @property
    def key(self) -> SlotKey:
        return (self.segment.seg_id, self.number)

    @property
    def nbytes(self) -> int:
        return self.segment.slot_bytes

    def bytes_view(self) -> torch.Tensor:
        """The slot as a uint8 tensor sharing its memory (helper side); made once per slot."""
        segment = self.segment
        view = segment.views[self.number]
        if view is None:
            start = self.number * segment.slot_bytes
            view = segment.views[self.number] = segment.u8[start : start + segment.slot_bytes]
        return view

    def address(self) -> int:
        return int(self.segment.u8.data_ptr()) + self.number * self.segment.slot_bytes


class RingWriter:
    """The helper's side: creates segments, hands out free slots, takes back released ones.

    Thread-safe: worker threads acquire, the helper's main thread releases. The lock is never
    held while announcing a segment (a pipe write that waits for the training process to
    read), so the main thread, which only ever takes the lock briefly, keeps reading tasks.

    Args:
        announce: called with each new segment and its descriptor before any slot of it is
            handed out, so the training process maps a segment before it reads a batch from it.
        slots_per_segment: slots of the first segment of each size: the batches in flight plus
            a few held by the training loop.
    """

    def __init__(
        self,
        announce: Callable[[Segment, int], None],
        slots_per_segment: int,
        mailbox: int | None = None,
    ) -> None:
        self._announce = announce
        self._mailbox = mailbox  # read end of the release mailbox (non-blocking), if any
        self._per_segment = max(2, slots_per_segment)
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._free: list[SlotKey] = []  # free slots of live segments; popped last-freed-first
        self._retired: list[int] = []  # dropped segments the training process may forget
        self._slot_bytes = 0  # 0 until the first batch sized the ring
        self._next_id = 0
        self._creating = 0  # slot size of the segment a thread is creating, outside the lock
        self._added = threading.Condition(self._lock)

    def __repr__(self) -> str:
        live = [s for s in self._segments.values() if not s.retired]
        return (
            f"<RingWriter slot_bytes={self._slot_bytes} segments={len(self._segments)} "
            f"live_slots={sum(s.count for s in live)} free={len(self._free)}>"
        )

    @property
    def slot_bytes(self) -> int:
        """Current slot size; 0 before the first batch."""
        return self._slot_bytes

    def acquire(self, min_bytes: int = 0) -> Slot | None:
        """A free slot of at least ``min_bytes``: reused, or from a new segment.

        Args:
            min_bytes: bytes the batch needs; 0 when not known yet (collating into the slot).

        Returns:
            A slot now owned by the caller, or None when ``min_bytes`` is 0 and the ring has not
            been sized yet (the caller collates into ordinary memory and asks again).
        """
        while True:
            with self._lock:
                self._read_mailbox()
                if min_bytes > self._slot_bytes:
                    self._resize(round_up(int(min_bytes * HEADROOM) + ALIGN, PAGE))
                elif self._slot_bytes == 0:
                    return None
                while not self._free and self._creating == self._slot_bytes:
                    self._added.wait()  # another thread is making slots of this size: wait
                if min_bytes > self._slot_bytes:
                    continue  # grown meanwhile, but not enough
                if self._free:
                    key = self._free.pop()
                    owner = self._segments[key[0]]
                    owner.in_use += 1
                    return Slot(owner, key[1])
                live = sum(s.count for s in self._segments.values() if not s.retired)
                slot_bytes, count = self._slot_bytes, max(self._per_segment, live)
                seg_id, self._next_id = self._next_id, self._next_id + 1
                self._creating = slot_bytes
            segment: Segment | None = None
            try:
                segment = self._create(seg_id, slot_bytes, count)
            finally:
                with self._lock:
                    if self._creating == slot_bytes:  # else another thread grew the slots and
                        self._creating = 0  # is making the new size's segment: its mark stays
                    if segment is not None:
                        self._segments[seg_id] = segment
                        if slot_bytes == self._slot_bytes:
                            self._free.extend((seg_id, i) for i in reversed(range(count)))
                        else:  # another thread grew the slots meanwhile: never used, drop it
                            segment.retired = True
                            self._drop(segment)
                    self._added.notify_all()

    def release(self, keys: Iterable[SlotKey]) -> None:
        """Take back slots; a retired segment is dropped once all its slots are back."""
        with self._lock:
            self._release(keys)

    def read_mailbox(self) -> None:
        """Take back the slots waiting in the mailbox (when no slot was needed for a while)."""
        with self._lock:
            self._read_mailbox()

    def _read_mailbox(self) -> None:
        if self._mailbox is None:
            return
        while True:
            try:
                data = os.read(self._mailbox, 64 * RECORD.size * RECORDS_PER_WRITE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed: the training process is gone, the helper is ending
                self._mailbox = None
                return
            if not data:
                self._mailbox = None
                return
            self._release(RECORD.iter_unpack(data))

    def _release(self, keys: Iterable[SlotKey]) -> None:
        for key in keys:
            segment = self._segments.get(key[0])
            if segment is None:
                continue
            segment.in_use -= 1
            if not segment.retired:
                self._free.append((key[0], key[1]))
            elif segment.in_use == 0:
                self._drop(segment)

    @property
    def has_retired(self) -> bool:
        """Whether ``take_retired`` has anything (a snapshot, read without the lock)."""
        return bool(self._retired)

    def take_retired(self) -> list[int]:
        """Ids of segments dropped since the last call, for the training process to unmap."""
        with self._lock:
            retired, self._retired = self._retired, []
            return retired

    def _resize(self, slot_bytes: int) -> None:
        self._slot_bytes = slot_bytes
        for segment in list(self._segments.values()):
            segment.retired = True
            if segment.in_use == 0:
                self._drop(segment)
        self._free = []

    def _drop(self, segment: Segment) -> None:
        self._segments.pop(segment.seg_id, None)
        self._retired.append(segment.seg_id)

    def _create(self, seg_id: int, slot_bytes: int, count: int) -> Segment:
        fd = _anonymous_file(slot_bytes * count)
        try:
            segment = Segment.map(seg_id, slot_bytes, count, fd)
            segment.u8 = torch.frombuffer(segment.mm, dtype=torch.uint8)
            segment.views = [None] * count
            self._announce(segment, fd)
        finally:
            os.close(fd)
        return segment


class SlotAllocator:
    """``allocator(shape, dtype)`` for ``memory.pinned_collate``: bump-allocates in one slot.

    A request that does not fit gets ordinary memory and marks the allocator ``overflowed``;
    ``pack`` then moves the whole batch to a bigger slot.

    Attributes:
        stacks_only: ``pinned_collate`` keeps what torch's collate functions build as built;
            ``pack`` copies it into the slot. Nothing is pinned in a helper: that would touch
            CUDA, which a process forked from one that uses CUDA cannot do.
    """

    stacks_only = True

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.used = 0
        self.overflowed = False
        self._bytes = slot.bytes_view()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        start = round_up(self.used, ALIGN)
        end = start + numel * dtype.itemsize
        if end > self.slot.nbytes:
            self.overflowed = True
            return torch.empty(shape, dtype=dtype)
        self.used = end
        return self._bytes[start:end].view(dtype).view(shape)
