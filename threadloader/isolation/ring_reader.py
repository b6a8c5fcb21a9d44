"""The training process's side of the slot ring: maps the helper's segments, rebuilds each batch as
views of its slot, and gives a slot back once no view of it is left (``shm_ring`` point 4).
"""

from __future__ import annotations

import io
import os
import pickle
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from threadloader._primitives.finalizers import DeathNotices
from threadloader.isolation.packing import Packed
from threadloader.isolation.shm_ring import RECORD, RECORDS_PER_WRITE, Segment, SlotKey


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
                # Through the tensor: numpy shortens a view's base to the array that owns the
                # memory (the segment's), which would let ``owner`` die, and the slot go back,
                # while the leaf still views it; a tensor holds ``owner``, and ends the chain.
                held = base.numpy()
                np_dtype = np.dtype(dtype)
                if stride:  # Fortran order, kept
                    leaf = np.ndarray(shape, np_dtype, buffer=held, offset=offset, strides=stride)
                else:
                    count = int(np.prod(shape, dtype=np.int64))
                    end = offset + count * np_dtype.itemsize
                    leaf = held[offset:end].view(np_dtype).reshape(shape)
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
        for start in range(0, len(keys), RECORDS_PER_WRITE):
            chunk = keys[start : start + RECORDS_PER_WRITE]
            try:
                os.write(self._mailbox, b"".join(RECORD.pack(*k) for k in chunk))
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
