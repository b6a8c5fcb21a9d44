"""A plain data-parallel training loop under torchrun: ThreadDataLoader, DistributedShuffleSampler, per-rank
checkpoints. Run by tests/test_torchrun.py::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/dist_scripts/torchrun_train.py OUT --stop-at 7

Each rank trains until global step 7 (mid-epoch 1: 5 steps an epoch), saves its own checkpoint
(model, optimizer, loader state; no collective) to ``OUT/ckpt-rank{r}.pt`` and stops, as a crash
would. Then, with a new model, sampler and loader (the same process: a new one would only add
start-up time), it loads that file and trains to the end of epoch 1. Each rank writes
``OUT/{first,resume}-rank{r}.json``: the ``(epoch, sample ids)`` of every step it trained, its
world size and its loader's options.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from threadloader import DistributedShuffleSampler, ThreadDataLoader

N, BATCH, EPOCHS = 40, 4, 2  # 5 steps an epoch on each of 2 ranks


class Ids(Dataset[tuple[int, torch.Tensor]]):
    """Item i is (i, features of i)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.full((4,), float(i) / N)


def train(out: Path, workers: int, stop_at: int, resume: bool) -> None:
    """Train from scratch (or from this rank's checkpoint) until ``stop_at`` or the end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 if resume else 0)  # the resume must not depend on the global RNG
    # Gradients averaged by hand rather than by DistributedDataParallel: at exit DDP's gloo
    # process group aborts the process more often ("terminate called without an active
    # exception", about 1 run in 25 here, also without threadloader). The plain group does
    # too, rarely: tests/helpers.py's torchrun() launches once more then.
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedShuffleSampler(Ids(), seed=1)  # rank and world size from dist
    loader = ThreadDataLoader(
        Ids(), batch_size=BATCH, sampler=sampler, num_workers=workers, log_every_s=3600.0
    )
    step, first_epoch = 0, 0
    ckpt_path = out / f"ckpt-rank{rank}.pt"
    if resume:
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step, first_epoch = ckpt["step"], ckpt["epoch"]

    seen: list[tuple[int, list[int]]] = []
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)  # a just-loaded state's epoch: keeps its resume
        for ids, x in loader:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            seen.append((epoch, ids.tolist()))
            step += 1
            if step == stop_at:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),  # this rank's, consumer-aligned
                    "step": step,
                    "epoch": epoch,
                }
                torch.save(state, ckpt_path)
                break
        else:
            continue
        break  # stopped, as a crash right after the checkpoint would

    options = {"num_workers": loader.num_workers, "log_every_s": loader.log_every_s}
    log: dict[str, Any] = {"seen": seen, "world": world, "options": options}
    (out / f"{'resume' if resume else 'first'}-rank{rank}.json").write_text(json.dumps(log))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stop-at", type=int, required=True, help="global step to stop after")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        train(Path(args.out), args.workers, args.stop_at, resume=False)
        dist.barrier()  # every checkpoint is written; nothing below reuses an object from above
        train(Path(args.out), args.workers, args.stop_at, resume=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
