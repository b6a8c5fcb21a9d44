"""The examples run as their docstrings say, from any folder, and write nothing into it: their
checkpoints and caches go to ``--out`` or the system's temporary directory. An example whose
optional package is missing says in one line which extra installs it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

pytestmark = pytest.mark.skipif(
    not EXAMPLES.is_dir(), reason="needs the repository's examples/ (tests run from a checkout)"
)


def _run(args: list[str], cwd: Path, tmpdir: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` in ``cwd`` with ``tmpdir`` as the system's temporary directory."""
    env = {
        **os.environ,
        "TMPDIR": str(tmpdir),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


def _left_in(tmpdir: Path) -> list[str]:
    """What the example left in the temporary folder, less torch's own compile cache."""
    return [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    """An empty folder to run an example in."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


@pytest.fixture
def tmpdir_() -> Iterator[Path]:
    """The folder an example sees as the system's temporary directory.

    A short path in the system's: multiprocessing puts the forkserver's socket there, and a
    Unix socket path has at most 107 bytes (pytest's per-test folders under pytest-xdist came
    close enough that the helpers could not start).
    """
    folder = Path(tempfile.mkdtemp(prefix="tl-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_remote_images_caches_in_a_temporary_folder(cwd: Path, tmpdir_: Path) -> None:
    """Two epochs over 1,024 JPEGs, the second from the cache, which is removed at the end."""
    pytest.importorskip("PIL")
    proc = _run([str(EXAMPLES / "remote_images.py")], cwd, tmpdir_)
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1: 1024 images" in proc.stdout and "epoch 2: 1024 images" in proc.stdout
    assert "cache_hits=1024" in proc.stdout
    assert list(cwd.iterdir()) == []
    assert _left_in(tmpdir_) == []


def test_remote_images_reports_the_cached_epoch_when_auto_moves_it_to_helpers(
    cwd: Path, tmpdir_: Path
) -> None:
    """A loaded machine can make isolation="auto" move epoch 2 into helper processes: the
    example still reports that epoch's cache hits (the helpers' counters, not this process's)."""
    pytest.importorskip("PIL")
    force_a_move = (
        "import runpy, sys; from threadloader.isolation import auto; "
        "auto.held_the_gil = lambda stats: True; auto.loop_pace = lambda stats: 1.0; "
        "auto.MIN_EPOCH_S = auto.MIN_EPOCH_S_SERVER = 0.0; "
        f"sys.argv = [{str(EXAMPLES / 'remote_images.py')!r}]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = _run(["-c", force_a_move], cwd, tmpdir_)
    assert proc.returncode == 0, proc.stderr
    assert "cache_hits=1024, cache_misses=0" in proc.stdout


def test_remote_images_without_pillow_names_the_extra(cwd: Path, tmpdir_: Path) -> None:
    """Without Pillow the example stops with one line naming the install command."""
    script = str(EXAMPLES / "remote_images.py")
    code = (
        "import runpy, sys; sys.modules['PIL'] = None; "  # makes `from PIL import ...` fail
        f"sys.argv = [{script!r}]; runpy.run_path({script!r}, run_name='__main__')"
    )
    proc = _run(["-c", code], cwd, tmpdir_)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert (
        proc.stderr == "examples/remote_images.py needs Pillow: pip install threadloader[images]\n"
    )


def test_pretrain_tokens_resumes_exactly_and_cleans_up(cwd: Path, tmpdir_: Path) -> None:
    """The mix changes live, the resumed run repeats the same batches, nothing is left."""
    proc = _run([str(EXAMPLES / "pretrain_tokens.py")], cwd, tmpdir_)
    assert proc.returncode == 0, proc.stderr
    assert "same 50 batches: True, same losses: True" in proc.stdout
    # "steps   0- 59: 0.300 (set: 0.300)": where the change lands depends on prefetching
    shares = re.findall(r"steps +\d+- *\d+: (\S+) \(set: (\S+)\)", proc.stdout)
    assert shares == [("0.300", "0.300"), ("0.700", "0.700")], proc.stdout
    assert list(cwd.iterdir()) == []
    assert _left_in(tmpdir_) == []


def test_lightning_example_checkpoints_under_the_temporary_folder(cwd: Path, tmpdir_: Path) -> None:
    """Without --out, checkpoints and logs go to <tmp>/threadloader-lightning-example."""
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        pytest.importorskip("pytorch_lightning", reason="needs Lightning")
    proc = _run([str(EXAMPLES / "lightning_train.py"), "--stop-at", "10"], cwd, tmpdir_)
    assert proc.returncode == 0, proc.stderr
    out = tmpdir_ / "threadloader-lightning-example"
    assert f"stopped at step 10, batch 10 of epoch 0; last checkpoint: {out}" in proc.stdout
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert list(cwd.iterdir()) == []


def test_torchrun_example_checkpoints_under_out(cwd: Path, tmpdir_: Path) -> None:
    """--out names the folder each rank writes its checkpoint to."""
    out = tmpdir_ / "run1"
    script = str(EXAMPLES / "torchrun_train.py")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script]
    proc = _run([*launch, "--stop-at", "15", "--out", str(out)], cwd, tmpdir_)
    assert proc.returncode == 0, proc.stderr
    assert "[1 ranks] step 15 (epoch 0): stopping" in proc.stdout
    assert {p.name for p in out.iterdir()} == {"rank0.pt", "world.json"}
    assert list(cwd.iterdir()) == []
