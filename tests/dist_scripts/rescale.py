"""Issue 6, distributed: save mid-epoch on 2 ranks, each on its own; resume on 3 ranks or 1.

Functions that tests/test_distributed_resume.py runs with ``torch.multiprocessing.spawn``, one
process a rank, over gloo on CPU. Each writes its index log (and ``save`` its loader state) to
``out``; the test reads them all back.

- ``save`` (2 ranks, 2 worker threads): epoch ``EPOCH`` of ``DistributedShuffleSampler`` over
  ``range(N)``, ``SAVE_AFTER`` batches of ``BATCH``, then each rank saves ``state_dict()`` with
  every torch.distributed collective made to raise, so a collective would fail the run.
- ``resume`` (any number of ranks): rank r loads the state rank ``r % 2`` saved (all saved states
  are the same: ranks advance in lockstep), with 2 and with 4 worker threads, and reads to the end
  of the epoch.

Both run once with ``drop_last=False`` (pad) and once with ``drop_last=True`` (drop).

A second resume in the same epoch: on ``CHAIN_WORLD`` (3) ranks, ``resume`` also reads
``CHAIN_AFTER`` batches of a resumed epoch (``drop_last=False``, 2 workers) and saves again; on 1
rank it resumes from that second state and reads to the end.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from threadloader import DistributedShuffleSampler, ThreadDataLoader

N, BATCH, EPOCH, SEED, SAVE_AFTER = 101, 4, 3, 1, 5
SAVE_WORKERS, RESUME_WORKERS = 2, (2, 4)
CHAIN_WORLD, CHAIN_AFTER = 3, 2
_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
)


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _loader(drop_last: bool, workers: int) -> tuple[ThreadDataLoader[Any], Any]:
    sampler = DistributedShuffleSampler(range(N), seed=SEED, drop_last=drop_last)  # rank from dist
    sampler.set_epoch(EPOCH)
    return ThreadDataLoader(
        range(N), batch_size=BATCH, sampler=sampler, num_workers=workers
    ), sampler


@contextlib.contextmanager
def _no_collectives() -> Iterator[None]:
    """Make every torch.distributed collective raise inside the block."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("state_dict() called a torch.distributed collective")

    modules = (dist, dist.distributed_c10d)
    saved = [
        (m, name, getattr(m, name)) for m in modules for name in _COLLECTIVES if hasattr(m, name)
    ]
    for m, name, _ in saved:
        setattr(m, name, refuse)
    try:
        yield
    finally:
        for m, name, original in saved:
            setattr(m, name, original)


def save(rank: int, world: int, port: int, out: str) -> None:
    """Read ``SAVE_AFTER`` batches of the epoch, then save this rank's state, talking to no one."""
    _init(rank, world, port)
    try:
        for drop_last in (False, True):
            loader, _ = _loader(drop_last, SAVE_WORKERS)
            it = iter(loader)
            seen = [next(it).tolist() for _ in range(SAVE_AFTER)]
            with _no_collectives():
                state = loader.state_dict()
            del it
            torch.save(state, Path(out) / f"state-d{int(drop_last)}-rank{rank}.pt")
            _write(out, f"save-w{world}-d{int(drop_last)}-rank{rank}", seen, state)
    finally:
        dist.destroy_process_group()


def resume(rank: int, world: int, port: int, out: str) -> None:
    """Load the state rank ``rank % 2`` saved; read to the end of the epoch, per worker count."""
    _init(rank, world, port)
    try:
        for drop_last in (False, True):
            state = torch.load(Path(out) / f"state-d{int(drop_last)}-rank{rank % 2}.pt")
            for workers in RESUME_WORKERS:
                loader, sampler = _loader(drop_last, workers)
                loader.load_state_dict(state)
                sampler.set_epoch(EPOCH)  # as a training loop does: keeps the resume
                seen = [batch.tolist() for batch in loader]
                name = f"resume-w{world}-n{workers}-d{int(drop_last)}-rank{rank}"
                _write(out, name, seen, loader.state_dict())
        if world == CHAIN_WORLD:
            _save_again(rank, world, out)
        elif world == 1:
            _resume_again(rank, world, out)
    finally:
        dist.destroy_process_group()


def _save_again(rank: int, world: int, out: str) -> None:
    """Resume the 2-rank state, read ``CHAIN_AFTER`` batches, save again (no collective)."""
    loader, sampler = _loader(False, SAVE_WORKERS)
    loader.load_state_dict(torch.load(Path(out) / f"state-d0-rank{rank % 2}.pt"))
    sampler.set_epoch(EPOCH)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(CHAIN_AFTER)]
    with _no_collectives():
        state = loader.state_dict()
    del it
    torch.save(state, Path(out) / f"chain-rank{rank}.pt")
    _write(out, f"chain-save-w{world}-rank{rank}", seen, state)


def _resume_again(rank: int, world: int, out: str) -> None:
    """Resume the state saved by the resumed run; read to the end of the epoch."""
    loader, sampler = _loader(False, SAVE_WORKERS)
    loader.load_state_dict(torch.load(Path(out) / f"chain-rank{rank % CHAIN_WORLD}.pt"))
    sampler.set_epoch(EPOCH)
    seen = [batch.tolist() for batch in loader]
    _write(out, f"chain-resume-w{world}-rank{rank}", seen, loader.state_dict())


def _write(out: str, name: str, seen: list[list[int]], state: dict[str, Any]) -> None:
    meta = {k: state[k] for k in ("world_size", "rank", "num_workers", "batches_yielded")}
    (Path(out) / f"{name}.json").write_text(json.dumps({"seen": seen, "state": meta}))
