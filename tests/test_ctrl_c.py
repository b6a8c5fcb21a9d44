"""A Ctrl-C always stops a training loop: never swallowed by a finalizer the loader runs.

Batches the loop drops give their memory back from finalizers (recycled buffers, shared-memory
slots), and dropped iterators join their threads from one; Python prints and drops any exception
raised in a finalizer, and a signal handler raises ``KeyboardInterrupt`` between any two
bytecodes, so a Ctrl-C landing in one of them was lost. Each trial presses Ctrl-C at a random
moment of a training loop in a child interpreter (``ctrl_c_trials.py``) and needs: the
``KeyboardInterrupt`` in the loop within 2 s, no ``Exception ignored`` on stderr, no thread or
helper process left; each child's last trial ends the interpreter with it.

``THREADLOADER_CTRL_C_TRIALS=200`` runs 200 trials per configuration (about 4 minutes each on
2 cores); the default suite runs ``DEFAULT_TRIALS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ctrl_c_trials import CONFIGS, LIMIT_S

DEFAULT_TRIALS = 12
#: Trials per child interpreter: each child's last trial exits the interpreter.
PER_CHILD = 20
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
            [sys.executable, str(SCRIPT), config, str(trials), str(seed)],
            stdout=out,
            stderr=err,
            cwd=SCRIPT.parent,
            env=env,  # this checkout's threadloader, whatever is installed
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
    failures = [
        f"trial {i}: {line}"
        for i, line in enumerate(lines)
        if not line.startswith(("ok ", "exit "))
    ]
    if len(lines) < trials or not lines[-1].startswith("exit "):
        failures.append(
            f"child stopped after {len(lines)} of {trials} trials (rc {proc.returncode})"
        )
    else:
        _, sent_at, *helpers = lines[-1].split()
        took = ended - float(sent_at)
        if proc.returncode == 0 or "KeyboardInterrupt" not in stderr or took > LIMIT_S:
            failures.append(f"exit trial: rc {proc.returncode}, {took:.2f} s after the Ctrl-C")
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


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ctrl_c_at_a_random_moment_stops_the_training_loop(config: str, tmp_path: Path) -> None:
    """Ctrl-C pressed anywhere in a training loop over large batches raises KeyboardInterrupt in
    the loop within 2 s, prints no ``Exception ignored``, and leaves no thread or helper."""
    total = int(os.environ.get("THREADLOADER_CTRL_C_TRIALS", DEFAULT_TRIALS))
    failures: list[str] = []
    failed_trials = 0
    for seed, start in enumerate(range(0, total, PER_CHILD)):
        child = _run_child(config, min(PER_CHILD, total - start), seed, tmp_path)
        failed_trials += sum(line.startswith(("trial", "exit trial")) for line in child)
        failures += child
    assert not failures, f"{failed_trials} of {total} trials failed:\n" + "\n".join(failures)
