"""Under torchrun: a sharded IterDataPipe through DataLoader and ThreadDataLoader on each rank.

Usage: torchrun --standalone --nproc_per_node=2 datapipe_ranks.py OUT_DIR
Writes OUT_DIR/rank{r}.json: {"nw0": {"torch": [...], "thread": [...]}, "nw2": {...}}.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

from threadloader import ThreadDataLoader

warnings.filterwarnings("ignore")  # torch's DataPipe deprecation notice


def _batches(loader_type: type, num_workers: int) -> list[list[int]]:
    pipe = IterableWrapper(range(24)).shuffle().sharding_filter()
    loader = loader_type(
        pipe, batch_size=2, num_workers=num_workers, generator=torch.Generator().manual_seed(3)
    )
    return [b.tolist() for b in loader]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {
        f"nw{nw}": {"torch": _batches(DataLoader, nw), "thread": _batches(ThreadDataLoader, nw)}
        for nw in (0, 2)
    }
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
