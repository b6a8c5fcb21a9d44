"""The whole training loop's pace: batches per second of a loop that loads and steps.

What a user measures is the loop, not the loader alone: a loader whose worker threads take the
GIL from the training thread can be fast and still slow the step. Each measurement runs in a
fresh interpreter: it builds the loader, runs ``--epochs`` epochs of a loop whose step is
``--step-ops`` tiny torch ops (Python-bound, like launching a model's kernels; 0: no step), and
reports batches/s over the epochs after the first (``isolation="auto"`` decides after the first
epoch, and every loader has started its workers by then). Loaders take turns within a round, in
an order that rotates each round; ratios are taken within a round, against the best of
DataLoader(2), torchdata.nodes(2) and SPDL(2) in that round.

Run::

    python bench/bench_loop.py                                # 400-op step, 3 rounds
    python bench/bench_loop.py --step-ops 0 --rounds 3        # the loader alone, epochs included
    python bench/bench_loop.py --workloads python --rounds 1  # one workload, quickly

Loaders: ``dl2`` DataLoader(num_workers=2); ``torchdata2`` torchdata.nodes ParallelMapper(2
threads) of whole batches; ``spdl2`` SPDL DataLoader(2 threads); ``thread2``
ThreadDataLoader(num_workers=2) with its default settings; ``auto2`` the same with
``isolation="auto"``; ``iso2p`` ``isolation="process", helpers=2``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

LOADERS = ("dl2", "torchdata2", "spdl2", "thread2", "auto2", "iso2p")
BASELINES = ("dl2", "torchdata2", "spdl2")
WORKLOADS = ("images", "python", "tensors", "tokens")
#: Batches per epoch: about a second of loading each on 2 cores.
EPOCH_BATCHES = {"images": 16, "python": 300, "tensors": 16, "tokens": 400}


def _child(workload: str, loader: str, step_ops: int, epochs: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, Subset

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from threadloader import ThreadDataLoader
    from threadloader.compare.workloads import make_workload

    spec = make_workload(workload, size="bench")
    bs = spec.batch_size
    count = min(len(spec.dataset), EPOCH_BATCHES[workload] * bs)  # type: ignore[arg-type]
    ds = Subset(spec.dataset, range(count))
    if loader == "dl2":
        epochs_of: Any = DataLoader(ds, batch_size=bs, shuffle=True, num_workers=2)
    elif loader in ("thread2", "auto2", "iso2p"):
        extra: dict[str, Any] = {
            "thread2": {},
            "auto2": {"isolation": "auto"},
            "iso2p": {"isolation": "process", "helpers": 2},
        }[loader]
        epochs_of = ThreadDataLoader(ds, batch_size=bs, shuffle=True, num_workers=2, **extra)
    elif loader == "torchdata2":
        import torchdata.nodes as tn
        from bench_loaders import _MapAndCollate
        from torch.utils.data import BatchSampler, RandomSampler

        node = tn.SamplerWrapper(BatchSampler(RandomSampler(ds), bs, drop_last=False))
        node = tn.ParallelMapper(node, map_fn=_MapAndCollate(ds), num_workers=2, method="thread")
        epochs_of = tn.Loader(tn.Prefetcher(node, prefetch_factor=4))
    elif loader == "spdl2":
        import spdl.dataloader
        from torch.utils.data._utils.collate import default_collate

        epochs_of = spdl.dataloader.DataLoader(
            range(len(ds)), preprocessor=ds.__getitem__, batch_size=bs,
            aggregator=default_collate, num_threads=2, output_order="input",
        )  # fmt: skip
    else:
        raise ValueError(f"unknown loader {loader!r}")
    w = torch.ones(8)

    def step(batch: Any) -> None:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        v = w * float(x.reshape(-1)[0])  # reads the batch, so it must really be there
        for _ in range(step_ops // 2):
            v = v.mul(1.0001).add_(1e-4)

    paces, batches_after_first, seconds_after_first = [], 0, 0.0
    for epoch in range(epochs):
        start, n = time.perf_counter(), 0
        for batch in epochs_of:
            step(batch)
            n += 1
        took = time.perf_counter() - start
        paces.append(n / took)
        if epoch:
            batches_after_first += n
            seconds_after_first += took
    mode = None
    if isinstance(epochs_of, ThreadDataLoader):
        mode = epochs_of.stats().mode
    return {
        "pace": batches_after_first / seconds_after_first if seconds_after_first else paces[0],
        "epoch_paces": paces,
        "mode": mode,
    }


def measure(workload: str, loader: str, step_ops: int, epochs: int) -> dict[str, Any]:
    """One measurement in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one", workload, loader, str(step_ops),
         str(epochs)],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{workload}/{loader} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ops", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        workload, loader, step_ops, epochs = args.one
        print(json.dumps(_child(workload, loader, int(step_ops), int(epochs))))
        return
    loaders = tuple(args.loaders.split(","))
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        measure(workload, "thread2", 0, 1)  # builds the workload's files outside the timing
        for r in range(args.rounds):
            order = loaders[r % len(loaders) :] + loaders[: r % len(loaders)]
            got = {key: measure(workload, key, args.step_ops, args.epochs) for key in order}
            best = max(got[b]["pace"] for b in BASELINES if b in got)
            for key, out in got.items():
                rows.append({
                    "workload": workload, "loader": key, "round": r, **out,
                    "ratio_vs_best_baseline": out["pace"] / best,
                    "load": os.getloadavg()[0],
                })  # fmt: skip
    print(f"| workload | loader | batches/s (median) | x best of {'/'.join(BASELINES)}, per round "
          "| mode |")  # fmt: skip
    print("| --- | --- | --: | --- | --- |")
    for workload in args.workloads.split(","):
        for key in loaders:
            mine = [row for row in rows if row["workload"] == workload and row["loader"] == key]
            pace = statistics.median(row["pace"] for row in mine)
            ratios = ", ".join(f"{row['ratio_vs_best_baseline']:.2f}" for row in mine)
            modes = ",".join(sorted({str(row["mode"]) for row in mine if row["mode"]}))
            print(f"| {workload} | {key} | {pace:.1f} | {ratios} | {modes} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"step_ops": args.step_ops, "epochs": args.epochs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
