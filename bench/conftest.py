"""Shared state of the loader benchmarks: options, the result store, the end-of-session table.

``bench_loaders.py`` records one row per (workload, round, loader) into :class:`BenchStore`;
rows of one round run back to back, so ratios are taken within a round (same machine state)
and the table quotes the median over rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from typing import Any

import pytest

LOADER_LABELS: dict[str, str] = {
    "dl0": "DataLoader(num_workers=0)",
    "dl2": "DataLoader(num_workers=2)",
    "thread2": "ThreadDataLoader(num_workers=2)",
    "thread2p": "ThreadDataLoader(num_workers=2, isolation='process', helpers=2)",
    "thread2pz": "same, helpers from the zygote (another thread runs at iter())",
    "thread2pfs": "same, helpers from the forkserver (THREADLOADER_ZYGOTE=0)",
    "torchdata2": "torchdata.nodes ParallelMapper(2 threads)",
    "spdl2": "spdl DataLoader(2 threads)",
    "dl4": "DataLoader(num_workers=4)",
    "thread4": "ThreadDataLoader(num_workers=4, isolation='threads')",
}
"""Loader keys used in test ids, with the names the table prints."""

BASELINES: tuple[str, ...] = ("dl0", "dl2")
"""Loaders every throughput ratio is taken against."""

THROUGHPUT_GOALS: dict[str, list[tuple[str, str, float]]] = {
    # workload: [(loader, baseline, minimum ratio)]: the throughput goals
    "tokens": [("thread2", "dl0", 1.0), ("thread2", "dl2", 5.0)],
    "images": [("thread2", "dl2", 1.0)],
    "tensors": [("thread2", "dl2", 1.3)],
    "python": [("thread2", "dl0", 1.0), ("thread2p", "dl2", 0.95)],
}
MEMORY_GOAL = 1.25
"""ThreadDataLoader(4) may add at most this many times what num_workers=0 adds above the dataset."""

_STORE_KEY = pytest.StashKey["BenchStore"]()


def _load_average() -> float:
    """The 1-minute load average, or -1 where the OS has none: tells how noisy a run was."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return -1.0


@dataclasses.dataclass
class ThroughputRow:
    """One measured round of one loader on one workload."""

    workload: str
    round: int
    loader: str
    samples_per_s: float
    first_batch_s: float
    extra_info: dict[str, Any]  # the benchmark's own dict: ratios are filled in as baselines land


@dataclasses.dataclass
class MemoryRow:
    """One memory measurement: peak PSS of the process tree above the built dataset."""

    loader: str
    dataset_bytes: int
    above_bytes: int
    epoch_s: float


@dataclasses.dataclass
class BenchStore:
    """Every result of the session, for the summary table and ``--bench-summary-json``."""

    size: str
    rounds: int
    throughput: list[ThroughputRow] = dataclasses.field(default_factory=list)
    memory: list[MemoryRow] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    load_at_start: float = dataclasses.field(default_factory=lambda: _load_average())

    def add_throughput(self, **fields: Any) -> None:
        """Record a :class:`ThroughputRow` and fill the ratios its round now allows."""
        row = ThroughputRow(**fields)
        self.throughput.append(row)
        same_round = [
            r for r in self.throughput if (r.workload, r.round) == (row.workload, row.round)
        ]
        base = {r.loader: r.samples_per_s for r in same_round if r.loader in BASELINES}
        for r in same_round:
            for b, value in base.items():
                r.extra_info[f"ratio_vs_{b}"] = round(r.samples_per_s / value, 3)

    def add_memory(self, **fields: Any) -> None:
        """Record a :class:`MemoryRow`."""
        self.memory.append(MemoryRow(**fields))

    def ratios(self, workload: str, loader: str, baseline: str) -> list[float]:
        """Per-round ratios of ``loader`` to ``baseline`` on ``workload``."""
        by_round: dict[int, dict[str, float]] = {}
        for r in self.throughput:
            if r.workload == workload:
                by_round.setdefault(r.round, {})[r.loader] = r.samples_per_s
        return [v[loader] / v[baseline] for v in by_round.values() if loader in v and baseline in v]

    def medians(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{workload: {loader: {samples_per_s, first_batch_s, x_dl0, x_dl2}}}``, medians."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for workload in dict.fromkeys(r.workload for r in self.throughput):
            rows = [r for r in self.throughput if r.workload == workload]
            for loader in dict.fromkeys(r.loader for r in rows):
                mine = [r for r in rows if r.loader == loader]
                cell = {
                    "samples_per_s": statistics.median(r.samples_per_s for r in mine),
                    "first_batch_s": statistics.median(r.first_batch_s for r in mine),
                    "rounds": float(len(mine)),
                }
                for b in BASELINES:
                    ratios = self.ratios(workload, loader, b)
                    if ratios:
                        cell[f"x_{b}"] = statistics.median(ratios)
                out.setdefault(workload, {})[loader] = cell
        return out

    def memory_table(self) -> dict[str, dict[str, float]]:
        """``{loader: {above_mib, dataset_mib, x_dl0, epoch_s}}``."""
        base = next((m.above_bytes for m in self.memory if m.loader == "dl0"), None)
        out = {}
        for m in self.memory:
            cell = {
                "above_mib": m.above_bytes / 2**20,
                "dataset_mib": m.dataset_bytes / 2**20,
                "epoch_s": m.epoch_s,
            }
            if base:
                cell["x_dl0"] = m.above_bytes / base
            out[m.loader] = cell
        return out


def pytest_collect_file(file_path: Any, parent: pytest.Collector) -> pytest.Module | None:
    # bench files are named bench_*.py so the default run (testpaths = tests) and a plain
    # `pytest` never pick them up; here, under bench/, they are collected like test files.
    # A file named on the command line is collected by pytest itself: do not add it twice.
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("threadloader bench")
    group.addoption(
        "--bench-size",
        default="bench",
        choices=("small", "bench"),
        help="workload size: 'bench' (default) or 'small' for a quick smoke run",
    )
    group.addoption("--bench-rounds", type=int, default=3, help="interleaved rounds (default 3)")
    group.addoption(
        "--bench-workloads",
        default="tokens,images,tensors,python",
        help="comma-separated throughput workloads (default: all four)",
    )
    group.addoption(
        "--bench-summary-json", default=None, help="also write the summary table to this file"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STORE_KEY] = BenchStore(
        size=config.getoption("--bench-size"), rounds=config.getoption("--bench-rounds")
    )


@pytest.fixture(scope="session")
def bench_store(request: pytest.FixtureRequest) -> BenchStore:
    """The session's result store."""
    return request.config.stash[_STORE_KEY]


def _goal_lines(store: BenchStore, med: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    lines = []
    for workload, goals in THROUGHPUT_GOALS.items():
        for loader, baseline, minimum in goals:
            got = med.get(workload, {}).get(loader, {}).get(f"x_{baseline}")
            if got is None:
                continue
            verdict = "met" if got >= minimum else "MISSED"
            per_round = ", ".join(f"{r:.2f}" for r in store.ratios(workload, loader, baseline))
            lines.append(
                f"  {workload:8s} {LOADER_LABELS[loader]} >= {minimum:g}x {LOADER_LABELS[baseline]}:"
                f" {got:.2f}x {verdict}  (rounds: {per_round})"
            )
    mem = store.memory_table()
    if "thread4" in mem and "x_dl0" in mem["thread4"]:
        got = mem["thread4"]["x_dl0"]
        verdict = "met" if got <= MEMORY_GOAL else "MISSED"
        lines.append(
            f"  memory   ThreadDataLoader(4) adds <= {MEMORY_GOAL:g}x what num_workers=0 adds:"
            f" {got:.2f}x {verdict}"
        )
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    store: BenchStore = config.stash[_STORE_KEY]
    if not store.throughput and not store.memory:
        return
    tr = terminalreporter
    med = store.medians()
    tr.section("threadloader: loader comparison (medians of interleaved rounds)")
    load_at_end = _load_average()
    cpus = os.cpu_count() or 1
    tr.write_line(
        f"size={store.size}, rounds={store.rounds}, cpus={cpus}, load average "
        f"{store.load_at_start:.1f} at start, {load_at_end:.1f} at end; ratios are medians of "
        "per-round ratios"
    )
    if max(store.load_at_start, load_at_end) > cpus:
        tr.write_line(
            "note: the load average exceeded the cpu count: other jobs shared the machine, "
            "so single rounds are noisy; compare the per-round ratios below"
        )
    if med:
        tr.write_line("")
        header = f"{'workload':9s}{'loader':44s}{'samples/s':>11s}{'1st batch':>11s}"
        tr.write_line(header + f"{'x DL(0)':>9s}{'x DL(2)':>9s}")
        for workload, loaders in med.items():
            for loader, c in loaders.items():
                x0, x2 = c.get("x_dl0"), c.get("x_dl2")
                tr.write_line(
                    f"{workload:9s}{LOADER_LABELS.get(loader, loader):44s}"
                    f"{c['samples_per_s']:11,.0f}{c['first_batch_s']:10.2f}s"
                    + (f"{x0:9.2f}" if x0 is not None else f"{'-':>9s}")
                    + (f"{x2:9.2f}" if x2 is not None else f"{'-':>9s}")
                )
    mem = store.memory_table()
    if mem:
        tr.write_line("")
        tr.write_line("memory: objects workload, shuffled epoch; peak PSS of the process tree")
        tr.write_line(
            f"{'loader':44s}{'dataset MiB':>12s}{'above MiB':>11s}{'x DL(0)':>9s}{'epoch':>9s}"
        )
        for loader, c in mem.items():
            x = c.get("x_dl0")
            tr.write_line(
                f"{LOADER_LABELS.get(loader, loader):44s}{c['dataset_mib']:12.1f}"
                f"{c['above_mib']:11.1f}"
                + (f"{x:9.2f}" if x is not None else f"{'-':>9s}")
                + f"{c['epoch_s']:8.1f}s"
            )
    goals = _goal_lines(store, med)
    if goals:
        tr.write_line("")
        tr.write_line("goals:")
        for line in goals:
            tr.write_line(line)
    if store.skipped:
        tr.write_line("")
        for loader, why in store.skipped.items():
            tr.write_line(f"not measured: {LOADER_LABELS.get(loader, loader)}: {why}")
    path = config.getoption("--bench-summary-json")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "size": store.size,
                    "rounds": store.rounds,
                    "cpus": os.cpu_count(),
                    "load_average": [store.load_at_start, load_at_end],
                    "throughput": med,
                    "memory": mem,
                    "goals": goals,
                },
                f,
                indent=2,
            )
        tr.write_line(f"summary written to {path}")
