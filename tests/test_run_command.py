"""``python -m threadloader run``: a script runs as ``python SCRIPT`` runs it, on ThreadDataLoaders.

Each test runs the same script both ways, in parallel, and compares what python itself did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    }
    print(json.dumps(seen))

if __name__ == "__main__":
    main()
    if "--fail" in sys.argv:
        raise ValueError("the script's own error")
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""


def _env() -> dict[str, str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONSTARTUP", None)
    return env


def _both(
    cwd: Path, target: list[str], run_options: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """(``python TARGET``, ``python -m threadloader run OPTIONS TARGET``), run concurrently."""
    commands = [
        [sys.executable, *target],
        [sys.executable, "-m", "threadloader", "run", *run_options, *target],
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in commands
    ]
    done = []
    for cmd, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done[0], done[1]


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train.py"
    script.write_text(PROBE)
    return script


def test_script_sees_what_python_gives_it(probe: Path) -> None:
    """argv, __name__, sys.path[0], __file__ and batches as under python; loaders are ours; no
    output of our own."""
    plain, ours = _both(probe.parent.parent, ["scripts/train.py", "--lr", "0.1", "-v"])
    assert plain.returncode == ours.returncode == 0, plain.stderr + ours.stderr
    assert ours.stderr == plain.stderr == ""
    expected, seen = json.loads(plain.stdout), json.loads(ours.stdout)
    assert expected["loader"] == "DataLoader" and seen["loader"] == "ThreadDataLoader"
    assert seen["subclass"] == expected["subclass"] == "Mine"
    assert seen["argv"] == ["scripts/train.py", "--lr", "0.1", "-v"]
    for key in ("argv", "name", "path0", "file", "batches", "main_module"):
        assert seen[key] == expected[key], key


def test_module_form_runs_as_python_dash_m(probe: Path) -> None:
    """``run -m pkg.mod ARGS``: as ``python -m pkg.mod ARGS``."""
    (probe.parent / "__init__.py").write_text("")
    plain, ours = _both(probe.parent.parent, ["-m", "scripts.train", "--epochs", "2"])
    assert plain.returncode == ours.returncode == 0, plain.stderr + ours.stderr
    expected, seen = json.loads(plain.stdout), json.loads(ours.stdout)
    assert seen["loader"] == "ThreadDataLoader"
    for key in ("argv", "name", "path0", "file", "batches"):
        assert seen[key] == expected[key], key


@pytest.mark.parametrize(
    ("target", "status"),
    [
        (["scripts/train.py", "--fail"], 1),  # the script's traceback, from its own frame
        (["scripts/train.py", "--exit", "3"], 3),
        (["scripts/missing.py"], 2),
        (["-m", "scripts.missing"], 1),
    ],
    ids=["raises", "sys-exit", "missing-script", "missing-module"],
)
def test_errors_are_the_scripts_own(probe: Path, target: list[str], status: int) -> None:
    """Exit status and stderr are exactly python's: no threadloader frame, message or status."""
    plain, ours = _both(probe.parent.parent, target)
    assert plain.returncode == status
    assert ours.returncode == plain.returncode
    assert ours.stderr == plain.stderr
    assert "threadloader" not in ours.stderr


def test_report_prints_every_loaders_stats(tmp_path: Path) -> None:
    """--report: one entry per loader iterated, with where it was built, on stderr at the end;
    --log-every shows the throughput lines; stdout stays the script's."""
    script = tmp_path / "report.py"
    script.write_text(
        textwrap.dedent(
            """\
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
        )
    )
    cmd = [sys.executable, "-m", "threadloader", "run", "--report", "--log-every", "0.05"]
    proc = subprocess.run(
        [*cmd, str(script)], env=_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert "2 loader(s) built, 1 iterated" in proc.stderr
    assert f"[loader 1] built at {script}:13, num_workers=2" in proc.stderr
    assert "threadloader: 4 batches in" in proc.stderr
    assert "batches/s" in proc.stderr.split("threadloader run:")[0]  # a --log-every line


def test_scripts_own_processes_are_unaffected(tmp_path: Path) -> None:
    """A script's own multiprocessing (spawn: a new interpreter imports the script) works."""
    script = tmp_path / "pool.py"
    script.write_text(
        textwrap.dedent(
            """\
            import multiprocessing as mp

            def square(x):
                return x * x

            if __name__ == "__main__":
                with mp.get_context("spawn").Pool(2) as pool:
                    print(pool.map(square, range(5)))
            """
        )
    )
    plain, ours = _both(tmp_path, ["pool.py"])
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout == "[0, 1, 4, 9, 16]\n"


def test_bad_options_are_usage_errors(probe: Path) -> None:
    """Our options are parsed before the script: a bad one is one line and status 2."""
    cmd = [sys.executable, "-m", "threadloader", "run", "--isolation", "thread", str(probe)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("python -m threadloader run: error: argument --isolation")
    assert proc.stderr.count("\n") == 1
