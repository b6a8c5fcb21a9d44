"""``python -m threadloader compare`` prints a table of every loader, JSON for machines, a plot,
and answers bad input with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import importlib
import io
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from threadloader.__main__ import build_parser, main
from threadloader.compare import runner

# Tiny runs: these tests check the command, not the loaders' speed.
QUICK = ["--batches", "20", "--rounds", "1", "--no-progress"]
CORE = ["--loaders", "thread,dataloader,dataloader0"]
LABELS = {
    "thread": "ThreadDataLoader(num_workers=2)",
    "dataloader": "DataLoader(num_workers=2)",
    "dataloader0": "DataLoader(num_workers=0)",
    "torchdata": "torchdata.nodes (2 threads)",
    "spdl": "SPDL DataLoader (2 threads)",
}

USER_MODULE = """
import time
import torch
from torch.utils.data import Dataset, IterableDataset

class Squares(Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return {"x": torch.tensor([i * i]), "i": i}

class Counting(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(3 * i, 3 * i + 3) for i in range(1000))

class Broken(Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        raise KeyError(f"no sample {i}\\nsecond line")

class Sleepy(Dataset):
    def __len__(self):
        return 400
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor([i])

class Flaky(Squares):
    def __getitem__(self, i):
        if i % 10 == 3:
            raise ValueError(f"sample {i} is corrupt")
        return super().__getitem__(i)

READS = []

class Recorded(Squares):
    def __getitem__(self, i):
        READS.append(i)
        return super().__getitem__(i)

def make_squares():
    return Squares()

def make_recorded():
    return Recorded()

def make_sleepy():
    return Sleepy()

def make_flaky():
    return Flaky()

class One(IterableDataset):
    def __iter__(self):
        return iter([torch.tensor([0])])

def make_counting():
    return Counting()

def make_one():
    return One()

def make_broken():
    return Broken()

def make_generator():
    return (i for i in range(3))

def make_empty():
    return []

def raises():
    raise RuntimeError("cannot open the bucket\\nmore detail")

not_callable = 42
squares = Squares()
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module named ``compare_user_data`` on sys.path and PYTHONPATH; returns its name."""
    name = "compare_user_data"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    sys.modules.pop(name, None)
    return name


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the command in a fresh interpreter, as a user would."""
    env = {**os.environ}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "threadloader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``main(argv)`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors and --help
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_default_table_lists_every_loader() -> None:
    """The table has a row for each loader, or says why one did not run; stderr stays quiet."""
    proc = _cli("compare", "--workload", "python", *QUICK)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("loader"))
    for column in ("samples/s", "1st batch", "peak PSS", "data wait", "vs DataLoader(2)"):
        assert column in header
    for key, label in LABELS.items():
        row = [line for line in lines if line.startswith(label)]
        skipped = [line for line in lines if line.startswith(f"not run: {label}: ")]
        if key in ("thread", "dataloader", "dataloader0"):
            assert len(row) == 1, proc.stdout
        else:
            assert len(row) + len(skipped) == 1, proc.stdout
    baseline = next(line for line in lines if line.startswith(LABELS["dataloader"]))
    assert baseline.endswith("1.00x")
    assert lines[-1] == (
        "other workloads: --workload tokens|images|tensors (python holds the GIL throughout); "
        "your own dataset: --dataset module:factory."
    )


def test_json_has_the_medians_and_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints only JSON: config, dataset, one result per loader with its runs."""
    argv = ["compare", "--workload", "tokens", "--json", *QUICK, *CORE, "--rounds", "2"]
    code, out, _ = _main(argv, capsys)
    assert code == 0
    data = json.loads(out)
    assert data["baseline"] == "dataloader"
    assert data["dataset"]["name"] == "tokens" and data["dataset"]["batch_size"] == 16
    assert data["config"]["rounds"] == 2 and data["config"]["batches"] == 20
    assert [r["loader"] for r in data["results"]] == ["thread", "dataloader", "dataloader0"]
    for r in data["results"]:
        assert r["samples_per_s"] > 0 and r["first_batch_s"] > 0
        assert 0 <= r["data_wait_fraction"] <= 1
        assert r["peak_pss_bytes"] > 0
        assert r["ratio_vs_baseline"] > 0
        assert len(r["runs"]) == 2
        for run in r["runs"]:
            assert run["batches"] == 20 and run["samples"] == 20 * 16
            assert run["wait_s"] <= run["elapsed_s"]
    base = next(r for r in data["results"] if r["loader"] == "dataloader")
    assert base["ratio_vs_baseline"] == pytest.approx(1.0)


def test_runs_last_one_second_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --batches or --seconds each run is timed for 1 s: past every loader's start-up.

    The runner's clock is a fake one, advancing 1/64 s per reading (exact in binary): the timed
    loop reads it twice per batch, so a 1 s run takes exactly 32 batches, however fast the
    machine is."""
    ticks = itertools.count()
    fake_time = types.SimpleNamespace(perf_counter=lambda: next(ticks) / 64, sleep=time.sleep)
    monkeypatch.setattr(runner, "time", fake_time)
    argv = ["compare", "--workload", "tokens", "--loaders", "dataloader0", "--rounds", "1"]
    code, out, _ = _main([*argv, "--json", "--no-progress"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["config"]["seconds"] == 1.0 and data["config"]["batches"] is None
    (run,) = data["results"][0]["runs"]
    assert run["batches"] == 32 and not run["ran_out"]


def test_the_demo_runs_the_tensors_workload_and_python_is_one_flag_away() -> None:
    """The default workload is one threads are for (numpy releasing the GIL); the GIL-bound
    case is --workload python."""
    parser = build_parser()
    assert parser.parse_args(["compare"]).workload == "tensors"
    assert runner.CompareConfig().workload == "tensors"
    assert parser.parse_args(["compare", "--workload", "python"]).workload == "python"


def test_a_loader_without_workers_gets_no_warm_up_batches(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DataLoader(num_workers=0) makes nothing ahead of the loop: after its first batch the
    clock starts at once, so it reads exactly 1 + --batches batches; a loader with 2 workers
    first takes the 2 x 2 batches they made while the first was awaited."""
    argv = ["compare", "--dataset", f"{user_module}:make_recorded", "--batch-size", "2"]
    argv += ["--batches", "20", "--rounds", "1", "--no-progress", "--json"]
    reads = importlib.import_module(user_module).READS
    code, out, err = _main([*argv, "--loaders", "dataloader0"], capsys)
    assert code == 0, err
    assert len(reads) == (1 + 20) * 2
    assert json.loads(out)["results"][0]["runs"][0]["batches"] == 20
    reads.clear()
    code, out, err = _main([*argv, "--loaders", "thread"], capsys)
    assert code == 0, err
    assert len(reads) == (1 + 4 + 20) * 2


def test_progress_is_one_line_per_run_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """While it measures, stderr says which run of how many (no tqdm needed); stdout keeps
    only the table."""
    argv = ["compare", "--workload", "python", "--batches", "20", "--rounds", "2", *CORE]
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    lines = err.splitlines()
    assert len(lines) == 6, err
    assert lines[0] == f"[1/6] measuring {LABELS['thread']}, round 1 of 2"
    assert all(line.startswith(f"[{i}/6] measuring ") for i, line in enumerate(lines, 1))
    assert "s left" in lines[-1]
    assert "[" not in out and LABELS["thread"] in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_rewritten_then_erased(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a terminal the progress line is rewritten in place and erased before the table."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["compare", "--workload", "python", "--batches", "20", "--rounds", "1", *CORE]
    code, out, _ = _main(argv, capsys)
    assert code == 0
    err = terminal.getvalue()
    assert "\n" not in err
    updates = err.split("\r")
    assert [u.split("]")[0] for u in updates if u.strip()] == ["[1/3", "[2/3", "[3/3"]
    assert updates[-2].strip() == "" and updates[-1] == ""  # erased: blanks, then back to col 0
    assert LABELS["thread"] in out


def test_seconds_bounds_a_run_and_step_ms_lowers_data_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--seconds stops a run by time (each batch has a 5 ms step, so 0.2 s holds at most ~40
    batches); a step after each batch is not data wait."""
    argv = ["compare", "--workload", "python", "--seconds", "0.2", "--rounds", "1"]
    argv += ["--loaders", "thread,dataloader0", "--step-ms", "5", "--json", "--no-progress"]
    code, out, _ = _main(argv, capsys)
    assert code == 0
    for r in json.loads(out)["results"]:
        (run,) = r["runs"]
        assert 2 <= run["batches"] <= 0.2 / 0.005 + 1
        assert run["data_wait_fraction"] < 0.9  # most of each iteration is the 5 ms step
        assert r["ratio_vs_baseline"] is None  # DataLoader(2) did not run


def test_no_thread_outlives_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Every loader, the memory sampler and the progress bar are stopped when main returns."""
    before = set(threading.enumerate())
    code, _, _ = _main(["compare", "--workload", "python", *QUICK], capsys)
    assert code == 0
    deadline = time.monotonic() + 10  # torchdata joins its threads with a timeout
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nope"], "invalid choice: 'nope'"),
        (["--batches", "0"], "--batches: expected a positive integer, got '0'"),
        (["--seconds", "-1"], "--seconds: expected a positive number"),
        (["--num-workers", "0"], "--num-workers: expected a positive integer"),
        (["--rounds", "two"], "--rounds: expected a positive integer"),
        (["--batch-size", "-4"], "--batch-size: expected a positive integer"),
        (["--step-ms", "-1"], "--step-ms: expected a number >= 0"),
        (["--loaders", "thread,nope"], "unknown loader 'nope'"),
        (["--batches", "2", "--seconds", "1"], "not allowed with argument --batches"),
        (["--dataset", "no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
        (["--dataset", "os"], "expects module:factory"),
        (["--plot", "/no/such/folder/out.png"], "folder '/no/such/folder' does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each mistake gets one line on stderr naming it, exit status 2, nothing on stdout."""
    code, out, err = _main(["compare", *args, *QUICK], capsys)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("missing", "'compare_user_data' has no attribute 'missing'"),
        ("raises", "compare_user_data:raises() raised RuntimeError: cannot open the bucket"),
        ("not_callable", "is a int, not a factory or a dataset"),
        ("make_generator", "returned a generator, not a dataset"),
        ("make_empty", "is empty"),
        ("make_broken", "DataLoader(num_workers=0) failed: KeyError"),
    ],
)
def test_bad_dataset_exits_2_with_one_line(
    user_module: str, factory: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory that is missing, raises, or returns no usable dataset is one line, status 2."""
    argv = ["compare", "--dataset", f"{user_module}:{factory}", *QUICK, "--loaders", "dataloader0"]
    code, out, err = _main(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err, err


def test_bad_dataset_in_a_fresh_interpreter_prints_no_traceback(user_module: str) -> None:
    """Run as a user would, a factory that raises gives one line and status 2."""
    proc = _cli("compare", "--dataset", f"{user_module}:raises", *QUICK)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "RuntimeError: cannot open the bucket" in proc.stderr


def test_user_dataset_factory_from_pythonpath(user_module: str) -> None:
    """--dataset module:factory loads the user's map-style dataset; --batch-size applies."""
    dataset = f"{user_module}:make_squares"
    proc = _cli("compare", "--dataset", dataset, "--batch-size", "4", "--json", *QUICK, *CORE)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["dataset"]["map_style"] is True and data["dataset"]["batch_size"] == 4
    for r in data["results"]:
        assert r["runs"][0]["samples"] == 20 * 4  # counted from the dict batch's first tensor


@pytest.mark.parametrize("target", ["make_counting", "squares"])
def test_iterable_dataset_and_dataset_object(
    user_module: str, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An IterableDataset runs on the loaders that take one; torchdata and SPDL say why not.

    ``module:name`` may also name a dataset object instead of a factory.
    """
    argv = ["compare", "--dataset", f"{user_module}:{target}", "--batch-size", "5", *QUICK]
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    assert out.count("\n" + LABELS["thread"]) == 1
    if target == "make_counting":
        for key in ("torchdata", "spdl"):
            assert f"not run: {LABELS[key]}: " in out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes a PNG bar chart and still prints the table."""
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "compare.png"
    code, out, err = _main(
        ["compare", "--workload", "python", "--plot", str(out_png), *QUICK, *CORE], capsys
    )
    assert code == 0, err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {out_png}" in out


def test_plot_without_an_extension_writes_and_names_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot out (no extension) writes out.png, and the message names that file."""
    pytest.importorskip("matplotlib")
    code, out, err = _main(
        ["compare", "--workload", "python", "--plot", str(tmp_path / "out"), *QUICK, *CORE], capsys
    )
    assert code == 0, err
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {tmp_path / 'out.png'}" in out


def test_plot_to_a_directory_is_one_line_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot naming a directory fails at once, status 2 (it used to write <dir>.png)."""
    pytest.importorskip("matplotlib")
    code, out, err = _main(["compare", "--plot", str(tmp_path), *QUICK], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "it is a directory" in err, err
    assert not Path(str(tmp_path) + ".png").exists()


def test_no_chosen_loader_able_to_run_is_one_line(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only loaders that cannot read an IterableDataset chosen: one line naming why, status 2."""
    argv = ["compare", "--dataset", f"{user_module}:make_counting", "--loaders", "torchdata,spdl"]
    code, out, err = _main([*argv, *QUICK], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "none of the chosen loaders can run" in err, err


def test_plot_without_matplotlib_is_one_line_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without matplotlib, --plot fails at once (nothing measured) with an install hint."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail

    def no_run(config: Any) -> Any:
        raise AssertionError("measured before checking --plot")

    monkeypatch.setattr(runner, "run_compare", no_run)
    code, out, err = _main(["compare", "--plot", str(tmp_path / "x.png"), *QUICK], capsys)
    assert code == 2 and out == ""
    assert err == "python -m threadloader compare: error: --plot needs matplotlib: " + (
        "pip install threadloader[compare]\n"
    )
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [("no/such/folder/out.png", "does not exist"), ("", "give a file name")],
)
def test_a_bad_plot_path_is_named_first_even_without_matplotlib(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    message: str,
) -> None:
    """The path is checked before matplotlib: a missing folder is the user's first mistake
    (README's test command installs no matplotlib)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = str(tmp_path / name) if name else name
    code, out, err = _main(["compare", "--plot", path, *QUICK], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err and "matplotlib" not in err, err


def test_an_unwritable_plot_folder_is_one_line_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder the user may not write to fails before measuring."""
    real_access = os.access
    folder = str(tmp_path)
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if p == folder else real_access(p, mode)
    )  # root may write anywhere: pretend this folder is read-only
    monkeypatch.setattr(runner, "run_compare", lambda config: pytest.fail("measured"))
    code, out, err = _main(["compare", "--plot", str(tmp_path / "x.png"), *QUICK], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "is not writable" in err, err


def test_missing_optional_packages_are_noted_not_fatal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without psutil, torchdata and SPDL the table still prints, and says what is missing."""
    for name in (
        "threadloader.compare.memory_probe",
        "psutil",
        "torchdata.nodes",
        "spdl.dataloader",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # makes importing it fail
    code, out, err = _main(["compare", "--workload", "python", *QUICK], capsys)
    assert code == 0, err
    assert f"not run: {LABELS['torchdata']}: not installed (pip install torchdata)" in out
    assert f"not run: {LABELS['spdl']}: not installed (pip install spdl)" in out
    assert "peak memory not measured: pip install psutil" in out
    row = next(line for line in out.splitlines() if line.startswith(LABELS["thread"]))
    assert " n/a " in row


@pytest.mark.parametrize("factory", ["make_broken", "make_flaky"])
def test_spdl_failing_on_the_dataset_is_one_line(
    user_module: str, factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPDL logs and drops a failing item by default: compare makes it fail as torch does,
    instead of hanging on tracebacks (every item fails) or timing the items that worked."""
    pytest.importorskip("spdl.dataloader")
    argv = ["compare", "--dataset", f"{user_module}:{factory}", "--loaders", "spdl"]
    code, out, err = _main([*argv, "--batches", "20", "--rounds", "1", "--no-progress"], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert f"{LABELS['spdl']} failed: " in err and "Error" in err, err


def test_timed_batches_exclude_work_done_before_the_clock(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dataset of 10 ms items cannot make more than 100 samples/s per worker: batches the
    workers made while the loop awaited the first are warm-up, not timed (timing 1 batch
    after the first used to report 170,000 samples/s)."""
    argv = ["compare", "--dataset", f"{user_module}:make_sleepy", "--batch-size", "4"]
    argv += ["--batches", "20", "--rounds", "1", "--no-progress", "--json"]
    code, out, err = _main([*argv, "--loaders", "thread,dataloader0"], capsys)
    assert code == 0, err
    rates = {r["loader"]: r["samples_per_s"] for r in json.loads(out)["results"]}
    assert 0 < rates["thread"] <= 1.1 * 2 * 100, rates  # 2 workers
    assert 0 < rates["dataloader0"] <= 1.1 * 100, rates


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        ("dataloader0", "the first starts the loader up, and at least one more is timed"),
        ("thread", "the first 5 start the loader up (the first batch, and 4 made ahead"),
    ],
)
def test_a_dataset_too_short_to_time_says_how_many_batches_start_up(
    user_module: str, loader: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An iterable that ends after its first batch leaves nothing to time: one line saying
    how many batches start each loader up (none made ahead without workers)."""
    argv = ["compare", "--dataset", f"{user_module}:make_one", "--batch-size", "1"]
    code, out, err = _main([*argv, *QUICK, "--loaders", loader], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "too few batches to time: " + message in err, err


@pytest.mark.parametrize(
    ("name", "message"),
    [("out.xyz", "matplotlib cannot write .xyz files"), ("", "give a file name")],
)
def test_unwritable_plot_name_is_one_line_before_any_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    message: str,
) -> None:
    """A format matplotlib cannot write, or no file name at all, fails before measuring."""
    pytest.importorskip("matplotlib")

    def no_run(config: Any) -> Any:
        raise AssertionError("measured before checking --plot")

    monkeypatch.setattr(runner, "run_compare", no_run)
    path = str(tmp_path / name) if name else name
    code, out, err = _main(["compare", "--plot", path, *QUICK], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and message in err, err


def test_plot_name_ending_in_a_dot_names_the_file_matplotlib_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot out. writes out.png (matplotlib drops the dot), and the message says so."""
    pytest.importorskip("matplotlib")
    code, out, err = _main(
        ["compare", "--workload", "python", "--plot", str(tmp_path / "out."), *QUICK, *CORE],
        capsys,
    )
    assert code == 0, err
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {tmp_path / 'out.png'}" in out


def test_a_plot_failing_after_the_run_keeps_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the plot cannot be written after measuring (disk full...), the table is still
    printed, then the one-line error and status 2."""
    pytest.importorskip("matplotlib")

    def failing_plot(result: Any, path: str) -> str:
        raise runner.CompareError(f"cannot write plot {path!r}: No space left on device")

    monkeypatch.setattr(runner, "write_plot", failing_plot)
    argv = ["compare", "--workload", "python", "--plot", str(tmp_path / "x.png"), *QUICK, *CORE]
    code, out, err = _main(argv, capsys)
    assert code == 2
    assert "samples/s" in out and LABELS["thread"] in out
    assert len(err.splitlines()) == 1 and "No space left" in err, err


def test_too_few_timed_batches_for_the_workers_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two workers deliver batches two at a time: fewer than 20 timed batches is refused."""
    argv = ["compare", "--workload", "python", "--rounds", "1", "--no-progress"]
    code, out, err = _main([*argv, "--batches", "5"], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "at least 20 with 2 workers" in err, err
