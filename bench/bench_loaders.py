"""ThreadDataLoader against torch's DataLoader and other thread loaders, on the built-in workloads.

Run::

    pytest bench/ --benchmark-only                      # everything, ~10 minutes on 2 cores
    pytest bench/ --benchmark-only --bench-size small   # smoke run, ~1 minute
    pytest bench/ --benchmark-only -k memory            # only the memory case

Throughput: for each workload, each round runs every loader once, back to back (the order
rotates each round), so all loaders in a round see the same machine state. A measurement is
``warmup`` batches (worker start-up, first-batch latency) and then ``batches`` timed batches;
samples/s counts the timed batches only. Ratios are taken within a round; the table printed at
the end (bench/conftest.py) quotes medians over rounds.

Memory: each loader runs one shuffled epoch of the ``objects`` workload in a fresh interpreter
(so one loader's freed memory cannot hide the next one's), and reports the peak PSS of the
process tree above what it was once the dataset was built.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, default_collate

from threadloader.compare.workloads import WorkloadSpec, make_workload

NUM_WORKERS = 2
THROUGHPUT_LOADERS: tuple[str, ...] = ("dl0", "dl2", "thread2", "thread2p", "torchdata2", "spdl2")
MEMORY_LOADERS: tuple[str, ...] = (
    "dl0", "dl2", "dl4", "thread4", "thread2p", "thread2pz", "thread2pfs"
)  # fmt: skip
MEMORY_CASE_TIMEOUT_S = 300  # one epoch takes 15-40 s on 2 cores

# (warm-up batches, timed batches): sized so the slowest loader's round takes a few seconds, and
# long enough that ThreadDataLoader's concurrency controller (~0.1-0.3 s to settle) is measured
# settled, as it is for nearly all of a training run. tokens: 1,525 batches in an epoch.
MEASURE: dict[str, dict[str, tuple[int, int]]] = {
    "bench": {"tokens": (40, 1400), "images": (6, 40), "tensors": (6, 30), "python": (40, 2000)},
    "small": {"tokens": (4, 24), "images": (2, 5), "tensors": (1, 3), "python": (4, 24)},
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if "throughput_case" in metafunc.fixturenames:
        rounds = config.getoption("--bench-rounds")
        workloads = [w for w in config.getoption("--bench-workloads").split(",") if w]
        cases = []
        for workload in workloads:
            for r in range(rounds):
                shift = r % len(THROUGHPUT_LOADERS)
                for loader in THROUGHPUT_LOADERS[shift:] + THROUGHPUT_LOADERS[:shift]:
                    cases.append((workload, r, loader))
        metafunc.parametrize(
            "throughput_case", cases, ids=[f"{w}-round{r}-{loader}" for w, r, loader in cases]
        )


@functools.cache
def _workload(name: str, size: str) -> WorkloadSpec:
    return make_workload(name, size=size)


class _MapAndCollate:
    """torchdata.nodes' recipe for replacing DataLoader: one task per batch of indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        return default_collate([self.dataset[i] for i in indices])


def _open_loader(loader: str, spec: WorkloadSpec) -> tuple[Iterator[Any], Callable[[], None]]:
    """Start ``loader`` on ``spec`` and return its iterator and a function that stops it."""
    ds, bs = spec.dataset, spec.batch_size
    if loader in ("dl0", "dl2"):
        workers = 0 if loader == "dl0" else NUM_WORKERS
        it = iter(DataLoader(ds, batch_size=bs, num_workers=workers))

        def close() -> None:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

        return it, close
    if loader == "thread2":
        from threadloader import ThreadDataLoader

        thread_it = iter(ThreadDataLoader(ds, batch_size=bs, num_workers=NUM_WORKERS))
        return thread_it, getattr(thread_it, "close", lambda: None)
    if loader == "thread2p":
        from threadloader import ThreadDataLoader

        isolated = ThreadDataLoader(
            ds, batch_size=bs, num_workers=NUM_WORKERS, isolation="process", helpers=NUM_WORKERS
        )
        isolated_it = iter(isolated)
        return isolated_it, getattr(isolated_it, "close", lambda: None)
    if loader == "torchdata2":
        import torchdata.nodes as tn

        node = tn.SamplerWrapper(BatchSampler(SequentialSampler(ds), bs, drop_last=False))
        node = tn.ParallelMapper(
            node, map_fn=_MapAndCollate(ds), num_workers=NUM_WORKERS, method="thread"
        )
        node = tn.Prefetcher(node, prefetch_factor=2 * NUM_WORKERS)  # DataLoader's default depth
        return iter(tn.Loader(node)), lambda: None  # threads stop when the nodes are collected
    if loader == "spdl2":
        import spdl.dataloader

        spdl_loader = spdl.dataloader.DataLoader(
            range(len(ds)),  # type: ignore[arg-type]
            preprocessor=ds.__getitem__,
            batch_size=bs,
            aggregator=default_collate,
            num_threads=NUM_WORKERS,
            output_order="input",
        )
        gen = iter(spdl_loader)
        return gen, gen.close
    raise ValueError(f"unknown loader {loader!r}")


def _skip_if_unavailable(loader: str, bench_store: Any) -> None:
    """Skip (and list in the summary) a loader whose package is not installed."""
    why = None
    if loader.startswith("thread"):
        import threadloader

        if not hasattr(threadloader, "ThreadDataLoader"):
            why = "threadloader.ThreadDataLoader is not available yet"
    elif loader.startswith("torchdata") and importlib.util.find_spec("torchdata") is None:
        why = "torchdata is not installed (pip install torchdata)"
    elif loader.startswith("spdl") and importlib.util.find_spec("spdl") is None:
        why = "spdl is not installed (pip install spdl)"
    if why is not None:
        bench_store.skipped[loader] = why
        pytest.skip(why)


def _pedantic(benchmark: Any, target: Callable[[], None], **kwargs: Any) -> None:
    """``benchmark.pedantic`` for one round, safe against pytest's own outcomes.

    pytest-benchmark marks a benchmark as failed only on ``Exception``; a timeout from
    pytest-timeout or a ``pytest.fail`` is a ``BaseException`` and would leave a benchmark with
    no data, which crashes its JSON report at the end of the session and hides every result.
    """
    try:
        benchmark.pedantic(target, rounds=1, iterations=1, warmup_rounds=0, **kwargs)
    except BaseException:
        benchmark.has_error = True
        raise


def _wait_for_threads(count: int, timeout_s: float = 10.0) -> int:
    """Wait until at most ``count`` threads are alive; return how many more are left.

    A loader whose threads stop only when they finish what they prefetched (torchdata.nodes'
    threads are never joined; SPDL's wind down in the background) would otherwise still be
    decoding when the next case starts: that case's first batch took 0.24-0.27 s instead of
    0.10 s on images.
    """
    deadline = time.monotonic() + timeout_s
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count() - count


def _batch_len(batch: Any) -> int:
    return int(batch.shape[0]) if isinstance(batch, torch.Tensor) else len(batch)


@pytest.mark.timeout(120)  # a hung loader fails its own test, with every thread's stack
def test_throughput(
    benchmark: Any, bench_store: Any, throughput_case: tuple[str, int, str]
) -> None:
    """Samples/s of one loader on one workload, in one interleaved round."""
    workload, round_no, loader = throughput_case
    _skip_if_unavailable(loader, bench_store)
    spec = _workload(workload, bench_store.size)
    warmup, batches = MEASURE[bench_store.size][workload]
    benchmark.group = f"throughput-{workload}"
    state: dict[str, Any] = {}

    def setup() -> None:
        gc.collect()
        state["threads_before"] = threading.active_count()
        start = time.perf_counter()
        state["it"], state["close"] = _open_loader(loader, spec)
        next(state["it"])
        state["first_batch_s"] = time.perf_counter() - start
        for _ in range(warmup - 1):
            next(state["it"])

    def run() -> None:
        it, samples = state["it"], 0
        start = time.perf_counter()
        for _ in range(batches):
            samples += _batch_len(next(it))
        state["elapsed"] = time.perf_counter() - start
        state["samples"] = samples

    try:
        _pedantic(benchmark, run, setup=setup)
    finally:
        close = state.pop("close", None)
        state.pop("it", None)
        if close is not None:
            close()
        del close
        gc.collect()
        threads_left = _wait_for_threads(state["threads_before"])
    samples_per_s = state["samples"] * spec.samples_per_item / state["elapsed"]
    benchmark.extra_info.update(
        workload=workload,
        loader=loader,
        round=round_no,
        samples_per_s=round(samples_per_s, 1),
        first_batch_s=round(state["first_batch_s"], 4),
        timed_batches=batches,
        batch_size=spec.batch_size,
        threads_left=threads_left,
    )
    bench_store.add_throughput(
        workload=workload,
        round=round_no,
        loader=loader,
        samples_per_s=samples_per_s,
        first_batch_s=state["first_batch_s"],
        extra_info=benchmark.extra_info,
    )


@pytest.mark.timeout(MEMORY_CASE_TIMEOUT_S + 120)
@pytest.mark.parametrize("loader", MEMORY_LOADERS)
def test_memory_above_dataset(benchmark: Any, bench_store: Any, loader: str) -> None:
    """Peak PSS of the process tree above the built dataset, over one shuffled epoch."""
    _skip_if_unavailable(loader, bench_store)
    benchmark.group = "memory-objects"
    out: dict[str, Any] = {}

    def run() -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "memory", loader, bench_store.size]
        env = {**os.environ, **({"THREADLOADER_ZYGOTE": "0"} if loader == "thread2pfs" else {})}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=MEMORY_CASE_TIMEOUT_S + 60, check=False,
            env=env,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"memory case {loader} failed:\n{proc.stderr[-4000:]}")
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))

    _pedantic(benchmark, run)
    benchmark.extra_info.update(loader=loader, **out)
    bench_store.add_memory(
        loader=loader,
        dataset_bytes=out["dataset_bytes"],
        above_bytes=out["above_bytes"],
        epoch_s=out["epoch_s"],
    )


def _memory_case(loader: str, size: str) -> dict[str, Any]:
    """Run one shuffled epoch of ``objects`` with ``loader`` and measure the process tree."""
    import faulthandler

    # A hung loader ends this process with every thread's stack on stderr, which the test
    # reports, instead of holding the session until the test's timeout.
    faulthandler.dump_traceback_later(MEMORY_CASE_TIMEOUT_S, exit=True)
    from threadloader.compare.memory_probe import PeakSampler, tree_pss_bytes

    gc.collect()
    before = tree_pss_bytes()
    spec = make_workload("objects", size=size)
    gc.collect()
    baseline = tree_pss_bytes()
    kwargs: dict[str, Any] = {
        "batch_size": spec.batch_size,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(0),
    }
    if loader == "dl0":
        dl: DataLoader[Any] = DataLoader(spec.dataset, num_workers=0, **kwargs)
    elif loader in ("dl2", "dl4"):
        dl = DataLoader(spec.dataset, num_workers=int(loader[2:]), **kwargs)
    elif loader == "thread4":
        from threadloader import ThreadDataLoader

        # Threads throughout. (The default would stay in threads here too: the PSS sampler's
        # thread keeps a long GIL-bound epoch from forking helpers mid-epoch; the thread2p
        # rows show what forked helpers cost.)
        dl = ThreadDataLoader(spec.dataset, num_workers=4, isolation="threads", **kwargs)
    elif loader.startswith("thread2p"):
        # thread2p: helpers forked from this process (one Python thread at iter());
        # thread2pz: from the zygote (another thread runs at iter()); thread2pfs: from the
        # forkserver (THREADLOADER_ZYGOTE=0, set by the caller).
        from threadloader import ThreadDataLoader

        dl = ThreadDataLoader(spec.dataset, num_workers=2, isolation="process", helpers=2, **kwargs)
    else:
        raise ValueError(f"unknown loader {loader!r}")
    expected, samples = len(dl.dataset), 0  # type: ignore[arg-type]
    start = time.perf_counter()
    # The epoch starts before the sampler's thread: the helpers of thread2p are forked from a
    # process that runs one thread, as they are from a training loop that runs no other thread.
    other = threading.Thread(target=time.sleep, args=(0.5,)) if loader == "thread2pz" else None
    if other is not None:
        other.start()
    epoch = iter(dl)
    with PeakSampler() as peak:
        for batch in epoch:
            samples += _batch_len(batch)
    if other is not None:
        other.join()
    epoch_s = time.perf_counter() - start
    if samples != expected:
        raise RuntimeError(f"the epoch gave {samples} samples, the dataset has {expected}")
    return {
        "dataset_bytes": baseline - before,
        "baseline_bytes": baseline,
        "peak_bytes": peak.peak_bytes,
        "above_bytes": peak.peak_bytes - baseline,
        "epoch_s": epoch_s,
        "samples": samples,
        "pss_samples": peak.samples,
    }


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "memory":
        sys.exit(
            "usage: python bench/bench_loaders.py memory dl0|dl2|dl4|thread4|thread2p small|bench"
        )
    print(json.dumps(_memory_case(sys.argv[2], sys.argv[3])))
