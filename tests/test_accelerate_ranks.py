"""``torchrun --nproc_per_node=2 -m threadloader run SCRIPT``: an Accelerate script on 2 CPU ranks
(gloo) trains on worker threads, sharded by Accelerate, and resumes mid-epoch exactly on each
rank: its own ``DataLoader`` with ``load_state`` + ``skip_first_batches`` as for torch's, a
``ThreadDataLoader`` with ``load_state`` alone (tests/dist_scripts/accelerate_ranks.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import torchrun

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
    proc = torchrun(["-m", "threadloader", "run", str(SCRIPT), str(out)], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("kind", ["torch", "stateful", "dispatch"])
def test_each_rank_trains_on_its_shard_from_worker_threads(
    logs: list[dict[str, Any]], kind: str
) -> None:
    """Both ranks' loaders are ThreadDataLoaders; no worker process; each epoch is split."""
    assert [log["world"] for log in logs] == [2, 2]
    assert all(
        log[kind]["inner"] == "ThreadDataLoader" and log[kind]["children"] == 0 for log in logs
    )
    for epoch in (0, 1):
        part = slice(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        shards = [{i for batch in log[kind]["first"][part] for i in batch} for log in logs]
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(N))


@pytest.mark.parametrize("kind", ["torch", "stateful", "dispatch"])
def test_resume_gives_each_rank_the_uninterrupted_batches(
    logs: list[dict[str, Any]], kind: str
) -> None:
    """After load_state (and, for the script's own DataLoader, skip_first_batches as Accelerate
    documents for it): the batches the uninterrupted run trained on after the checkpoint."""
    for log in logs:
        assert len(log[kind]["first"]) == 2 * STEPS_PER_EPOCH
        assert log[kind]["resumed"] == log[kind]["first"][SAVED_AFTER:]
        # A ThreadDataLoader is stateful, as a StatefulDataLoader; a DataLoader keeps torch's.
        assert log[kind]["saved_loader_state"] == (kind != "torch")


@pytest.mark.parametrize("kind", ["stateful", "dispatch"])
def test_a_threadloader_resumes_a_later_epoch_on_each_rank(
    logs: list[dict[str, Any]], kind: str
) -> None:
    """From the checkpoint 2 steps into epoch 1: the rest of epoch 1 of the uninterrupted run
    (the order of a later epoch comes from the sampler's generator, saved in the loader state)."""
    for log in logs:
        assert log[kind]["resumed_epoch1"] == log[kind]["first"][STEPS_PER_EPOCH + 2 :]
