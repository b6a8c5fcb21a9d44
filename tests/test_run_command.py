"""``python -m threadloader run``: a script runs as ``python SCRIPT`` runs it, on ThreadDataLoaders.

Each test runs the same script both ways, in parallel, and compares what python itself did.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import threadloader
from threadloader.integrations import run

REPO = Path(__file__).resolve().parents[1]

PROBE = """\
import json, os, sys
import torch
from torch.utils.data import DataLoader

class Mine(DataLoader):
    pass

def main():
    loader = DataLoader(list(range(10)), batch_size=4, num_workers=2)
    batches = [b.tolist() for b in loader]
    seen = {
        "argv": sys.argv, "name": __name__, "path0": sys.path[0], "file": __file__,
        "batches": batches, "loader": type(loader).__name__,
        "subclass": type(Mine(list(range(4)))).__name__,
        "main_module": sys.modules["__main__"].__dict__ is globals(),
        "globals": sorted(k for k in globals() if k.startswith("__")),
    }
    print(json.dumps(seen))

if __name__ == "__main__":
    main()
    if "--fail" in sys.argv:
        raise ValueError("the script's own error")
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""


REPORT = """\
import time
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        time.sleep(0.02)
        return i

def main():
    unused = DataLoader(Slow())
    for _ in DataLoader(Slow(), batch_size=2, num_workers=2):
        pass
    print("done")

main()
"""

POOL = """\
import multiprocessing as mp

def square(x):
    return x * x

if __name__ == "__main__":
    with mp.get_context("spawn").Pool(2) as pool:
        print(pool.map(square, range(5)))
"""

FAILS = """\
import sys
if sys.argv[1] == "raise":
    raise ValueError("the script's own error")
sys.exit(int(sys.argv[2]))
"""

RUN = ("-m", "threadloader", "run")
#: case -> (arguments after the interpreter, compare with plain python?); all run at once.
#: (Each pays torch's import, ~2 s of CPU: the cases that need no process of their own run
#: in-process below.)
CASES: dict[str, tuple[tuple[str, ...], bool]] = {
    "script": (("scripts/train.py", "--lr", "0.1", "-v"), True),
    "module": (("-m", "scripts.train", "--epochs", "2"), True),
    "raises": (("fails.py", "raise"), True),  # the script's traceback, from its own frame
    "missing-script": (("scripts/missing.py",), True),
    "report": (("--report", "--log-every", "0.05", "report.py"), False),
}


def _env() -> dict[str, str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONSTARTUP", None)
    return env


Runs = dict[tuple[str, str], subprocess.CompletedProcess[str]]


def _write_scripts(root: Path) -> None:
    (root / "scripts").mkdir()
    (root / "scripts" / "train.py").write_text(PROBE)
    (root / "scripts" / "__init__.py").write_text("")
    for name, text in (("report.py", REPORT), ("pool.py", POOL), ("fails.py", FAILS)):
        (root / name).write_text(text)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every case under ``python -m threadloader run`` and, where compared, plain ``python``,
    all started at once (each pays torch's import: run one after another they take ~45 s)."""
    root = tmp_path_factory.mktemp("run_command")
    _write_scripts(root)
    commands = {}
    for case, (args, compared) in CASES.items():
        commands[case, "ours"] = [sys.executable, *RUN, *args]
        if compared:
            commands[case, "python"] = [sys.executable, *args]
    procs = {
        key: subprocess.Popen(
            cmd, cwd=root, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for key, cmd in commands.items()
    }
    done = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        done[key] = subprocess.CompletedProcess(commands[key], proc.returncode, out, err)
    done["root", str(root)] = subprocess.CompletedProcess([], 0)  # where the scripts are
    return done


def test_script_sees_what_python_gives_it(runs: Runs) -> None:
    """argv, __name__, sys.path[0], __file__ and batches as under python; loaders are ours; no
    output of our own."""
    plain, ours = runs["script", "python"], runs["script", "ours"]
    assert plain.returncode == ours.returncode == 0, plain.stderr + ours.stderr
    assert ours.stderr == plain.stderr == ""
    expected, seen = json.loads(plain.stdout), json.loads(ours.stdout)
    assert expected["loader"] == "DataLoader" and seen["loader"] == "ThreadDataLoader"
    assert seen["subclass"] == expected["subclass"] == "Mine"
    assert seen["argv"] == ["scripts/train.py", "--lr", "0.1", "-v"]
    for key in ("argv", "name", "path0", "file", "batches", "main_module", "globals"):
        assert seen[key] == expected[key], key


def test_module_form_runs_as_python_dash_m(runs: Runs) -> None:
    """``run -m pkg.mod ARGS``: as ``python -m pkg.mod ARGS``."""
    plain, ours = runs["module", "python"], runs["module", "ours"]
    assert plain.returncode == ours.returncode == 0, plain.stderr + ours.stderr
    expected, seen = json.loads(plain.stdout), json.loads(ours.stdout)
    assert seen["loader"] == "ThreadDataLoader"
    for key in ("argv", "name", "path0", "file", "batches"):
        assert seen[key] == expected[key], key


@pytest.mark.parametrize(("case", "status"), [("raises", 1), ("missing-script", 2)])
def test_errors_are_the_scripts_own(runs: Runs, case: str, status: int) -> None:
    """Exit status and stderr are exactly python's: no threadloader frame, message or status."""
    plain, ours = runs[case, "python"], runs[case, "ours"]
    assert plain.returncode == status
    assert ours.returncode == plain.returncode
    assert ours.stderr == plain.stderr
    assert "threadloader" not in ours.stderr


def test_report_prints_every_loaders_stats(runs: Runs) -> None:
    """--report: one entry per loader iterated, with where it was built, on stderr at the end;
    --log-every shows the throughput lines; stdout stays the script's."""
    proc = runs["report", "ours"]
    root = next(k for r, k in runs if r == "root")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert "2 loader(s) built, 1 iterated" in proc.stderr
    assert f"[loader 1] built at {Path(root) / 'report.py'}:13, num_workers=2" in proc.stderr
    assert "threadloader: 4 batches in" in proc.stderr
    assert "batches/s" in proc.stderr.split("threadloader run:")[0]  # a --log-every line


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run ``run.main`` in this process: the scripts in the cwd, sys.argv/path/patch restored."""
    _write_scripts(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    logger = logging.getLogger("threadloader")  # --log-every sets it up
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "level", logger.level)
    yield tmp_path
    while threadloader.is_patched():
        threadloader.unpatch()


def test_scripts_own_processes_are_unaffected(
    in_process: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A script's own multiprocessing (spawn: a new interpreter imports the script) works."""
    assert run.main(["pool.py"]) == 0
    assert capfd.readouterr().out == "[0, 1, 4, 9, 16]\n"


def test_sys_exit_status_is_the_scripts(in_process: Path) -> None:
    """``sys.exit(3)`` in the script: SystemExit(3) out of ``python -m threadloader``."""
    with pytest.raises(SystemExit) as exit_info:
        run.main(["fails.py", "exit", "3"])
    assert exit_info.value.code == 3


def test_missing_module_reads_as_pythons(
    in_process: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``-m`` of a module that does not exist: python's one line and status 1."""
    assert run.main(["-m", "scripts.missing"]) == 1
    assert capfd.readouterr().err == f"{sys.executable}: No module named scripts.missing\n"


def test_bad_options_are_usage_errors(in_process: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Our options are parsed before the script: a bad one is one line and status 2."""
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--isolation", "thread", "scripts/train.py"])
    assert exit_info.value.code == 2
    err = capfd.readouterr().err
    assert err.startswith("python -m threadloader run: error: argument --isolation")
    assert err.count("\n") == 1
    assert not threadloader.is_patched()


def test_options_reach_the_scripts_loaders(
    in_process: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--isolation and --log-every become the options of every loader the script builds."""
    (in_process / "options.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(4)), num_workers=1)\n"
        "print(type(loader).__name__, loader.isolation, loader.log_every_s)\n"
    )
    assert run.main(["--isolation", "process", "--log-every", "30", "options.py"]) == 0
    assert capfd.readouterr().out == "ThreadDataLoader process 30.0\n"


def test_helpers_and_auto_reach_the_scripts_loaders(
    in_process: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--isolation auto and --helpers become the options of the script's loaders."""
    (in_process / "helper_opts.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader(list(range(4)), num_workers=3)\n"
        "print(loader.isolation, loader.helpers)\n"
    )
    assert run.main(["--isolation", "auto", "--helpers", "2", "helper_opts.py"]) == 0
    assert capfd.readouterr().out == "auto 2\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_device_without_cuda_is_a_usage_error(
    in_process: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--device cuda where there is none: one line, status 2, before the script runs."""
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--device", "cuda", "scripts/train.py"])
    assert exit_info.value.code == 2
    err = capfd.readouterr()
    assert err.out == "" and err.err.startswith("python -m threadloader run: error:")
    assert "CUDA" in err.err and err.err.count("\n") == 1


def test_a_ctrl_c_while_a_dropped_loaders_stats_are_kept_reaches_the_script() -> None:
    """The report's finalizer runs when a loader dies: a Ctrl-C landing in it is not lost."""
    code = textwrap.dedent("""
        import time
        from threadloader import ThreadDataLoader
        from threadloader.integrations import run

        def pressed(state, kept):
            raise KeyboardInterrupt  # a Ctrl-C landing while the finalizer runs

        run._keep_stats_parts = pressed
        report = run._Report()
        loader = ThreadDataLoader(list(range(4)))
        report(loader, "here")
        try:
            del loader
            time.sleep(5)
            print("lost")
        except KeyboardInterrupt:
            print("reached the script")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "reached the script", out.stderr
    assert "Exception ignored" not in out.stderr
