"""loader.stats() says where the time went: stages, data wait, workers, and GIL-bound datasets."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from threadloader import LoaderStats, ThreadDataLoader


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


@needs_two_cores
def test_pure_python_dataset_is_reported_gil_bound() -> None:
    """A dataset holding the GIL is flagged, and the advice says what to do."""
    s = _run_for(ThreadDataLoader(PurePython(), batch_size=16, num_workers=2), 2.5)
    assert s.gil_bound, str(s)
    assert s.advice is not None and "GIL" in s.advice


@needs_two_cores
def test_gil_releasing_dataset_is_not_reported_gil_bound() -> None:
    """A dataset whose items wait with the GIL released (I/O-like) is not flagged."""
    s = _run_for(ThreadDataLoader(Ids(10**6, delay=0.0005), batch_size=16, num_workers=2), 1.0)
    assert not s.gil_bound, str(s)
