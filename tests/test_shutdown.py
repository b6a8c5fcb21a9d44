"""No worker thread outlives its use, however an epoch ends.

Each test names its trigger: exhaustion, ``break``, ``del``, garbage collection, a worker
exception, ``KeyboardInterrupt`` while waiting, a worker stuck in slow user code, interpreter exit.
"""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import interrupted_next
from torch.utils.data import Dataset, IterableDataset

from threadloader import ThreadDataLoader
from threadloader._engine import workers as _workers
from threadloader._primitives import exit_hook

_preexisting: set[threading.Thread] = set()


def _ours() -> list[threading.Thread]:
    """Live threadloader threads started by the current test."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("threadloader-") and t not in _preexisting
    ]


def _wait_for_no_threads(timeout: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while _ours() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _ours()


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    # Threads another test file left finishing a slow call are not this test's.
    _wait_for_no_threads(timeout=2.0)
    _preexisting.clear()
    _preexisting.update(_ours())
    yield
    assert _wait_for_no_threads() == []


class Squares(Dataset[torch.Tensor]):
    def __init__(self, n: int = 64, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(i * i)


class Failing(Squares):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 9:
            raise ValueError("item 9 is corrupt")
        return super().__getitem__(i)


class Stream(IterableDataset[int]):
    def __iter__(self):
        yield from range(40)


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_threads_end_after_exhaustion(num_workers: int) -> None:
    """Iterating to the end joins every worker thread before StopIteration is raised."""
    it = iter(ThreadDataLoader(Squares(), batch_size=4, num_workers=num_workers))
    assert len(_ours()) == num_workers
    assert len(list(it)) == 16
    assert _ours() == []  # joined synchronously, not eventually


def test_threads_end_after_break() -> None:
    """Leaving a for loop early drops the iterator, whose finalizer joins the threads at once."""
    for _batch in ThreadDataLoader(Squares(), batch_size=4, num_workers=2):
        break
    assert _ours() == []


def test_threads_end_after_del() -> None:
    """Deleting a half-consumed iterator joins its threads."""
    it = iter(ThreadDataLoader(Squares(), batch_size=4, num_workers=2))
    next(it)
    del it
    assert _ours() == []


def test_threads_end_when_iterator_is_garbage_collected() -> None:
    """An iterator kept alive only by a reference cycle is closed by the garbage collector."""
    it = iter(ThreadDataLoader(Squares(), batch_size=4, num_workers=2))
    next(it)
    holder: dict[str, object] = {}
    holder["self"], holder["it"] = holder, it
    del it, holder
    assert len(_ours()) == 2
    gc.collect()
    assert _ours() == []


def test_a_forked_child_collecting_an_inherited_iterator_neither_waits_nor_closes_it() -> None:
    """A process forked while an iterator lives (torch's worker processes, a user's fork) has
    none of its threads: collecting its copy there runs nothing, where closing it waited
    ``JOIN_TIMEOUT_S`` for threads that do not exist. The parent's epoch goes on whole."""
    it = iter(ThreadDataLoader(Squares(), batch_size=4, num_workers=2))
    first = next(it)
    holder: dict[str, object] = {}
    holder["self"], holder["it"] = holder, it  # only a collection frees it
    del it

    def child() -> None:
        start = time.monotonic()
        holder.clear()  # the child's copy: frees it
        gc.collect()
        sys.exit(0 if time.monotonic() - start < 2.0 else 3)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    rest = list(holder["it"])  # type: ignore[call-overload]
    assert torch.cat([first, *rest]).tolist() == [i * i for i in range(64)]


def test_threads_end_after_worker_exception_and_exhaustion() -> None:
    """A worker error is raised in the training thread; the epoch goes on and ends cleanly."""
    it = iter(ThreadDataLoader(Failing(), batch_size=4, num_workers=2))
    outcomes = []
    while True:
        try:
            outcomes.append(next(it).tolist())
        except ValueError:
            outcomes.append("error")
        except StopIteration:
            break
    assert outcomes.count("error") == 1 and len(outcomes) == 16
    assert _ours() == []


def test_threads_end_when_iterator_is_dropped_after_worker_exception() -> None:
    """Dropping the iterator right after a worker error joins every thread."""
    with pytest.raises(ValueError, match="item 9 is corrupt"):
        for _ in ThreadDataLoader(Failing(), batch_size=4, num_workers=2):
            pass
    assert _wait_for_no_threads() == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_keyboard_interrupt_while_waiting_ends_the_threads() -> None:
    """Ctrl-C while next() waits for a slow batch raises KeyboardInterrupt; the threads end."""
    loader = ThreadDataLoader(Squares(delay=0.2), batch_size=8, num_workers=2)
    it = iter(loader)
    interrupted_next(it)
    assert _wait_for_no_threads() == []  # each finishes the item it was in, then exits
    with pytest.raises(RuntimeError, match="was closed"):
        next(it)


def test_keyboard_interrupt_stops_the_batches_being_made_after_their_item_in_flight() -> None:
    """Ctrl-C while both workers are inside batches of 16 slow items: each thread ends after
    the item it is in (or at most the next, begun before the epoch closed), without making the
    rest of a batch nobody will take (torch's worker processes are killed)."""
    started: list[int] = []

    class Counted(Squares):
        def __getitem__(self, i: int) -> torch.Tensor:
            started.append(i)
            time.sleep(0.05)
            return torch.tensor(i)

    # timeout > 0: the training thread never makes a batch itself, the workers do.
    it = iter(ThreadDataLoader(Counted(), batch_size=16, num_workers=2, timeout=60))
    interrupted_next(it, after_s=0.2)
    at_interrupt = len(started)
    assert _wait_for_no_threads() == []
    assert len(started) - at_interrupt <= 4, (at_interrupt, len(started))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_keyboard_interrupt_does_not_wait_for_a_worker_stuck_in_user_code(monkeypatch) -> None:
    """Ctrl-C is raised while a worker is still inside a slow read (torch raises at once too);
    that worker exits when its read returns, and the exit hook would join it at exit."""
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    class Stuck(Squares):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 0:
                entered.set()
                release.wait(30)
                left.set()
            return torch.tensor(i)

    monkeypatch.setattr(_workers, "JOIN_TIMEOUT_S", 60.0)  # a join would outlast the read
    # timeout > 0: the training thread never makes the batch itself, a worker does.
    it = iter(ThreadDataLoader(Stuck(), batch_size=4, num_workers=2, timeout=60))
    assert entered.wait(10)
    interrupted_next(it)
    assert not left.is_set()  # raised while the read was still running, not after it
    assert any(isinstance(o, _workers.WorkerPool) for o in exit_hook.tracked())
    release.set()
    assert _wait_for_no_threads() == []


def test_worker_stuck_in_slow_getitem_does_not_hang_shutdown(monkeypatch) -> None:
    """Closing waits at most JOIN_TIMEOUT_S for a worker inside slow user code, then returns."""
    release = threading.Event()

    class Stuck(Squares):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i >= 4:
                release.wait(60)
            return torch.tensor(i)

    monkeypatch.setattr(_workers, "JOIN_TIMEOUT_S", 0.3)
    it = iter(ThreadDataLoader(Stuck(), batch_size=4, num_workers=2))
    next(it)
    time.sleep(0.1)  # let the workers enter the stuck batches
    started = time.monotonic()
    del it
    assert time.monotonic() - started < 30  # bounded by JOIN_TIMEOUT_S, not by the 60 s read
    release.set()  # the stuck threads finish their call, find nothing to do, and exit
    assert _wait_for_no_threads() == []


def test_many_iterators_created_and_dropped_leave_no_thread() -> None:
    """1,000 iterators created, partly consumed and dropped leave the thread count at baseline."""
    loader = ThreadDataLoader(Squares(16), batch_size=4, num_workers=2)
    for i in range(1000):
        it = iter(loader)
        if i % 2:
            next(it)
        del it
    assert _ours() == []


def test_persistent_workers_survive_epochs_and_end_with_the_loader() -> None:
    """persistent_workers keeps the same threads across epochs; dropping the loader ends them."""
    loader = ThreadDataLoader(Squares(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    first = set(_ours())
    for _ in range(2):
        for _batch in loader:
            break  # an abandoned epoch does not end persistent workers either
        assert set(_ours()) == first
    del loader
    gc.collect()
    assert _ours() == []


def test_iterable_dataset_threads_end_after_exhaustion() -> None:
    """Workers of an IterableDataset end when every worker's copy is exhausted."""
    batches = list(ThreadDataLoader(Stream(), batch_size=5, num_workers=3))
    assert len(batches) == 24  # each worker yields the whole stream: torch's behaviour
    assert _ours() == []


def test_close_from_a_worker_thread_does_not_deadlock() -> None:
    """A finalizer run by GC inside a worker thread closes the pool without joining itself."""
    dropped = threading.Event()
    collected_in = []

    class CollectsGarbage(Squares):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 8:  # batch 2: prefetched by the worker while the test drops the iterator
                dropped.wait(10)
                gc.collect()
                collected_in.append(threading.current_thread().name)
            return torch.tensor(i)

    it = iter(ThreadDataLoader(CollectsGarbage(), batch_size=4, num_workers=1))
    holder: list[object] = [it]
    holder.append(holder)
    next(it)
    del it, holder
    dropped.set()
    assert _wait_for_no_threads() == []
    assert collected_in and collected_in[0].endswith("worker0")


def test_register_atexit_api_available() -> None:
    """The private stdlib hook that runs before non-daemon threads are joined still exists."""
    assert callable(threading._register_atexit)  # type: ignore[attr-defined]


@pytest.mark.parametrize("persistent", [False, True])
def test_exit_with_a_live_iterator_does_not_hang(persistent: bool) -> None:
    """A loader still referenced at interpreter exit (no break, no del) lets the process exit."""
    code = textwrap.dedent(
        f"""
        import time, torch
        from torch.utils.data import Dataset
        from threadloader import ThreadDataLoader
        class Slow(Dataset):
            def __len__(self): return 10_000
            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.tensor(i)
        loader = ThreadDataLoader(Slow(), batch_size=2, num_workers=2,
                                  persistent_workers={persistent})
        it = iter(loader)
        next(it)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""


@pytest.mark.parametrize("prefetch_factor", [2, 4])
def test_a_new_epoch_after_a_break_with_results_unread_completes(prefetch_factor: int) -> None:
    """A break leaves up to prefetch_factor * num_workers results unread in a persistent
    loader; the next epoch dispatches as many again. The stale ones must make room (they did
    not: the results queue overflowed, a worker thread died, and the epoch hung)."""
    loader = ThreadDataLoader(
        Squares(n=64),
        batch_size=2,
        num_workers=2,
        prefetch_factor=prefetch_factor,
        persistent_workers=True,
        timeout=10,  # workers make every batch; a lost one fails the test instead of hanging
    )
    it = iter(loader)
    next(it)
    pool = it._pool
    deadline = time.monotonic() + 5
    while len(pool.results) < prefetch_factor * 2 - 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # let the workers finish every batch in flight
    del it
    it = iter(loader)  # dispatches prefetch_factor * 2 tasks of the new epoch at once
    deadline = time.monotonic() + 2
    while any(len(w.tasks) for w in pool.workers) and time.monotonic() < deadline:
        time.sleep(0.01)  # ... and the workers take them all before the loop reads any
    time.sleep(0.05)  # and hand the last ones over
    assert len(list(it)) == 32
    assert all(t.is_alive() for t in pool._threads)


def test_untrack_from_a_finalizer_on_a_thread_holding_the_hook_lock_does_not_deadlock() -> None:
    """The garbage collector may run an iterator's finalizer (pool.close -> untrack) inside
    track(), on the thread that holds the hook's lock: untrack must not wait for it."""

    class Owner:
        def close(self) -> None:
            pass

    owner = Owner()
    exit_hook.track(owner)

    def finalizer_inside_track() -> None:
        with exit_hook._lock:
            exit_hook.untrack(owner)

    thread = threading.Thread(target=finalizer_inside_track, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    exit_hook.untrack(owner)  # the lock is free now: this one removes it
    assert owner not in exit_hook.tracked()


class StateFailsOnThird(IterableDataset[int]):
    """Counts 0..11; its state_dict() raises on the third call (the loader saves it per batch)."""

    def __init__(self) -> None:
        self.pos = 0
        self.calls = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.pos < 12:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self) -> dict[str, int]:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("state cannot be saved")
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def test_a_dataset_state_that_cannot_be_saved_is_raised_not_a_dead_worker() -> None:
    """The loader saves a stateful IterableDataset's state after each batch, in the worker:
    when state_dict() raises, that batch raises it in the training thread (a worker thread
    used to die there, and the epoch waited for its batch forever)."""
    loader = ThreadDataLoader(StateFailsOnThird(), batch_size=2, num_workers=1, timeout=10)
    with pytest.raises(ValueError, match="state cannot be saved"):
        list(loader)
    assert _wait_for_no_threads() == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("isolation", [None, "process"])
@pytest.mark.parametrize("ending", ["break", "close"])
def test_ctrl_c_while_the_epoch_waits_for_its_workers_is_raised(
    isolation: str | None, ending: str, tmp_path: Path
) -> None:
    """``break`` joins workers still inside slow reads from a finalizer, which drops any
    exception: a Ctrl-C pressed meanwhile must still reach the loop, not be printed and lost.
    An explicit ``close()`` raises it itself, once (nothing is sent again later)."""
    (tmp_path / "slow_items.py").write_text(
        textwrap.dedent(
            """
            import time, torch
            from torch.utils.data import Dataset
            class Slow(Dataset):
                def __len__(self): return 64
                def __getitem__(self, i):
                    if i >= 4 and i % 4 == 0:  # a batch's first read: one 3 s wait per batch
                        time.sleep(3)
                    return torch.tensor(i)
            """
        )
    )
    script = tmp_path / "loop.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, threading, time
            from slow_items import Slow
            from threadloader import ThreadDataLoader
            if __name__ == "__main__":
                loader = ThreadDataLoader(Slow(), batch_size=4, num_workers=2,
                                          isolation={isolation!r})
                try:
                    for batch in loader:
                        start = time.monotonic()  # not the helper's start-up: the wait it ends
                        time.sleep(0.3)  # the workers are inside their 3 s reads
                        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
                        if {ending!r} == "close":
                            iter_ = loader._host_epoch()
                            iter_.close()
                            print("close returned", flush=True)
                        break
                    time.sleep(5)
                    print("lost", flush=True)
                except KeyboardInterrupt:
                    print("raised", round(time.monotonic() - start), flush=True)
                    time.sleep(0.5)  # a second, re-sent interrupt would land here
                    print("once", flush=True)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, timeout=60, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().split()
    # (isolation's close() may return before the Ctrl-C: the helper ends at once)
    assert "raised" in out and "lost" not in out, (out, proc.stderr.decode())
    assert int(out[out.index("raised") + 1]) <= 2, out  # at the Ctrl-C, not after the reads
    assert out[-1] == "once" and out.count("raised") == 1, out
    if ending == "close" and isolation is None:
        assert "returned" not in out, out  # close() itself raised, inside its join
