"""GPU check of the device stage: H2D bandwidth, and how long a training loop waits for data.

Run on a CUDA host (one GPU, under 3 minutes; ``--quick`` halves it)::

    python bench/gpu_check.py

1. Bandwidth. The same pinned bytes are copied host-to-device (a) by bare back-to-back
   ``dst.copy_(src, non_blocking=True)`` on one stream, the ceiling, and (b) through
   ``DevicePrefetcher``, which adds a thread hand-off, an event and ``record_stream`` per batch
   and allocates every batch from the caching allocator. Goal: (b) >= 80 % of (a). When
   ``ThreadDataLoader`` has a ``device=`` option, (c) is the whole loader on large items, for
   information: it also pays the collate copy on the CPU.
2. A simulated training loop: each step runs a fixed GPU kernel (matmuls, calibrated to
   ``--step-ms``) that reads the batch, then ``.item()`` as a real loss would. Measured per step:
   the host time spent getting the batch onto the GPU (``next()``, plus ``.to()`` for
   DataLoader) and the step's wall time above the kernel alone (GPU starved, or copies
   serialised with compute). ThreadDataLoader + DevicePrefetcher (``device=`` when available)
   against ``DataLoader(pin_memory=True)`` + ``.to(non_blocking=True)``, same worker count,
   once with loading faster than the step and once slower. Goal: ours waits no longer than
   DataLoader, and about zero when loading is faster than the step.

Numbers are medians over interleaved rounds, as the README's other benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from threadloader import ThreadDataLoader
from threadloader.transfer import DevicePrefetcher

HAS_DEVICE_OPTION = "device" in inspect.signature(ThreadDataLoader).parameters


def _sync() -> None:
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# 1. Bandwidth


def bare_copy_gbps(host: list[torch.Tensor], dev: torch.device, copies: int) -> float:
    dst = torch.empty_like(host[0], device=dev)
    _sync()
    start = time.perf_counter()
    for i in range(copies):
        dst.copy_(host[i % len(host)], non_blocking=True)
    _sync()
    return copies * host[0].nbytes / (time.perf_counter() - start) / 1e9


def prefetcher_gbps(host: list[torch.Tensor], dev: torch.device, copies: int) -> float:
    source = (host[i % len(host)] for i in range(copies))
    _sync()
    start = time.perf_counter()
    with contextlib.closing(DevicePrefetcher(source, dev, depth=2)) as prefetcher:
        for batch in prefetcher:
            del batch  # the consumer does nothing: the copies are the whole cost
    _sync()
    return copies * host[0].nbytes / (time.perf_counter() - start) / 1e9


class BigItems(Dataset[torch.Tensor]):
    """Items of ``item_bytes`` each, slices of one preallocated tensor: collate is a memcpy."""

    def __init__(self, n: int, item_bytes: int) -> None:
        self.n = n
        self.data = torch.randint(0, 255, (8, item_bytes), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i % 8]


def loader_gbps(dev: torch.device, batch_bytes: int, batches: int, workers: int) -> float:
    per_batch = 8
    dataset = BigItems(batches * per_batch, batch_bytes // per_batch)
    loader: Any = ThreadDataLoader(
        dataset, batch_size=per_batch, num_workers=workers, device=dev
    )  # only called when HAS_DEVICE_OPTION
    _sync()
    start = time.perf_counter()
    for batch in loader:
        del batch
    _sync()
    return batches * batch_bytes / (time.perf_counter() - start) / 1e9


def bandwidth_section(dev: torch.device, args: argparse.Namespace) -> list[list[str]]:
    nbytes = args.batch_mb << 20
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(i) for i in range(4)]
    copies = max(8, (args.bandwidth_gb << 30) // nbytes)
    bare_copy_gbps(host, dev, 8)  # warm up: contexts, allocator segments
    prefetcher_gbps(host, dev, 8)
    bare, ours, loader = [], [], []
    for _ in range(args.rounds):  # interleaved, so both see the same machine state
        bare.append(bare_copy_gbps(host, dev, copies))
        ours.append(prefetcher_gbps(host, dev, copies))
        if HAS_DEVICE_OPTION:
            loader.append(loader_gbps(dev, nbytes, copies // 2, args.workers))
    b, o = statistics.median(bare), statistics.median(ours)
    rows = [
        ["bare pinned copy_(non_blocking=True)", f"{b:.1f}", "100%", ""],
        [
            "DevicePrefetcher, pinned batches",
            f"{o:.1f}",
            f"{100 * o / b:.0f}%",
            "PASS" if o >= 0.8 * b else "FAIL (goal >= 80%)",
        ],
    ]
    if loader:
        lo = statistics.median(loader)
        rows.append(
            [
                f"ThreadDataLoader(device=, num_workers={args.workers}), collate included",
                f"{lo:.1f}",
                f"{100 * lo / b:.0f}%",
                "info",
            ]
        )
    else:
        rows.append(["ThreadDataLoader(device=...)", "-", "-", "no device= option yet"])
    return rows


# ------------------------------------------------------------------------------------------------
# 2. Simulated training loop


class Images(Dataset[tuple[torch.Tensor, int]]):
    """uint8 3x224x224 images sliced from a preallocated tensor, plus optional CPU work."""

    def __init__(self, n: int, work_s: float) -> None:
        self.n = n
        self.work_s = work_s
        self.data = torch.randint(0, 255, (64, 3, 224, 224), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.work_s:
            time.sleep(self.work_s)  # decode-like work that releases the GIL
        return self.data[i % 64].clone(), i


def calibrate_kernel(
    dev: torch.device, step_ms: float
) -> tuple[Callable[[torch.Tensor], Any], float]:
    """A step function doing ~step_ms of matmuls that depend on the batch; and its GPU time."""
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def run(repeats: int, x: torch.Tensor) -> torch.Tensor:
        y = a * (x.float().mean() / 255)  # reads the whole batch: waits for its copy
        for _ in range(repeats):
            y = y @ a
            y = y / y.abs().amax().clamp_min(1)
        return y.float().mean()

    probe = torch.zeros(1, 3, 224, 224, dtype=torch.uint8, device=dev)
    run(2, probe)
    _sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(10, probe)
    end.record()
    _sync()
    per_repeat = start.elapsed_time(end) / 10
    repeats = max(1, round(step_ms / per_repeat))
    return (lambda x: run(repeats, x)), repeats * per_repeat


def kernel_only_ms(step: Callable[[torch.Tensor], Any], x: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x).item()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def train(
    batches: Iterator[Any],
    to_device: Callable[[Any], Any],
    step: Callable[[torch.Tensor], Any],
    steps: int,
    warmup: int,
) -> tuple[list[float], list[float]]:
    """Run the loop; per-step (host data wait, whole step) times in ms, after warm-up."""
    waits, totals = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        x, _ = to_device(next(batches))
        t1 = time.perf_counter()
        step(x).item()  # the loss read each step: the host waits for the GPU here
        t2 = time.perf_counter()
        if i >= warmup:
            waits.append(1e3 * (t1 - t0))
            totals.append(1e3 * (t2 - t0))
    return waits, totals


def torch_run(ds: Dataset[Any], dev: torch.device, args: argparse.Namespace, step: Any) -> Any:
    loader = DataLoader(
        ds, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True, shuffle=True
    )
    it = iter(loader)
    try:
        return train(
            it,
            lambda b: [t.to(dev, non_blocking=True) for t in b],
            step,
            args.steps,
            args.warmup,
        )
    finally:
        del it


def _isolation(args: argparse.Namespace) -> dict[str, Any]:
    """ThreadDataLoader's isolation options from the command line; none: its defaults."""
    options: dict[str, Any] = {}
    if args.isolation is not None:
        options["isolation"] = args.isolation
    if args.helpers is not None:
        options["helpers"] = args.helpers
    return options


def ours_run(ds: Dataset[Any], dev: torch.device, args: argparse.Namespace, step: Any) -> Any:
    if HAS_DEVICE_OPTION:
        loader: Any = ThreadDataLoader(
            ds,
            batch_size=args.batch_size,
            num_workers=args.workers,
            shuffle=True,
            device=dev,
            **_isolation(args),
        )
        it: Any = iter(loader)
    else:  # compose by hand until the loader has device=
        host = ThreadDataLoader(
            ds, batch_size=args.batch_size, num_workers=args.workers, shuffle=True, pin_memory=True
        )
        it = DevicePrefetcher(iter(host), dev, depth=2)
    try:
        return train(it, lambda b: b, step, args.steps, args.warmup)
    finally:
        with contextlib.suppress(AttributeError):
            it.close()
        del it


def training_section(dev: torch.device, args: argparse.Namespace) -> list[list[str]]:
    step, kernel_ms = calibrate_kernel(dev, args.step_ms)
    x = torch.zeros(args.batch_size, 3, 224, 224, dtype=torch.uint8, device=dev)
    base_ms = kernel_only_ms(step, x, 20)
    n = (args.steps + args.warmup + 4) * args.batch_size
    # Per-item work such that one worker needs `factor` steps of time per batch: with
    # `workers` workers loading keeps up when factor < workers.
    scenarios = {
        "loading faster than the step": 0.0,
        "loading slower than the step": (
            2.0 * args.workers * base_ms / 1e3 / args.batch_size
        ),  # each worker needs 2 * workers steps per batch: half the needed throughput
    }
    rows = []
    ours_name = "ThreadDataLoader(device=)" if HAS_DEVICE_OPTION else "ThreadDataLoader+Prefetcher"
    chosen = _isolation(args)
    if chosen:
        options = ", ".join(f"{k}={v!r}" for k, v in chosen.items())
        ours_name = f"ThreadDataLoader(device=, {options})"
    for scenario, work_s in scenarios.items():
        ds = Images(n, work_s)
        results: dict[str, tuple[list[float], list[float]]] = {"torch": ([], []), "ours": ([], [])}
        for _ in range(args.rounds):
            for name, run in (("torch", torch_run), ("ours", ours_run)):
                waits, totals = run(ds, dev, args, step)
                results[name][0].extend(waits)
                results[name][1].extend(totals)
        medians = {
            k: (statistics.median(w), statistics.mean(w), statistics.median(t))
            for k, (w, t) in results.items()
        }
        for name, label in (("torch", "DataLoader(pin_memory)+.to()"), ("ours", ours_name)):
            wait_med, wait_mean, total = medians[name]
            verdict = ""
            if name == "ours":
                ok = medians["ours"][1] <= medians["torch"][1] * 1.05 + 0.05
                if work_s == 0.0:
                    ok = ok and wait_mean <= 0.1 * base_ms
                verdict = "PASS" if ok else "FAIL"
            rows.append(
                [
                    scenario,
                    label,
                    f"{wait_med:.2f}",
                    f"{wait_mean:.2f}",
                    f"{total:.2f}",
                    f"{total - base_ms:+.2f}",
                    verdict,
                ]
            )
    rows.append(["kernel alone", f"{kernel_ms:.2f} ms GPU", "", "", f"{base_ms:.2f}", "", ""])
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--batch-mb", type=int, default=64, help="bandwidth batch size")
    parser.add_argument("--bandwidth-gb", type=int, default=4, help="bytes per bandwidth round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--isolation", choices=["auto", "threads", "process"], help="ThreadDataLoader's isolation"
    )
    parser.add_argument("--helpers", type=int, help="ThreadDataLoader's helpers (with process)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.bandwidth_gb = 2, 40, 2
    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA device; nothing measured", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    print(
        f"{torch.cuda.get_device_name(dev)} | torch {torch.__version__} | "
        f"CUDA {torch.version.cuda} | ThreadDataLoader device= option: {HAS_DEVICE_OPTION}"
    )
    print_table(
        "1. Host-to-device bandwidth, GB/s (median of rounds)",
        ["path", "GB/s", "of bare", "goal"],
        bandwidth_section(dev, args),
    )
    print_table(
        f"2. Training loop, ms per step (batch {args.batch_size}x3x224x224 uint8, "
        f"{args.workers} workers, median of {args.rounds} rounds x {args.steps} steps)",
        ["scenario", "loader", "wait med", "wait mean", "step med", "vs kernel", "goal"],
        training_section(dev, args),
    )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
