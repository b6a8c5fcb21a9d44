"""Large default-collated batches reuse dropped memory, and never memory something still reaches.

Expected batches come from torch's DataLoader on the same dataset; the allocator's ``hits`` show
that memory was reused, and the safety tests keep slices, numpy views and whole batches alive
while the loader keeps allocating, then check every kept value against torch's.
"""

from __future__ import annotations

import collections.abc
import threading
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from helpers import assert_batches_equal, torch_loader
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader
from threadloader.device import recycle
from threadloader.device.recycle import ALIGN, MIN_BYTES, RecyclingAllocator


class BigItems(Dataset[dict[str, object]]):
    """Items whose image stacks to ~2 MiB per batch of 8 (pooled) plus small fields (not)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, object]:
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.rand(3, 128, 128, generator=g),
            "mask": np.arange(256 * 256, dtype=np.int64).reshape(256, 256) % (i + 2) == 0,
            "label": i,
            "name": f"item{i}",
        }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_equal_torch_and_memory_is_reused(num_workers: int) -> None:
    expected = list(torch_loader(BigItems(), batch_size=8))
    loader = ThreadDataLoader(BigItems(), batch_size=8, num_workers=num_workers)
    for _ in range(2):
        for ours, theirs in zip(loader, expected, strict=True):
            assert_batches_equal(ours, theirs)
            del ours  # dropped: its memory may serve a later batch
    assert loader._recycler.hits > 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_memory_still_reachable_is_never_reused(num_workers: int) -> None:
    """Slices, numpy views and whole batches kept by the loop keep their values."""
    expected = list(torch_loader(BigItems(), batch_size=8))
    loader = ThreadDataLoader(BigItems(), batch_size=8, num_workers=num_workers)
    kept: list[tuple[int, str, object]] = []
    for epoch in range(3):
        for i, batch in enumerate(loader):
            if i % 3 == 0:
                kept.append((i, "slice", batch["image"][1:3]))
            elif i % 3 == 1:
                kept.append((i, "numpy", batch["mask"].numpy()))
            elif epoch == 0:
                kept.append((i, "batch", batch))
    for i, kind, value in kept:
        if kind == "slice":
            assert torch.equal(value, expected[i]["image"][1:3])  # type: ignore[arg-type]
        elif kind == "numpy":
            assert np.array_equal(value, expected[i]["mask"].numpy())  # type: ignore[arg-type]
        else:
            assert_batches_equal(value, expected[i])
    assert loader._recycler.hits > 0  # the batches not kept were recycled meanwhile


def test_small_batches_come_from_torch() -> None:
    loader = ThreadDataLoader(list(range(64)), batch_size=8, num_workers=2)
    assert [b.tolist() for b in loader] == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert loader._recycler.hits == loader._recycler.misses == 0


def test_custom_collate_fn_is_left_alone() -> None:
    def collate(batch: list[dict[str, object]]) -> list[dict[str, object]]:
        return batch

    loader = ThreadDataLoader(BigItems(), batch_size=8, num_workers=2, collate_fn=collate)
    assert all(isinstance(b, list) for b in loader)
    assert loader._recycler.misses == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_tensors_have_the_requested_shape_dtype_and_alignment(dtype: torch.dtype) -> None:
    alloc = RecyclingAllocator(max_free=2)
    shape = (4, 512, 600)
    t = alloc(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % ALIGN == 0
    t.fill_(1)
    assert bool((t == 1).all())


def test_free_list_is_bounded_and_oldest_buffers_go_first() -> None:
    alloc = RecyclingAllocator(max_free=2)
    live = [alloc((MIN_BYTES,), torch.uint8) for _ in range(5)]
    assert alloc.misses == 5 and alloc.free_buffers() == 0
    del live
    assert alloc.free_buffers() == 2
    again = [alloc((MIN_BYTES,), torch.uint8) for _ in range(3)]
    assert alloc.hits == 2 and alloc.misses == 6
    assert len({t.data_ptr() for t in again}) == 3


def test_a_buffer_is_not_reused_for_another_size() -> None:
    alloc = RecyclingAllocator(max_free=2)
    t = alloc((MIN_BYTES,), torch.uint8)
    del t
    u = alloc((2 * MIN_BYTES,), torch.uint8)
    assert alloc.hits == 0 and u.numel() == 2 * MIN_BYTES


def test_finalizer_while_the_lock_is_held_does_not_deadlock() -> None:
    """A batch freed by garbage collection inside the allocator's own critical section."""
    alloc = RecyclingAllocator(max_free=4)
    t = alloc((MIN_BYTES,), torch.uint8)
    with alloc._lock:  # as if cyclic GC ran the finalizer during _take, in the same thread
        del t
    assert alloc.free_buffers() == 1  # taken in later, at the next drain


@pytest.mark.timeout(60)
def test_threads_never_get_memory_another_live_tensor_uses() -> None:
    alloc = RecyclingAllocator(max_free=3)
    errors: list[str] = []

    def work(seed: int) -> None:
        held: list[tuple[torch.Tensor, int]] = []
        for step in range(300):
            t = alloc((MIN_BYTES // 8,), torch.int64)
            value = seed * 1000 + step
            t.fill_(value)
            held.append((t, value))
            if len(held) > 2:
                old, v = held.pop(0)
                if not bool((old == v).all()):
                    errors.append(f"thread {seed}: a held tensor was overwritten")
                del old

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert alloc.hits > 0


class _Pair(NamedTuple):
    image: torch.Tensor
    label: int


class _Row(collections.abc.Sequence):  # type: ignore[type-arg]
    def __init__(self, *values: Any) -> None:
        self._values = values

    def __getitem__(self, i: Any) -> Any:
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        (torch.zeros(4, dtype=torch.int64), 32),
        (np.zeros(3, dtype=np.float32), 12),
        ((torch.zeros(2), torch.zeros(3)), 20),
        ([torch.zeros(2), "text", 7], 8),
        ({"x": torch.zeros(5), "y": np.zeros(2, dtype=np.int8)}, 22),
        (_Pair(torch.zeros(6), 1), 24),
        (_Row(torch.zeros(1), np.zeros(1)), 12),
        ("a string", 0),
        (3.5, 0),
    ],
    ids=["tensor", "array", "tuple", "list", "dict", "namedtuple", "sequence", "str", "float"],
)
def test_size_check_counts_top_level_tensors_of_every_sample_kind(
    sample: Any, expected: int
) -> None:
    """The per-batch size check (which collate path to take) sees the same bytes for every kind."""
    assert recycle._sample_bytes(sample) == expected
