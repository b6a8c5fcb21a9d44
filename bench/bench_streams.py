"""Token streams: opening cost, and windows/s through the loaders with a global or block shuffle.

Run::

    pytest bench/ -k bench_streams --benchmark-only                    # ~2 minutes on 2 cores
    pytest bench/ -k bench_streams --benchmark-only --bench-size small # smoke run, ~20 s

(Not ``pytest bench/bench_streams.py``: bench/conftest.py collects bench_*.py itself.)

Cases:

- ``open``: ``TokenWindows`` over 10,000 raw ``.bin`` files and over 10,000 ``.npy`` files (zero
  build: sizes, resp. headers, are all that is read). Median of 5 openings.
- ``throughput``: ``TokenWindows(seq_len=1024)`` over 16 uint16 shards (128 MiB; ``small``: 4 x
  1 MiB tokens), batch 16, 20 warm-up then 2,000 timed batches, windows/s and tokens/s
  (windows x 1024). Each round runs every case once, back to back, the order rotating by round;
  the table gives medians over rounds and the median per-round ratio to ``dl0-seq``:

  ``dl0-seq``            DataLoader(num_workers=0), sequential windows (the baseline)
  ``dl0-shuffle``        DataLoader(num_workers=0), ``ShuffleSampler`` (global shuffle)
  ``dl0-block64``        DataLoader(num_workers=0), ``BlockShuffleSampler(block_size=64)``
                         (blocks of 64 windows, 128 KiB)
  ``dl0-mixture``        DataLoader(num_workers=0), 70/30 ``Mixture`` of two shard sets
  ``thread2-*``          the same through ThreadDataLoader(num_workers=2)

  Every measurement opens a fresh ``TokenWindows``, so mapping files and first-touch page faults
  are paid inside it, as in a real epoch. The shards sit in the page cache (they were just
  written): random reads cost page faults and cache misses, not I/O, which is why block and full
  shuffle run alike here.

Why there is no cold-cache case: this machine's disk has an 8 MiB read-ahead
(``/sys/block/vda/queue/read_ahead_kb``), so the first fault in a mapped shard reads 8 MiB around
it, and after a few dozen random windows every shard is cached. Dropping the shards from the page
cache (``posix_fadvise(DONTNEED)``) and timing the first 200 batches measures how many distinct
8 MiB regions a sampler touches, not the cost of a random read: full shuffle ~17k windows/s,
64-window blocks ~17k, 512-window (1 MiB) blocks ~43k, sequential ~46k (2-core machine, one run of
3 rounds, medians). Blocks pay off when they are at least as large as what one read fetches (a
read-ahead window on disks, an object-store request): choose ``block_size`` from that size.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from threadloader import ThreadDataLoader
from threadloader.samplers import ShuffleSampler
from threadloader.streams import BlockShuffleSampler, Mixture, MixtureSampler, TokenWindows

SEQ_LEN = 1024
BATCH = 16
CASES: tuple[str, ...] = (
    "dl0-seq",
    "dl0-shuffle",
    "dl0-block64",
    "dl0-mixture",
    "thread2-seq",
    "thread2-shuffle",
    "thread2-block64",
    "thread2-mixture",
)
SHARDS = {"bench": (16, 4 << 20), "small": (4, 1 << 20)}  # (files, tokens per file)
# (warm-up batches, timed batches). 2,000 batches are ~0.15 s sequentially: 400 (~30 ms) were about
# as long as one fetching-limit decision of ThreadDataLoader, so they measured its start, not its rate.
MEASURE = {"bench": (20, 2000), "small": (5, 60)}
OPEN_FILES = 10_000

_rates: dict[str, list[float]] = {}
_round_rates: dict[int, dict[str, float]] = {}
_open_s: dict[str, float] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stream_case" in metafunc.fixturenames:
        rounds = metafunc.config.getoption("--bench-rounds")
        cases = []
        for r in range(rounds):
            shift = r % len(CASES)
            cases += [(r, c) for c in CASES[shift:] + CASES[:shift]]
        metafunc.parametrize("stream_case", cases, ids=[f"round{r}-{c}" for r, c in cases])


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not (_rates or _open_s):
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_sep("-", "threadloader.streams (medians over rounds)")
        for what, seconds in _open_s.items():
            reporter.write_line(f"open {OPEN_FILES:,} {what} files: {seconds * 1e3:8.1f} ms")
        if _rates:
            reporter.write_line(
                f"{'case':22s}{'windows/s':>12s}{'tokens/s':>14s}{'x seq':>11s}  rounds"
            )
        for case in CASES:
            if case not in _rates:
                continue
            rate = statistics.median(_rates[case])
            # Ratios are taken within a round (same machine state), then the median of those.
            ratios = [r[case] / r["dl0-seq"] for r in _round_rates.values() if len(r) > 1]
            ratio = statistics.median(ratios) if ratios else float("nan")
            reporter.write_line(
                f"{case:22s}{rate:12,.0f}{rate * SEQ_LEN:14,.0f}{ratio:11.2f}  {len(_rates[case])}"
            )


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[str]:
    files, tokens = SHARDS[request.config.getoption("--bench-size")]
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(files):
        path = root / f"shard{i:03d}.bin"
        rng.integers(0, 50_257, tokens, dtype=np.uint16).tofile(path)
        paths.append(str(path))
    return paths


def _open_loader(case: str, shards: list[str]) -> Iterator[Any]:
    loader_key, order = case.split("-")
    dataset: Any
    sampler: Any = None
    if order == "mixture":
        half = len(shards) // 2
        sources = {
            "web": TokenWindows(shards[:half], SEQ_LEN),
            "code": TokenWindows(shards[half:], SEQ_LEN),
        }
        dataset = Mixture(sources, {"web": 0.7, "code": 0.3}, seed=0)
        sampler = MixtureSampler(dataset)
    else:
        dataset = TokenWindows(shards, SEQ_LEN)
        if order == "shuffle":
            sampler = ShuffleSampler(dataset, seed=0)
        elif order.startswith("block"):
            block = int(order.removeprefix("block"))
            sampler = BlockShuffleSampler(dataset, block, num_replicas=1, rank=0, seed=0)
    if loader_key == "dl0":
        return iter(DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    return iter(ThreadDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2))


def test_throughput(
    benchmark: Any, request: pytest.FixtureRequest, shards: list[str], stream_case: tuple[int, str]
) -> None:
    """Windows/s of one loader and sampler over the token shards, in one interleaved round."""
    round_no, case = stream_case
    warmup, batches = MEASURE[request.config.getoption("--bench-size")]
    benchmark.group = "streams-throughput"
    state: dict[str, Any] = {}

    def setup() -> None:
        gc.collect()
        state["it"] = it = _open_loader(case, shards)
        for _ in range(warmup):
            next(it)

    def run() -> None:
        it, windows = state["it"], 0
        start = time.perf_counter()
        for _ in range(batches):
            windows += int(next(it)[0].shape[0])
        state["elapsed"] = time.perf_counter() - start
        state["windows"] = windows

    try:
        benchmark.pedantic(run, setup=setup, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        it = state.pop("it", None)
        close: Callable[[], None] | None = getattr(it, "close", None)
        if close is not None:
            close()
        del it, close
        gc.collect()
    rate = state["windows"] / state["elapsed"]
    _rates.setdefault(case, []).append(rate)
    _round_rates.setdefault(round_no, {})[case] = rate
    benchmark.extra_info.update(
        case=case, round=round_no, windows_per_s=round(rate, 1), tokens_per_s=round(rate * SEQ_LEN)
    )


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """10,000 small raw files and 10,000 small .npy files (2,049 tokens each)."""
    root = tmp_path_factory.mktemp("many")
    tokens = np.arange(SEQ_LEN * 2 + 1, dtype=np.uint16)
    raw = tokens.tobytes()
    npy_root = root / "npy"
    npy_root.mkdir()
    np.save(npy_root / "proto.npy", tokens)
    npy = (npy_root / "proto.npy").read_bytes()
    paths: dict[str, list[str]] = {"bin": [], "npy": []}
    for i in range(OPEN_FILES):
        for kind, content in (("bin", raw), ("npy", npy)):
            path = root / f"{i:05d}.{kind}"
            path.write_bytes(content)
            paths[kind].append(str(path))
    return paths


@pytest.mark.parametrize("kind", ["bin", "npy"])
def test_open(benchmark: Any, many_files: dict[str, list[str]], kind: str) -> None:
    """Seconds to open TokenWindows over 10,000 files: sizes (raw) or headers (.npy) only."""
    benchmark.group = "streams-open"
    paths = many_files[kind]
    ds = benchmark.pedantic(lambda: TokenWindows(paths, SEQ_LEN), rounds=5, warmup_rounds=1)
    assert len(ds) == (OPEN_FILES * (2 * SEQ_LEN + 1) - 1) // SEQ_LEN
    _open_s[kind] = benchmark.stats.stats.median
    benchmark.extra_info["seconds"] = benchmark.stats.stats.median
