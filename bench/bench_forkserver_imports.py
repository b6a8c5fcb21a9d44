"""How long helpers from a ready forkserver take to a first batch when the script imports a
large library: the server imports the script once, or (``--each``) every helper imports it.

A script's imports run again in each helper whose server did not import the script, at every
epoch's start (helpers start per epoch). Here the script imports ``transformers``' BERT next to
torch. A monitor thread runs, so helpers come from the forkserver; the server gets 6 s to be
ready before the first ``iter()``.

Run (``pip install -e ".[bench]"`` installs transformers)::

    python bench/bench_forkserver_imports.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertModel  # noqa: F401  # what a training script imports


class Items(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def _child(each: bool) -> list[float]:
    import multiprocessing

    from threadloader import ThreadDataLoader

    if each:  # a preload list without "__main__": the server does not import the script
        multiprocessing.set_forkserver_preload(["threadloader.isolation.helper"])
    stop = threading.Event()
    monitor = threading.Thread(target=stop.wait, daemon=True)
    monitor.start()
    loader = ThreadDataLoader(Items(), batch_size=4, num_workers=2, isolation="process", helpers=2)
    time.sleep(6.0)
    firsts = []
    for _ in range(3):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        firsts.append(time.perf_counter() - start)
        for _ in it:
            pass
    stop.set()
    monitor.join()
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", choices=["once", "each"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(" ".join(f"{s:.4f}" for s in _child(args.one == "each")))
        return
    env = {**os.environ, "THREADLOADER_ZYGOTE": "0"}
    got: dict[str, list[float]] = {"once": [], "each": []}
    for _ in range(args.rounds):
        for how in got:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", how],
                check=True, capture_output=True, text=True, env=env, timeout=300,
            )  # fmt: skip
            got[how] += [float(x) for x in out.stdout.split()]
    for how, label in (("once", "the server imports the script"), ("each", "each helper does")):
        firsts = got[how]
        print(
            f"{label}: first batch median {statistics.median(firsts):.3f} s "
            f"(range {min(firsts):.3f}-{max(firsts):.3f} s, {len(firsts)} epochs)"
        )


if __name__ == "__main__":
    main()
