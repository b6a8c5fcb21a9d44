"""Accelerate on 2 CPU ranks (gloo), under ``torchrun ... -m threadloader run``: a script written
for torch's DataLoader, unchanged. Run by tests/test_accelerate_ranks.py::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m threadloader run tests/dist_scripts/accelerate_ranks.py OUT

Each rank prepares model, optimizer and a shuffling DataLoader with ``accelerator.prepare``,
trains 2 steps, ``save_state`` (a checkpoint mid-epoch 0), trains on to the end of epoch 1 (the
uninterrupted run). Then, as a restarted job would, it seeds as before, prepares new ones,
``load_state`` and trains to the end of epoch 1. It writes ``OUT/rank{r}.json``: the sample
ids of every step of both runs, the inner loader's class and the worker processes seen.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

N, BATCH = 32, 4  # 4 steps an epoch on each of 2 ranks


class Ids(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def prepare() -> tuple[Accelerator, Any, Any, Any]:
    set_seed(0)  # as a training script does on every start
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def step(accelerator: Accelerator, model: Any, optimizer: Any, batch: torch.Tensor) -> list[int]:
    optimizer.zero_grad()
    accelerator.backward(model(batch).pow(2).mean())
    optimizer.step()
    return batch[:, 0].long().tolist()


def main() -> None:
    out = Path(sys.argv[1])
    accelerator, model, optimizer, loader = prepare()
    rank = accelerator.process_index
    children = 0
    it = iter(loader)
    first = [step(accelerator, model, optimizer, next(it)) for _ in range(2)]
    accelerator.save_state(str(out / "ckpt"))
    first += [step(accelerator, model, optimizer, b) for b in it]
    first += [step(accelerator, model, optimizer, b) for b in loader]
    children = max(children, len(multiprocessing.active_children()))
    accelerator.wait_for_everyone()

    accelerator, model, optimizer, loader = prepare()
    accelerator.load_state(str(out / "ckpt"))
    resumed = [step(accelerator, model, optimizer, b) for b in loader]
    resumed += [step(accelerator, model, optimizer, b) for b in loader]
    children = max(children, len(multiprocessing.active_children()))
    log = {
        "rank": rank,
        "world": accelerator.num_processes,
        "inner": type(loader.base_dataloader).__name__,
        "children": children,
        "first": first,
        "resumed": resumed,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
