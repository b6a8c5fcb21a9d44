"""The whole training loop's pace: batches per second of a loop that loads and steps.

What a user measures is the loop, not the loader alone: a loader whose worker threads take the
GIL from the training thread can be fast and still slow the step. Each measurement runs in a
fresh interpreter: it builds the loader, runs ``--epochs`` epochs of a loop whose step is
``--step-ops`` tiny torch ops (Python-bound, like launching a model's kernels; 0: no step), and
reports batches/s over the epochs after the first (every loader has started its workers by
then); with ``--epochs 1``, over the one epoch, start-up included: a run of one long epoch, which
``isolation="auto"`` moves into helper processes mid-epoch when its items hold the GIL. With
``--monitor-thread``, a thread like a progress bar's monitor (tqdm's) starts once the loader is
built, as ``for batch in tqdm(loader)`` starts one: the training process is no longer forked, and
helpers come from the zygote (``isolation="process"``, which starts it when built) or a
forkserver (``"auto"``). With ``--seed-workers``, the loaders that take a ``worker_init_fn``
(DataLoader, ThreadDataLoader) get one that reseeds each worker's global RNGs from
``torch.initial_seed()``, as Hugging Face Trainer's ``seed_worker`` does. Loaders take turns within a round, in
an order that rotates each round; ratios are taken within a round, against the best of
DataLoader, torchdata.nodes and SPDL in that round.

Run::

    python bench/bench_loop.py                                # 400-op step, 3 rounds
    python bench/bench_loop.py --step-ops 0 --rounds 3        # the loader alone, epochs included
    python bench/bench_loop.py --cpus 1                       # the same pinned to one CPU
    python bench/bench_loop.py --workloads python --rounds 1  # one workload, quickly
    python bench/bench_loop.py --epochs 1 --epoch-scale 5     # one long epoch, start included
    python bench/bench_loop.py --monitor-thread --epochs 5    # a progress bar's thread runs
    python bench/bench_loop.py --monitor-thread --seed-workers --epochs 1 --epoch-scale 10

Loaders, each with 2 workers (32 on ``latency``, 10 ms reads): ``dl`` DataLoader; ``torchdata``
torchdata.nodes ParallelMapper (threads) of whole batches; ``spdl`` SPDL DataLoader (threads);
``thread`` ThreadDataLoader with its default settings (``isolation="auto"``); ``threads`` the
same with ``isolation="threads"``; ``iso`` ``isolation="process", helpers=2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

LOADERS = ("dl", "torchdata", "spdl", "thread", "threads", "iso")
BASELINES = ("dl", "torchdata", "spdl")
WORKLOADS = ("images", "python", "tensors", "tokens", "latency")
#: Batches per epoch: about a second of loading each on 2 cores.
EPOCH_BATCHES = {"images": 16, "python": 300, "tensors": 16, "tokens": 400, "latency": 200}
#: Workers per loader: latency-bound reads need many in flight.
WORKERS = {"latency": 32}
LATENCY_S = 0.01


class LatencyReads:
    """Item i: a 10 ms wait (a remote read, the GIL released), then 4 KiB of bytes as a tensor."""

    batch_size = 16

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> Any:
        import torch

        time.sleep(LATENCY_S)
        return torch.full((1024,), index, dtype=torch.int32)


def seed_worker(worker_id: int) -> None:
    """What Hugging Face Trainer's ``seed_worker`` does: reseed the worker's global RNGs."""
    import random

    import numpy as np
    import torch

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _monitor(stop: threading.Event) -> None:
    """What tqdm's monitor thread does: wake every few seconds, check, sleep again."""
    while not stop.wait(10.0):
        pass


@dataclasses.dataclass(frozen=True)
class Shape:
    """The loop each loader runs: its step, epochs, epoch length, monitor thread, seeding."""

    step_ops: int
    epochs: int
    scale: int = 1
    monitor: bool = False
    seeded: bool = False

    def argv(self) -> list[str]:
        """As ``--one`` passes it to the measuring interpreter."""
        return [str(int(v)) for v in dataclasses.astuple(self)]

    @classmethod
    def from_argv(cls, argv: list[str]) -> Shape:
        step_ops, epochs, scale, monitor, seeded = (int(v) for v in argv)
        return cls(step_ops, epochs, scale, bool(monitor), bool(seeded))


def _child(workload: str, loader: str, shape: Shape) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, Subset

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from threadloader import ThreadDataLoader
    from threadloader.compare.workloads import make_workload

    dataset: Any = LatencyReads() if workload == "latency" else None
    if dataset is None:
        spec = make_workload(workload, size="bench")
        dataset, bs = spec.dataset, spec.batch_size
    else:
        bs = LatencyReads.batch_size
    count = min(len(dataset), EPOCH_BATCHES[workload] * shape.scale * bs)
    ds = Subset(dataset, range(count))
    workers = WORKERS.get(workload, 2)
    init = {"worker_init_fn": seed_worker} if shape.seeded else {}
    if loader == "dl":
        epochs_of: Any = DataLoader(ds, batch_size=bs, shuffle=True, num_workers=workers, **init)
    elif loader in ("thread", "threads", "iso"):
        extra: dict[str, Any] = {
            "thread": {},
            "threads": {"isolation": "threads"},
            "iso": {"isolation": "process", "helpers": 2},
        }[loader]
        epochs_of = ThreadDataLoader(
            ds, batch_size=bs, shuffle=True, num_workers=workers, **extra, **init
        )
    elif loader == "torchdata":
        import torchdata.nodes as tn
        from bench_loaders import _MapAndCollate
        from torch.utils.data import BatchSampler, RandomSampler

        node = tn.SamplerWrapper(BatchSampler(RandomSampler(ds), bs, drop_last=False))
        node = tn.ParallelMapper(
            node, map_fn=_MapAndCollate(ds), num_workers=workers, method="thread"
        )
        epochs_of = tn.Loader(tn.Prefetcher(node, prefetch_factor=4))
    elif loader == "spdl":
        import spdl.dataloader
        from torch.utils.data._utils.collate import default_collate

        epochs_of = spdl.dataloader.DataLoader(
            range(len(ds)), preprocessor=ds.__getitem__, batch_size=bs,
            aggregator=default_collate, num_threads=workers, output_order="input",
        )  # fmt: skip
    else:
        raise ValueError(f"unknown loader {loader!r}")
    stop = threading.Event()
    watcher = threading.Thread(target=_monitor, args=(stop,), name="monitor", daemon=True)
    if shape.monitor:
        watcher.start()
    w = torch.ones(8)

    def step(batch: Any) -> None:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        v = w * float(x.reshape(-1)[0])  # reads the batch, so it must really be there
        for _ in range(shape.step_ops // 2):
            v = v.mul(1.0001).add_(1e-4)

    paces, modes, batches_after_first, seconds_after_first = [], [], 0, 0.0
    for epoch in range(shape.epochs):
        start, n = time.perf_counter(), 0
        for batch in epochs_of:
            step(batch)
            n += 1
        took = time.perf_counter() - start
        paces.append(n / took)
        if isinstance(epochs_of, ThreadDataLoader):
            modes.append(epochs_of.stats().mode)
        if epoch:
            batches_after_first += n
            seconds_after_first += took
    if shape.monitor:
        stop.set()
        watcher.join()
    mode = None
    if isinstance(epochs_of, ThreadDataLoader):
        mode = epochs_of.stats().mode
    return {
        "pace": batches_after_first / seconds_after_first if seconds_after_first else paces[0],
        "epoch_paces": paces,
        "epoch_modes": modes,
        "mode": mode,
    }


def measure(workload: str, loader: str, shape: Shape) -> dict[str, Any]:
    """One measurement in a fresh interpreter.

    A baseline's interpreter that fails is run once more, with a note on stderr (torchdata's
    threads have ended an interpreter with ``terminate called without an active exception``);
    a ThreadDataLoader failure stops the bench.
    """
    tries = 2 if loader in BASELINES else 1
    for attempt in range(tries):
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", workload, loader, *shape.argv()],
            check=False, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode == 0:
            return dict(json.loads(done.stdout.strip().splitlines()[-1]))
        if attempt + 1 < tries:
            print(f"{workload}/{loader} failed, run again:\n{done.stderr[-500:]}", file=sys.stderr)
    raise RuntimeError(f"{workload}/{loader} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ops", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--epoch-scale", type=int, default=1, help="epochs this many times longer (default 1)"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--cpus", type=int, help="run every measurement on this many CPUs")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument(
        "--monitor-thread", action="store_true", help="a progress bar's thread runs (tqdm's)"
    )
    parser.add_argument(
        "--seed-workers",
        action="store_true",
        help="a worker_init_fn reseeds each worker (Hugging Face Trainer's seed_worker)",
    )
    parser.add_argument("--one", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        workload, loader, *shape = args.one
        out = _child(workload, loader, Shape.from_argv(shape))
        print(json.dumps(out))
        return
    if args.cpus:  # measurements are child processes: they inherit the affinity
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    cpus = len(os.sched_getaffinity(0))
    loaders = tuple(args.loaders.split(","))
    rows: list[dict[str, Any]] = []
    shape = Shape(
        args.step_ops, args.epochs, args.epoch_scale, args.monitor_thread, args.seed_workers
    )
    for workload in args.workloads.split(","):
        measure(workload, "threads", Shape(0, 1))  # builds the workload's files outside the timing
        for r in range(args.rounds):
            order = loaders[r % len(loaders) :] + loaders[: r % len(loaders)]
            got = {key: measure(workload, key, shape) for key in order}
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
            out = {
                "step_ops": args.step_ops,
                "epochs": args.epochs,
                "epoch_scale": args.epoch_scale,
                "monitor_thread": args.monitor_thread,
                "seed_workers": args.seed_workers,
                "cpus": cpus,
                "rows": rows,
            }
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
