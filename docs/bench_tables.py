"""Render docs/benchmarks.md from the bench results committed under bench/results/.

Every table on the benchmarks page is computed here from those JSON files, never typed::

    python docs/bench_tables.py                   # rewrite docs/benchmarks.md
    python docs/bench_tables.py --check           # exit 1 if the page is not what the files render
    python docs/bench_tables.py run loaders       # rerun one bench (or several), rewrite its file,
                                                  # then the page

``run`` executes the bench command printed on the page (with ``PYTHONPATH`` set to this
checkout), samples the machine's load average while it runs, and writes
``bench/results/NAME.json``: the command, the machine, the load, and the bench's own output
(pytest-benchmark rows are kept as their ``extra_info``, which holds every measured value).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing_extensions import Self

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
LOAD_SAMPLE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Bench:
    """One bench command, and the files it writes (``{name}`` placeholders in ``argv``)."""

    name: str
    title: str
    argv: tuple[str, ...]
    outputs: dict[str, str]  # placeholder -> "pytest-benchmark" or "json"

    def command(self) -> str:
        """The command as a user types it, output files named after their placeholders."""
        shown = [a.format(**{k: f"{k}.json" for k in self.outputs}) for a in self.argv]
        return "PYTHONPATH=$PWD python " + shlex.join(shown)


BENCHES: dict[str, Bench] = {
    b.name: b
    for b in (
        Bench(
            "loaders",
            "Throughput against other loaders",
            (
                *("-m", "pytest", "bench/bench_loaders.py", "--benchmark-only"),
                *("-k", "not memory", "--bench-rounds", "3", "-p", "no:cacheprovider"),
                *("--bench-summary-json", "{summary}", "--benchmark-json", "{rounds}"),
            ),
            {"summary": "json", "rounds": "pytest-benchmark"},
        ),
        Bench(
            "memory",
            "Memory: one dataset, many workers",
            (
                *("-m", "pytest", "bench/bench_loaders.py", "--benchmark-only", "-k", "memory"),
                *("-p", "no:cacheprovider", "--bench-summary-json", "{summary}"),
            ),
            {"summary": "json"},
        ),
        Bench(
            "loop",
            "The training loop: loading and a Python-bound step",
            ("bench/bench_loop.py", "--rounds", "3", "--json", "{rows}"),
            {"rows": "json"},
        ),
        Bench(
            "loop_no_step",
            "The training loop with no step",
            ("bench/bench_loop.py", "--rounds", "3", "--step-ops", "0", "--json", "{rows}"),
            {"rows": "json"},
        ),
        Bench(
            "loop_one_epoch",
            "The training loop: one long epoch",
            (
                *("bench/bench_loop.py", "--rounds", "3", "--epochs", "1"),
                *("--epoch-scale", "5", "--json", "{rows}"),
            ),
            {"rows": "json"},
        ),
        Bench(
            "loop_monitor",
            "The training loop with a progress bar's thread",
            (
                *("bench/bench_loop.py", "--rounds", "3", "--epochs", "5"),
                *("--monitor-thread", "--json", "{rows}"),
            ),
            {"rows": "json"},
        ),
        Bench(
            "loop_one_epoch_monitor",
            "The training loop: one long epoch with a progress bar's thread",
            (
                *("bench/bench_loop.py", "--rounds", "3", "--epochs", "1"),
                *("--epoch-scale", "10", "--monitor-thread", "--json", "{rows}"),
            ),
            {"rows": "json"},
        ),
        Bench(
            "loop_trainer_shape",
            "The training loop shaped like Hugging Face Trainer's: one long epoch, a progress "
            "bar's thread, a worker_init_fn",
            (
                *("bench/bench_loop.py", "--rounds", "3", "--epochs", "1", "--epoch-scale", "10"),
                *("--monitor-thread", "--seed-workers", "--workloads", "python,tensors"),
                *("--json", "{rows}"),
            ),
            {"rows": "json"},
        ),
        Bench(
            "loop_one_cpu",
            "The training loop on one CPU",
            ("bench/bench_loop.py", "--rounds", "3", "--cpus", "1", "--json", "{rows}"),
            {"rows": "json"},
        ),
        Bench(
            "noisy_neighbour",
            "The training step while a loader runs",
            ("bench/bench_noisy_neighbour.py", "--rounds", "3", "--json", "{rows}"),
            {"rows": "json"},
        ),
        Bench(
            "streams",
            "Token streams",
            (
                *("-m", "pytest", "bench/bench_streams.py", "--benchmark-only"),
                *("--bench-rounds", "5", "-p", "no:cacheprovider", "--benchmark-json", "{rows}"),
            ),
            {"rows": "pytest-benchmark"},
        ),
        Bench(
            "remote",
            "Remote reads",
            (
                *("-m", "pytest", "bench/bench_remote.py", "--benchmark-only"),
                *("--bench-rounds", "2", "-p", "no:cacheprovider", "--benchmark-json", "{rows}"),
            ),
            {"rows": "pytest-benchmark"},
        ),
        Bench(
            "worker_globals",
            "What a worker's own RNGs and dataset copy cost",
            (
                "bench/bench_worker_globals.py",
                *("--rounds", "9", "--workloads", "tokens,images,python", "--json", "{rows}"),
            ),
            {"rows": "json"},
        ),
    )
}

LOADERS = {
    "dl0": "DataLoader(0)",
    "dl2": "DataLoader(2)",
    "dl4": "DataLoader(4)",
    "thread2": "**ThreadDataLoader(2)**",
    "thread2p": 'ThreadDataLoader(2, isolation="process", helpers=2)',
    "thread4": '**ThreadDataLoader(4, isolation="threads")**',
    "torchdata2": "torchdata.nodes ParallelMapper(2 threads)",
    "spdl2": "SPDL DataLoader(2 threads)",
    "thread2pz": 'ThreadDataLoader(2, isolation="process", helpers=2), from the zygote',
    "thread2pfs": 'ThreadDataLoader(2, isolation="process", helpers=2), from a forkserver',
    "iso2": 'ThreadDataLoader(2, isolation="process")',
    "thread32": "ThreadDataLoader(32) + RemoteFiles",
    "thread32_serial": "ThreadDataLoader(32) + RemoteFiles(max_concurrency=0)",
    "dl32": "DataLoader(32) + RemoteFiles(max_concurrency=0)",
    "bare32": "32 plain threads + http.client, no loader",
}
"""Names the page prints for the loader keys the benches record."""


def _first_batch(seconds: float) -> str:
    """A first-batch time for a table; "-" for a row that makes no batches (NaN)."""
    return "-" if math.isnan(seconds) else f"{seconds:.3f}"


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")


# --- running a bench ---------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, memory, Python, torch and the other loaders."""
    from importlib import metadata

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    memory_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        memory_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    versions: dict[str, str | None] = {}
    for dist in ("torch", "numpy", "torchdata", "spdl", "pillow"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib,
        "os": f"{platform.system()} {platform.release().split('-')[0]}",
        "python": platform.python_version(),
        "packages": versions,
    }


class _LoadSampler:
    """The 1-minute load average every few seconds while a bench runs: how busy the machine was."""

    def __init__(self, interval_s: float = LOAD_SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> Self:
        self.start = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()


def load_summary(start: Any, end: Any, samples: list[float]) -> dict[str, Any]:
    """Load averages at the start and end, and the 1-minute one's median and max during the run."""
    during = samples or [start[0], end[0]]
    return {
        "start": [round(x, 2) for x in start],
        "end": [round(x, 2) for x in end],
        "median_1min": round(statistics.median(during), 2),
        "max_1min": round(max(during), 2),
        "samples": len(samples),
    }


def trim_pytest_benchmark(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A pytest-benchmark JSON file's rows, as the bench recorded them in ``extra_info``."""
    return [
        {"name": b["name"], "group": b.get("group"), **b.get("extra_info", {})}
        for b in raw["benchmarks"]
    ]


def envelope(
    bench: Bench, outputs: dict[str, Any], load: dict[str, Any], started: str, wall_s: float
) -> dict[str, Any]:
    """What ``bench/results/NAME.json`` holds."""
    return {
        "bench": bench.name,
        "command": bench.command(),
        "date": started,
        "wall_s": round(wall_s),
        "machine": machine(),
        "load_average": load,
        "results": outputs,
    }


def read_outputs(bench: Bench, paths: dict[str, str]) -> dict[str, Any]:
    """The bench's output files, pytest-benchmark ones trimmed to their rows."""
    out = {}
    for key, kind in bench.outputs.items():
        with open(paths[key]) as f:
            data = json.load(f)
        out[key] = trim_pytest_benchmark(data) if kind == "pytest-benchmark" else data
    return out


def run_bench(bench: Bench) -> Path:
    """Run one bench, sampling the load, and write its result file."""
    import time

    with tempfile.TemporaryDirectory(prefix="threadloader-bench-") as tmp:
        paths = {k: os.path.join(tmp, f"{k}.json") for k in bench.outputs}
        argv = [sys.executable, *(a.format(**paths) for a in bench.argv)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        started = datetime.date.today().isoformat()
        t0 = time.monotonic()
        _say(f"+ {bench.command()}")
        with _LoadSampler() as sampler:
            proc = subprocess.run(argv, cwd=ROOT, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{bench.name}: the bench exited with status {proc.returncode}")
        outputs = read_outputs(bench, paths)
    load = load_summary(sampler.start, sampler.end, sampler.samples)
    data = envelope(bench, outputs, load, started, time.monotonic() - t0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench.name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


# --- rendering ---------------------------------------------------------------------------------


def _n(x: float) -> str:
    """A rate or size as the page prints it: thousands separated, decimals only below 100."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _table(header: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    sep = ["---" if a == "l" else "--:" for a in align]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(sep) + " |",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _per_round(
    rows: list[dict[str, Any]], key: str, value: str, group: str
) -> dict[str, dict[int, dict[str, float]]]:
    """``{group: {round: {key: value}}}`` from benchmark rows."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        if value in r:
            out.setdefault(r[group], {}).setdefault(r["round"], {})[r[key]] = r[value]
    return out


def _round_ratios(rounds: dict[int, dict[str, float]], a: str, b: str) -> list[float]:
    return [v[a] / v[b] for _, v in sorted(rounds.items()) if a in v and b in v and v[b]]


def _busy(data: dict[str, Any]) -> bool:
    """Whether other jobs shared the machine: the median load above twice the CPUs. A bench
    keeps every CPU busy itself, with more runnable threads than CPUs at times (32 waiting on
    reads), which lifts the load to about the CPU count, and its peak above it."""
    return bool(data["load_average"]["median_1min"] > 2 * data["machine"]["cpus"])


def _header(data: dict[str, Any]) -> list[str]:
    load = data["load_average"]
    cpus = data["machine"]["cpus"]
    lines = [
        "```bash",
        data["command"],
        "```",
        "",
        f"Measured {data['date']}, {data['wall_s'] // 60} min {data['wall_s'] % 60} s. Load "
        f"average (1 min) during the run: median {load['median_1min']:.1f}, max "
        f"{load['max_1min']:.1f}, on {cpus} CPUs ({data['machine']['cpu']})"
        + (
            ": other jobs used the machine at the same time, so single rounds are noisy."
            if _busy(data)
            else "."
        ),
        "",
    ]
    return lines


def render_loaders(data: dict[str, Any]) -> list[str]:
    """Samples/s per workload and loader, with per-round ratios to DataLoader(0) and (2)."""
    rows = data["results"]["rounds"]
    summary = data["results"]["summary"]
    by_workload = _per_round(rows, "loader", "samples_per_s", "workload")
    first = _per_round(rows, "loader", "first_batch_s", "workload")
    lines = [
        (
            f"Each workload runs every loader once per round, back to back, the order rotating each "
            f"round; {summary['rounds']} rounds. samples/s and 1st batch are medians over rounds; "
            "a ratio is the median of the ratios within each round (the rounds' own ratios in "
            "brackets), so it need not equal the ratio of the medians."
        ),
        "",
    ]
    table = []
    for workload, rounds in by_workload.items():
        loaders = [k for k in LOADERS if any(k in v for v in rounds.values())]
        for loader in loaders:
            rates = [v[loader] for v in rounds.values() if loader in v]
            firsts = [v[loader] for v in first[workload].values() if loader in v]
            cells = [workload, LOADERS[loader], _n(statistics.median(rates))]
            cells.append(f"{statistics.median(firsts):.3f} s")
            for base in ("dl0", "dl2"):
                got = _round_ratios(rounds, loader, base)
                cells.append(f"{statistics.median(got):.2f} ({_ratios(got)})" if got else "-")
            table.append(cells)
    lines += _table(
        ["workload", "loader", "samples/s", "1st batch", "x DataLoader(0)", "x DataLoader(2)"],
        "llrrrr",
        table,
    )
    return lines


def render_memory(data: dict[str, Any]) -> list[str]:
    mem = data["results"]["summary"]["memory"]
    dataset = next(iter(mem.values()))["dataset_mib"]
    lines = [
        (
            f"The `objects` workload: 3M Python strings in one list ({dataset:.0f} MiB), one shuffled "
            "epoch, batch 256. Each loader runs in a fresh interpreter; the figure is the peak PSS "
            "of the whole process tree (workers and helpers included) above what it was once the "
            "dataset was built. Helpers are forked from the training process when it runs one "
            "Python thread at `iter()`; the zygote and forkserver rows run another thread then "
            "(the zygote) or switch the zygote off, and pickle the dataset to each helper."
        ),
        "",
    ]
    table = [
        [
            LOADERS.get(k, k),
            f"{c['above_mib']:,.1f}",
            f"{c['x_dl0']:.2f}" if "x_dl0" in c else "-",
            f"{c['epoch_s']:.1f} s",
        ]
        for k, c in mem.items()
    ]
    return lines + _table(
        ["loader", "peak PSS above the dataset, MiB", "x DataLoader(0)", "epoch"], "lrrr", table
    )


LOOP_LOADERS = {
    "dl": "DataLoader",
    "torchdata": "torchdata.nodes ParallelMapper (threads)",
    "spdl": "SPDL DataLoader (threads)",
    "thread": "**ThreadDataLoader** (defaults)",
    "threads": 'ThreadDataLoader(isolation="threads")',
    "iso": 'ThreadDataLoader(isolation="process", helpers=2)',
}
"""Names the loop pages print for bench/bench_loop.py's loader keys."""


def _loop_epochs(out: dict[str, Any]) -> str:
    epochs, scale = out["epochs"], out.get("epoch_scale", 1)
    if epochs == 1:
        text = (
            f"Each loader runs one epoch, {scale}x the usual length (about {scale} s of loading), "
            "in a fresh interpreter; the pace counts all of it, start-up included: a run of one "
            'long epoch, which `isolation="auto"` moves into helper processes mid-epoch when its '
            "items hold the GIL. "
        )
    else:
        text = (
            f"Each loader runs {epochs} epochs in a fresh interpreter; the pace counts the epochs "
            'after the first (`isolation="auto"` decides after the first). '
        )
    if out.get("monitor_thread"):
        text += (
            "A thread like a progress bar's monitor (tqdm's) starts once the loader is built, so "
            'the training process is not forked: `isolation="process"` forks its helpers from '
            "the zygote it started when built, and the default starts a forkserver once an epoch "
            "says the workers should move, and moves after it has imported torch. "
        )
    if out.get("seed_workers"):
        text += (
            "DataLoader and ThreadDataLoader get a `worker_init_fn` that reseeds each worker's "
            "global RNGs from `torch.initial_seed()`, as Hugging Face Trainer's `seed_worker`. "
        )
    return text


def render_loop(data: dict[str, Any]) -> list[str]:
    out = data["results"]["rows"]
    step = out["step_ops"]
    by_epoch = bool(out.get("monitor_thread"))  # the default moves within the run
    lines = [
        (
            f"Batches per second of a whole training loop on {out['cpus']} CPU"
            f"{'s' if out['cpus'] > 1 else ''}: "
            + (
                f"after every batch a Python-bound step of {step} tiny torch ops (the Python "
                "time of launching a model's kernels) runs in the training thread. "
                if step
                else "no step, the loader alone, epochs and their starts included. "
            )
            + _loop_epochs(out)
            + "*x best* divides by the best of "
            "DataLoader, torchdata.nodes and SPDL in the same round (rounds in brackets); "
            "*mode* is where ThreadDataLoader's workers ran in the last epoch"
            + ("; *first epoch in helpers* counts from 1, per round" if by_epoch else "")
            + ". 2 workers each; 32 on `latency` (10 ms reads)."
        ),
        "",
    ]
    rows = out["rows"]
    table = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for loader, shown in LOOP_LOADERS.items():
            mine = sorted(
                (r for r in rows if (r["workload"], r["loader"]) == (workload, loader)),
                key=lambda r: r["round"],
            )
            if not mine:
                continue
            ratios = [r["ratio_vs_best_baseline"] for r in mine]
            modes = ", ".join(sorted({r["mode"] for r in mine if r.get("mode")}))
            row = [
                workload,
                shown,
                _n(statistics.median(r["pace"] for r in mine)),
                f"{statistics.median(ratios):.2f} ({_ratios(ratios)})",
                modes,
            ]
            if by_epoch:
                row.append(_first_in_helpers(mine))
            table.append(row)
    header = ["workload", "loader", "batches/s", "x best", "mode"]
    if by_epoch:
        header.append("first epoch in helpers")
    return lines + _table(header, "llrrl" + "l" * by_epoch, table)


def _first_in_helpers(rows: list[dict[str, Any]]) -> str:
    """Per round, the first epoch (from 1) whose workers ran in helpers; "-" for none."""
    if not any(r.get("epoch_modes") for r in rows):
        return ""
    firsts = [
        next((str(i + 1) for i, m in enumerate(r["epoch_modes"]) if m == "process"), "-")
        for r in rows
    ]
    return ", ".join(firsts)


def render_noisy(data: dict[str, Any]) -> list[str]:
    rows = [r for r in data["results"]["rows"] if "error" not in r]
    lines = [
        (
            "A fixed Python-heavy training step (400 tiny torch ops, about 1-2 ms alone) runs after "
            "every batch. *step slowdown* is the step's median time while the loader runs divided "
            "by its time with no loader (rounds in brackets); *samples/s* is the loader alone, "
            "without the step; *peak PSS* covers the whole process tree. `num_workers=2` "
            "throughout; each measurement in a fresh interpreter."
        ),
        "",
    ]
    table = []
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for workload in workloads:
        for loader in ("thread2", "iso2", "dl2"):
            mine = sorted(
                (r for r in rows if (r["workload"], r["loader"]) == (workload, loader)),
                key=lambda r: r["round"],
            )
            if not mine:
                continue
            slow = [r["slowdown"] for r in mine]
            table.append(
                [
                    workload,
                    LOADERS[loader],
                    f"{statistics.median(slow):.2f} ({_ratios(slow)})",
                    _n(statistics.median(r["samples_s"] for r in mine)),
                    f"{statistics.median(r['peak_mib'] for r in mine):,.0f}",
                ]
            )
    return lines + _table(
        ["workload", "loader", "step slowdown", "samples/s", "peak PSS MiB"], "llrrr", table
    )


def render_streams(data: dict[str, Any]) -> list[str]:
    rows = data["results"]["rows"]
    opened = {r["name"]: r["seconds"] for r in rows if r.get("group") == "streams-open"}
    rounds = _per_round(
        [dict(r, one="all") for r in rows if "case" in r], "case", "windows_per_s", "one"
    ).get("all", {})
    lines = [
        (
            "`TokenWindows(seq_len=1024)` over 16 shards of 4M uint16 tokens (in the page cache), "
            "batch 16, 2,000 timed batches per measurement; the ratio is to `DataLoader(0)` reading "
            "windows in order, within each round."
        ),
        "",
    ]
    for name, seconds in sorted(opened.items()):
        kind = "`.npy`" if "npy" in name else "raw `.bin`"
        lines.append(f"- opening 10,000 {kind} files: {seconds * 1e3:.1f} ms (median of 5)")
    lines.append("")
    cases = list(dict.fromkeys(c for v in rounds.values() for c in v))
    order = {"seq": 0, "shuffle": 1, "block64": 2, "mixture": 3}
    cases.sort(key=lambda c: (c.split("-")[0] != "dl0", order.get(c.split("-")[1], 9)))
    what = {
        "seq": "in order",
        "shuffle": "global shuffle (`ShuffleSampler`)",
        "block64": "64-window blocks (`BlockShuffleSampler`)",
        "mixture": "70/30 `Mixture` (`MixtureSampler`)",
    }
    table = []
    for case in cases:
        loader, how = case.split("-")
        rates = [v[case] for v in rounds.values() if case in v]
        got = _round_ratios(rounds, case, "dl0-seq")
        table.append(
            [
                LOADERS[loader],
                what.get(how, how),
                _n(statistics.median(rates)),
                f"{statistics.median(got):.2f} ({_ratios(got)})",
            ]
        )
    return lines + _table(
        ["loader", "order", "windows/s", "x DataLoader(0) in order"], "llrr", table
    )


def render_remote(data: dict[str, Any]) -> list[str]:
    rows = data["results"]["rows"]
    lines = [
        (
            "Objects of 16 KiB on a local HTTP server (its own process) that answers every request "
            "after 10 ms; batch 16, 32 workers, so 32 reads in flight give at most 3,200 samples/s "
            "(the limit below). With `max_concurrency=0` and with worker processes exactly 32 are "
            "in flight; by default `RemoteFiles` reads each batch with its worker and the free "
            "threads of its 32-thread read pool, so up to 64, and can pass that limit. Each loader "
            "runs one epoch of 8,192 objects in a fresh interpreter."
        ),
        "",
    ]
    table = []
    for loader in ("thread32", "thread32_serial", "dl32"):
        mine = sorted(
            (r for r in rows if r.get("group") == "remote-throughput" and r["loader"] == loader),
            key=lambda r: r["round"],
        )
        if not mine:
            continue
        rates = [r["samples_per_s"] for r in mine]
        table.append(
            [
                LOADERS[loader],
                f"{_n(statistics.median(rates))} ({', '.join(_n(x) for x in rates)})",
                f"{statistics.median(r['peak_bytes'] for r in mine) / 2**20:,.0f}",
                f"{statistics.median(r['rss_sum_bytes'] for r in mine) / 2**20:,.0f}",
            ]
        )
    lines += _table(
        ["loader", "samples/s (rounds)", "peak PSS MiB", "RSS summed over processes, MiB"],
        "lrrr",
        table,
    )
    short = []
    for loader in ("thread32", "thread32_serial", "dl32", "bare32"):
        mine = sorted(
            (r for r in rows if r.get("group") == "remote-short" and r["loader"] == loader),
            key=lambda r: r["round"],
        )
        if mine:
            rates = [r["samples_per_s"] for r in mine]
            short.append(
                [
                    LOADERS[loader],
                    f"{_n(statistics.median(rates))} ({', '.join(_n(x) for x in rates)})",
                    f"{statistics.median(rates) / 3200:.2f}",
                    _first_batch(statistics.median(r["first_batch_s"] for r in mine)),
                ]
            )
    if short:
        lines += [
            "",
            (
                "A short epoch, start-up included: 1,024 objects, timed from the loader's "
                "constructor to its last batch, the first loader of a fresh interpreter. For "
                "reference, no loader at all: 32 plain threads read the same objects with the "
                "standard library's `http.client`, each its share one after another, timed "
                "from starting the threads; the CPU time of its requests (~0.1 ms each, client "
                "and server on the same cores) keeps it below the limit."
            ),
            "",
            *_table(["loader", "samples/s (rounds)", "of 3,200", "first batch, s"], "lrrr", short),
        ]
    cache = [r for r in rows if r.get("group") == "remote-cache"]
    if cache:
        speed = [r["epoch1_s"] / r["epoch2_s"] for r in sorted(cache, key=lambda r: r["round"])]
        lines += [
            "",
            "With `cache_dir=`, the second epoch reads local files only: epoch 1 "
            f"{statistics.median(r['epoch1_s'] for r in cache):.2f} s, epoch 2 "
            f"{statistics.median(r['epoch2_s'] for r in cache):.3f} s, "
            f"{statistics.median(speed):.1f}x faster (rounds: "
            + ", ".join(f"{x:.1f}x" for x in speed)
            + ").",
        ]
    per = [r for r in rows if r.get("group") == "remote-memory"]
    for p in per:
        lines += [
            "",
            (
                "Memory per worker thread (64 workers against 8, on 64-byte objects): "
                f"{p['per_thread_bytes'] / 1024:,.0f} KiB at the peak, "
                f"{p['per_thread_settled_bytes'] / 1024:,.0f} KiB once the epoch is over."
            ),
        ]
    return lines


def render_worker_globals(data: dict[str, Any]) -> list[str]:
    res = data["results"]["rows"]
    lines = [
        (
            "`ThreadDataLoader(num_workers=2)` as it is (*on*), against the same loader with each "
            "worker's own global RNGs and dataset copy switched off (*off*), alternating within "
            f"one process, {res['rounds']} rounds. Ratios are medians of the same-round ratios; CPU "
            "is the process's CPU time per batch (all threads), which a busy neighbour moves less "
            "than wall time."
        ),
        "",
    ]
    table = [
        [
            r["workload"],
            _n(r["on_samples_s"]),
            _n(r["off_samples_s"]),
            f"{r['on_off_samples_s']:.3f}",
            f"{r['on_cpu_us']:,.0f}",
            f"{r['off_cpu_us']:,.0f}",
            f"{r['on_off_cpu']:.3f}",
        ]
        for r in res["rows"]
    ]
    return lines + _table(
        [
            "workload",
            "on samples/s",
            "off samples/s",
            "on/off samples/s",
            "on CPU us/batch",
            "off CPU us/batch",
            "on/off CPU",
        ],
        "lrrrrrr",
        table,
    )


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "loaders": render_loaders,
    "memory": render_memory,
    "loop": render_loop,
    "loop_no_step": render_loop,
    "loop_one_epoch": render_loop,
    "loop_one_cpu": render_loop,
    "loop_monitor": render_loop,
    "loop_one_epoch_monitor": render_loop,
    "loop_trainer_shape": render_loop,
    "noisy_neighbour": render_noisy,
    "streams": render_streams,
    "remote": render_remote,
    "worker_globals": render_worker_globals,
}

INTRO = """\
# Benchmarks

<!-- Generated by `python docs/bench_tables.py` from bench/results/*.json: do not edit. -->

Every table below is rendered by `docs/bench_tables.py` from the result files in
`bench/results/`, which the command above each table wrote. To measure again on your machine,
run that command, or `python docs/bench_tables.py run NAME` (NAME: {names}), which runs it,
records the machine's load while it runs, rewrites `bench/results/NAME.json` and this page.

!!! warning "A small machine"
    These figures come from a 2-core machine, and the load average quoted with each run says
    how busy it was. Rounds interleave the loaders so that all of them see the same conditions,
    and ratios are taken within a round; still, compare the per-round ratios, not single
    numbers: rounds move by about 8% on this machine. When other jobs share it, the scheduler
    gives a loader with more processes a larger share of the CPU, which favours process
    workers.{busy}

## Machine
"""


def _anchor(title: str) -> str:
    """The id MkDocs gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return "-".join(kept.split())


def _admonition_paragraph(text: str) -> str:
    """``text`` as one more paragraph of the admonition above it: wrapped and indented."""
    if not text:
        return ""
    pad = "    "
    return "\n\n" + textwrap.fill(
        text,
        96,
        initial_indent=pad,
        subsequent_indent=pad,
        break_long_words=False,
        break_on_hyphens=False,
    )


def render(results: dict[str, dict[str, Any]]) -> str:
    """The whole page, from ``{bench name: result file contents}``."""
    busy = [
        f"[{BENCHES[n].title}](#{_anchor(BENCHES[n].title)})"
        for n, d in results.items()
        if _busy(d)
    ]
    note = (
        "Other jobs kept the load average above the CPU count during these runs: "
        + ", ".join(busy)
        + ". Their rounds spread widely (see the ratios in brackets) and single figures can be "
        "off by a factor of two; rerun them on a quiet machine before relying on them."
        if busy
        else ""
    )
    names = ", ".join(f"`{n}`" for n in BENCHES)
    lines = INTRO.format(names=names, busy=_admonition_paragraph(note)).splitlines()
    machines = {json.dumps(d["machine"], sort_keys=True): d["machine"] for d in results.values()}
    for m in machines.values():
        pkgs = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
        lines += [
            "",
            (
                f"- {m['cpus']} CPUs ({m['cpu']}), {m['memory_gib']} GiB memory, {m['os']}, "
                f"Python {m['python']}"
            ),
            f"- {pkgs}; CPU only (no GPU)",
        ]
    for name, bench in BENCHES.items():
        if name not in results:
            continue
        lines += [
            "",
            f"## {bench.title}",
            "",
            *_header(results[name]),
            *RENDER[name](results[name]),
        ]
    return "\n".join(lines) + "\n"


def load_results() -> dict[str, dict[str, Any]]:
    out = {}
    for name in BENCHES:
        path = RESULTS / f"{name}.json"
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="rerun benches and rewrite their result files")
    run.add_argument("names", nargs="+", choices=list(BENCHES))
    args = parser.parse_args(argv)
    if args.command == "run":
        for name in args.names:
            _say(f"wrote {run_bench(BENCHES[name]).relative_to(ROOT)}")
    page = render(load_results())
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            diff = difflib.unified_diff(
                current.splitlines(),
                page.splitlines(),
                "docs/benchmarks.md",
                "rendered",
                lineterm="",
            )
            _say("\n".join(list(diff)[:40]))
            _say(
                "docs/benchmarks.md differs from what bench/results/*.json render: "
                "run `python docs/bench_tables.py`"
            )
            return 1
        return 0
    PAGE.write_text(page)
    _say(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
