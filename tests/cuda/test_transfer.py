"""On a CUDA device: batches arrive complete, pinned where expected, uncorrupted, without a sync.

Skips itself where torch has no CUDA. The race tests delay the GPU with ``torch.cuda._sleep`` so
that a missing ``wait_event``, ``record_stream`` or event-gated pool release would corrupt data
deterministically rather than once in a while.
"""

from __future__ import annotations

import collections
import copy
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from threadloader import ThreadDataLoader
from threadloader.memory import (
    BufferPool,
    pin_batch,
    pinned_allocator,
    pinned_collate,
)
from threadloader.transfer import DevicePrefetcher, device_from_arg

DEVICE = torch.device("cuda", torch.cuda.current_device())
#: About 1 ms of GPU time at ~2 GHz: long enough to hold a stream while the host runs ahead.
SLEEP_CYCLES = 2_000_000


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


def assert_batches_equal(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Same types, keys, dtypes, shapes, devices and values (tests/helpers.py is not importable
    from this folder under every pytest invocation, so this is a small local version)."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.device) == (theirs.dtype, theirs.shape, theirs.device)
        assert torch.equal(ours, theirs), f"{path}: values differ"
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys differ"
        for k in theirs:
            assert_batches_equal(ours[k], theirs[k], f"{path}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_batches_equal(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def to_cpu(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, dict):
        return {k: to_cpu(v) for k, v in data.items()}
    if isinstance(data, Pair):
        return Pair(*(to_cpu(v) for v in data))
    if isinstance(data, list):
        return [to_cpu(v) for v in data]
    return data


def tensors_in(data: Any) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, dict):
        for v in data.values():
            yield from tensors_in(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from tensors_in(v)


def host_batches(n: int) -> list[Any]:
    samples = [
        [
            {
                "pair": Pair(torch.full((3, 8, 8), float(b * 10 + i)), torch.tensor(b * 10 + i)),
                "tokens": torch.arange(5, dtype=torch.int32) + b,
                "name": f"b{b}i{i}",
            }
            for i in range(4)
        ]
        for b in range(n)
    ]
    return [pinned_collate(s, pinned_allocator) for s in samples]


def test_values_on_the_device_equal_the_host_batch() -> None:
    """Every tensor arrives on the device with the host batch's values; strings pass through."""
    batches = host_batches(6)
    expected = copy.deepcopy(batches)  # taken before any copy to the device
    with_device = list(DevicePrefetcher(iter(batches), "cuda"))
    for ours, theirs in zip(with_device, expected, strict=True):
        for t in tensors_in(ours):
            assert t.device == DEVICE
        assert_batches_equal(to_cpu(ours), theirs)


def test_cuda_resolves_to_the_current_device() -> None:
    """device="cuda" means the caller's current device, not the transfer thread's."""
    assert device_from_arg("cuda") == DEVICE
    with pytest.raises(ValueError, match="no CUDA device"):
        device_from_arg(f"cuda:{torch.cuda.device_count()}")


def test_pinned_collate_output_is_pinned() -> None:
    """With pinned_allocator every collated tensor is page-locked, and equals default_collate."""
    samples = [{"x": torch.rand(3, 4), "y": i, "z": [1.5, torch.ones(2)]} for i in range(5)]
    ours = pinned_collate(samples, pinned_allocator)
    assert_batches_equal(ours, default_collate(samples))
    assert all(t.is_pinned() for t in tensors_in(ours))


def test_pin_batch_equals_torch_pin_memory() -> None:
    """pin_batch gives torch's pin_memory result: values, strides, and pinned memory."""
    data = {
        "permuted": torch.arange(12.0).reshape(3, 4).t(),
        "list": [torch.ones(3), "s", (torch.zeros(1), 2)],
        "pinned": torch.ones(2).pin_memory(),
    }
    ours = pin_batch(data, pinned_allocator)
    theirs = torch_pin_memory(data)
    assert_batches_equal(ours, theirs)
    assert ours["permuted"].stride() == theirs["permuted"].stride()
    assert all(t.is_pinned() for t in tensors_in(ours))
    assert ours["pinned"] is data["pinned"]


def test_pool_buffers_are_pinned() -> None:
    """A default BufferPool hands out page-locked host buffers."""
    assert BufferPool().acquire((16, 4), torch.float32).is_pinned()


def test_batch_is_complete_when_read_on_another_stream() -> None:
    """A batch read on a side stream right after next() holds the copied values."""
    batches = [torch.full((1 << 20,), float(i), pin_memory=True) for i in range(8)]
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for batch in DevicePrefetcher(iter(batches), DEVICE):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            sums.append(batch.sum())
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [float(i * (1 << 20)) for i in range(8)]


def test_no_corruption_when_the_consumer_frees_and_reallocates() -> None:
    """The SPDL PR #1082 race: a batch dropped while kernels still read it is not recycled.

    Each step queues a slow kernel that reads the batch, drops the batch at once and allocates
    fresh device memory; meanwhile the transfer thread allocates the next batches. Without
    record_stream the side stream could reuse the dropped batch's block and overwrite it
    before the slow kernel reads it.
    """
    n, steps = 1 << 22, 24  # 16 MB int32 batches
    pool = BufferPool()

    def source() -> Iterator[torch.Tensor]:
        for i in range(steps):
            buf = pool.acquire((n,), torch.int32)
            buf.fill_(i)
            yield buf

    sums = []
    for batch in DevicePrefetcher(source(), DEVICE, depth=2, pool=pool):
        torch.cuda._sleep(SLEEP_CYCLES * 3)  # the batch's reader starts late
        sums.append(batch.sum())
        del batch
        junk = torch.empty(n, dtype=torch.int32, device=DEVICE).fill_(-7)  # grab freed blocks
        del junk
    torch.cuda.synchronize()
    assert [int(s.item()) for s in sums] == [i * n for i in range(steps)]


def test_pooled_staging_buffer_is_not_reused_before_its_copy() -> None:
    """A pooled host buffer is handed out again only after the copy that reads it ran.

    The source delays the prefetcher's stream before each copy, so the copy of buffer i runs
    late; were the pool to hand buffer i out before the copy's event, the source would refill
    it with i + 1 before the copy read it.
    """
    n, steps = 1 << 20, 16
    pool = BufferPool()

    def source() -> Iterator[torch.Tensor]:
        for i in range(steps):
            buf = pool.acquire((n,), torch.int64)
            buf.fill_(i)
            torch.cuda._sleep(SLEEP_CYCLES)  # runs on the transfer thread's stream: delays the copy
            yield buf

    sums = [batch.sum() for batch in DevicePrefetcher(source(), DEVICE, depth=3, pool=pool)]
    torch.cuda.synchronize()
    assert [int(s.item()) for s in sums] == [i * n for i in range(steps)]
    pool.wait_pending()
    assert pool.stats().pending == 0


def test_steady_state_never_synchronizes_the_host() -> None:
    """Between batches neither the consumer nor the transfer thread makes the host wait on the GPU."""
    pool = BufferPool()
    shapes = {"x": (64, 3, 32, 32), "y": (64,)}

    def source() -> Iterator[dict[str, torch.Tensor]]:
        i = 0
        while True:
            batch = {k: pool.acquire(s, torch.float32) for k, s in shapes.items()}
            for t in batch.values():
                t.fill_(i)
            yield batch
            i += 1

    prefetcher = DevicePrefetcher(source(), DEVICE, depth=2, pool=pool)
    acc = torch.zeros((), device=DEVICE)
    for _ in range(5):  # warm up: caching allocators and the pool fill
        acc += next(prefetcher)["x"].sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            batch = next(prefetcher)
            acc += batch["x"].mean() + batch["y"].sum()
            del batch
    finally:
        torch.cuda.set_sync_debug_mode("default")
        prefetcher.close()
    torch.cuda.synchronize()
    assert torch.isfinite(acc).item()


def test_pool_is_hit_in_the_steady_state() -> None:
    """Pageable batches are staged through pooled pinned buffers, which get reused."""
    pool = BufferPool()
    batches = ({"x": torch.full((256, 1024), float(i))} for i in range(40))
    sums = [b["x"].sum() for b in DevicePrefetcher(batches, DEVICE, pool=pool)]
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [float(i * 256 * 1024) for i in range(40)]
    stats = pool.stats()
    assert stats.hits >= 30, stats
    assert stats.misses <= 10, stats


def test_already_pinned_batches_are_not_staged() -> None:
    """A pinned host batch is copied from where it is: the pool is not asked for a buffer."""
    pool = BufferPool()
    batches = [torch.ones(1024, pin_memory=True) for _ in range(4)]
    out = [b.sum() for b in DevicePrefetcher(iter(batches), DEVICE, pool=pool)]
    torch.cuda.synchronize()
    assert [o.item() for o in out] == [1024.0] * 4
    assert pool.stats().misses == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_batches_land_on_the_requested_device() -> None:
    """device="cuda:1" puts every tensor on device 1 whatever the current device is."""
    batches = [torch.ones(4, pin_memory=True) * i for i in range(3)]
    out = list(DevicePrefetcher(iter(batches), "cuda:1"))
    assert all(b.device == torch.device("cuda", 1) for b in out)
    torch.cuda.synchronize(1)
    assert [b.sum().item() for b in out] == [0.0, 4.0, 8.0]


class Images(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 16, 16), float(i)), i


def test_loader_pin_memory_batches_are_pinned() -> None:
    """ThreadDataLoader(pin_memory=True) delivers page-locked batches equal to DataLoader's."""
    ours = list(ThreadDataLoader(Images(), batch_size=8, num_workers=2, pin_memory=True))
    theirs = list(DataLoader(Images(), batch_size=8))
    for a, b in zip(ours, theirs, strict=True):
        assert_batches_equal(a, b)
        assert all(t.is_pinned() for t in tensors_in(a))


@pytest.mark.skipif(
    "device" not in inspect.signature(ThreadDataLoader).parameters,
    reason="ThreadDataLoader has no device= option yet",
)
def test_loader_device_batches_equal_dataloader_batches() -> None:
    """ThreadDataLoader(device="cuda") delivers DataLoader's batches, on the device."""
    loader: Any = ThreadDataLoader(Images(), batch_size=8, num_workers=2, device="cuda")
    theirs = list(DataLoader(Images(), batch_size=8))
    count: collections.Counter[str] = collections.Counter()
    for a, b in zip(loader, theirs, strict=True):
        for t in tensors_in(a):
            assert t.device == DEVICE
            count["tensors"] += 1
        assert_batches_equal(to_cpu(a), b)
    assert count["tensors"] == 2 * len(theirs)


@pytest.mark.parametrize("option", ["pin_memory", "device"])
def test_helper_processes_of_a_process_using_cuda_deliver_dataloaders_batches(
    option: str,
) -> None:
    """Helpers forked from a process that already initialised CUDA never call CUDA themselves
    (a forked child cannot): over two epochs the batches are DataLoader's, pinned or on the
    device, from ``isolation="process"``."""
    torch.zeros(1, device=DEVICE)  # CUDA initialised in this process before the helpers fork
    kwargs: dict[str, Any] = {"pin_memory": True} if option == "pin_memory" else {"device": "cuda"}
    loader: Any = ThreadDataLoader(
        Images(), batch_size=8, num_workers=2, isolation="process", helpers=2,
        persistent_workers=True, **kwargs,
    )  # fmt: skip
    theirs = list(DataLoader(Images(), batch_size=8))
    for _ in range(2):
        ours = list(loader)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            for t in tensors_in(a):
                if option == "pin_memory":
                    assert t.is_pinned()
                else:
                    assert t.device == DEVICE
            assert_batches_equal(to_cpu(a), b)
