"""Pack a batch into a slot: its tensors and arrays placed in the slot, the rest pickled around them.

``pack`` is the helper's half (``shm_ring`` point 3: a batch collated straight into its slot is
placed where it already lies); ``ring_reader.RingReader.unpack`` is the training process's half.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import numpy as np
import torch

from threadloader.isolation.shm_ring import (
    ALIGN,
    RingWriter,
    Slot,
    SlotAllocator,
    SlotKey,
    round_up,
)

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
                    start = round_up(used, ALIGN)
                    used = start + end - first
                    spans[key] = (start, first, end)
                start, first, _ = spans[key]
                plan.append((leaf, start + _byte_offset(leaf) - first, False))
                continue
        start = round_up(used, ALIGN)
        used = start + _nbytes(leaf)
        plan.append((leaf, start, True))
    # Distinct storages may start at one address (``torch.from_numpy`` of ``a[:4]`` and of
    # ``a``): the largest holds every byte the group's tensors span.
    sources = {key: max(groups[key], key=_storage_nbytes) for key in spans}
    return plan, spans, sources, used


def _storage_nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


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
