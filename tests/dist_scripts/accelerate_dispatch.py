"""Accelerate's ``dispatch_batches=True`` on 2 CPU ranks (gloo): rank 0's ThreadDataLoader reads
each step's batches for both ranks, one step ahead. Run by tests/test_accelerate_dispatch.py::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/dist_scripts/accelerate_dispatch.py OUT N SPLIT

Two epochs of ``N`` samples, batch 4 (``SPLIT=1``: ``split_batches=True``), with a checkpoint
after every step (rank 0 saves its loader state again after ``save_state``: every rank writes the
one ``dl_state_dict.bin``, and only rank 0's loader moved). Then, for each checkpoint, a restarted
job seeds as before, prepares anew, ``load_state`` and runs to the end of that epoch. It writes
``OUT/rank{r}.json``: the uninterrupted steps' sample ids and, per checkpoint, the resumed ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader


class Ids(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def prepare(n: int, split: bool) -> tuple[Accelerator, Any]:
    set_seed(0)
    config = DataLoaderConfiguration(dispatch_batches=True, split_batches=split)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    loader = ThreadDataLoader(Ids(n), batch_size=4, shuffle=True, num_workers=2)
    return accelerator, accelerator.prepare(loader)


def save(accelerator: Accelerator, loader: Any, where: Path) -> None:
    accelerator.save_state(str(where))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(loader.state_dict(), where / "dl_state_dict.bin")
    accelerator.wait_for_everyone()


def ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def main() -> None:
    out, n, split = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    accelerator, loader = prepare(n, split)
    steps: list[list[int]] = []
    epoch_ends = []
    for _ in range(2):
        for batch in loader:
            steps.append(ids(batch))
            save(accelerator, loader, out / f"ckpt-{len(steps)}")
        epoch_ends.append(len(steps))
    resumed = {}
    for k in range(1, epoch_ends[-1]):
        if k == epoch_ends[0]:
            continue  # a state after an epoch's last step: the next epoch, tested elsewhere
        accelerator, loader = prepare(n, split)
        accelerator.load_state(str(out / f"ckpt-{k}"))
        resumed[k] = [ids(batch) for batch in loader]
    rank = PartialState().process_index
    log = {"steps": steps, "epoch_ends": epoch_ends, "resumed": resumed}
    (out / f"rank{rank}.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
