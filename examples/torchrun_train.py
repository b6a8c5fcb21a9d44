"""Data-parallel training under torchrun; each rank checkpoints alone; resume on another world size.

Example (CPU, gloo)::

    torchrun --standalone --nproc_per_node=2 examples/torchrun_train.py --stop-at 45
    torchrun --standalone --nproc_per_node=3 examples/torchrun_train.py --resume

What it does: a 2-layer MLP learns a synthetic 4-class problem (4,096 samples of 32 features,
labels from a fixed random linear map) for 2 epochs, with a plain DDP loop over a
``ThreadDataLoader(num_workers=2)`` whose ``DistributedShuffleSampler`` deals every rank its
stride of one global, world-size-independent order. Each sample gets Gaussian-noise augmentation
drawn from ``torch.random.thread_safe_generator()``: the worker thread's own generator. Every 15
steps each rank saves model, optimizer, ``loader.state_dict()`` and the sample ids it trained on
this epoch to ``rank{r}.pt`` in ``--out`` (default: ``threadloader-torchrun-example`` in the
system's temporary directory), on its own: no collective, no barrier. ``--stop-at 45``
stops right after step 45's checkpoint, as a crash would; ``--resume`` on 3 processes has rank r
load the checkpoint rank ``r % 2`` wrote (all ranks save the same loader state: they advance in
lockstep) and finishes epoch 1 where the 2 ranks left it, each of 3 ranks taking its own stride.
At each epoch's end rank 0 gathers the ids trained on in it, before the crash (from the
checkpoints) and after, and counts the samples missed and those trained on twice.

Result (2-core CPU; each command 7-8 s, mostly interpreter and torch start-up)::

    [2 ranks] epoch 0: loss 0.921, 32 steps a rank, data wait 5.6% of wall time
    epoch 0: 4096 of 4096 samples trained, 0 missed, 0 twice (the padding of the epoch's last round)
    [2 ranks] step 45 (epoch 1): stopping
    [3 ranks] resumed at step 45, epoch 1: 13 steps done, 1664 of 4096 samples seen
    [3 ranks] epoch 1: loss 0.570, 13 steps a rank, data wait 2.5% of wall time
    epoch 1: 4096 of 4096 samples trained, 0 missed, 1 twice (the padding of the epoch's last round)

Why 13 steps and 1 sample twice: 2 ranks had read global positions 0-1663 of epoch 1's order
(13 steps x 64 x 2); the 2,432 left split 3 ways are 810.7 a rank, so each rank takes 811 (13
batches, the last of 43) and the stream wraps around by one position, as torch's
``DistributedSampler`` pads an epoch that does not divide by the world size. The world size that
finishes an epoch pads it (``drop_last=True`` would drop the 2 extra instead). ``--resume`` on 2
or on 1 process works the same way, and so do several crashes in one epoch: with ``--stop-at 45``
on 2 processes, ``--resume --stop-at 60`` on 1, then ``--resume`` on 3, epoch 1 still ends with
4096 of 4096 samples trained, 0 missed, 1 twice.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from threadloader import DistributedShuffleSampler, ThreadDataLoader

N, FEATURES, CLASSES, BATCH, EPOCHS, SAVE_EVERY = 4096, 32, 4, 64, 2, 15


class Synthetic(Dataset[tuple[int, torch.Tensor, int]]):
    """Item i: (i, features with augmentation noise, label); labels from a fixed linear map."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int]:
        noise = torch.randn(FEATURES, generator=torch.random.thread_safe_generator())
        return i, self.x[i] + 0.1 * noise, int(self.y[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stop-at", type=int, default=0, help="stop after this global step")
    parser.add_argument("--resume", action="store_true", help="resume from --out's checkpoints")
    parser.add_argument(
        "--out",
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "threadloader-torchrun-example",
        help="folder for the checkpoints (default: %(default)s)",
    )
    args = parser.parse_args()
    ckpt_dir: Path = args.out
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    dataset = Synthetic()
    sampler = DistributedShuffleSampler(dataset, seed=0)  # rank and world size from dist
    loader = ThreadDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)

    step, first_epoch, seen_before = 0, 0, []
    if args.resume:
        saved_world = json.loads((ckpt_dir / "world.json").read_text())["world"]
        ckpt = torch.load(ckpt_dir / f"rank{rank % saved_world}.pt", weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # on any world size: the sampler's global cursor
        step, first_epoch = ckpt["step"], ckpt["epoch"]
        seen_before = _seen_in_checkpoints(ckpt_dir, saved_world)
        _say(
            rank,
            f"[{world} ranks] resumed at step {step}, epoch {first_epoch}: "
            f"{ckpt['loader']['batches_yielded']} steps done, "
            f"{len(seen_before)} of {N} samples seen",
        )
    train(model, optimizer, loader, sampler, ckpt_dir, args.stop_at, step, first_epoch, seen_before)
    # DDP's reducer holds the process group: let it go first, or gloo may abort the process at
    # exit ("terminate called without an active exception"; torch's, about 1 run in 15 here).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def train(
    model: Any,
    optimizer: torch.optim.Optimizer,
    loader: ThreadDataLoader[Any],
    sampler: DistributedShuffleSampler,
    ckpt_dir: Path,
    stop_at: int,
    step: int,
    first_epoch: int,
    seen_before: list[int],
) -> None:
    """Train to the end of the run, or to global step ``stop_at``; checkpoint every 15 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)  # the epoch of a just-loaded state: keeps its resume
        # Ids trained on this epoch; rank 0 also carries those of the ranks before the crash.
        seen = list(seen_before) if epoch == first_epoch and rank == 0 else []
        losses, saves = [], 0
        for ids, x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            seen += ids.tolist()
            step += 1
            if step % SAVE_EVERY == 0:  # each rank alone
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "seen": seen,
                }
                torch.save(state, ckpt_dir / f"rank{rank}.pt")
                if rank == 0:
                    (ckpt_dir / "world.json").write_text(json.dumps({"world": world}))
                saves += 1
            if step == stop_at:
                _say(rank, f"[{world} ranks] step {step} (epoch {epoch}): stopping")
                return
        wait = loader.stats().wait_fraction
        _say(
            rank,
            f"[{world} ranks] epoch {epoch}: loss {sum(losses[-5:]) / 5:.3f}, {len(losses)} "
            f"steps a rank, data wait {wait:.1%} of wall time",
        )
        _check_epoch(rank, world, epoch, seen)


def _seen_in_checkpoints(ckpt_dir: Path, saved_world: int) -> list[int]:
    """What the ranks of the run that saved had trained on in the checkpoint's epoch."""
    seen: list[int] = []
    for r in range(saved_world):
        seen += torch.load(ckpt_dir / f"rank{r}.pt", weights_only=False)["seen"]
    return seen


def _check_epoch(rank: int, world: int, epoch: int, seen: list[int]) -> None:
    """Gather what every rank trained on this epoch; count samples missed and repeated."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, seen)
    counts = Counter(i for part in gathered for i in part)
    repeated = sum(counts.values()) - len(counts)
    _say(
        rank,
        f"epoch {epoch}: {len(counts)} of {N} samples trained, {N - len(counts)} missed, "
        f"{repeated} twice (the padding of the epoch's last round)",
    )


def _say(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)


if __name__ == "__main__":
    main()
