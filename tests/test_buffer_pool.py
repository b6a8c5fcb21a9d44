"""BufferPool recycles a buffer by (shape, dtype, device) only once its copy's event completed.

The events are fakes (``query()`` returns what the test says), and the allocator is pageable,
so every rule of the pool is checked here without a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from threadloader.memory import BufferPool, pinned_collate


class FakeEvent:
    """Completes when the test says so; counts synchronize() calls."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def make_pool(**kwargs: object) -> BufferPool:
    return BufferPool(allocate, **kwargs)  # type: ignore[arg-type]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_released_buffer_is_reused_for_the_same_key() -> None:
    """A buffer released without an event is handed out again for the same key: a hit."""
    pool = make_pool()
    a = pool.acquire((4, 3), torch.float32)
    assert pool.release([a]) == 1
    b = pool.acquire((4, 3), torch.float32)
    assert same(a, b)
    assert (pool.stats().hits, pool.stats().misses) == (1, 1)


@pytest.mark.parametrize(
    "other",
    [
        ((4, 4), torch.float32, "cpu"),
        ((4, 3), torch.float64, "cpu"),
        ((4, 3), torch.float32, "meta"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_keys_differ_by_shape_dtype_and_device(other: tuple) -> None:
    """A buffer never serves a request that differs in shape, dtype or device."""
    pool = make_pool()
    a = pool.acquire((4, 3), torch.float32, "cpu")
    pool.release([a])
    shape, dtype, device = other
    b = pool.acquire(shape, dtype, device)
    assert (tuple(b.shape), b.dtype, b.device.type) == (shape, dtype, device)
    assert pool.stats().hits == 0


def test_buffer_waits_for_its_event() -> None:
    """A buffer released with an event is not handed out before event.query() is True."""
    pool = make_pool()
    a = pool.acquire((8,), torch.uint8)
    event = FakeEvent()
    pool.release([a], event)
    assert pool.stats().pending == 1
    b = pool.acquire((8,), torch.uint8)
    assert not same(a, b), "reused while its copy may still read it"
    pool.release([b])  # b itself is free at once
    event.done = True
    c = pool.acquire((8,), torch.uint8)
    d = pool.acquire((8,), torch.uint8)
    assert {c.untyped_storage().data_ptr(), d.untyped_storage().data_ptr()} == {
        a.untyped_storage().data_ptr(),
        b.untyped_storage().data_ptr(),
    }
    assert pool.stats().pending == 0


def test_events_completing_out_of_order_each_free_their_own_buffers() -> None:
    """Each release is gated by its own event, whatever order the events complete in."""
    pool = make_pool()
    first, second = FakeEvent(), FakeEvent()
    a = pool.acquire((2,), torch.int64)
    b = pool.acquire((2,), torch.int64)
    pool.release([a], first)
    pool.release([b], second)
    second.done = True
    c = pool.acquire((2,), torch.int64)
    assert same(c, b)
    assert pool.stats().pending == 1


def test_wait_pending_synchronizes_and_frees() -> None:
    """wait_pending() synchronizes every pending event and makes its buffers reusable."""
    pool = make_pool()
    events = [FakeEvent(), FakeEvent()]
    for event in events:
        pool.release([pool.acquire((3,), torch.float32)], event)
    pool.wait_pending()
    assert [e.synchronized for e in events] == [1, 1]
    assert (pool.stats().pending, pool.stats().free) == (0, 2)


def test_foreign_tensors_are_ignored() -> None:
    """Only buffers the pool handed out come back: a user's tensor is never recycled."""
    pool = make_pool()
    mine = pool.acquire((2, 2), torch.float32)
    theirs = torch.empty(2, 2)
    assert pool.release([theirs, mine, torch.empty(0), torch.ones(2).to_sparse()]) == 1
    assert pool.release([mine]) == 0, "released twice"
    assert pool.stats().free == 1


def test_a_view_returns_its_buffer() -> None:
    """Releasing a view (a batch built from part of a buffer) returns the whole buffer."""
    pool = make_pool()
    buf = pool.acquire((4, 4), torch.float32)
    assert pool.release([buf[1:, :2]]) == 1
    assert same(pool.acquire((4, 4), torch.float32), buf)


def test_dropped_buffers_are_not_tracked() -> None:
    """A buffer the caller drops without releasing is simply freed, not held by the pool."""
    pool = make_pool()
    for _ in range(10):
        pool.acquire((16,), torch.float32)
    assert pool.stats().outstanding == 0


def test_free_buffers_are_bounded_by_count() -> None:
    """The pool retains at most max_buffers buffers; the excess is evicted."""
    pool = make_pool(max_buffers=3)
    bufs = [pool.acquire((5,), torch.float32) for _ in range(5)]
    pool.release(bufs)
    stats = pool.stats()
    assert (stats.free, stats.evicted) == (3, 2)


def test_pending_buffers_count_toward_the_bound() -> None:
    """Buffers awaiting their event count too; the oldest are forgotten past the bound."""
    pool = make_pool(max_buffers=2)
    for _ in range(4):
        pool.release([pool.acquire((5,), torch.float32)], FakeEvent())
    stats = pool.stats()
    assert (stats.pending, stats.evicted) == (2, 2)


def test_free_buffers_are_bounded_by_bytes() -> None:
    """With max_bytes, ready buffers beyond that many bytes are evicted."""
    pool = make_pool(max_bytes=100)
    bufs = [pool.acquire((10,), torch.float32) for _ in range(3)]  # 40 bytes each
    pool.release(bufs)
    assert (pool.stats().free, pool.stats().free_bytes) == (2, 80)


def test_least_recently_requested_shape_is_evicted_first() -> None:
    """Over the bound, the shape requested longest ago loses its buffers first."""
    pool = make_pool(max_buffers=2)
    old = pool.acquire((1,), torch.float32)
    recent = pool.acquire((2,), torch.float32)
    pool.release([old, recent])
    newest = pool.acquire((3,), torch.float32)
    pool.release([newest])
    assert same(pool.acquire((2,), torch.float32), recent)
    assert same(pool.acquire((3,), torch.float32), newest)
    assert pool.stats().hits == 2 and pool.stats().evicted == 1


def test_pool_shrinks_when_shapes_change() -> None:
    """Buffers of a shape nobody requested in stale_after acquisitions are dropped."""
    pool = make_pool(stale_after=4, max_buffers=64)
    pool.release([pool.acquire((100,), torch.float32) for _ in range(3)])
    assert pool.stats().free == 3
    for _ in range(8):  # the sequence length changed: only the new shape is requested now
        pool.release([pool.acquire((7,), torch.float32)])
    stats = pool.stats()
    assert stats.free == 1 and stats.free_bytes == 7 * 4
    assert stats.evicted == 3


def test_pool_is_an_allocator_for_pinned_collate() -> None:
    """pinned_collate(batch, pool) collates into pooled buffers; the next batch reuses them."""
    pool = make_pool()
    batch = [{"x": torch.ones(3), "y": i} for i in range(4)]
    first = pinned_collate(batch, pool)
    assert pool.release([first["x"], first["y"]]) == 2
    second = pinned_collate(batch, pool)
    assert same(second["x"], first["x"]) and same(second["y"], first["y"])
    assert pool.stats().hits == 2


def test_empty_buffers_are_not_pooled() -> None:
    """Zero-element buffers (all at address 0) are allocated fresh, never confused."""
    pool = make_pool()
    a = pool.acquire((0, 3), torch.float32)
    assert a.shape == (0, 3)
    assert pool.release([a]) == 0


def test_clear_forgets_everything() -> None:
    """clear() empties the pool: free, pending and handed-out buffers."""
    pool = make_pool()
    pool.release([pool.acquire((2,), torch.float32)])
    pool.release([pool.acquire((2,), torch.float32)], FakeEvent())
    kept = pool.acquire((3,), torch.float32)
    pool.clear()
    stats = pool.stats()
    assert (stats.free, stats.pending, stats.outstanding) == (0, 0, 0)
    assert pool.release([kept]) == 0


@pytest.mark.parametrize("kwargs", [{"max_buffers": 0}, {"max_bytes": 0}, {"stale_after": 0}])
def test_bounds_below_one_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_pool(**kwargs)


def test_concurrent_acquire_and_release_never_share_a_buffer() -> None:
    """Threads acquiring while others release never hold the same buffer at once."""
    pool = make_pool(max_buffers=8)
    held: set[int] = set()
    lock = threading.Lock()
    errors: list[str] = []

    def work() -> None:
        for _ in range(300):
            buf = pool.acquire((16,), torch.float32)
            ptr = buf.untyped_storage().data_ptr()
            with lock:
                if ptr in held:
                    errors.append("shared")
                held.add(ptr)
            with lock:
                held.discard(ptr)
            pool.release([buf], FakeEvent(done=True))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.stats().hits > 0
