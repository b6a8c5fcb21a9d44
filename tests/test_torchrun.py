"""torchrun, 2 CPU ranks (gloo): distinct shards per rank, exact resume from per-rank checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import torchrun

from threadloader import DistributedShuffleSampler

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

SCRIPT = Path(__file__).parent / "dist_scripts" / "torchrun_train.py"
N, BATCH, EPOCHS, STOP = 40, 4, 2, 7  # as in the script; step 7 is mid-epoch 1


def _torchrun(out: Path, *args: str) -> None:
    proc = torchrun([str(SCRIPT), str(out), *args], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """A run stopped after global step 7, then resumed from its per-rank checkpoints."""
    out = tmp_path_factory.mktemp("torchrun")
    _torchrun(out, "--stop-at", str(STOP))
    return {
        (phase, rank): json.loads((out / f"{phase}-rank{rank}.json").read_text())
        for phase in ("first", "resume")
        for rank in (0, 1)
    }


def _expected(rank: int, epoch: int) -> list[list[int]]:
    """The batches DistributedShuffleSampler(seed=1) deals ``rank`` of 2 in ``epoch``."""
    sampler = DistributedShuffleSampler(range(N), num_replicas=2, rank=rank, seed=1)
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


def test_each_rank_trains_on_its_own_shard(logs: dict[tuple[str, int], dict[str, Any]]) -> None:
    """In each epoch the two ranks' samples are disjoint and together are the whole dataset."""
    for epoch in range(EPOCHS):
        shards = [
            {
                i
                for phase in ("first", "resume")
                for e, b in logs[phase, r]["seen"]
                if e == epoch
                for i in b
            }
            for r in (0, 1)
        ]
        assert shards[0].isdisjoint(shards[1])
        assert shards[0] | shards[1] == set(range(N))
    assert all(log["world"] == 2 and log["options"]["num_workers"] == 2 for log in logs.values())


def test_resume_from_per_rank_checkpoints_continues_exactly(
    logs: dict[tuple[str, int], dict[str, Any]],
) -> None:
    """Stopped after step 7 and resumed: each rank trains on exactly its epochs' batches, in order."""
    for rank in (0, 1):
        first, resumed = logs["first", rank]["seen"], logs["resume", rank]["seen"]
        assert len(first) == STOP and len(resumed) == EPOCHS * 5 - STOP
        trained = [(e, b) for e, b in first + resumed]
        expected = [(e, b) for e in range(EPOCHS) for b in _expected(rank, e)]
        assert trained == expected
