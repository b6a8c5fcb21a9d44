"""loader.stats() says where the time went: stages, data wait, workers, and GIL-bound datasets."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from threadloader import LoaderStats, ThreadDataLoader
from threadloader._engine import threaded
from threadloader._engine.stats import is_gil_bound
from threadloader._primitives.concurrency import ConcurrencyController


class Ids(Dataset[torch.Tensor]):
    def __init__(self, n: int = 64, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(i)


class PurePython(Dataset[torch.Tensor]):
    """Holds the GIL for the whole item."""

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> torch.Tensor:
        x = 0.0
        for k in range(300):
            x += k * 0.5
        return torch.tensor(x)


class Stream(IterableDataset[int]):
    def __iter__(self):
        yield from range(30)


def test_stats_before_any_epoch_raise() -> None:
    """stats() before the first iter() raises a RuntimeError that says why."""
    with pytest.raises(RuntimeError, match="iterate over the loader first"):
        ThreadDataLoader(Ids(), batch_size=4).stats()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stats_count_every_delivered_batch_and_stage(num_workers: int) -> None:
    """After an epoch the snapshot counts each batch once and times fetch, collate, sampler."""
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=num_workers)
    assert len(list(loader)) == 16
    s = loader.stats()
    assert isinstance(s, LoaderStats)
    assert s.batches == 16
    assert s.stages["fetch"].count == 16 and s.stages["collate"].count == 16
    assert s.stages["fetch"].p50_s <= s.stages["fetch"].p90_s <= s.stages["fetch"].p99_s
    assert 0.0 <= s.wait_fraction <= 1.0 and 0.0 <= s.ready_fraction <= 1.0
    assert len(s.worker_busy_s) == num_workers
    assert 0 <= s.batches_run_by_caller <= 16
    assert s.stages["sampler"].count >= 16  # the training thread draws indices, at any workers
    assert s.caller_busy_s >= s.stages["sampler"].total_s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batches = 0  # type: ignore[misc]


def test_stats_is_a_snapshot_not_a_live_view() -> None:
    """A snapshot taken mid-epoch keeps its numbers while the epoch goes on."""
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it), next(it)
    early = loader.stats()
    list(it)
    assert early.batches == 2 and loader.stats().batches == 16


def test_slow_dataset_shows_as_data_wait_and_fast_one_does_not() -> None:
    """A loop faster than its data waits most of the time; a slow loop hardly waits."""
    data_bound = ThreadDataLoader(Ids(40, delay=0.005), batch_size=4, num_workers=2, timeout=5)
    list(data_bound)
    compute_bound = ThreadDataLoader(Ids(40), batch_size=4, num_workers=2)
    for _ in compute_bound:
        time.sleep(0.02)
    assert data_bound.stats().wait_fraction > 0.5
    assert compute_bound.stats().wait_fraction < 0.5


def test_report_is_one_readable_screen() -> None:
    """str() of the snapshot names the data wait, the workers and each stage."""
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=2)
    list(loader)
    report = str(loader.stats())
    assert "data wait" in report and "workers" in report
    for stage in ("fetch", "collate", "sampler"):
        assert stage in report
    assert len(report.splitlines()) < 25


def test_iterable_dataset_stats() -> None:
    """IterableDatasets are timed too; the end-of-data markers are not counted as batches."""
    loader = ThreadDataLoader(Stream(), batch_size=4, num_workers=2)
    batches = list(loader)
    assert loader.stats().batches == len(batches)


def test_log_every_s_logs_through_the_threadloader_logger(caplog) -> None:
    """With log_every_s, a one-line summary goes to the 'threadloader' logger at INFO."""
    loader = ThreadDataLoader(Ids(40, delay=0.002), batch_size=2, num_workers=2, log_every_s=0.01)
    with caplog.at_level(logging.INFO, logger="threadloader"):
        list(loader)
    lines = [r.getMessage() for r in caplog.records if r.name == "threadloader"]
    assert lines and "data wait" in lines[0]
    with pytest.raises(ValueError, match="log_every_s"):
        ThreadDataLoader(Ids(), log_every_s=0)


def test_no_logging_by_default(caplog) -> None:
    """Without log_every_s nothing is logged."""
    with caplog.at_level(logging.DEBUG, logger="threadloader"):
        list(ThreadDataLoader(Ids(), batch_size=4, num_workers=2))
    assert not [r for r in caplog.records if r.name == "threadloader"]


needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="GIL-bound detection compares against 2 cores"
)


def _run_for(loader: ThreadDataLoader[torch.Tensor], seconds: float) -> LoaderStats:
    start = time.perf_counter()
    for _ in loader:
        if time.perf_counter() - start > seconds:
            break
    return loader.stats()


@pytest.mark.parametrize(
    ("numbers", "gil_bound"),
    [
        ({"cpu_cores_used": 1.0, "busy_threads": 0.3, "alone_is_best": True}, True),
        ({"cpu_cores_used": 0.4, "busy_threads": 0.3, "alone_is_best": True}, True),
        ({"cpu_cores_used": 1.0, "busy_threads": 1.9, "alone_is_best": False}, True),
        ({"cpu_cores_used": 0.12, "busy_threads": 2.0, "alone_is_best": False}, False),
        ({"cpu_cores_used": 1.7, "busy_threads": 0.5, "alone_is_best": True}, False),
        ({"cpu_cores_used": 1.0, "busy_threads": 1.2, "alone_is_best": False}, False),
        ({"cpu_cores_used": 1.0, "busy_threads": 0.3, "alone_is_best": True, "cores": 1}, False),
        (
            {"cpu_cores_used": 1.0, "busy_threads": 0.9, "alone_is_best": True, "num_workers": 1},
            False,
        ),
    ],
    ids=[
        "pure-python-training-thread-alone-won",
        "pure-python-on-a-loaded-machine",
        "pure-python-workers-take-turns",
        "io-sleeps-release-the-gil",
        "numpy-already-uses-both-cores",
        "workers-not-busy-enough",
        "one-core",
        "one-worker",
    ],
)
def test_gil_bound_verdict_on_an_epochs_numbers(numbers: dict[str, Any], gil_bound: bool) -> None:
    """The verdict on the numbers measured on 2 cores with 2 workers (module docstring of
    threadloader._engine.stats): the controller's finding needs no particular CPU share, so a
    loaded machine that leaves the epoch 0.4 cores still flags a pure-Python dataset."""
    kwargs: dict[str, Any] = {"num_workers": 2, "cores": 2, **numbers}
    assert is_gil_bound(**kwargs) is gil_bound


class _SettledAlone(ConcurrencyController):
    """A controller that found the training thread alone fastest, and stays there."""

    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        super().__init__(maximum, minimum, initial=0)
        self._alone_won = True

    def on_batch(self, *args: float | None) -> int | None:
        return None


@needs_two_cores
def test_pure_python_dataset_is_reported_gil_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset holding the GIL, on which the controller settled on the training thread
    alone, is flagged, and the advice says what to do. (The controller's settling on GIL-bound
    rates: tests/test_concurrency.py, on a fake clock.)"""
    monkeypatch.setattr(threaded, "ConcurrencyController", _SettledAlone)
    loader = ThreadDataLoader(PurePython(), batch_size=16, num_workers=2)
    for _ in itertools.islice(loader, 20):
        pass
    s = loader.stats()
    assert s.gil_bound, str(s)
    assert s.advice is not None and "GIL" in s.advice


@needs_two_cores
def test_gil_releasing_dataset_is_not_reported_gil_bound() -> None:
    """A dataset whose items wait with the GIL released (I/O-like) is not flagged."""
    s = _run_for(ThreadDataLoader(Ids(10**6, delay=0.0005), batch_size=16, num_workers=2), 1.0)
    assert not s.gil_bound, str(s)


class FailsAt(Ids):
    """Item ``bad`` raises; the others sleep ``delay``."""

    def __init__(self, n: int, delay: float, bad: int) -> None:
        super().__init__(n, delay)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        item = super().__getitem__(i)
        if i == self.bad:
            raise ValueError(f"item {i} is bad")
        return item


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_mid_epoch_does_not_stop_the_epochs_clock(num_workers: int) -> None:
    """A batch that raises ends nothing (the loop may go on, as in torch): wall time keeps going
    until the epoch's StopIteration, so data wait never exceeds it."""
    loader = ThreadDataLoader(FailsAt(20, 0.005, bad=1), batch_size=1, num_workers=num_workers)
    start, got, errors = time.perf_counter(), 0, 0
    it = iter(loader)
    while True:
        try:
            next(it)
            got += 1
        except ValueError:
            errors += 1
        except StopIteration:
            break
    loop_s = time.perf_counter() - start
    s = loader.stats()
    assert (got, errors, s.batches) == (19, 1, 19)
    assert s.wall_s >= 0.9 * s.wait_s and s.wall_s >= 0.5 * loop_s, str(s)


def test_a_finished_epochs_snapshot_stays_the_same() -> None:
    """After the epoch's end, wall time and the cores used stop: later CPU work is not the
    epoch's, so gil_bound cannot flip by calling stats() later."""
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=2)
    list(loader)
    first = loader.stats()
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:  # CPU work that belongs to no epoch
        pass
    later = loader.stats()
    assert later.wall_s == first.wall_s
    assert later.cpu_cores_used == first.cpu_cores_used
    assert later.gil_bound == first.gil_bound


def test_device_stage_epoch_ends_when_the_loop_gets_its_last_batch() -> None:
    """With device=, the transfer thread drains the epoch ahead of the loop; wall time runs
    until the loop itself reaches the end, so a slow loop is not reported as a fast loader."""
    loader = ThreadDataLoader(Ids(12), batch_size=1, num_workers=2, device="cpu", device_prefetch=4)
    for _ in loader:
        time.sleep(0.02)
    s = loader.stats()
    assert s.batches == 12
    assert s.wall_s >= 12 * 0.02, str(s)  # every step's sleep, however fast the data came
    assert s.wait_fraction < 0.5, str(s)


@pytest.mark.parametrize("isolation", [None, "process"])
def test_an_abandoned_epochs_work_is_not_counted_in_the_next(isolation: str | None) -> None:
    """Persistent workers finish batches of an epoch the loop broke out of; the next epoch's
    snapshot counts only its own (isolation too, where timings come with each result)."""
    loader = ThreadDataLoader(
        Ids(40, delay=0.002),
        batch_size=4,
        num_workers=3,
        persistent_workers=True,
        isolation=isolation,
    )
    for k, _ in enumerate(loader):
        if k == 1:
            break
    time.sleep(0.3)  # the abandoned epoch's batches in flight finish meanwhile
    assert len(list(loader)) == 10
    s = loader.stats()
    assert s.batches == 10
    assert s.stages["fetch"].count == 10 and s.stages["collate"].count == 10, str(s)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0], 0.5, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([float(v) for v in range(1, 11)], 0.9, 9.0),
        ([float(v) for v in range(1, 101)], 0.99, 99.0),
        ([5.0], 0.99, 5.0),
    ],
)
def test_percentiles_are_nearest_rank(values: list[float], q: float, expected: float) -> None:
    """p50 of [1, 2] is 1, p90 of 1..10 is 9 (not the maximum): nearest rank."""
    from threadloader._engine.stats import _percentile

    assert _percentile(values, q) == expected
