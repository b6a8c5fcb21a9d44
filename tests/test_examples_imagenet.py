"""examples/imagenet_train.py (pytorch/examples' ImageNet script shape, synthetic images, random
crops and flips in the workers): seeded, ``python -m threadloader run`` prints the losses of
``python`` with torch's DataLoader and worker processes, digit for digit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "imagenet_train.py"
ARGS = ("--dummy", "--seed", "0", "-j", "2", "-b", "8", "--steps", "6", "--images", "96")


@pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the repository's examples/")
def test_first_losses_equal_torchs(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    commands = [
        [sys.executable, str(SCRIPT), *ARGS],
        [sys.executable, "-m", "threadloader", "run", "--report", str(SCRIPT), *ARGS],
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in commands
    ]
    (torch_out, torch_err), (ours_out, ours_err) = (p.communicate(timeout=180) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], torch_err + ours_err
    theirs = [line for line in torch_out.splitlines() if line.startswith("step ")]
    ours = [line for line in ours_out.splitlines() if line.startswith("step ")]
    assert len(theirs) == 6
    assert ours == theirs
    assert len({line.split()[-1] for line in ours}) == 6
    assert "1 loader(s) built, 1 iterated" in ours_err  # the script's DataLoader was ours
    assert "num_workers=2" in ours_err
    assert list(tmp_path.iterdir()) == []  # writes nothing where it runs
