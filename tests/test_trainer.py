"""Hugging Face Trainer on threadloader: with ``python -m threadloader run`` (no line changed) and
with ``threadloader.patch()`` (one line), it trains on ThreadDataLoaders, and a resume from a
checkpoint mid-epoch (in epoch 0 and in epoch 1) trains on the batches the uninterrupted run
trained on (tests/dist_scripts/trainer_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "dist_scripts" / "trainer_resume.py"
STEPS, N = 12, 24  # 2 epochs of 6 steps; checkpoints at steps 4 and 8

Logs = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Logs:
    """The script under ``run`` and with its ``--patch`` line, both at once."""
    out = tmp_path_factory.mktemp("trainer")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    commands = {
        "run": [sys.executable, "-m", "threadloader", "run", str(SCRIPT), str(out / "run")],
        "patch": [sys.executable, str(SCRIPT), str(out / "patch"), "--patch"],
    }
    procs = {}
    for how, cmd in commands.items():
        (out / how).mkdir()
        procs[how] = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    found = {}
    for how, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
        found[how] = json.loads((out / how / "log.json").read_text())
    return found


@pytest.mark.parametrize("how", ["run", "patch"])
def test_trainer_trains_on_worker_threads(logs: Logs, how: str) -> None:
    """The loader Trainer prepared wraps a ThreadDataLoader; worker threads read the samples,
    no worker process ever ran; each epoch trains on every sample once."""
    log = logs[how]
    assert log["full"]["inner"] == "ThreadDataLoader"
    assert log["from4"]["inner"] == log["from8"]["inner"] == "ThreadDataLoader"
    assert log["children"] == 0
    assert any("-worker" in name for name in log["readers"])
    seen = log["full"]["seen"]
    assert len(seen) == STEPS
    for epoch in (seen[:6], seen[6:]):
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert seen[:6] != seen[6:]  # reshuffled


@pytest.mark.parametrize("how", ["run", "patch"])
def test_resume_mid_epoch_trains_on_the_uninterrupted_batches(logs: Logs, how: str) -> None:
    """From checkpoint-4 (mid-epoch 0) and checkpoint-8 (mid-epoch 1): the batches of steps
    5..12 and 9..12 of the uninterrupted run, in order."""
    log = logs[how]
    seen = log["full"]["seen"]
    assert log["from4"]["seen"] == seen[4:]
    assert log["from8"]["seen"] == seen[8:]
    assert logs["run"]["full"]["seen"] == logs["patch"]["full"]["seen"]  # seeded: one order
