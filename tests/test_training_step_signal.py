"""The training thread's own step, timed while worker threads run and while they are idle.

``stats()`` splits the loop's steps (the time between two ``next()`` calls) by whether a worker
thread ran a task at both ends; ``training_slowed`` says the busy ones were slower. These tests
drive the clock and the workers' activity, so no machine load can change what they check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from threadloader import ThreadDataLoader
from threadloader._engine import stats as stats_module
from threadloader._engine.stats import EpochStats, step_slowed


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now / 2


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(stats_module, "time", fake)
    return fake


def _steps(
    stats: EpochStats, clock: _Clock, active: list[int], plan: list[tuple[int, float]]
) -> None:
    """Run ``plan``: (workers active during the step, its seconds) per step, next() taking 1 ms."""
    for workers, seconds in plan:
        active[0] = workers
        stats.on_call()
        clock.now += 0.001
        stats.on_next(0.001, True, False, True, False)
        clock.now += seconds


def test_steps_are_split_by_what_the_workers_did(clock: _Clock) -> None:
    """Busy and idle steps are averaged apart; a step whose two ends disagree counts for neither."""
    stats = EpochStats(num_workers=2)
    active = [0]
    stats.workers_active = lambda: active[0]
    _steps(stats, clock, active, [(1, 0.004)] * 10 + [(0, 0.002)] * 10)
    snap = stats.snapshot()
    # The first step ends at the first call after a return; the change from busy to idle makes
    # one step that began busy and ended idle: neither kind.
    assert (snap.steps_busy, snap.steps_idle) == (9, 9)
    assert snap.step_busy_s == pytest.approx(0.004)
    assert snap.step_idle_s == pytest.approx(0.002)
    assert snap.training_slowed
    assert "loop step" in str(snap) and "slowed by the workers" in str(snap)


def test_steps_at_one_pace_are_not_slowed(clock: _Clock) -> None:
    stats = EpochStats(num_workers=2)
    active = [0]
    stats.workers_active = lambda: active[0]
    _steps(stats, clock, active, [(1, 0.002), (0, 0.002)] * 20)  # every step's ends disagree
    _steps(stats, clock, active, [(1, 0.002)] * 10 + [(0, 0.0021)] * 10)
    snap = stats.snapshot()
    assert not snap.training_slowed


def test_without_worker_threads_nothing_is_split(clock: _Clock) -> None:
    """No activity probe (num_workers=0, helper processes): no step is classified."""
    stats = EpochStats(num_workers=2)
    _steps(stats, clock, [0], [(1, 0.004)] * 10)
    snap = stats.snapshot()
    assert (snap.steps_busy, snap.steps_idle, snap.training_slowed) == (0, 0, False)
    assert "loop step" not in str(snap)


@pytest.mark.parametrize(
    ("busy_s", "busy_n", "idle_s", "idle_n", "wall_s", "slowed"),
    [
        (0.003, 8, 0.002, 8, 0.1, True),
        (0.003, 7, 0.002, 50, 0.1, False),  # too few busy steps to say
        (0.003, 50, 0.002, 7, 0.1, False),  # too few idle steps
        (0.0023, 50, 0.002, 50, 0.1, False),  # within 1.2x
        (0.000015, 50, 0.000005, 50, 0.01, False),  # 3x, but 10 us: noise on a tiny step
        # 30x and 0.22 ms a step, but 14 ms lost in a 1.8 s epoch: a loop that does almost
        # nothing between batches (measured: examples/remote_images.py, 32 workers)
        (0.00023, 64, 0.000007, 25, 1.8, False),
        (0.00023, 64, 0.000007, 25, 0.25, True),  # the same loss in a 0.25 s epoch: 6%
    ],
)
def test_step_slowed_verdict(
    busy_s: float, busy_n: int, idle_s: float, idle_n: int, wall_s: float, slowed: bool
) -> None:
    assert step_slowed(busy_s, busy_n, idle_s, idle_n, wall_s) is slowed


def test_a_real_epoch_classifies_its_steps() -> None:
    """With worker threads, the loop's steps are counted as busy or idle (how many of each
    depends on the machine; that some are counted does not)."""
    data = torch.arange(400.0)
    loader = ThreadDataLoader(data, batch_size=4, num_workers=2)
    for _ in loader:
        pass
    snap = loader.stats()
    assert snap.steps_busy + snap.steps_idle > 0
    inline: Any = ThreadDataLoader(data, batch_size=4, num_workers=0)
    for _ in inline:
        pass
    assert inline.stats().steps_busy + inline.stats().steps_idle == 0
