"""A Ctrl-C always stops a training loop: never swallowed by a finalizer the loader runs.

Batches the loop drops give their memory back from finalizers (recycled buffers, shared-memory
slots), and dropped iterators join their threads from one; Python prints and drops any exception
raised in a finalizer, and a signal handler raises ``KeyboardInterrupt`` between any two
bytecodes, so a Ctrl-C landing in one of them was lost. Each trial presses Ctrl-C at a random
moment of a training loop in a child interpreter (``ctrl_c_trials.py``) and needs: the
``KeyboardInterrupt`` in the loop within 2 s, no ``Exception ignored`` on stderr, no thread or
helper process left; each child's last trial ends the interpreter with it.

``THREADLOADER_CTRL_C_TRIALS=200`` runs 200 trials per configuration (about 3 minutes each on
2 cores); the default suite runs ``DEFAULT_TRIALS``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from ctrl_c_trials import CONFIGS, LIMIT_S
from helpers import press_ctrl_c_during, threadloader_threads_after
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader
from threadloader._engine import threaded
from threadloader._primitives.concurrency import ConcurrencyController
from threadloader._primitives.finalizers import Finalizer

DEFAULT_TRIALS = 10
TRIALS = int(os.environ.get("THREADLOADER_CTRL_C_TRIALS", DEFAULT_TRIALS))
#: Trials per child interpreter: each child's last trial exits the interpreter.
PER_CHILD = 20
#: The longest the interpreter may take to end once every exit handler ran: tearing down one
#: that imported torch takes 0.5-0.6 s on an idle 2-core machine and stretched past 2 s while
#: other tests ran beside it. What the loader does at exit (its exit hook, its atexit handlers)
#: is held to ``LIMIT_S`` on its own.
EXIT_LIMIT_S = 10.0
#: Runs the child script with an atexit handler registered before anything else, so that it
#: runs after every other one and prints when they were done.
_EXIT_TIMER = (
    "import atexit, runpy, sys, time\n"
    "atexit.register(lambda: print('atexit-done', time.monotonic(), flush=True))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
SCRIPT = Path(__file__).with_name("ctrl_c_trials.py")

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _run_child(config: str, trials: int, seed: int, tmp_path: Path) -> list[str]:
    """Run one child; return a failure line per trial that failed (empty: all passed)."""
    out_path, err_path = tmp_path / f"{seed}.out", tmp_path / f"{seed}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), str(SCRIPT.parent)])
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXIT_TIMER, str(SCRIPT), config, str(trials), str(seed)],
            stdout=out,
            stderr=err,
            cwd=SCRIPT.parent,
            env=env,  # this checkout's threadloader, whatever is installed
            start_new_session=True,  # its Ctrl-C goes to its own process group
        )
        deadline = time.monotonic() + 30 + 5 * trials
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ended = time.monotonic()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out_path.read_text().splitlines()
    stderr = err_path.read_text()
    done_at = [line.split()[1] for line in lines if line.startswith("atexit-done ")]
    lines = [line for line in lines if not line.startswith("atexit-done ")]
    failures = [
        f"trial {i}: {line}"
        for i, line in enumerate(lines)
        if not line.startswith(("ok ", "exit "))
    ]
    if len(lines) < trials or not lines[-1].startswith("exit "):
        failures.append(
            f"child stopped after {len(lines)} of {trials} trials (rc {proc.returncode})"
        )
    elif not done_at:
        failures.append(f"exit trial: the exit handlers never finished (rc {proc.returncode})")
    else:
        _, sent_at, caught_at, *helpers = lines[-1].split()
        reached = float(caught_at) - float(sent_at)
        handlers = float(done_at[0]) - float(caught_at)
        teardown = ended - float(done_at[0])
        if (
            proc.returncode == 0
            or "KeyboardInterrupt" not in stderr
            or max(reached, handlers) > LIMIT_S
            or teardown > EXIT_LIMIT_S
        ):
            failures.append(
                f"exit trial: rc {proc.returncode}, interrupt in the loop {reached:.2f} s after"
                f" the Ctrl-C, exit handlers done {handlers:.2f} s later, process ended"
                f" {teardown:.2f} s after that"
            )
        left = [p for p in map(int, helpers) if psutil.pid_exists(p) and _running(p)]
        if left:
            failures.append(f"exit trial: helper processes left: {left}")
    if "Exception ignored" in stderr:
        failures.append(f"stderr: {stderr.count('Exception ignored')} x Exception ignored")
    if failures:
        failures.append(f"stderr tail: {stderr[-1500:]}")
    return failures


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(60 + 6 * TRIALS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ctrl_c_at_a_random_moment_stops_the_training_loop(config: str, tmp_path: Path) -> None:
    """Ctrl-C pressed anywhere in a training loop over large batches raises KeyboardInterrupt in
    the loop within 2 s, prints no ``Exception ignored``, and leaves no thread or helper."""
    total = TRIALS
    failures: list[str] = []
    failed_trials = 0
    for seed, start in enumerate(range(0, total, PER_CHILD)):
        child = _run_child(config, min(PER_CHILD, total - start), seed, tmp_path)
        failed_trials += sum(line.startswith(("trial", "exit trial")) for line in child)
        failures += child
    assert not failures, f"{failed_trials} of {total} trials failed:\n" + "\n".join(failures)


# -- the mechanisms, one at a time -------------------------------------------------------------


class Large(Dataset[torch.Tensor]):
    """Samples of 1 MiB: every batch is large enough to be collated into recycled memory."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256, 1024), float(i))


def _python_calls_while(action: Callable[[], object]) -> list[str]:
    """The Python functions the main thread entered while ``action`` ran (its own excepted)."""
    calls: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return [c for c in calls if not c.endswith(":action")]


@pytest.mark.parametrize("isolation", [None, "process"])
def test_dropping_a_batch_runs_no_python_code(isolation: str | None) -> None:
    """The loop dropping a batch gives its memory back (recycled buffer, shared-memory slot)
    without running Python code, where a Ctrl-C could land and be dropped."""
    loader = ThreadDataLoader(Large(), batch_size=4, num_workers=2, isolation=isolation)
    it = iter(loader)
    holder = [next(it)]
    assert holder[0].untyped_storage().nbytes() >= 4 << 20
    calls = _python_calls_while(holder.clear)
    assert calls == []
    it.close()


def _wait_for_the_ctrl_c(limit_s: float = 60.0) -> None:
    """Sleep until the Ctrl-C sent again arrives (it interrupts the sleep), ``limit_s`` at most:
    the timer thread that sends it may start late on a loaded machine."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.05)


def test_ctrl_c_dropped_by_any_finalizer_on_the_main_thread_is_sent_again() -> None:
    """A Ctrl-C landing in the standard library's finalizers that our objects' deaths run (a
    thread's ``_dangling`` entry, a connection's ``__del__``) reaches the loop too."""

    def callback(_ref: object) -> None:
        raise KeyboardInterrupt  # as if the Ctrl-C landed here

    keep = Finalizer(_Owner(), lambda: None)  # the first iterator installs the hook, so does this
    owner = _Owner()
    ref = weakref.ref(owner, callback)
    with pytest.raises(KeyboardInterrupt):
        del owner  # printed and dropped, without the hook
        _wait_for_the_ctrl_c()
    del ref, keep


class _Owner:
    pass


def test_ctrl_c_inside_a_finalizer_reaches_the_loop_after_it() -> None:
    """A KeyboardInterrupt raised while a finalizer runs (here: by its function) is not
    printed and dropped: the finalizer finishes without waiting, then the loop gets it."""
    done: list[str] = []

    def close() -> None:
        done.append("close")
        raise KeyboardInterrupt

    owner = _Owner()
    Finalizer(owner, close, on_interrupt=lambda: done.append("finish without waiting"))
    with pytest.raises(KeyboardInterrupt):
        del owner  # the finalizer returns normally ...
        assert done == ["close", "finish without waiting"]
        _wait_for_the_ctrl_c()  # ... and the Ctrl-C comes back here
    assert done == ["close", "finish without waiting"]


class _SigInt:
    @classmethod
    def from_param(cls, _obj: object) -> ctypes.c_int:
        return ctypes.c_int(signal.SIGINT)


def test_ctrl_c_landing_on_entering_a_finalizer_still_closes_and_reaches_the_loop() -> None:
    """The signal arrives just before the finalizer's first bytecode, where no ``try`` covers
    it: the unraisable hook still runs the close and sends the Ctrl-C again."""
    # As a real SIGINT does, PyErr_SetInterruptEx only flags the signal; a weak-reference
    # callback made after the finalizer's runs before it, from C, so the next bytecode the
    # main thread runs, the one that raises, is the finalizer's first.
    press = ctypes.pythonapi.PyErr_SetInterruptEx
    press.argtypes = [_SigInt]
    done: list[str] = []
    owner = _Owner()
    Finalizer(owner, done.append, "closed")
    press_at_death = weakref.ref(owner, press)
    with pytest.raises(KeyboardInterrupt):
        del owner
        assert done == ["closed"]
        _wait_for_the_ctrl_c()
    assert done == ["closed"]
    del press_at_death


def test_a_close_stopped_halfway_by_ctrl_c_still_ends_the_threads(monkeypatch) -> None:
    """A Ctrl-C landing inside ``break``'s close before the workers were woken: the threads
    still end (the close that finishes the job wakes them again), and the loop gets the Ctrl-C."""
    loader = ThreadDataLoader(Large(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    pool = it._pool
    threads = list(pool._threads)
    first = pool.workers[0].tasks
    calls = []

    def interrupted_once() -> list[Any]:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # before any worker was woken
        return type(first).close(first)

    monkeypatch.setattr(first, "close", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        del it
        _wait_for_the_ctrl_c()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


class BusyItems(Dataset[int]):
    """Items that take 0.6 s of user code, which a close cannot interrupt."""

    def __init__(self) -> None:
        self.inside = threading.Event()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        self.inside.set()
        time.sleep(0.6)
        self.inside.clear()
        return i


def test_a_close_after_one_a_ctrl_c_stopped_still_waits_for_the_workers() -> None:
    """A Ctrl-C stops close() while it joins a worker busy in an item; the next close (the
    exit hook's) waits for that worker to end, though CPython 3.11 then calls it stopped."""
    dataset = BusyItems()
    it = iter(ThreadDataLoader(dataset, num_workers=1, prefetch_factor=1))
    assert dataset.inside.wait(10)
    pool = it._pool
    press_ctrl_c_during(pool.close, after_s=0.1)
    pool.close()
    assert not dataset.inside.is_set()
    assert all(finished.is_set() for finished in pool._finished)
    del it


def test_an_isolated_close_stopped_halfway_by_ctrl_c_still_ends_the_helper(monkeypatch) -> None:
    """A Ctrl-C landing inside ``break``'s close of the helper link before its pipes were
    closed: the helper still ends, and the loop gets the Ctrl-C."""
    loader = ThreadDataLoader(Large(), batch_size=4, num_workers=2, isolation="process")
    it = iter(loader)
    next(it)
    link = it._links.links[0]
    calls = []
    ours = link._ours

    def interrupted_once() -> list[Any]:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return ours()

    monkeypatch.setattr(link, "_ours", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        del it
        _wait_for_the_ctrl_c()
    link.process.join(30)
    assert link.process.exitcode is not None


class _CtrlCOnTheTrainingThread(Dataset[int]):
    """Item 5, fetched on the main thread, raises KeyboardInterrupt: a Ctrl-C landing there."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == 5 and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        return i


def test_ctrl_c_while_the_training_thread_makes_a_batch_is_raised_as_itself(monkeypatch) -> None:
    """A Ctrl-C landing while the training thread makes a batch itself (for a worker that had
    not started it) is the loop's own KeyboardInterrupt, not a worker error about that batch."""

    class AlwaysZero(ConcurrencyController):  # the training thread makes every batch
        def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
            super().__init__(maximum, minimum, initial=minimum)

        def on_batch(self, *args: float | None) -> int | None:
            return None

    monkeypatch.setattr(threaded, "ConcurrencyController", AlwaysZero)
    it = iter(ThreadDataLoader(_CtrlCOnTheTrainingThread(), batch_size=4, num_workers=2))
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyboardInterrupt) as info:
        next(it)
    assert str(info.value) == ""  # raised as it was, not rebuilt from a worker's traceback
    assert info.traceback[-1].name == "__getitem__"


class _ExitsOnTheTrainingThread(Dataset[int]):
    """Item code during which, on the training thread, a signal handler calls ``sys.exit``
    (a SIGTERM handler at preemption); ``ran_here`` counts the items made there (on the class:
    each worker has its own copy)."""

    ran_here = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if threading.current_thread() is threading.main_thread():
            type(self).ran_here += 1
            signal.raise_signal(signal.SIGUSR1)  # the handler runs here, in the item code
        time.sleep(0.002)
        return i


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs SIGUSR1")
def test_a_signal_handlers_sys_exit_on_the_training_thread_reaches_the_loop() -> None:
    """A SIGTERM handler's ``sys.exit()`` that lands while the training thread makes a batch
    itself is the loop's SystemExit, as a Ctrl-C is, not a worker error a loop that skips bad
    batches (``except Exception``) would swallow: torch's waiting loop gets it as itself."""
    dataset = _ExitsOnTheTrainingThread()
    _ExitsOnTheTrainingThread.ran_here = 0
    previous = signal.signal(signal.SIGUSR1, lambda *_: sys.exit(143))
    skipped, code = [], None
    try:
        for _ in range(20):
            try:
                for _ in ThreadDataLoader(
                    dataset, batch_size=8, num_workers=2, isolation="threads"
                ):
                    pass
            except Exception as error:  # noqa: BLE001  # what a skipping loop does
                skipped.append(repr(error))
    except SystemExit as exit_:  # not kept: its frames hold the epoch's iterator
        code = exit_.code
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert code == 143
    assert _ExitsOnTheTrainingThread.ran_here > 0
    assert not skipped
    assert threadloader_threads_after() == []


class _CallsSysExitOnTheTrainingThread(Dataset[int]):
    """Item code that itself calls ``sys.exit``, on the training thread."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if threading.current_thread() is threading.main_thread():
            sys.exit(3)
        time.sleep(0.002)
        return i


def test_item_codes_own_sys_exit_on_the_training_thread_stays_a_worker_error() -> None:
    """Only what a signal handler raises is the loop's: item code's own ``sys.exit()`` is a
    worker's RuntimeError wherever the batch was made, as torch's dead worker gives one."""
    errors = []
    for _ in range(20):
        try:
            for _ in ThreadDataLoader(
                _CallsSysExitOnTheTrainingThread(), batch_size=8, num_workers=2, isolation="threads"
            ):
                pass
        except RuntimeError as error:
            errors.append(str(error))  # not the error: its frames hold the epoch's iterator
    assert errors, "the training thread made no batch: the scenario is wrong"
    assert all("Caught SystemExit" in e for e in errors)
    assert threadloader_threads_after() == []


AFTER_FORK_CTRL_C = """\
import os, time
from threadloader import ThreadDataLoader

fired = []

def after_fork_in_parent():
    if not fired:  # a Ctrl-C landing in an after-fork hook (logging's has one)
        fired.append(1)
        raise KeyboardInterrupt

if __name__ == "__main__":
    os.register_at_fork(after_in_parent=after_fork_in_parent)
    try:
        loader = ThreadDataLoader(list(range(8)), batch_size=2, num_workers=2, isolation="process")
        time.sleep(1)
        print("lost", fired)
    except KeyboardInterrupt:
        print("reached", fired)
"""


def test_a_ctrl_c_in_an_after_fork_hook_while_a_loader_forks_its_zygote_reaches_the_script(
    tmp_path: Path,
) -> None:
    """``isolation="process"`` forks its zygote when built: a Ctrl-C that lands in an after-fork
    hook then is python's "Exception ignored" unless sent again; it must reach the script."""
    script = tmp_path / "after_fork.py"
    script.write_text(AFTER_FORK_CTRL_C)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.strip() == "reached [1]", done.stdout + done.stderr
