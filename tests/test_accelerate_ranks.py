"""``torchrun --nproc_per_node=2 -m threadloader run SCRIPT``: an unchanged Accelerate script on 2
CPU ranks (gloo) trains on worker threads, sharded by Accelerate, and ``save_state`` /
``load_state`` resume it mid-epoch exactly on each rank (tests/dist_scripts/accelerate_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("accelerate")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "dist_scripts" / "accelerate_ranks.py"
N, STEPS_PER_EPOCH, SAVED_AFTER = 32, 4, 2


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("accelerate_ranks")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "-m", "threadloader", "run", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_each_rank_trains_on_its_shard_from_worker_threads(logs: list[dict[str, Any]]) -> None:
    """Both ranks' loaders are ThreadDataLoaders; no worker process; each epoch is split."""
    assert [log["world"] for log in logs] == [2, 2]
    assert all(log["inner"] == "ThreadDataLoader" and log["children"] == 0 for log in logs)
    for epoch in (0, 1):
        part = slice(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        shards = [{i for batch in log["first"][part] for i in batch} for log in logs]
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(N))


def test_load_state_resumes_each_rank_exactly(logs: list[dict[str, Any]]) -> None:
    """After load_state: the batches the uninterrupted run trained on after the checkpoint."""
    for log in logs:
        assert len(log["first"]) == 2 * STEPS_PER_EPOCH
        assert log["resumed"] == log["first"][SAVED_AFTER:]
