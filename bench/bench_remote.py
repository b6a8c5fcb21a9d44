"""Latency-bound reads: ThreadDataLoader + RemoteFiles against DataLoader with 32 processes.

Run::

    pytest bench/bench_remote.py --benchmark-only                    # ~3 minutes on 2 cores
    pytest bench/bench_remote.py --benchmark-only --bench-rounds 1   # one round, ~1 minute

The workload: objects on a local HTTP server (``tests/remote_servers.py``, its own
process) that answers every request after 10 ms; batch 16. With 32 reads in flight the latency
limit is 32 / 10 ms = 3,200 samples/s. Loaders, each in a fresh interpreter so memory and threads
never carry over, measured in interleaved rounds (the order rotates each round):

- ``thread32``: ``ThreadDataLoader(num_workers=32)`` over ``RemoteFiles(urls)``: each batch is
  read by its worker and the free threads of the dataset's 32-thread pool, so up to 64 reads are
  in flight, and it can pass the limit that 32 set.
- ``thread32_serial``: the same with ``RemoteFiles(max_concurrency=0)``: each worker reads its
  batch one object after another, so exactly 32 reads are in flight, as with 32 processes.
- ``dl32``: ``torch.utils.data.DataLoader(num_workers=32)`` (32 worker processes) over
  ``RemoteFiles(urls, max_concurrency=0)``: one read in flight per process.

Each measurement takes ``WARMUP`` batches (worker start-up), then times the rest of the epoch;
memory is the peak PSS of the process tree (``threadloader.compare.memory_probe``), sampled every
0.25 s, and the RSS summed over the tree once all workers are up (what ``top`` adds up: each
process counts the pages it shares with the others; PSS splits them). The short case times a
1,024-object epoch from the loader's constructor to its last batch, start-up included, the first
loader of the interpreter (samples/s and the first batch), next to ``bare32``: 32 plain threads
reading the same objects over ``http.client`` with no loader, what 32 reads in flight reach with
the standard library's client on this machine and server. The cache case runs two epochs of
``thread32`` with ``cache_dir=``: the second reads local files only. The per-thread case
compares the memory of 8 and 64 worker threads on 64-byte
objects (so batches in flight weigh nothing) and divides by the 56 extra threads: at the peak,
and once the epoch is over with the (persistent) workers idle.

The end of the session prints the medians and checks the goals.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LATENCY_MS = 10.0
OBJECTS = 8192
OBJECT_BYTES = 16384
BATCH = 16
WORKERS = 32
WARMUP = 64  # batches before timing starts: two per worker
SHORT = 1024  # objects in the short epoch, timed from the loader's constructor
LOADERS = ("thread32", "thread32_serial", "dl32")
LABELS = {
    "thread32": "ThreadDataLoader(32) + RemoteFiles (batch reads concurrent)",
    "thread32_serial": "ThreadDataLoader(32) + RemoteFiles(max_concurrency=0)",
    "dl32": "DataLoader(32 processes) + RemoteFiles(max_concurrency=0)",
}
#: The short case also times this reference: no loader and no dataset, 32 plain threads each
#: reading its 32 objects one after another over one keep-alive connection (``http.client``).
SHORT_LOADERS = (*LOADERS, "bare32")
LABELS["bare32"] = "32 plain threads + http.client, no loader"
LIMIT = WORKERS / (LATENCY_MS / 1e3)  # samples/s with exactly 32 reads in flight
SERVER = Path(__file__).resolve().parents[1] / "tests" / "remote_servers.py"

_results: dict[str, list[dict[str, Any]]] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    rounds = metafunc.config.getoption("--bench-rounds")
    for fixture, loaders in (("remote_case", LOADERS), ("short_case", SHORT_LOADERS)):
        if fixture in metafunc.fixturenames:
            cases = []
            for r in range(rounds):
                shift = r % len(loaders)
                cases += [(r, loader) for loader in loaders[shift:] + loaders[:shift]]
            metafunc.parametrize(fixture, cases, ids=[f"round{r}-{lo}" for r, lo in cases])
    if "remote_round" in metafunc.fixturenames:
        metafunc.parametrize(
            "remote_round", range(rounds), ids=[f"round{r}" for r in range(rounds)]
        )


@pytest.fixture(scope="module")
def server_port(request: pytest.FixtureRequest) -> Iterator[int]:
    """The HTTP server, in its own process: its CPU and memory are not the loaders'."""
    cmd = [sys.executable, str(SERVER), f"--objects={OBJECTS}", f"--size={OBJECT_BYTES}"]
    proc = subprocess.Popen(
        [*cmd, f"--latency-ms={LATENCY_MS}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdin is not None
    port = int(proc.stdout.readline())
    if not request.config.pluginmanager.has_plugin(_SUMMARY):
        request.config.pluginmanager.register(_Summary(), _SUMMARY)
    yield port
    proc.stdin.close()  # the server stops when its stdin closes
    proc.wait(timeout=30)


_SUMMARY = "threadloader-remote-summary"


class _Summary:
    """Plugin registered by the first remote benchmark: prints the table at the session's end."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        _report(terminalreporter)


def _run(*args: Any, timeout: int = 600) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _once(benchmark: Any, fn: Any) -> None:
    benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)


def _measure_loader(benchmark: Any, what: str, key: str, port: int, case: tuple[int, str]) -> None:
    """Run ``what`` for the case's loader in a fresh interpreter; keep its row under ``key``."""
    round_no, loader = case
    benchmark.group = f"remote-{what}"
    out: dict[str, Any] = {}
    _once(benchmark, lambda: out.update(_run(what, loader, port)))
    benchmark.extra_info.update(loader=loader, round=round_no, **out)
    _results.setdefault(key.format(loader=loader), []).append(out)


def test_remote_throughput(benchmark: Any, server_port: int, remote_case: tuple[int, str]) -> None:
    """Samples/s and peak memory of one loader on the 10 ms workload, in one round."""
    _measure_loader(benchmark, "throughput", "{loader}", server_port, remote_case)


def test_remote_short_epoch(benchmark: Any, server_port: int, short_case: tuple[int, str]) -> None:
    """A 1,024-object epoch, start-up included, the first loader of a fresh interpreter."""
    _measure_loader(benchmark, "short", "short-{loader}", server_port, short_case)


def test_remote_cache_second_epoch(benchmark: Any, server_port: int, remote_round: int) -> None:
    """Epoch 1 (server) against epoch 2 (cache_dir) of ThreadDataLoader(32)."""
    benchmark.group = "remote-cache"
    out: dict[str, Any] = {}
    _once(benchmark, lambda: out.update(_run("cache", "thread32", server_port)))
    benchmark.extra_info.update(round=remote_round, **out)
    _results.setdefault("cache", []).append(out)


def test_remote_memory_per_worker_thread(benchmark: Any, server_port: int) -> None:
    """Extra peak PSS of 64 worker threads over 8, per extra thread, on 64-byte objects."""
    benchmark.group = "remote-memory"
    out: dict[str, Any] = {}

    def run() -> None:
        few, many = _run("threads", 8, server_port), _run("threads", 64, server_port)
        out.update(
            few_above_bytes=few["above_bytes"],
            many_above_bytes=many["above_bytes"],
            per_thread_bytes=(many["above_bytes"] - few["above_bytes"]) / 56,
            few_settled_bytes=few["settled_bytes"],
            many_settled_bytes=many["settled_bytes"],
            per_thread_settled_bytes=(many["settled_bytes"] - few["settled_bytes"]) / 56,
        )

    _once(benchmark, run)
    benchmark.extra_info.update(out)
    _results.setdefault("per_thread", []).append(out)


def _report(tr: Any) -> None:
    if not _results:
        return
    med = statistics.median
    tr.section("threadloader: remote reads, 10 ms per object, batch 16 (medians)")
    tr.write_line(f"latency limit with 32 reads in flight: {LIMIT:,.0f} samples/s")
    tr.write_line(
        f"{'loader':62s}{'samples/s':>10s}{'peak MiB':>10s}{'above MiB':>10s}{'RSS sum':>10s}"
    )
    for loader in LOADERS:
        rows = _results.get(loader, [])
        if rows:
            each = ", ".join(f"{r['samples_per_s']:.0f}" for r in rows)
            tr.write_line(
                f"{LABELS[loader]:62s}{med(r['samples_per_s'] for r in rows):10,.0f}"
                f"{med(r['peak_bytes'] for r in rows) / 2**20:10.0f}"
                f"{med(r['above_bytes'] for r in rows) / 2**20:10.0f}"
                f"{med(r['rss_sum_bytes'] for r in rows) / 2**20:10.0f}   rounds: {each}"
            )
    for loader in SHORT_LOADERS:
        rows = _results.get(f"short-{loader}", [])
        if rows:
            got = med(r["samples_per_s"] for r in rows)
            first = med(r["first_batch_s"] for r in rows)
            tr.write_line(
                f"{SHORT:,}-object epoch from the constructor, {LABELS[loader]}: "
                f"{got:,.0f} samples/s ({got / LIMIT:.2f} of the limit)"
                + (f", first batch {first:.3f} s" if not math.isnan(first) else "")
                + " (rounds: "
                + ", ".join(f"{r['samples_per_s']:.0f}" for r in rows)
                + ")"
            )
    goals = []
    thread, dl = _results.get("thread32", []), _results.get("dl32", [])
    if thread:
        got = med(r["samples_per_s"] for r in thread)
        goals.append(("thread32 >= 90% of the latency limit", got / LIMIT, 0.9))
    if thread and dl:
        pairs = list(zip(thread, dl, strict=False))
        ratio = med(t["samples_per_s"] / d["samples_per_s"] for t, d in pairs)
        goals.append(("thread32 >= 2x dl32 samples/s", ratio, 2.0))
        mem = med(d["peak_bytes"] / t["peak_bytes"] for t, d in pairs)
        goals.append(("thread32 peak PSS <= 1/10 of dl32's", mem, 10.0))
        above = med(d["above_bytes"] / t["above_bytes"] for t, d in pairs)
        goals.append(("  (same, above the built dataset)", above, 10.0))
        rss = med(d["rss_sum_bytes"] / t["rss_sum_bytes"] for t, d in pairs)
        goals.append(("  (same, RSS summed over processes)", rss, 10.0))
    short = _results.get("short-thread32", [])
    if short:
        got = med(r["samples_per_s"] for r in short)
        goals.append((f"thread32, {SHORT:,}-object epoch >= 90% of the limit", got / LIMIT, 0.9))
    cache = _results.get("cache", [])
    if cache:
        speedup = med(c["epoch1_s"] / c["epoch2_s"] for c in cache)
        tr.write_line(
            f"cache: epoch 1 {med(c['epoch1_s'] for c in cache):.2f} s, epoch 2 "
            f"{med(c['epoch2_s'] for c in cache):.3f} s (rounds: "
            + ", ".join(f"{c['epoch1_s'] / c['epoch2_s']:.1f}x" for c in cache)
            + ")"
        )
        goals.append(("cache: epoch 2 >= 10x faster than epoch 1", speedup, 10.0))
    for p in _results.get("per_thread", []):
        tr.write_line(
            f"memory per extra worker thread (8 -> 64): peak {p['per_thread_bytes'] / 1024:.0f} KiB"
            f" (+{p['few_above_bytes'] / 2**20:.1f} -> +{p['many_above_bytes'] / 2**20:.1f} MiB),"
            f" idle after the epoch {p['per_thread_settled_bytes'] / 1024:.0f} KiB"
            f" (+{p['few_settled_bytes'] / 2**20:.1f} -> +{p['many_settled_bytes'] / 2**20:.1f} MiB)"
        )
    tr.write_line("goals:")
    for name, got, want in goals:
        tr.write_line(f"  {name}: {got:.2f}x {'met' if got >= want else 'MISSED'} (goal {want:g}x)")


# --- what runs in the fresh interpreter -------------------------------------------------------


def _collate(batch: list[bytes]) -> int:
    return len(batch)  # the bytes are the sample; collating them is not what is measured


def _loader(name: str, dataset: Any, workers: int = WORKERS) -> Any:
    if name == "dl32":
        from torch.utils.data import DataLoader

        return DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=_collate)
    from threadloader import ThreadDataLoader

    return ThreadDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=_collate)


def _urls(port: int, kind: str = "obj") -> list[str]:
    return [f"http://127.0.0.1:{port}/{kind}/{i}" for i in range(OBJECTS)]


def _remote_files(loader_name: str, port: int, count: int = OBJECTS) -> Any:
    """The first ``count`` objects, read as ``loader_name`` reads them (``LOADERS``)."""
    from threadloader.remote import RemoteFiles

    concurrency = 32 if loader_name == "thread32" else 0
    return RemoteFiles(_urls(port)[:count], max_concurrency=concurrency)


def _throughput(loader_name: str, port: int) -> dict[str, Any]:
    from threadloader.compare.memory_probe import PeakSampler, tree_pss_bytes

    dataset = _remote_files(loader_name, port)
    baseline = tree_pss_bytes()
    samples = 0
    start = time.perf_counter()
    with PeakSampler(interval_s=0.25) as peak:
        it = iter(_loader(loader_name, dataset))
        for _ in range(WARMUP):
            next(it)
        rss_sum = _tree_rss_sum()  # every worker is up by now
        timed = time.perf_counter()
        for n in it:
            samples += n
        end = time.perf_counter()
    del it
    stats = dataset.stats()
    dataset.close()
    if samples != OBJECTS - WARMUP * BATCH:
        raise RuntimeError(f"timed {samples} samples, expected {OBJECTS - WARMUP * BATCH}")
    return {
        "samples_per_s": samples / (end - timed),
        "warmup_s": timed - start,
        "peak_bytes": peak.peak_bytes,
        "above_bytes": peak.peak_bytes - baseline,
        "baseline_bytes": baseline,
        "rss_sum_bytes": rss_sum,
        "retries": stats.retries,  # the parent's reads only: process workers count their own
    }


def _short(loader_name: str, port: int) -> dict[str, Any]:
    """The first loader of this interpreter over ``SHORT`` objects: seconds from building it to
    its first batch and to the end of the epoch, start-up included."""
    dataset = _remote_files(loader_name, port, SHORT)
    samples = 0
    start = time.perf_counter()
    it = iter(_loader(loader_name, dataset))
    samples += next(it)
    first = time.perf_counter()
    for n in it:
        samples += n
    end = time.perf_counter()
    del it
    dataset.close()
    if samples != SHORT:
        raise RuntimeError(f"read {samples} samples, expected {SHORT}")
    return {"samples_per_s": SHORT / (end - start), "first_batch_s": first - start}


def _bare_reads(port: int) -> dict[str, Any]:
    """``SHORT`` objects read by 32 plain threads over ``http.client``, no loader (a reference)."""
    import http.client
    import threading

    def read(first: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port)
        for i in range(first, SHORT, WORKERS):
            connection.request("GET", f"/obj/{i}")
            connection.getresponse().read()
        connection.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=read, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    return {"samples_per_s": SHORT / (end - start), "first_batch_s": float("nan")}


def _cache(port: int) -> dict[str, Any]:
    from threadloader.remote import RemoteFiles

    directory = tempfile.mkdtemp(prefix="threadloader-bench-cache-")
    try:
        dataset = RemoteFiles(_urls(port), cache_dir=directory)
        loader = _loader("thread32", dataset)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            samples = sum(loader)
            times.append(time.perf_counter() - start)
            if samples != OBJECTS:
                raise RuntimeError(f"an epoch gave {samples} samples, expected {OBJECTS}")
        stats = dataset.stats()
        dataset.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "epoch1_s": times[0],
        "epoch2_s": times[1],
        "cache_hits": stats.cache_hits,
        "reads": stats.reads,
    }


def _tree_rss_sum() -> int:
    """RSS summed over the process tree: counts shared pages once per process, as ``top`` does."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _threads(workers: int, port: int) -> dict[str, Any]:
    import gc

    from threadloader import ThreadDataLoader
    from threadloader.compare.memory_probe import PeakSampler, tree_pss_bytes
    from threadloader.remote import RemoteFiles

    dataset = RemoteFiles(_urls(port, "tiny"))
    loader = ThreadDataLoader(
        dataset, batch_size=BATCH, num_workers=workers, collate_fn=_collate, persistent_workers=True
    )
    baseline = tree_pss_bytes()
    with PeakSampler(interval_s=0.1) as peak:
        samples = sum(loader)
    gc.collect()
    settled = tree_pss_bytes()  # the workers (persistent) and the read pool are alive, idle
    dataset.close()
    assert samples == OBJECTS
    return {"above_bytes": peak.peak_bytes - baseline, "settled_bytes": settled - baseline}


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "throughput":
        out = _throughput(args[0], int(args[1]))
    elif what == "short":
        out = _bare_reads(int(args[1])) if args[0] == "bare32" else _short(args[0], int(args[1]))
    elif what == "cache":
        out = _cache(int(args[1]))
    elif what == "threads":
        out = _threads(int(args[0]), int(args[1]))
    else:
        sys.exit("usage: bench_remote.py throughput|short|cache|threads ...")
    print(json.dumps(out))
