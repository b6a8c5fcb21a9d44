"""Accelerate's ``dispatch_batches=True`` over a ThreadDataLoader, 2 CPU ranks: a checkpoint saved
after any step resumes at the next one, also where the epoch ends in a partial step and with
``split_batches=True`` (tests/dist_scripts/accelerate_dispatch.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import torchrun

pytest.importorskip("accelerate")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "dist_scripts" / "accelerate_dispatch.py"


@pytest.mark.parametrize(
    ("n", "split"),
    [(28, False), (32, True)],
    ids=["partial last step", "split batches"],
)
def test_a_dispatch_checkpoint_after_any_step_resumes_at_the_next(
    tmp_path: Path, n: int, split: bool
) -> None:
    """Each checkpoint's resume gives the rest of its epoch as the uninterrupted run had it: no
    step lost (the dispatcher reads one step ahead), none repeated."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = torchrun(
        [str(SCRIPT), str(tmp_path), str(n), "1" if split else "0"], timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        steps, (end0, end1) = log["steps"], log["epoch_ends"]
        assert len(log["resumed"]) == end1 - 2
        for k, resumed in log["resumed"].items():
            k = int(k)
            end = end0 if k < end0 else end1
            assert resumed == steps[k:end], (rank, k)
