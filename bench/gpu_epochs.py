"""Several epochs of ``gpu_check.py``'s "loading slower than the step" loop, per epoch.

Run on a CUDA host (about 30 s)::

    python bench/gpu_epochs.py

``DataLoader(6, pin_memory=True)`` plus ``.to(non_blocking=True)`` against
``ThreadDataLoader(6, device=)`` with its defaults, both with ``persistent_workers=True``, five
epochs each, twice, interleaved. Per epoch: the mean host wait for the next batch on the GPU and
the median step, and for ThreadDataLoader the mode it ran in and why. ``gpu_check.py`` measures
one epoch per loader; this shows whether what it measured is the first epoch's cost.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
import gpu_check

from threadloader import ThreadDataLoader

BATCHES = 48
BATCH_SIZE = 128
WORKERS = 6
EPOCHS = 5


def run_epochs(
    name: str, loader: Any, to_device: Callable[[Any], Any], step: Callable[[torch.Tensor], Any]
) -> None:
    for epoch in range(EPOCHS):
        it = iter(loader)
        waits, totals = gpu_check.train(it, to_device, step, BATCHES - 2, 2)
        for _ in it:  # the epoch ends, so the loader may decide how to run the next
            pass
        line = (
            f"{name:36s} epoch {epoch}: wait mean {statistics.mean(waits):6.2f} ms, "
            f"step median {statistics.median(totals):6.2f} ms"
        )
        if hasattr(loader, "stats"):
            stats = loader.stats()
            line += f" | mode {stats.mode}: {stats.mode_reason}"
        print(line, flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_epochs: needs a CUDA device; nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    step, kernel_ms = gpu_check.calibrate_kernel(dev, 10.0)
    x = torch.zeros(BATCH_SIZE, 3, 224, 224, dtype=torch.uint8, device=dev)
    base_ms = gpu_check.kernel_only_ms(step, x, 20)
    work_s = 2.0 * WORKERS * base_ms / 1e3 / BATCH_SIZE  # as gpu_check's slower scenario
    dataset = gpu_check.Images(BATCHES * BATCH_SIZE, work_s)
    print(f"kernel {kernel_ms:.2f} ms, step alone {base_ms:.2f} ms, item {work_s * 1e3:.3f} ms")
    for _ in range(2):
        torch_loader = DataLoader(
            dataset, batch_size=BATCH_SIZE, num_workers=WORKERS, shuffle=True,
            pin_memory=True, persistent_workers=True,
        )  # fmt: skip
        run_epochs(
            "DataLoader(6, pin_memory)",
            torch_loader,
            lambda b: [t.to(dev, non_blocking=True) for t in b],
            step,
        )
        del torch_loader
        ours = ThreadDataLoader(
            dataset, batch_size=BATCH_SIZE, num_workers=WORKERS, shuffle=True,
            device=dev, persistent_workers=True,
        )  # fmt: skip
        run_epochs("ThreadDataLoader(6, device=) default", ours, lambda b: b, step)
        del ours
    return 0


if __name__ == "__main__":
    sys.exit(main())
