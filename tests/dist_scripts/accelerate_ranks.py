"""Accelerate on 2 CPU ranks (gloo), under ``torchrun ... -m threadloader run``: a script written
for torch's DataLoader, unchanged. Run by tests/test_accelerate_ranks.py::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        -m threadloader run tests/dist_scripts/accelerate_ranks.py OUT

Each rank prepares model, optimizer and a shuffling loader with ``accelerator.prepare`` and
trains 2 epochs (the uninterrupted run), with ``save_state`` after 2 steps of each. Then, as a
restarted job would, it seeds as before, prepares new ones, ``load_state`` and trains to the end
of epoch 1. Twice:

- ``torch``: the script's own ``DataLoader`` (a ThreadDataLoader under ``run``), resumed as
  Accelerate documents for it: ``load_state``, then ``skip_first_batches`` past the 2 steps.
- ``stateful``: a ``ThreadDataLoader``, resumed as a StatefulDataLoader: ``load_state`` alone,
  from the checkpoint in epoch 0 and from the one in epoch 1 (the sampler's generator, which
  Accelerate seeds at ``prepare``, is in the loader's state).
- ``dispatch``: the same with ``DataLoaderConfiguration(dispatch_batches=True)``: rank 0's
  loader reads every step's batches and sends each rank its part. (Every rank writes the one
  ``dl_state_dict.bin``, and only rank 0's loader moved: rank 0 writes its own again after.)

It writes ``OUT/rank{r}.json``: per trial, the sample ids of every step of both runs, the inner
loader's class, and the most worker processes seen.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset

from threadloader import ThreadDataLoader

N, BATCH = 32, 4  # 4 steps an epoch on each of 2 ranks


class Ids(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def prepare(kind: str) -> tuple[Accelerator, Any, Any, Any]:
    set_seed(0)  # as a training script does on every start
    config = DataLoaderConfiguration(dispatch_batches=kind == "dispatch")
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    make = DataLoader if kind == "torch" else ThreadDataLoader
    loader = make(Ids(), batch_size=BATCH, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model, optimizer, loader


def step(accelerator: Accelerator, model: Any, optimizer: Any, batch: torch.Tensor) -> list[int]:
    optimizer.zero_grad()
    accelerator.backward(model(batch).pow(2).mean())
    optimizer.step()
    return batch[:, 0].long().tolist()


def save(accelerator: Accelerator, loader: Any, where: Path, kind: str) -> None:
    accelerator.save_state(str(where))
    accelerator.wait_for_everyone()
    if kind == "dispatch" and accelerator.is_main_process:  # only rank 0's state moved
        torch.save(loader.state_dict(), where / "dl_state_dict.bin")
    accelerator.wait_for_everyone()


def trial(kind: str, out: Path) -> dict[str, Any]:
    accelerator, model, optimizer, loader = prepare(kind)
    it = iter(loader)
    first = [step(accelerator, model, optimizer, next(it)) for _ in range(2)]
    save(accelerator, loader, out / f"ckpt-{kind}-0", kind)  # mid-epoch 0
    first += [step(accelerator, model, optimizer, b) for b in it]
    it = iter(loader)
    first += [step(accelerator, model, optimizer, next(it)) for _ in range(2)]
    save(accelerator, loader, out / f"ckpt-{kind}-1", kind)  # mid-epoch 1
    first += [step(accelerator, model, optimizer, b) for b in it]
    children = len(multiprocessing.active_children())
    accelerator.wait_for_everyone()

    accelerator, model, optimizer, loader = prepare(kind)
    accelerator.load_state(str(out / f"ckpt-{kind}-0"))
    epoch = accelerator.skip_first_batches(loader, 2) if kind == "torch" else loader
    resumed = [step(accelerator, model, optimizer, b) for b in epoch]
    resumed += [step(accelerator, model, optimizer, b) for b in loader]
    log = {
        "inner": type(loader.base_dataloader).__name__,
        "children": max(children, len(multiprocessing.active_children())),
        "saved_loader_state": (out / f"ckpt-{kind}-0" / "dl_state_dict.bin").exists(),
        "first": first,
        "resumed": resumed,
    }
    if kind != "torch":  # Accelerate's skip_first_batches cannot resume a later epoch
        accelerator, model, optimizer, loader = prepare(kind)
        accelerator.load_state(str(out / f"ckpt-{kind}-1"))
        log["resumed_epoch1"] = [step(accelerator, model, optimizer, b) for b in loader]
    return log


def main() -> None:
    out = Path(sys.argv[1])
    log: dict[str, Any] = {kind: trial(kind, out) for kind in ("torch", "stateful", "dispatch")}
    state = PartialState()
    log.update(rank=state.process_index, world=state.num_processes)
    (out / f"rank{state.process_index}.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
