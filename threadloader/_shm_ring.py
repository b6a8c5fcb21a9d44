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

import io
import mmap
import os
import pickle
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from threadloader._finalizers import DeathNotices

#: Tensors start at multiples of this many bytes inside a slot (cache line; any dtype's size).
ALIGN = 64
#: A slot is this much larger than the batch it was sized from, so small variations still fit.
HEADROOM = 1.25
#: Slot sizes are multiples of the page size.
PAGE = mmap.PAGESIZE

SlotKey = tuple[int, int]  # (segment id, slot number)
#: One released slot in the mailbox. Writes of at most ``PIPE_BUF`` bytes (>= 512 on POSIX) are
#: atomic, so the pipe only ever holds whole records.
_RECORD = struct.Struct("<ii")
_RECORDS_PER_WRITE = 512 // _RECORD.size


def _round_up(n: int, to: int) -> int:
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
                    self._resize(_round_up(int(min_bytes * HEADROOM) + ALIGN, PAGE))
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
                    self._creating = 0
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
                data = os.read(self._mailbox, 64 * _RECORD.size * _RECORDS_PER_WRITE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed: the training process is gone, the helper is ending
                self._mailbox = None
                return
            if not data:
                self._mailbox = None
                return
            self._release(_RECORD.iter_unpack(data))

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
    """

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.used = 0
        self.overflowed = False
        self._bytes = slot.bytes_view()

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        start = _round_up(self.used, ALIGN)
        end = start + numel * dtype.itemsize
        if end > self.slot.nbytes:
            self.overflowed = True
            return torch.empty(shape, dtype=dtype)
        self.used = end
        return self._bytes[start:end].view(dtype).view(shape)


# --------------------------------------------------------------------------------------------
# A batch on the wire: the slot, the pickled structure, and where each array lives in the slot.


Layout = tuple[str, int, Any, tuple[int, ...], tuple[int, ...]]
"""Where one leaf of a batch lives in its slot: ``(kind, offset, dtype, shape, stride)``."""


class Packed(NamedTuple):
    """What crosses the pipe for one batch.

    Attributes:
        key: the slot holding the batch's arrays; None when it has none (all pickled).
        payload: the batch pickled, each placed tensor / array replaced by its layout index.
        layout: per placed leaf: ``(kind, offset, dtype, shape, stride)``; ``kind`` is "t" for a
            tensor (stride in elements) or "n" for a numpy array (C order when ``stride`` is
            empty, else its strides in bytes: Fortran order).
    """

    key: SlotKey | None
    payload: bytes
    layout: tuple[Layout, ...]


def _placeable_tensor(obj: object) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
        and not obj.is_conj()
        and not obj.is_neg()
        and not obj.is_quantized
    )


def _placeable_array(obj: object) -> bool:
    return type(obj) is np.ndarray and obj.dtype.kind in "biufc" and not obj.dtype.hasobject


class _LeafPickler(pickle.Pickler):
    """Pickles a batch, setting aside its tensors and numeric numpy arrays by index."""

    def __init__(self, file: io.BytesIO, leaves: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._leaves = leaves
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:  # pickle's hook
        if _placeable_tensor(obj) or _placeable_array(obj):
            index = self._seen.get(id(obj))
            if index is None:
                index = self._seen[id(obj)] = len(self._leaves)
                self._leaves.append(obj)
            return index
        return None


def _tensor_span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last one."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _inside(t: torch.Tensor, slot: Slot) -> int | None:
    """``t``'s byte offset in ``slot`` when it already lives there (collated into it)."""
    if t.numel() == 0:
        return None
    offset = int(t.data_ptr()) - slot.address()
    if 0 <= offset and offset + _tensor_span(t) <= slot.nbytes and offset % t.element_size() == 0:
        return offset
    return None


def _dense_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``empty_like`` would give: a permuted tensor stays permuted, densely."""
    if t.is_contiguous():
        return tuple(t.stride())
    return tuple(torch.empty_like(t, device="meta").stride())


def pack(data: Any, ring: RingWriter, allocator: SlotAllocator | None) -> Packed:
    """Put ``data``'s tensors and arrays into a slot and describe the rest in a small message.

    Args:
        data: the collated batch.
        ring: where slots come from.
        allocator: the slot ``data`` was collated into, if any; released here if not used.

    Returns:
        The message for the training process; the slot it names now belongs to that process.

    Raises:
        Exception: whatever pickling a leaf of ``data`` raises (the batch cannot cross).
    """
    leaves: list[Any] = []
    buf = io.BytesIO()
    try:
        _LeafPickler(buf, leaves).dump(data)
    except BaseException:
        if allocator is not None:
            ring.release([allocator.slot.key])
        raise
    if not leaves:
        if allocator is not None:
            ring.release([allocator.slot.key])
        return Packed(None, buf.getvalue(), ())
    slot, used = None, 0
    if allocator is not None and not allocator.overflowed:
        slot, used = allocator.slot, allocator.used
    layout = _place(leaves, slot, used)
    if layout is None:  # did not fit (or no slot yet): every leaf goes to a big enough slot
        needed = _plan(leaves, None, 0, copy_all=True)[3]
        slot = ring.acquire(max(needed, 1))  # 1: a batch of empty tensors still needs a slot
        assert slot is not None
        layout = _place(leaves, slot, 0, copy_all=True)
        assert layout is not None, "a slot acquired for its size must hold the batch"
        if allocator is not None:  # only now: some leaves were copied out of it
            ring.release([allocator.slot.key])
    assert slot is not None
    return Packed(slot.key, buf.getvalue(), tuple(layout))


def _byte_offset(t: torch.Tensor) -> int:
    """Where ``t`` starts in its storage, in bytes."""
    return int(t.storage_offset()) * t.element_size()


def _nbytes(leaf: Any) -> int:
    if isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    return int(leaf.nbytes)


_Plan = tuple[list[tuple[Any, int, bool]], dict[int, tuple[int, int, int]], dict[int, Any], int]


def _plan(leaves: list[Any], slot: Slot | None, used: int, copy_all: bool) -> _Plan:
    """Where each leaf goes: ``(leaf, offset, needs its own copy)``, the shared spans, and the
    bytes used. Tensors already in ``slot`` stay where they are (unless ``copy_all``)."""
    groups: dict[int, list[torch.Tensor]] = {}
    inside: dict[int, int | None] = {}  # leaf index -> its offset in the slot, if it is there
    storage: dict[int, int] = {}  # leaf index -> its storage, for tensors to copy in
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            inside[i] = None if copy_all or slot is None else _inside(leaf, slot)
            if inside[i] is None and leaf.numel():
                storage[i] = ptr = leaf.untyped_storage().data_ptr()
                groups.setdefault(ptr, []).append(leaf)
    spans: dict[int, tuple[int, int, int]] = {}  # storage -> (slot offset, first byte, end byte)
    plan: list[tuple[Any, int, bool]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            offset = inside[i]
            if offset is not None:
                plan.append((leaf, offset, False))
                continue
            key = storage.get(i)
            shared = groups.get(key) if key is not None else None
            if (
                key is not None
                and shared is not None
                and (len(shared) > 1 or _tensor_span(leaf) < _nbytes(leaf))
            ):
                # Views of one storage, or one whose elements overlap (``expand``): copy the
                # bytes they span and keep their strides, so they stay views as in-process.
                if key not in spans:
                    first = min(_byte_offset(t) for t in shared)
                    first -= first % ALIGN  # keeps every view's alignment
                    end = max(_byte_offset(t) + _tensor_span(t) for t in shared)
                    start = _round_up(used, ALIGN)
                    used = start + end - first
                    spans[key] = (start, first, end)
                start, first, _ = spans[key]
                plan.append((leaf, start + _byte_offset(leaf) - first, False))
                continue
        start = _round_up(used, ALIGN)
        used = start + _nbytes(leaf)
        plan.append((leaf, start, True))
    sources = {key: groups[key][0] for key in spans}
    return plan, spans, sources, used


def _place(
    leaves: list[Any], slot: Slot | None, used: int, copy_all: bool = False
) -> list[Layout] | None:
    """Where each leaf lives in ``slot``, copying in those not there yet; None if they don't fit.

    Tensors that view one storage (``tokens`` and ``tokens[:-1]``) are placed as one copy of
    the bytes they span and keep their strides, so they still share memory on the other side,
    as they do in-process and through torch's worker processes.
    """
    if slot is None:
        return None
    plan, spans, sources, used = _plan(leaves, slot, used, copy_all)
    if used > slot.nbytes:
        return None
    view = slot.bytes_view()
    for key, (start, first, end) in spans.items():
        raw = torch.empty(0, dtype=torch.uint8).set_(sources[key].untyped_storage())
        view[start : start + end - first].copy_(raw[first:end])
    layout: list[Layout] = []
    for leaf, offset, needs_copy in plan:
        if isinstance(leaf, torch.Tensor):
            stride = _dense_stride(leaf) if needs_copy else tuple(leaf.stride())
            if needs_copy and leaf.numel():
                end = offset + leaf.numel() * leaf.element_size()
                dst = view[offset:end].view(leaf.dtype).as_strided(leaf.shape, stride)
                dst.copy_(leaf)
            layout.append(("t", offset, leaf.dtype, tuple(leaf.shape), stride))
            continue
        # numpy: C order, or F order as it is (a transposed batch stays so); 0-d stays 0-d.
        fortran = leaf.flags.f_contiguous and not leaf.flags.c_contiguous
        array = leaf if fortran else np.ascontiguousarray(leaf)
        if array.nbytes:
            dst_np = view[offset : offset + array.nbytes].numpy()
            dst_np[:] = array.ravel(order="A").view(np.uint8)
        layout.append(
            ("n", offset, array.dtype.str, tuple(leaf.shape), leaf.strides if fortran else ())
        )
    return layout


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, load: Callable[[int], Any]) -> None:
        super().__init__(file)
        self._load = load

    def persistent_load(self, pid: Any) -> Any:  # pickle's hook
        return self._load(pid)


class RingReader:
    """The training process's side: maps segments, rebuilds batches, notices released slots.

    Used by the training thread only. The death of a delivered batch, wherever it happens, runs
    no Python code (``_finalizers.DeathNotices``): a Ctrl-C landing in a callback run as the
    loop drops a batch would be lost.
    """

    def __init__(self, mailbox: int | None = None) -> None:
        self._segments: dict[int, Segment] = {}
        self._released: deque[SlotKey] = deque()  # slots of batches never delivered
        self._delivered: DeathNotices[SlotKey] = DeathNotices()
        self._mailbox = mailbox  # write end of the release mailbox (non-blocking), if any
        self._unsent: list[SlotKey] = []  # released while the mailbox was full

    def __repr__(self) -> str:
        return f"<RingReader segments={len(self._segments)} delivered_slots={len(self._delivered)}>"

    def add_segment(self, seg_id: int, slot_bytes: int, count: int, fd: int) -> None:
        """Map a segment the helper announced; closes ``fd``."""
        try:
            segment = Segment.map(seg_id, slot_bytes, count, fd)
        finally:
            os.close(fd)
        segment.array = np.frombuffer(segment.mm, dtype=np.uint8)
        self._segments[seg_id] = segment

    def retire(self, seg_id: int) -> None:
        """Forget a segment the helper dropped; batches still viewing it keep it mapped."""
        self._segments.pop(seg_id, None)

    def unpack(self, packed: Packed) -> Any:
        """Rebuild a batch; its arrays view the slot, which returns to the helper once unused.

        Raises:
            KeyError: the message names a segment that was never announced (a protocol bug).
        """
        key, payload, layout = packed
        if key is None:
            return pickle.loads(payload)
        segment = self._segments[key[0]]
        start = key[1] * segment.slot_bytes
        # A new array object per delivery: every view of this batch keeps it alive, and its
        # death (no view left anywhere) is what releases the slot.
        owner = segment.array[start : start + segment.slot_bytes]
        self._delivered.watch(owner, key)
        base = torch.from_numpy(owner)
        by_dtype: dict[Any, torch.Tensor] = {}
        loaded: dict[int, Any] = {}  # a leaf met twice in the batch is one object, as pickled

        def load(index: int) -> Any:
            leaf = loaded.get(index)
            if leaf is not None:
                return leaf
            kind, offset, dtype, shape, stride = layout[index]
            if kind == "t":
                typed = by_dtype.get(dtype)
                if typed is None:
                    typed = by_dtype[dtype] = base.view(dtype)
                leaf = typed.as_strided(shape, stride, offset // typed.element_size())
            else:
                np_dtype = np.dtype(dtype)
                if stride:  # Fortran order, kept
                    leaf = np.ndarray(shape, np_dtype, buffer=owner, offset=offset, strides=stride)
                else:
                    count = int(np.prod(shape, dtype=np.int64))
                    end = offset + count * np_dtype.itemsize
                    leaf = owner[offset:end].view(np_dtype).reshape(shape)
            loaded[index] = leaf
            return leaf

        return _LeafUnpickler(io.BytesIO(payload), load).load()

    def discard(self, packed: Packed) -> None:
        """Give back the slot of a batch that will never be delivered (a stale epoch's)."""
        if packed.key is not None:
            self._released.append(packed.key)

    def give_back(self, keys: Iterable[SlotKey]) -> None:
        """Give back slots of batches that will never be delivered (an abandoned epoch's)."""
        self._released.extend(keys)

    def send_released(self) -> None:
        """Write the slots released since the last call into the mailbox; never blocks.

        What does not fit (the helper has not needed a slot for a long while) waits here for
        the next call.
        """
        keys = self._unsent + self.take_released()
        self._unsent = []
        if not keys or self._mailbox is None:
            return
        for start in range(0, len(keys), _RECORDS_PER_WRITE):
            chunk = keys[start : start + _RECORDS_PER_WRITE]
            try:
                os.write(self._mailbox, b"".join(_RECORD.pack(*k) for k in chunk))
            except (BlockingIOError, InterruptedError):
                self._unsent = keys[start:]
                return
            except OSError:  # the helper is gone: the next message to it says so
                self._mailbox = None
                return

    def take_released(self) -> list[SlotKey]:
        """Slots whose batches died since the last call, for the helper to reuse."""
        out = self._delivered.take()
        released = self._released
        while released:
            out.append(released.popleft())
        return out
