"""``isolation="auto"`` in a script that runs another Python thread (a progress bar's monitor):
helpers come from a forkserver, which ``auto`` starts as soon as the first epoch says the workers
should move, so a later epoch's helpers start at once instead of waiting for an interpreter to
import torch. Real scripts in subprocesses: the forkserver is process-wide.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from test_helpers_and_the_main_module import _PRELUDE, _PROCESS_BODY, _REPO, _run

from threadloader.isolation import helper_source

#: Mid-epoch checks from the first batch on; epochs of any length move once the server is
#: ready, none before (a cold server's start is never won back).
_WARM_PRELUDE = (
    _PRELUDE
    + """
import multiprocessing.forkserver, time
from threadloader.isolation import helper_source, mid_epoch
mid_epoch.MEASURE_S = mid_epoch.CHECK_EVERY_S = 0.0
auto.MIN_EPOCH_S, auto.MIN_EPOCH_S_SERVER = 0.0, 1e9

class Many(Items):
    def __len__(self):
        return 256  # batches to check a move after, before the sampler is done

def server_pid():
    return multiprocessing.forkserver._forkserver._forkserver_pid
"""
)

_BODY = """
monitor.start()
loader = ThreadDataLoader(Many(), batch_size=4, num_workers=2)
first = [b.tolist() for b in loader]
print("SERVER AFTER THE FIRST EPOCH", server_pid() is not None, flush=True)
modes, reasons = [], []
deadline = time.monotonic() + 60
while time.monotonic() < deadline and "process" not in modes:
    assert [b.tolist() for b in loader] == first
    modes.append(loader.stats().mode)
    reasons.append(loader.stats().mode_reason)
    time.sleep(0.05)
print("MODES", modes, flush=True)
print("WAITED", reasons[0], flush=True)
print("READY", helper_source.forkserver_is_ready(), flush=True)
print("MARK", helper_source.mark_path(server_pid()), flush=True)
stop.set()
"""


def _line(stdout: str, key: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(key))[len(key) + 1 :]


def test_a_forkserver_started_in_the_first_epoch_moves_short_epochs_once_ready(
    tmp_path: Path,
) -> None:
    proc = _run(tmp_path, _BODY, guarded=True, prelude=_WARM_PRELUDE)
    assert proc.returncode == 0, proc.stderr
    assert _line(proc.stdout, "SERVER AFTER THE FIRST EPOCH") == "True"
    modes = _line(proc.stdout, "MODES")
    assert modes.endswith("'process']"), modes
    assert modes.startswith("['threads'"), modes  # the server was importing torch
    assert "is still importing torch" in _line(proc.stdout, "WAITED")
    assert _line(proc.stdout, "READY") == "True"
    # The forkserver removed its mark when the script's exit ended it, and the script its folder.
    mark = _line(proc.stdout, "MARK")
    assert not os.path.exists(os.path.dirname(mark))


_RESTARTED = """
import multiprocessing, os, signal, time
from threadloader.isolation import helper_source

def nothing():
    pass

def ready_within(seconds):
    deadline = time.monotonic() + seconds
    while not helper_source.forkserver_is_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    return helper_source.forkserver_is_ready()

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    helper_source.helper_context(ctx)  # threadloader's preloads, as a helper's start sets them
    first = ctx.Process(target=nothing)  # multiprocessing starts the server itself
    first.start()
    first.join()
    print("FIRST", ready_within(30), flush=True)
    os.kill(helper_source._server_pid(), signal.SIGKILL)
    time.sleep(0.3)
    second = ctx.Process(target=nothing)  # multiprocessing starts another: the first died
    second.start()
    second.join()
    print("SECOND", second.exitcode, ready_within(30), flush=True)
"""


def test_a_forkserver_multiprocessing_starts_itself_is_ready_too(tmp_path: Path) -> None:
    """A helper's start starts the server when none runs (an epoch that moves before any
    warm-up), and starts another when the first died (a Ctrl-C): each marks itself ready."""
    (tmp_path / "train.py").write_text(_RESTARTED)
    proc = _run_in(tmp_path, "train.py")
    assert proc.returncode == 0, proc.stderr
    assert _line(proc.stdout, "FIRST") == "True", proc.stdout
    assert _line(proc.stdout, "SECOND") == "0 True", proc.stdout


def test_a_forkserver_is_ready_in_a_temporary_folder_changed_after_the_import(
    tmp_path: Path,
) -> None:
    """The script sets ``tempfile.tempdir`` after importing threadloader: the server, a fresh
    interpreter, knows nothing of it, and marks itself at the path it was given."""
    moved = (
        "import atexit, shutil, tempfile\n"
        "tempfile.tempdir = tempfile.mkdtemp(prefix='tl-moved-')\n"  # short: the server's socket
        "atexit.register(shutil.rmtree, tempfile.tempdir, True)\n"
    )
    proc = _run(
        tmp_path, moved + _BODY.replace("+ 60", "+ 30"), guarded=True, prelude=_WARM_PRELUDE
    )
    assert proc.returncode == 0, proc.stderr
    assert _line(proc.stdout, "MODES").endswith("'process']"), proc.stdout
    assert "/tl-moved-" in _line(proc.stdout, "MARK")


def test_no_forkserver_starts_for_an_unguarded_script(tmp_path: Path) -> None:
    """The forkserver imports the main script: an unguarded one would train again in it."""
    body = _BODY.replace('print("MARK"', '# print("MARK"')
    body = body.replace(
        'while time.monotonic() < deadline and "process" not in modes:', "for _ in range(3):"
    )
    proc = _run(tmp_path, body, guarded=False, prelude=_WARM_PRELUDE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("SCRIPT RAN") == 1, proc.stdout
    assert _line(proc.stdout, "SERVER AFTER THE FIRST EPOCH") == "False"
    assert _line(proc.stdout, "MODES") == "['threads', 'threads', 'threads']"
    assert "would run it again" in _line(proc.stdout, "WAITED")
    assert _line(proc.stdout, "READY") == "False"


def test_a_forkserver_is_ready_once_it_marked_itself_or_preloads_the_helper(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``forkserver_ready`` marks a server threadloader started. One started by someone else
    without threadloader's helper (a ``multiprocessing.Pool`` of the user's) would make each
    helper import torch: not ready. One whose preloads include the helper but not the mark
    (started from a preload list the user set) counts as ready."""
    pid = 2**22 + os.getpid()  # no live process
    server = types.SimpleNamespace(_forkserver_pid=None, _preload_modules=["__main__"])
    monkeypatch.setattr(multiprocessing.forkserver, "_forkserver", server)
    monkeypatch.setattr(helper_source, "_mark_folder", [str(tmp_path)])
    mark = Path(str(helper_source.mark_path(pid)))
    assert not helper_source.forkserver_is_ready()  # none runs
    server._forkserver_pid = pid
    assert not helper_source.forkserver_is_ready()  # another library's, without torch
    server._preload_modules = ["__main__", "threadloader.isolation.helper"]
    assert helper_source.forkserver_is_ready()
    server._preload_modules = ["__main__", *helper_source._PRELOAD]
    assert not helper_source.forkserver_is_ready()  # ours, still importing
    mark.touch()
    assert helper_source.forkserver_is_ready()


_DYING_PRELUDE = (
    _WARM_PRELUDE
    + """
import multiprocessing
multiprocessing.set_forkserver_preload(["__main__", "preload_that_raises"])
"""
)


def test_a_forkserver_that_dies_before_it_is_ready_is_not_started_again(tmp_path: Path) -> None:
    """A preload module that raises ends the forkserver before its mark: the next epochs stay
    in threads without starting a server each (and printing its traceback each time)."""
    (tmp_path / "preload_that_raises.py").write_text("raise RuntimeError('no forkserver here')\n")
    body = """
monitor.start()
loader = ThreadDataLoader(Many(), batch_size=4, num_workers=2)
modes = []
for _ in range(2):
    list(loader)
    modes.append(loader.stats().mode)
deadline = time.monotonic() + 60
while not helper_source.forkserver_lost() and time.monotonic() < deadline:
    time.sleep(0.05)
print("LOST", helper_source.forkserver_lost(), flush=True)
for _ in range(3):
    list(loader)
    modes.append(loader.stats().mode)
print("MODES", modes, flush=True)
print("WHY", loader.stats().mode_reason, flush=True)
stop.set()
"""
    proc = _run(tmp_path, body, guarded=True, prelude=_DYING_PRELUDE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("RuntimeError: no forkserver here") == 1, proc.stderr
    assert _line(proc.stdout, "MODES") == str(["threads"] * 5)
    assert "exited before it was ready" in _line(proc.stdout, "WHY")
    assert _line(proc.stdout, "LOST") == "True"


def test_the_forkserver_imports_the_main_script_once_for_every_helper(tmp_path: Path) -> None:
    """Helpers forked from the forkserver find the script imported there (as ``__mp_main__``):
    its top level, imports included, runs in the training process and the forkserver only, not
    once more per helper (Python 3.11-3.13's forkserver imports nothing by itself)."""
    body = _PROCESS_BODY.replace('isolation="process")', 'isolation="process", helpers=2)')
    body = body.replace("Items()", "Many()")
    proc = _run(tmp_path, body, guarded=True, prelude=_WARM_PRELUDE)
    assert proc.returncode == 0, proc.stderr
    assert "BATCHES" in proc.stdout
    assert proc.stdout.count("SCRIPT RAN") == 2, proc.stdout


def test_only_the_forkserver_imports_its_main_import_ready_mark_and_quick_exit() -> None:
    """The forkserver imports the main script before the other preloads: a script's
    ``import threadloader`` must not import these (marking the server ready before its other
    preloads, registering the quick exit before their exit handlers)."""
    import ast

    import threadloader

    package = Path(threadloader.__file__).parent
    hooks = {"forkserver_ready", "forkserver_exit", "forkserver_main"}
    importers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.rsplit(".", 1)[-1] in hooks for n in names) and path.stem not in hooks:
                importers.append(str(path.relative_to(package)))
    assert importers == []


def _helpers_in_a_thread_loop(dataset: str, printed: str) -> str:
    """A script's guarded main: a monitor thread runs, so ``isolation="process"``'s two helpers
    come from the forkserver; it prints ``printed`` (evaluated over ``loader``)."""
    return (
        "if __name__ == '__main__':\n"
        "    from threadloader import ThreadDataLoader\n"
        "    stop = threading.Event()\n"
        "    threading.Thread(target=stop.wait, daemon=True).start()\n"
        f"    loader = ThreadDataLoader({dataset}, batch_size=4, num_workers=2,"
        " isolation='process', helpers=2)\n"
        f"    print({printed}, flush=True)\n"
        "    stop.set()\n"
    )


def _run_in(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python *argv`` in ``folder``, the zygote off (helpers come from the forkserver)."""
    env = {**os.environ, "PYTHONPATH": _REPO, "THREADLOADER_ZYGOTE": "0"}
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True, text=True, timeout=90, env=env, check=False, cwd=folder,
    )  # fmt: skip


def test_a_script_in_another_folder_is_imported_by_the_forkserver_with_its_sys_path(
    tmp_path: Path,
) -> None:
    """``python scripts/train.py`` from the project's root: the script imports a module beside
    it, found through ``sys.path[0]``, which the forkserver (a ``python -c`` process started in
    the root) lacks. The server imports the script with the training process's ``sys.path``,
    once; no helper imports it again, and nothing fails on the way."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "beside.py").write_text(
        "import torch\nfrom torch.utils.data import Dataset\n"
        "class Many(Dataset):\n"
        "    def __len__(self):\n        return 64\n"
        "    def __getitem__(self, i):\n        return torch.tensor(i)\n"
    )
    (scripts / "train.py").write_text(
        "import threading\nfrom beside import Many\nprint('SCRIPT RAN', flush=True)\n"
        + _helpers_in_a_thread_loop("Many()", "'BATCHES', len(list(loader))")
    )
    proc = _run_in(tmp_path, "scripts/train.py")
    assert proc.returncode == 0, proc.stderr
    assert "BATCHES 16" in proc.stdout
    assert proc.stdout.count("SCRIPT RAN") == 2, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_module_run_with_python_m_is_imported_by_the_forkserver_once(tmp_path: Path) -> None:
    """``python -m pkg.train``: multiprocessing names the main module instead of its file, and
    each helper would run it again (its imports included); the server runs it once for them."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "import multiprocessing, threading, torch\n"
        "from torch.utils.data import Dataset\n"
        "print('SCRIPT RAN', multiprocessing.current_process().name, flush=True)\n"
        "class Many(Dataset):\n"
        "    def __len__(self):\n        return 64\n"
        "    def __getitem__(self, i):\n        return torch.tensor(i)\n"
        + _helpers_in_a_thread_loop("Many()", "'BATCHES', len(list(loader))")
    )
    proc = _run_in(tmp_path, "-m", "pkg.train")
    assert proc.returncode == 0, proc.stderr
    assert "BATCHES 16" in proc.stdout
    ran = sorted(line for line in proc.stdout.splitlines() if line.startswith("SCRIPT RAN"))
    assert ran == ["SCRIPT RAN MainProcess", "SCRIPT RAN threadloader-forkserver"], proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_forkserver_imports_the_script_with_its_arguments_and_not_as_the_main_process(
    tmp_path: Path,
) -> None:
    """A script that parses its arguments at its top level (one required) and builds its
    dataset from them: the server imports it with the training process's ``sys.argv``, so
    helpers see the value given (not a default, not an argparse exit that would end the
    server), and under a process name that is not ``"MainProcess"``."""
    (tmp_path / "train.py").write_text(
        "import argparse, multiprocessing, threading, torch\n"
        "from torch.utils.data import Dataset\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--scale', type=int, required=True)\n"
        "ARGS = parser.parse_args()\n"
        "print('SCRIPT RAN', multiprocessing.current_process().name, flush=True)\n"
        "class Scaled(Dataset):\n"
        "    def __len__(self):\n        return 64\n"
        "    def __getitem__(self, i):\n        return torch.tensor(i * ARGS.scale)\n"
        + _helpers_in_a_thread_loop("Scaled()", "'TOTAL', int(sum(b.sum() for b in loader))")
    )
    proc = _run_in(tmp_path, "train.py", "--scale", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"TOTAL {3 * sum(range(64))}" in proc.stdout, proc.stdout
    ran = sorted(line for line in proc.stdout.splitlines() if line.startswith("SCRIPT RAN"))
    assert ran == ["SCRIPT RAN MainProcess", "SCRIPT RAN threadloader-forkserver"], proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


_LONG_PRELUDE = (
    _WARM_PRELUDE
    + """
import random
from torch.utils.data import DataLoader
mid_epoch.MIN_REMAINING_S = 0.0

class Long(Dataset):
    '''Item i: i, the worker's draws from torch and random, the items its copy made before.'''
    def __init__(self):
        self.made = 0
    def __len__(self):
        return 200_000
    def __getitem__(self, i):
        made, self.made = self.made, self.made + 1
        return torch.tensor([i, int(torch.randint(0, 10**6, ())), random.randrange(10**6), made])

def seeded():
    return torch.Generator().manual_seed(3)
"""
)

_LONG_BODY = """
monitor.start()
loader = ThreadDataLoader(Long(), batch_size=4, num_workers=2, shuffle=True, generator=seeded())
ours, moved_at = [], None
deadline = time.monotonic() + 30
for batch in loader:
    ours.append(batch.tolist())
    if moved_at is None and loader.stats().mode == "process":
        moved_at = len(ours)
    if len(ours) >= (moved_at or 10**9) + 50 or time.monotonic() > deadline:
        break
print("MOVED AT", moved_at, flush=True)
print("WHY", loader.stats().mode_reason, flush=True)
theirs = []
for batch in DataLoader(Long(), batch_size=4, num_workers=2, shuffle=True, generator=seeded()):
    theirs.append(batch.tolist())
    if len(theirs) == len(ours):
        break
print("SAME AS TORCH", ours == theirs, len(ours), flush=True)
stop.set()
"""


def test_a_long_first_epoch_moves_into_forkserver_helpers_once_the_server_is_ready(
    tmp_path: Path,
) -> None:
    """A progress bar's thread runs through one long epoch: the forkserver starts mid-way and
    once it is ready the epoch's workers move into its helpers, pickled as they stand; the
    batches, the workers' draws and their copies' counts are torch's throughout."""
    proc = _run(tmp_path, _LONG_BODY, guarded=True, prelude=_LONG_PRELUDE)
    assert proc.returncode == 0, proc.stderr
    moved_at = _line(proc.stdout, "MOVED AT")
    assert moved_at != "None" and int(moved_at) > 1, proc.stdout  # threads first
    assert "first epoch" in _line(proc.stdout, "WHY")
    assert _line(proc.stdout, "SAME AS TORCH").startswith("True"), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


KILLED_BY_SIGTERM = """\
import sys, time
import torch
from torch.utils.data import Dataset
from threadloader import ThreadDataLoader

class Items(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.tensor(i)

if __name__ == "__main__":
    loader = ThreadDataLoader(
        Items(), batch_size=4, num_workers=2, isolation="process",
        multiprocessing_context="forkserver",
    )
    for i, batch in enumerate(loader):
        if i == 10:
            print("running", flush=True)
"""


def test_a_training_process_killed_by_sigterm_leaves_no_ready_mark_folder(tmp_path: Path) -> None:
    """SIGTERM's default action skips the training process's exit handlers, which remove the
    folder of its forkserver's ready marks: the forkserver, exiting once its parent is gone,
    removes it."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_BY_SIGTERM)
    # Short: the forkserver's socket lives there, and a Unix socket's path has ~100 bytes.
    temp = Path(tempfile.mkdtemp(prefix="tl-", dir="/tmp" if os.path.isdir("/tmp") else None))
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(_REPO)}
    try:
        proc = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "running\n"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while any(p.name.startswith("threadloader-forkserver-") for p in temp.iterdir()):
            assert time.monotonic() < deadline, sorted(p.name for p in temp.iterdir())
            time.sleep(0.1)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
