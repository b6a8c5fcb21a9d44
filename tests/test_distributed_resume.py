"""A state saved mid-epoch on 2 ranks resumes on 3 ranks, on 1, and on 4 worker threads instead
of 2, and the full index log shows every sample of the epoch delivered exactly once.

How the last, incomplete round counts. ``DistributedShuffleSampler`` deals one global stream,
the epoch's permutation ``order``, rank r of W taking positions r, r + W, ... 2 ranks read
positions ``[0, c)`` before the save (c = 5 batches x 4 x 2 ranks = 40); W' ranks then read the
rest, ``N - c`` positions, from c on. When W' does not divide ``N - c``:

- ``drop_last=False`` pads like torch: each rank reads ``ceil((N - c) / W')`` positions, those
  past N wrap to the stream's start. Every sample is delivered once, and the first ``pad`` of
  ``order`` twice, ``pad = W' * ceil((N - c) / W') - (N - c)``.
- ``drop_last=True`` drops: each rank reads ``(N - c) // W'`` positions. Every sample is
  delivered once, except the last ``(N - c) % W'`` of ``order``, never.

So it is the world size that finishes the epoch that pads or drops, as if the epoch had run on it.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from threadloader import ShuffleSampler

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
import rescale  # spawned ranks import it by name, from this path

N, BATCH, SAVE_AFTER = rescale.N, rescale.BATCH, rescale.SAVE_AFTER
CURSOR = SAVE_AFTER * BATCH * 2  # global positions read by the 2 saving ranks

# The first test also runs the module's fixture: three worlds of spawned ranks, 79 s on a
# loaded machine, against pytest-timeout's 120 s default.
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, world: int, out: Path) -> None:
    mp.spawn(fn, args=(world, _free_port(), str(out)), nprocs=world, join=True)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved on 2 ranks, then resumed on 3 ranks and on 1 (each with 2 and 4 workers)."""
    out = tmp_path_factory.mktemp("rescale")
    _spawn(rescale.save, 2, out)
    _spawn(rescale.resume, 3, out)
    _spawn(rescale.resume, 1, out)
    return out


def _log(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / f"{name}.json").read_text())


def _order() -> list[int]:
    """The epoch's global stream: the permutation every world size deals from."""
    order = ShuffleSampler(N, seed=rescale.SEED)
    order.set_epoch(rescale.EPOCH)
    return list(order)


def _batches(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_saves_its_own_state_mid_epoch(out: Path, drop_last: bool) -> None:
    """Before the save, rank r of 2 read positions r, r + 2, ...; its state says where it was."""
    order = _order()
    for rank in (0, 1):
        log = _log(out, f"save-w2-d{int(drop_last)}-rank{rank}")
        assert log["seen"] == _batches(order[rank:CURSOR:2])
        assert log["state"] == {
            "world_size": 2,
            "rank": rank,
            "num_workers": 2,
            "batches_yielded": SAVE_AFTER,
        }


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_on_another_world_size_delivers_every_sample_once(
    out: Path, world: int, workers: int, drop_last: bool
) -> None:
    """2 ranks saved mid-epoch; ``world`` ranks with ``workers`` threads each finish the epoch:
    each rank reads its stride of the rest, and the whole log has every sample once (padding and
    dropping as the module docstring defines them)."""
    order, d = _order(), int(drop_last)
    before = [i for r in (0, 1) for b in _log(out, f"save-w2-d{d}-rank{r}")["seen"] for i in b]
    after: list[int] = []
    rest = N - CURSOR
    per_rank = rest // world if drop_last else math.ceil(rest / world)
    for rank in range(world):
        log = _log(out, f"resume-w{world}-n{workers}-d{d}-rank{rank}")
        positions = [CURSOR + rank + world * j for j in range(per_rank)]
        assert log["seen"] == _batches([order[p % N] for p in positions])
        assert log["state"]["world_size"] == world and log["state"]["num_workers"] == workers
        after += [i for b in log["seen"] for i in b]

    counts = Counter(before + after)
    if drop_last:
        dropped = order[CURSOR + world * per_rank :]
        assert len(dropped) == rest % world
        assert counts == Counter(i for i in range(N) if i not in dropped)
    else:
        pad = world * per_rank - rest
        assert counts == Counter(range(N)) + Counter(order[:pad])


def test_a_second_resume_in_the_same_epoch_delivers_every_sample_once(out: Path) -> None:
    """2 ranks save; 3 ranks resume, read 2 batches and save again; 1 rank finishes the epoch:
    every sample exactly once (1 rank pads nothing)."""
    order = _order()
    before = [i for r in (0, 1) for b in _log(out, f"save-w2-d0-rank{r}")["seen"] for i in b]
    middle = [i for r in range(3) for b in _log(out, f"chain-save-w3-rank{r}")["seen"] for i in b]
    cursor = CURSOR + rescale.CHAIN_AFTER * BATCH * 3
    assert sorted(before + middle) == sorted(order[:cursor])
    after = _log(out, "chain-resume-w1-rank0")["seen"]
    assert after == _batches(order[cursor:])
    assert Counter(before + middle + [i for b in after for i in b]) == Counter(range(N))
