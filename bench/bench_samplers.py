"""Indices per second of threadloader.samplers.shuffle, against torch's randperm-based RandomSampler.

Run::

    pytest bench/ -k bench_samplers --benchmark-only
    pytest bench/ -k "bench_samplers and iterate" --benchmark-only   # only the per-index iterators

(Not ``pytest bench/bench_samplers.py``: bench/conftest.py collects bench_*.py itself, so a file
named on the command line is collected twice.)

Each case times ``COUNT`` indices (medians over ``ROUNDS`` rounds) and, at the end of the module,
prints indices/s per case; the same number is in each benchmark's ``extra_info["indices_per_s"]``
(``--benchmark-json``). Cases:

- ``iterate``: ``for i in sampler`` as a DataLoader consumes it (Python ints, one at a time), at
  ``N = 10**7``, at ``N = 2**22 + 1`` (the worst case for cycle walking: half the power-of-two domain
  is out of range, so values need 2 applications on average) and at ``N = 10**12``.
- ``index_at``: one vectorised block of positions to indices (what resume and striding use).
- ``distributed``: one rank of 8 iterating a ``DistributedShuffleSampler`` over ``N = 10**9``.
- ``block_size``: the iterate case at ``N = 10**12`` for several ``BLOCK_SIZE`` values.
- ``torch_random_sampler``: ``RandomSampler`` at ``N = COUNT``, randperm included: the cost we
  avoid at large N is memory (8 bytes an index, all up front), not speed per index.

Result on the 2-core development machine (medians, other jobs running): see the commit message.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture
from torch.utils.data import RandomSampler

from threadloader.samplers import DistributedShuffleSampler, ShuffleSampler, shuffle

COUNT = 1 << 20
ROUNDS = 7

_results: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not _results:
        return
    with capture.global_and_fixture_disabled():  # module teardown output is captured otherwise
        reporter.write_line("")
        reporter.write_sep("-", "threadloader.samplers: indices/s (median of rounds)")
        for case, rate in _results.items():
            reporter.write_line(f"{case:48s}{rate / 1e6:8.1f} M/s")


def _measure(benchmark: BenchmarkFixture, case: str, run: Callable[[], object], n: int) -> None:
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    rate = n / benchmark.stats.stats.median
    benchmark.extra_info["indices_per_s"] = rate
    _results[case] = rate


def _drain(make: Callable[[], Iterator[int]], count: int) -> Callable[[], object]:
    return lambda: collections.deque(itertools.islice(make(), count), maxlen=0)


@pytest.mark.parametrize("length", [10**7, 2**22 + 1, 10**12], ids=["1e7", "2^22+1", "1e12"])
def test_iterate(benchmark: BenchmarkFixture, length: int) -> None:
    sampler = ShuffleSampler(length, seed=1)
    _measure(benchmark, f"iterate N={length}", _drain(lambda: iter(sampler), COUNT), COUNT)


@pytest.mark.parametrize("length", [10**7, 2**22 + 1, 10**12], ids=["1e7", "2^22+1", "1e12"])
def test_index_at(benchmark: BenchmarkFixture, length: int) -> None:
    sampler = ShuffleSampler(length, seed=1)
    positions = np.arange(1 << 16)
    _measure(
        benchmark,
        f"index_at 65536 positions N={length}",
        lambda: sampler.index_at(positions),
        1 << 16,
    )


def test_distributed(benchmark: BenchmarkFixture) -> None:
    sampler = DistributedShuffleSampler(range(10**9), num_replicas=8, rank=3, seed=1)
    _measure(
        benchmark, "distributed rank 3 of 8, N=1e9", _drain(lambda: iter(sampler), COUNT), COUNT
    )


@pytest.mark.parametrize("block", [1 << 12, 1 << 14, 1 << 15, 1 << 16, 1 << 18])
def test_block_size(
    benchmark: BenchmarkFixture, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(shuffle, "BLOCK_SIZE", block)
    sampler = ShuffleSampler(10**12, seed=1)
    _measure(
        benchmark, f"iterate N=1e12 BLOCK_SIZE={block}", _drain(lambda: iter(sampler), COUNT), COUNT
    )


def test_torch_random_sampler(benchmark: BenchmarkFixture) -> None:
    sampler = RandomSampler(range(COUNT), generator=torch.Generator().manual_seed(1))
    _measure(
        benchmark,
        f"torch RandomSampler N={COUNT} (randperm)",
        _drain(lambda: iter(sampler), COUNT),
        COUNT,
    )
