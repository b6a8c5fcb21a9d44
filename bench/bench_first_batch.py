"""Seconds from building a loader to its first batch, in a fresh interpreter per measurement.

``python bench/bench_first_batch.py [--rounds N] [--workloads images,tensors,python]`` runs, for
each workload and round, every loader in its own new Python process (the first loader of a
fresh process: module imports, worker or helper start-up and the first batch all count), in an
order that rotates each round, and prints medians of the seconds from the loader's constructor
to its first batch and the ratio to ``DataLoader(num_workers=2)``'s in the same round.

Loaders: ``dl2`` torch's DataLoader with 2 worker processes; ``thread2`` ThreadDataLoader with 2
worker threads; ``iso2`` ThreadDataLoader(isolation="process", helpers=2), whose helpers are
forked from the script's process (it runs one Python thread at ``iter()``); ``iso2z`` the same
with another Python thread running at ``iter()``: helpers forked by the zygote; ``iso2fs`` the same with the zygote switched off (``THREADLOADER_ZYGOTE=0``): helpers
from the forkserver, started when the loader is built.

``--collect-first`` runs ``gc.collect()`` in each child before the timer starts. After
``import torch`` the interpreter owes a full garbage collection (~80 ms on 2 cores here), which
runs in whatever code next allocates some hundreds of objects: the first loader's start-up when
it allocates enough before its first batch, or later, in the training loop, when it does not.
After building the small ``tensors`` workload, ``ThreadDataLoader(num_workers=2)`` (~850
objects to its first batch) paid it at ``iter()`` in every run seen, ``DataLoader(num_workers=2)``
(~620 in the training process) never. Building the bench-size workloads allocates enough that
the collection mostly runs before the timer: the medians moved by under 4% with the flag.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LOADERS = ("dl2", "thread2", "iso2", "iso2z", "iso2fs")

_CHILD = """
import sys, time, json
import torch
from threadloader import ThreadDataLoader
from threadloader.compare.workloads import make_workload
spec = make_workload(sys.argv[1], size="bench")
loader = sys.argv[2]
kwargs = dict(batch_size=spec.batch_size, shuffle=True)
if sys.argv[3] == "1":
    import gc
    gc.collect()
start = time.perf_counter()
if loader == "dl2":
    dl = torch.utils.data.DataLoader(spec.dataset, num_workers=2, **kwargs)
elif loader == "thread2":
    dl = ThreadDataLoader(spec.dataset, num_workers=2, **kwargs)
else:
    dl = ThreadDataLoader(spec.dataset, num_workers=2, isolation="process", helpers=2, **kwargs)
if loader == "iso2z":  # another Python thread at iter(): helpers come from the zygote
    import threading
    threading.Thread(target=time.sleep, args=(1.0,), daemon=True).start()
it = iter(dl)
next(it)
print(json.dumps({"first_batch_s": time.perf_counter() - start}))
del it
"""


def measure(workload: str, loader: str, collect_first: bool = False) -> float:
    env = dict(os.environ)
    if loader == "iso2fs":
        env["THREADLOADER_ZYGOTE"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, workload, loader, str(int(collect_first))],
        check=True, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    return float(json.loads(done.stdout.strip().splitlines()[-1])["first_batch_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="images,tensors,python")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument(
        "--collect-first",
        action="store_true",
        help="gc.collect() before the timer starts (the module docstring says why)",
    )
    args = parser.parse_args()
    rows: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    for workload in args.workloads.split(","):
        measure(workload, "thread2")  # builds the workload's files outside the timing
        for r in range(args.rounds):
            order = LOADERS[r % len(LOADERS) :] + LOADERS[: r % len(LOADERS)]
            got = {loader: measure(workload, loader, args.collect_first) for loader in order}
            for loader, seconds in got.items():
                rows.setdefault((workload, loader), []).append(seconds)
                ratios.setdefault((workload, loader), []).append(seconds / got["dl2"])
    print("| workload | loader | first batch (median) | x DL(2), per round |")
    print("| --- | --- | --: | --- |")
    for (workload, loader), seconds in rows.items():
        per_round = ", ".join(f"{x:.2f}" for x in ratios[(workload, loader)])
        print(f"| {workload} | {loader} | {statistics.median(seconds):.3f} s | {per_round} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {f"{w}/{l}": {"seconds": s, "ratio_vs_dl2": ratios[(w, l)]} for (w, l), s in rows.items()},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
