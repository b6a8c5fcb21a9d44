"""DevicePrefetcher's thread, order, errors, bound and shutdown, checked with device="cpu".

On the CPU the prefetcher passes batches through unchanged but runs the same thread, hand-off
and shutdown as on a GPU, so CI covers all of it; tests/cuda/test_transfer.py adds the copies.
Each shutdown test names its trigger: exhaustion, close(), break, del, garbage collection.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import press_ctrl_c_during

from threadloader._primitives import exit_hook
from threadloader.device.transfer import JOIN_TIMEOUT_S
from threadloader.transfer import DevicePrefetcher, Tagged, device_from_arg


def _ours() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetch-test")]


def _wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.fixture(autouse=True)
def _no_thread_left_behind() -> Iterator[None]:
    yield
    assert _wait_until(lambda: not _ours(), timeout=5.0), _ours()


class Counting:
    """An iterator over 0..n-1 that counts pulls and can raise at chosen positions."""

    def __init__(self, n: int, fail_at: tuple[int, ...] = (), delay: float = 0.0) -> None:
        self.n, self.fail_at, self.delay = n, fail_at, delay
        self.pulled = 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> int:
        if self.delay:
            time.sleep(self.delay)
        i = self.pulled
        if i >= self.n:
            raise StopIteration
        self.pulled += 1
        if i in self.fail_at:
            raise ValueError(f"item {i} is corrupt")
        return i


def prefetcher(source: Iterator[Any], depth: int = 2, **kwargs: Any) -> DevicePrefetcher[Any]:
    return DevicePrefetcher(source, "cpu", depth, name="prefetch-test", **kwargs)


def test_batches_arrive_in_source_order() -> None:
    """Every batch arrives, in the order the source produced it."""
    assert list(prefetcher(iter(range(50)))) == list(range(50))


def test_batches_pass_through_unchanged_on_cpu() -> None:
    """device="cpu" delivers the very objects the source yielded."""
    batches = [{"x": torch.ones(2)}, [torch.zeros(1), "s"], (1, 2)]
    out = list(prefetcher(iter(batches)))
    assert all(a is b for a, b in zip(out, batches, strict=True))


def test_exception_is_raised_at_its_position_and_iteration_goes_on() -> None:
    """A source error is raised by next() after the batches before it; later ones follow."""
    it = prefetcher(Counting(6, fail_at=(2, 4)))
    seen: list[Any] = []
    while True:
        try:
            seen.append(next(it))
        except ValueError as exc:
            seen.append(str(exc))
        except StopIteration:
            break
    assert seen == [0, 1, "item 2 is corrupt", 3, "item 4 is corrupt", 5]


def test_exception_keeps_the_source_traceback() -> None:
    """The re-raised exception carries the frame in the source that raised it."""
    it = prefetcher(Counting(3, fail_at=(0,)))
    with pytest.raises(ValueError) as info:
        next(it)
    frames = [(e.name, e.path.name) for e in info.traceback]  # type: ignore[union-attr]
    assert ("__next__", "test_device_prefetcher.py") in frames, frames
    it.close()


def test_base_exception_ends_the_stream() -> None:
    """A non-Exception from the source (SystemExit) is delivered, then the stream ends."""

    def source() -> Iterator[int]:
        yield 1
        raise SystemExit(3)

    it = prefetcher(source())
    assert next(it) == 1
    with pytest.raises(SystemExit):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_at_most_depth_batches_are_pulled_ahead(depth: int) -> None:
    """The thread pulls at most `depth` batches the consumer has not received yet."""
    source = Counting(100)
    it = prefetcher(source, depth=depth)
    for delivered in range(3):
        ahead = delivered + depth
        assert _wait_until(lambda ahead=ahead: source.pulled == ahead)
        time.sleep(0.02)  # room for the thread to overrun its bound, if it would
        assert source.pulled == ahead
        next(it)
    it.close()


def test_exhaustion_joins_the_thread() -> None:
    """Iterating to the end joins the thread before StopIteration is raised."""
    it = prefetcher(iter(range(5)))
    assert list(it) == list(range(5))
    assert not it.thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)


def test_close_joins_the_thread_and_is_idempotent() -> None:
    """close() stops and joins the thread; a second close() does nothing; next() raises."""
    it = prefetcher(Counting(10_000))
    next(it)
    it.close()
    assert not it.thread.is_alive()
    it.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


@pytest.mark.parametrize("ended", [False, True])
def test_restart_drops_what_was_pulled_and_pulls_on_from_the_rewound_source(ended: bool) -> None:
    """restart(rewind): the batches pulled and not delivered are dropped, rewind runs while no
    thread pulls (here it moves the source back), and a new thread pulls on from there; also
    after the old thread had pulled the source's end. Closing the source is not asked for."""
    n = 5 if ended else 6  # the three slots after the first two batches hold 2, 3, 4
    source = Counting(n)
    closed: list[bool] = []
    it = prefetcher(source, depth=4 if ended else 3, on_close=lambda: closed.append(True))
    assert [next(it), next(it)] == [0, 1]
    assert _wait_until(lambda: source.pulled == 5)
    if ended:  # a fourth slot: it pulled the end too
        assert _wait_until(lambda: not it.thread.is_alive())
    old_thread = it.thread

    def rewind() -> None:
        assert not old_thread.is_alive()
        assert not closed
        source.pulled = 2

    it.restart(rewind)
    assert list(it) == list(range(2, n))
    assert closed == [True]  # once, by the end the consumer reached


def test_restart_after_close_raises_and_a_failed_rewind_closes() -> None:
    """A closed prefetcher cannot restart; a rewind that raises ends the stream."""
    it = prefetcher(Counting(10))
    next(it)

    def fail() -> None:
        raise ValueError("cannot rewind")

    with pytest.raises(ValueError, match="cannot rewind"):
        it.restart(fail)
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    it.close()
    with pytest.raises(RuntimeError, match="closed"):
        it.restart(lambda: None)


def test_a_close_from_another_thread_while_restart_rewinds_leaves_no_thread() -> None:
    """``close()`` lands while ``restart()`` runs its rewind on another thread: the restart
    raises, and no new transfer thread is left pulling from a closed prefetcher."""
    it = prefetcher(Counting(10_000))
    next(it)
    rewinding = threading.Event()
    errors: list[BaseException] = []

    def rewind() -> None:
        rewinding.set()
        time.sleep(0.2)  # close() runs meanwhile

    def restart() -> None:
        try:
            it.restart(rewind)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=restart)
    thread.start()
    rewinding.wait()
    it.close()
    thread.join()
    assert [str(e) for e in errors] == [f"{it.thread.name} was closed while it restarted"]
    assert not it.thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == it.thread.name]


def test_break_then_del_ends_the_thread() -> None:
    """Leaving a for loop early and dropping the prefetcher ends its thread."""
    it = prefetcher(Counting(10_000))
    thread = it.thread
    for i in it:
        if i == 3:
            break
    del it
    assert not thread.is_alive()


def test_garbage_collection_ends_the_thread() -> None:
    """A prefetcher kept only by a reference cycle is closed when the collector runs."""
    it = prefetcher(Counting(10_000))
    thread = it.thread
    cycle: dict[str, Any] = {"it": it}
    cycle["self"] = cycle
    del it, cycle
    gc.collect()
    assert _wait_until(lambda: not thread.is_alive())


def test_close_while_the_source_blocks_wakes_it_with_on_close() -> None:
    """on_close() runs before the join, so a thread waiting inside the source is released."""
    release = threading.Event()

    def source() -> Iterator[int]:
        yield 0
        release.wait()  # a loader epoch waiting for its workers
        yield 1

    it = prefetcher(source(), on_close=release.set)
    assert next(it) == 0
    time.sleep(0.05)  # the thread is now waiting inside the source; without on_close the
    start = time.monotonic()
    it.close()  # join would wait JOIN_TIMEOUT_S
    assert time.monotonic() - start < JOIN_TIMEOUT_S / 2
    assert not it.thread.is_alive()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_close_after_one_a_ctrl_c_stopped_still_waits_for_the_thread() -> None:
    """Ctrl-C during close()'s join; the next close (the exit hook's) waits for the thread."""
    in_source = threading.Event()

    def stuck() -> Iterator[int]:
        while True:
            in_source.set()
            time.sleep(0.6)  # user code the close cannot wake
            in_source.clear()
            yield 1

    prefetcher = DevicePrefetcher(stuck(), "cpu", depth=1)
    assert in_source.wait(5)
    transfer = prefetcher._transfer
    press_ctrl_c_during(prefetcher.close, after_s=0.1)
    transfer.close()
    assert transfer.finished.is_set() and not in_source.is_set()
    assert transfer not in exit_hook.tracked()


def test_source_is_released_after_close() -> None:
    """After close() the prefetcher no longer holds the source (an epoch, its workers)."""
    source = Counting(10_000)
    ref = weakref.ref(source)
    it = prefetcher(source)
    del source
    next(it)
    it.close()
    gc.collect()
    assert ref() is None


class Owner:
    """A loader epoch in miniature: it owns a prefetcher whose source reaches it only weakly."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.prefetcher = prefetcher(WeakSource(weakref.ref(self)))
        self._finalizer = weakref.finalize(self, self.prefetcher.close)

    def produce(self) -> int:
        if self.fail:
            raise ValueError("worker failed")  # this frame's `self` is the owner
        return 1


class WeakSource:
    def __init__(self, ref: weakref.ref[Owner]) -> None:
        self.ref = ref

    def __iter__(self) -> WeakSource:
        return self

    def __next__(self) -> int:
        owner = self.ref()
        if owner is None:
            raise StopIteration
        try:
            return owner.produce()
        finally:
            del owner


@pytest.mark.parametrize("fail", [False, True], ids=["batches", "errors"])
def test_dropping_an_owner_with_a_full_hand_off_ends_the_thread(fail: bool) -> None:
    """An owner reached weakly by its source is collected even with errors queued for it.

    Queued exceptions carry the source's frames; their locals (the owner) are cleared, or
    the blocked thread would keep the owner, and so itself, alive forever.
    """
    owner = Owner(fail)
    thread = owner.prefetcher.thread
    handoff = owner.prefetcher._transfer.handoff
    assert _wait_until(lambda: handoff._used == 2)  # both slots filled: the thread is blocked
    ref = weakref.ref(owner)
    del owner
    assert ref() is None
    assert not thread.is_alive()


def test_queued_exception_keeps_its_frames_but_not_their_locals() -> None:
    """A delivered source error prints its source frames; their locals were released."""

    class Payload:
        pass

    payload_ref: list[weakref.ref[Payload]] = []

    def source() -> Iterator[int]:
        payload = Payload()
        payload_ref.append(weakref.ref(payload))
        raise ValueError("bad")
        yield 0

    it = prefetcher(source())
    with pytest.raises(ValueError) as info:
        next(it)
    assert "source" in [e.name for e in info.traceback]
    assert payload_ref[0]() is None
    it.close()


def test_tagged_batches_keep_their_tag_untouched() -> None:
    """A Tagged item's tag is delivered as the same object, alongside its batch."""
    tags = [{"state": torch.tensor([i])} for i in range(3)]
    out = list(prefetcher(Tagged(torch.ones(1) * i, tags[i]) for i in range(3)))
    assert all(isinstance(o, Tagged) and o.tag is tags[i] for i, o in enumerate(out))
    assert [int(o.batch) for o in out] == [0, 1, 2]


def test_exception_held_by_the_caller_does_not_keep_the_thread() -> None:
    """A raised exception the caller keeps does not stop close() from ending the thread."""
    it = prefetcher(Counting(10_000, fail_at=(0,)))
    try:
        next(it)
    except ValueError as exc:
        kept = exc
    thread = it.thread
    it.close()
    assert kept is not None and not thread.is_alive()


def test_thread_is_named_and_a_daemon() -> None:
    """The thread is named for its owner, so a stack dump reads on its own."""
    it = DevicePrefetcher(iter(range(3)), "cpu")
    assert it.thread.name.startswith("threadloader-") and it.thread.name.endswith("-transfer")
    assert it.thread.daemon
    assert "state=RUNNING" in repr(it)
    it.close()


def test_stats_count_delivered_batches_and_waiting() -> None:
    """stats() is a snapshot: batches delivered and time next() spent waiting."""
    it = prefetcher(Counting(4, delay=0.01))
    list(it)
    stats = it.stats()
    assert stats.batches == 4 and stats.wait_s > 0 and stats.pool is None
    assert stats.bytes == 0


def test_exit_with_a_live_prefetcher_does_not_hang() -> None:
    """A prefetcher still referenced at interpreter exit lets the interpreter exit cleanly."""
    code = (
        "import itertools\n"
        "from threadloader.device.transfer import DevicePrefetcher\n"
        "p = DevicePrefetcher(itertools.count(), 'cpu')\n"
        "next(p)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == b""


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_invalid_depth_is_rejected(depth: Any) -> None:
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher(iter(()), "cpu", depth)


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        ("foo", ValueError, "device='foo' is not a device torch knows"),
        ("cuda:-1", ValueError, "device='cuda:-1'"),
        ("meta", ValueError, "device='meta'.*'cpu' or 'cuda'"),
        (-2, ValueError, "device=-2"),
        (None, TypeError, "device must be"),
        (2.0, TypeError, "device must be"),
    ],
)
def test_invalid_devices_raise_naming_the_device(device: Any, error: type, match: str) -> None:
    """A device torch does not know, or cannot move batches to, is named in a clear error."""
    with pytest.raises(error, match=match):
        device_from_arg(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda")])
def test_cuda_without_cuda_raises_at_construction(device: Any) -> None:
    """device="cuda" on a machine without CUDA fails before any thread starts."""
    with pytest.raises(RuntimeError, match=r"device=.*needs CUDA"):
        DevicePrefetcher(iter(range(3)), device)
    assert not [t for t in threading.enumerate() if t.name.endswith("-transfer")]


def test_cpu_device_resolves_to_cpu() -> None:
    assert device_from_arg("cpu") == torch.device("cpu")
    assert device_from_arg(torch.device("cpu:0")) == torch.device("cpu")


def test_a_live_prefetcher_is_closed_by_the_exit_hook() -> None:
    """The shared exit hook tracks a running prefetcher and forgets it once closed."""
    from threadloader._primitives import exit_hook

    p = DevicePrefetcher(iter(range(100)), "cpu", depth=2)
    assert p._transfer in exit_hook.tracked()
    exit_hook._close_all()  # what interpreter exit runs
    assert not p.thread.is_alive()
    assert p._transfer not in exit_hook.tracked()
