"""What a worker's own global RNGs and dataset copy cost a batch: ThreadDataLoader A/B in one run.

``on`` is ThreadDataLoader as it is. ``off`` makes the calling thread a worker without pushing
the torch function mode that gives random ops the worker's generator, and hands workers the
loader's dataset object instead of a copy: what a worker cost before it behaved like a process.
Rounds alternate the two (the order flips every round); each ratio is the median over rounds of
on/off in the same round: of samples/s, and of the process's CPU time per batch (all threads),
which a busy neighbour on a shared machine moves less than wall time.

    python bench/bench_worker_globals.py [--workloads tokens,images] [--rounds 5] [--batches 200]
    python bench/bench_worker_globals.py --json out.json   # also write every row and round
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from threadloader import ThreadDataLoader
from threadloader._engine import worker as _worker
from threadloader._primitives import worker_globals
from threadloader.compare.workloads import make_workload


@contextlib.contextmanager
def _off() -> Iterator[None]:
    real_swap, real_copy = worker_globals.swap, _worker.worker_copy

    def swap_without_mode(rngs: Any) -> Any:
        previous = worker_globals._local.current
        worker_globals._local.current = rngs
        return previous

    worker_globals.swap = swap_without_mode  # type: ignore[assignment]
    _worker.worker_copy = lambda dataset: dataset  # type: ignore[assignment]
    try:
        yield
    finally:
        worker_globals.swap = real_swap  # type: ignore[assignment]
        _worker.worker_copy = real_copy  # type: ignore[assignment]


def _measure(spec: Any, batches: int, num_workers: int) -> tuple[float, float]:
    """Samples/s and CPU microseconds per batch of one timed run."""
    loader = ThreadDataLoader(
        spec.dataset, batch_size=spec.batch_size, shuffle=True, num_workers=num_workers
    )
    it = iter(loader)
    for _ in range(2 * num_workers):  # start-up, untimed
        next(it)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(it)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    del it
    return batches * spec.batch_size / elapsed, cpu / batches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tokens,images")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--size", default="bench", choices=["small", "bench"])
    parser.add_argument("--json", default=None, help="also write every row, with its rounds")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print(
        f"| workload | on samples/s | off samples/s | on/off samples/s | on CPU us/batch "
        f"| off CPU us/batch | on/off CPU (medians of {args.rounds}) |"
    )
    print("| --- | --: | --: | --: | --: | --: | --: |")
    for name in args.workloads.split(","):
        spec = make_workload(name, size=args.size)
        batches = args.batches if name != "images" else max(args.batches // 10, 20)
        on: list[tuple[float, float]] = []
        off: list[tuple[float, float]] = []
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                if mode == "on":
                    on.append(_measure(spec, batches, args.num_workers))
                else:
                    with _off():
                        off.append(_measure(spec, batches, args.num_workers))
        rate = statistics.median(a[0] / b[0] for a, b in zip(on, off, strict=True))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(on, off, strict=True))
        on_rate, off_rate = (statistics.median(r[0] for r in x) for x in (on, off))
        on_cpu, off_cpu = (statistics.median(r[1] for r in x) for x in (on, off))
        print(
            f"| {name} | {on_rate:,.0f} | {off_rate:,.0f} | {rate:.3f} | {on_cpu:,.0f} "
            f"| {off_cpu:,.0f} | {cpu:.3f} |"
        )
        rows.append(
            {
                "workload": name,
                "batches": batches,
                "on_samples_s": on_rate,
                "off_samples_s": off_rate,
                "on_off_samples_s": rate,
                "on_cpu_us": on_cpu,
                "off_cpu_us": off_cpu,
                "on_off_cpu": cpu,
                "rounds_on": [list(x) for x in on],
                "rounds_off": [list(x) for x in off],
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rounds": args.rounds,
                    "num_workers": args.num_workers,
                    "size": args.size,
                    "cpus": os.cpu_count(),
                    "load_average_end": os.getloadavg(),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
