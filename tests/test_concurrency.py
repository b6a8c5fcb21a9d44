"""The adaptive fetching limit: how the controller moves, and that no limit can stall an epoch."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any

import pytest
import torch
from helpers import (
    assert_epochs_equal,
    assert_resumes_exactly,
    collect_epochs,
    torch_epochs,
    torch_loader,
)
from torch.utils.data import Dataset, RandomSampler

from threadloader import ThreadDataLoader
from threadloader._engine import threaded
from threadloader._primitives.concurrency import BACKOFF_MAX, PROBE_BUDGET, ConcurrencyController
from threadloader._primitives.gate import Gate


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drive(
    ctl: ConcurrencyController, clock: FakeClock, rate_at: dict[int, float], n: int
) -> list[int]:
    """Deliver ``n`` batches at the rate the current limit gives; return the limits seen."""
    seen = []
    for _ in range(n):
        clock.now += 1.0 / rate_at[ctl.limit]
        ctl.on_batch()
        seen.append(ctl.limit)
    return seen


def test_a_controller_serves_the_transfer_thread_and_the_next_iter_one_at_a_time() -> None:
    """With ``device=``, an iterator's transfer thread counts batches while the training
    thread's next ``iter()`` takes the controller's ``next_epoch``: they never run inside it at
    once (each reads the clock while there; the clock notes how many are in)."""
    inside, most, lock = 0, 0, threading.Lock()
    ticks = itertools.count()

    def clock() -> float:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.0002)
        with lock:
            inside -= 1
        return next(ticks) * 1e-3

    ctl = ConcurrencyController(4, minimum=0, clock=clock)
    stop = threading.Event()

    def transfer() -> None:
        while not stop.is_set():
            ctl.on_batch(started=None)

    thread = threading.Thread(target=transfer)
    thread.start()
    try:
        for _ in range(200):
            ctl.next_epoch()
    finally:
        stop.set()
        thread.join()
    assert most == 1


def test_controller_walks_down_when_threads_do_not_help() -> None:
    """GIL-bound rates (fewer threads faster) take the limit to 0 and keep it there."""
    clock = FakeClock()
    ctl = ConcurrencyController(4, minimum=0, clock=clock)
    limits = _drive(ctl, clock, {4: 1000, 3: 1200, 2: 1500, 1: 2000, 0: 3000}, 10000)
    assert limits[-1] == 0 and ctl.threads_do_not_help()
    assert limits.count(0) > 0.8 * len(limits)


def test_threads_do_not_help_holds_while_a_probe_of_more_threads_runs() -> None:
    """Settled on the training thread alone, the verdict stays while a probe tries 1 worker:
    stats() taken mid-probe must not call a GIL-bound dataset unbound."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock)
    rates = {2: 1000.0, 1: 1200.0, 0: 3000.0}
    _drive(ctl, clock, rates, 400)
    assert ctl.settled == 0 and ctl.threads_do_not_help()
    while ctl.limit == 0:  # until the next probe starts
        _drive(ctl, clock, rates, 1)
    assert ctl.limit == 1 and ctl.settled == 0
    assert ctl.threads_do_not_help()
    while ctl.limit == 1:  # the probe loses: still the training thread alone
        _drive(ctl, clock, rates, 1)
    assert ctl.threads_do_not_help()


def test_controller_keeps_threads_that_scale() -> None:
    """When each extra thread adds throughput, the limit returns to and stays at the maximum."""
    clock = FakeClock()
    ctl = ConcurrencyController(4, minimum=0, clock=clock)
    limits = _drive(ctl, clock, {k: 500.0 * (k + 1) for k in range(5)}, 5000)
    assert limits[-1] == 4 and not ctl.threads_do_not_help()
    assert limits.count(4) > 0.8 * len(limits)


def test_losing_probe_ends_before_its_window() -> None:
    """A probe at half the settled rate is rejected after a few batches, not a whole window."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock)
    rates = {2: 1000.0, 1: 1000.0, 0: 2000.0}
    _drive(ctl, clock, rates, 400)  # settles at 0
    assert ctl.settled == 0
    probe_lengths, run = [], 0
    for limit in _drive(ctl, clock, rates, 4000):
        if limit != 0:
            run += 1
        elif run:
            probe_lengths.append(run)
            run = 0
    assert probe_lengths, "the controller stopped probing"
    # a window is 20 ms = 20 batches at 1000/s; a losing probe must end after ~4-5 batches
    assert max(probe_lengths) <= 6, probe_lengths


def test_controller_starting_at_its_minimum_still_probes_upwards() -> None:
    """An epoch that starts from a learned limit of 0 still finds threads that scale."""
    clock = FakeClock()
    ctl = ConcurrencyController(3, minimum=0, clock=clock, initial=0)
    limits = _drive(ctl, clock, {k: 500.0 * (k + 1) for k in range(4)}, 3000)
    assert limits[0] == 0 and limits[-1] == 3


def test_next_epoch_starts_at_the_limit_the_last_one_settled_at() -> None:
    """The loader remembers what its previous epoch learned; a new worker count forgets it."""
    loader = ThreadDataLoader(list(range(64)), batch_size=4, num_workers=2)
    list(loader)
    assert loader._stats is not None and loader._stats.controller is not None
    loader._stats.controller._settled_at = 1  # as if the first epoch had settled at 1
    it = iter(loader)
    assert it._concurrency.limit == 1 and it._pool.gate.limit == 1
    assert torch.equal(torch.cat(list(it)), torch.arange(64))
    loader2 = ThreadDataLoader(list(range(64)), batch_size=4, num_workers=3)
    loader2._stats = loader._stats  # a different worker count: start over at the maximum
    assert iter(loader2)._concurrency.limit == 3


def test_controller_respects_its_minimum() -> None:
    """With minimum == maximum (no caller fallback) the limit never moves."""
    clock = FakeClock()
    ctl = ConcurrencyController(3, minimum=3, clock=clock)
    assert set(_drive(ctl, clock, {3: 1000}, 500)) == {3}


def test_gate_limits_concurrent_holders_and_wakes_on_close() -> None:
    """At most `limit` threads pass the gate; close() releases every waiter."""
    gate = Gate(1)
    assert gate.enter()
    entered = threading.Event()
    results: list[bool] = []

    def second() -> None:
        results.append(gate.enter())
        entered.set()

    t = threading.Thread(target=second)
    t.start()
    assert not entered.wait(0.1)  # blocked: the one slot is taken
    gate.close()
    t.join(5)
    assert results == [False]


class SlowInit(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class _AlwaysZero(ConcurrencyController):
    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        super().__init__(maximum, minimum, initial=minimum)

    def on_batch(self, *args: float | None) -> int | None:
        return None


class _AlwaysMax(ConcurrencyController):
    def on_batch(self, *args: float | None) -> int | None:
        return None


@pytest.mark.timeout(30)
def test_workers_parked_at_limit_zero_never_stall_the_epoch(monkeypatch) -> None:
    """A worker still starting when the limit drops to 0 does not leave its batch unfetched."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)

    def slow_init(worker_id: int) -> None:
        time.sleep(0.2)

    loader = ThreadDataLoader(SlowInit(), batch_size=4, num_workers=2, worker_init_fn=slow_init)
    it = iter(loader)
    it._pool.gate.set_limit(0)  # as if the controller had already settled on 0
    assert torch.equal(torch.cat(list(it)), torch.arange(40))


@pytest.mark.timeout(30)
def test_persistent_workers_parked_at_limit_zero_start_the_next_epoch(monkeypatch) -> None:
    """Workers parked at the gate across an epoch boundary do not stall the next epoch."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)
    loader = ThreadDataLoader(SlowInit(), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    it._pool.gate.set_limit(0)  # parked for the whole first epoch
    first = torch.cat(list(it))
    second = torch.cat(list(loader))
    assert torch.equal(first, torch.arange(40)) and torch.equal(second, torch.arange(40))


class Draws(Dataset[float]):
    """Item i: a draw from the worker's global torch RNG."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> float:
        return float(torch.rand(()))


@pytest.mark.timeout(30)
def test_parked_persistent_workers_finish_an_abandoned_epochs_tasks_before_the_next(
    monkeypatch,
) -> None:
    """Leaving an epoch while workers are parked at limit 0 with tasks queued: the training
    thread starts the next epoch on their behalf, after running those tasks as they would have
    (torch's persistent workers make every batch given to them), so the next epochs' draws are
    torch's, and nothing waits for a parked worker."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)

    def epochs(loader: Any, park: bool) -> list[list[float]]:
        it = iter(loader)
        if park:
            it._pool.gate.set_limit(0)  # the tasks dispatched at iter() stay queued
        out = [[next(it).tolist()]]
        del it
        return out + [[b.tolist() for b in loader] for _ in range(2)]

    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "persistent_workers": True}
    torch.manual_seed(0)
    expected = epochs(torch_loader(Draws(), multiprocessing_context="fork", **kwargs), False)
    torch.manual_seed(0)
    assert epochs(ThreadDataLoader(Draws(), **kwargs), True) == expected


class CallCount(Dataset[tuple[int, int]]):
    """Item i: ``(i, items this copy made)``; a persistent worker's copy keeps counting."""

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.calls += 1
        return i, self.calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lean", [True, False], ids=["limit 0", "every thread"])
def test_persistent_workers_left_early_in_several_epochs_count_like_dataloader(
    monkeypatch, lean: bool
) -> None:
    """Epochs left after 1 batch, then before the loop kept one (break at the first), then
    after 3: each worker's copy has made what torch's had, whatever the limit. A worker parked
    through two abandoned epochs started only the first of them on the training thread, so its
    copy lagged one item behind torch's."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero if lean else _AlwaysMax)

    def epochs(loader: Any) -> list[list[list[int]]]:
        out = []
        for taken in (None, 1, 0, 3):
            epoch: list[list[int]] = []
            for batch in loader:
                if taken is not None and len(epoch) >= taken:
                    break
                epoch.append([int(x) for x in batch])
            out.append(epoch)
        return out[1:]

    kwargs: dict[str, Any] = {
        "batch_size": 1, "num_workers": 2, "prefetch_factor": 1, "persistent_workers": True,
    }  # fmt: skip
    expected = epochs(torch_loader(CallCount(), multiprocessing_context="fork", **kwargs))
    assert epochs(ThreadDataLoader(CallCount(), **kwargs)) == expected


class _Schedule(ConcurrencyController):
    """A controller that follows a fixed schedule of limits, one entry per delivered batch."""

    schedule: tuple[int, ...] = (0,)

    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        super().__init__(maximum, minimum, initial=max(minimum, self.schedule[0]))
        self._n = 0
        self._minimum = minimum  # never below what the iterator allows, as the real one

    def on_batch(self, *args: float | None) -> int | None:
        self._n += 1
        limit = max(self._minimum, self.schedule[self._n % len(self.schedule)])
        if limit == self.limit:
            return None
        self.limit = limit
        return limit


class WhoMadeIt(Dataset[tuple[int, int]]):
    """Each item says which worker made it, as torch's get_worker_info() reports it."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return i, -1 if info is None else info.id


LIMIT_SCHEDULES = {
    "always-0": (0,),
    "0-then-2": (0,) * 4 + (2,) * 4,
    "2-then-0": (2,) * 3 + (0,) * 5,
    "0-1-2": (0, 0, 1, 1, 2, 2),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", LIMIT_SCHEDULES.values(), ids=LIMIT_SCHEDULES.keys())
@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_and_their_workers_match_torch_whatever_the_limit(
    monkeypatch, schedule: tuple[int, ...], shuffle: bool
) -> None:
    """The lean path (limit 0) and the dispatching path make the same batches, by the same worker."""
    controller = type("S", (_Schedule,), {"schedule": schedule})
    monkeypatch.setattr(threaded, "ConcurrencyController", controller)
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 3, "shuffle": shuffle}
    expected = torch_epochs(
        WhoMadeIt(), epochs=2, generator=torch.Generator().manual_seed(5), **kwargs
    )
    loader = ThreadDataLoader(WhoMadeIt(), generator=torch.Generator().manual_seed(5), **kwargs)
    assert_epochs_equal(collect_epochs(loader, 2), expected)


@pytest.mark.timeout(60)
def test_persistent_workers_lean_path_across_epochs(monkeypatch) -> None:
    monkeypatch.setattr(
        threaded, "ConcurrencyController", type("S", (_Schedule,), {"schedule": (0, 0, 0, 2, 2)})
    )
    expected = list(torch_loader(WhoMadeIt(), batch_size=4, num_workers=2))
    loader = ThreadDataLoader(WhoMadeIt(), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(3):
        assert_epochs_equal([list(loader)], [expected])


class FailsAt(Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == 13:
            raise KeyError("no item 13")
        return i


@pytest.mark.timeout(60)
def test_lean_path_raises_worker_errors_like_torch(monkeypatch) -> None:
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)
    it = iter(ThreadDataLoader(FailsAt(), batch_size=4, num_workers=2))
    first = [next(it).tolist() for _ in range(3)]
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(KeyError, match="worker thread 1") as info:
        next(it)
    assert "no item 13" in str(info.value)
    assert next(it).tolist() == [16, 17, 18, 19]  # as in torch, the epoch goes on


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", [(0,), (0, 0, 2, 2, 2)], ids=["always-0", "switching"])
def test_state_saved_on_the_lean_path_resumes_exactly(
    monkeypatch, schedule: tuple[int, ...]
) -> None:
    monkeypatch.setattr(
        threaded, "ConcurrencyController", type("S", (_Schedule,), {"schedule": schedule})
    )

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            WhoMadeIt(),
            batch_size=4,
            num_workers=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(9),
        )

    assert_resumes_exactly(make, cut=6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", LIMIT_SCHEDULES.values(), ids=LIMIT_SCHEDULES.keys())
def test_out_of_order_delivery_loses_and_repeats_nothing_whatever_the_limit(
    monkeypatch, schedule: tuple[int, ...]
) -> None:
    controller = type("S", (_Schedule,), {"schedule": schedule})
    monkeypatch.setattr(threaded, "ConcurrencyController", controller)
    loader = ThreadDataLoader(WhoMadeIt(), batch_size=4, num_workers=3, in_order=False)
    for _ in range(2):
        it = iter(loader)
        items = sorted(int(i) for batch in it for i in batch[0])
        assert items == list(range(60))
        # Out of order, the loop takes whichever batch is done first: it never makes one itself
        assert it._stats.snapshot().batches_run_by_caller == 0


def _drive_with_cpu(
    ctl: ConcurrencyController,
    clock: FakeClock,
    rate: float | dict[int, float],
    cpu_per_batch: float,
    n: int,
    wall_per_batch: float | None = None,
) -> list[int]:
    """Deliver ``n`` batches at ``rate``, each reporting its CPU (and wall) seconds."""
    seen = []
    for _ in range(n):
        r = rate if isinstance(rate, float) else rate[ctl.limit]
        clock.now += 1.0 / r
        ctl.on_batch(started=clock.now - 0.5 / r, cpu=cpu_per_batch, wall=wall_per_batch)
        seen.append(ctl.limit)
    return seen


@pytest.mark.parametrize(
    ("cores", "probes_down"),
    [(0.1, False), (1.0, True), (1.9, False)],
    ids=["threads-mostly-wait", "threads-take-turns-at-the-gil", "threads-run-in-parallel"],
)
def test_down_probes_only_when_fetch_threads_contend(cores: float, probes_down: bool) -> None:
    """I/O-bound (0.1 cores) and parallel (1.9 of 2) fetching never probe fewer threads."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    rate = 1000.0
    limits = _drive_with_cpu(ctl, clock, rate, cores / rate, 3000)
    assert (min(limits) < 2) == probes_down


@pytest.mark.parametrize(
    ("wall_per_cpu", "settles_at_zero"),
    [(1.0, True), (20.0, False)],
    ids=["cheap-fetches-hand-offs-bound", "fetches-wait-on-io"],
)
def test_cheap_fetches_that_use_little_cpu_still_try_the_training_thread_alone(
    wall_per_cpu: float, settles_at_zero: bool
) -> None:
    """Little CPU per second is I/O only if each fetch mostly waits, not if it is just cheap.

    Four cheap items a batch (2 us of CPU): through two workers the hand-offs make it 27 us a
    batch (0.07 cores of fetching), the training thread alone 10 us. Fetches that take 20x
    their CPU time in wall time are waiting on I/O: no probe goes below the maximum.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    cpu = 2e-6
    rates = {2: 1 / 27e-6, 1: 1 / 27e-6, 0: 1 / 10e-6}
    limits = _drive_with_cpu(ctl, clock, rates, cpu, 20000, wall_per_batch=cpu * wall_per_cpu)
    late = limits[len(limits) // 2 :]
    if settles_at_zero:
        assert late.count(0) > 0.9 * len(late)
    else:
        assert min(limits) == 2


def test_batches_begun_under_the_previous_limit_are_not_counted() -> None:
    """After a probe to 0, batches the workers had already made do not make the probe look fast."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock)
    while ctl.limit == 2:  # measures limit 2, then probes the minimum
        clock.now += 0.001
        ctl.on_batch(started=clock.now - 0.0005)
    assert ctl.limit == 0
    changed = clock.now
    for _ in range(50):  # a burst of stale batches: 10x the rate, begun before the change
        clock.now += 0.0001
        ctl.on_batch(started=changed - 0.001)
    assert ctl.limit == 0 and 0 not in ctl._rates
    _drive(ctl, clock, {0: 300.0, 1: 300.0, 2: 1000.0}, 30)  # fresh batches: slow, rejected
    assert ctl.limit == 2 and ctl._rates[0] < 400


@pytest.mark.parametrize(("cores", "fewer"), [(1.0, True), (0.1, False)], ids=["gil", "io"])
def test_isolation_helper_pacer_sees_each_batch_cpu_time(cores: float, fewer: bool) -> None:
    """The helper's pacer tries one thread when its two take turns at the GIL, not when they wait.

    It must pass each batch's CPU time on: without it the controller cannot tell threads
    waiting on I/O from threads taking turns at the GIL, and probes fewer in both cases.
    """
    from threadloader.isolation.helper import _Pacer

    clock = FakeClock()
    pacer = _Pacer(2, clock=clock, cpus=2)
    rate, limits = 1000.0, []
    for _ in range(3000):
        clock.now += 1.0 / rate
        pacer.on_batch(clock.now - 0.5 / rate, cores / rate)
        limits.append(pacer.limit)
    assert (min(limits) == 1) == fewer


def test_isolation_helper_pacer_applies_limits_in_the_order_it_decides_them() -> None:
    """Two runners' batches change the limit one after the other: the board ends on the last.

    Runner A's new limit must reach the task board before runner B's batch is counted; else B's
    later limit could be overwritten by A's stale one until the next change.
    """
    from threadloader.isolation.helper import _Pacer

    pacer = _Pacer(4, cpus=2)
    decided = iter([1, 3])
    pacer._controller.on_batch = lambda *args: next(decided)  # type: ignore[method-assign]
    applied: list[int] = []
    a_applying = threading.Event()

    def slow_apply(limit: int) -> None:  # runner A is descheduled while applying its limit
        a_applying.set()
        time.sleep(0.2)
        applied.append(limit)

    runner_a = threading.Thread(target=pacer.on_batch, args=(0.0, None, None, slow_apply))
    runner_a.start()
    assert a_applying.wait(5)
    pacer.on_batch(0.0, None, None, applied.append)  # runner B
    runner_a.join()
    assert applied == [1, 3]


def test_first_probe_comes_after_a_short_first_window() -> None:
    """The starting limit is judged on ~5 ms, later windows on 20 ms: contention costs at start."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock)
    rates = {2: 2000.0, 1: 2000.0, 0: 4000.0}
    while ctl.limit == 2:
        clock.now += 1.0 / rates[ctl.limit]
        ctl.on_batch()
    assert clock.now < 0.01  # first window 5 ms (10 batches), not 20 ms
    first_change = clock.now
    while ctl.limit == 0 and clock.now < 1.0:
        clock.now += 1.0 / rates[ctl.limit]
        ctl.on_batch()
    assert clock.now - first_change >= 0.02  # later windows are full length before a probe


def test_no_downward_creep_when_every_thread_adds_throughput() -> None:
    """Latency-bound reads (rate proportional to threads) never settle far below the maximum.

    One step down from 32 threads loses 3%, within what a lower limit may lose; step after
    step those losses compounded (32 -> 20 threads, 62% of the rate, was measured with 32
    threads reading over HTTP). A lower limit is judged against the best rate seen above it.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(32, minimum=0, clock=clock)
    limits = _drive(ctl, clock, {k: 100.0 * max(k, 0.5) for k in range(33)}, 30000)
    assert min(limits[len(limits) // 2 :]) >= 30, sorted(set(limits))


def test_a_losing_probe_to_zero_ends_after_one_slow_batch() -> None:
    """32 threads reading 10 ms objects: the training thread alone takes 160 ms a batch.

    Elsewhere a probe is judged over two batch latencies (slow batches arrive in bursts); at 0
    the training thread makes every batch in turn, so one batch already shows the loss.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(32, minimum=0, clock=clock, cpus=2)
    latency = 0.16
    while ctl.limit == 32:  # 32 threads: 200 batches/s, each 160 ms from start to delivery
        clock.now += 1 / 200
        ctl.on_batch(started=clock.now - latency)
    assert ctl.limit == 0
    probe_start = clock.now
    while ctl.limit == 0 and clock.now - probe_start < 5:
        clock.now += latency  # alone: one batch every 160 ms, begun after the probe started
        ctl.on_batch(started=clock.now - latency)
    assert ctl.limit == 32
    assert clock.now - probe_start <= 2 * latency + 1e-9  # without the rule: >= 3 batches


def test_probing_loses_little_of_the_first_half_second() -> None:
    """Losing probes are spaced by what they lose: ~1/PROBE_BUDGET of the time.

    Token windows: one worker next to the training thread runs at 40% of the rate, and a probe
    lasts at least two of its batch latencies (~3 ms each). Spacing probes by 20x their length
    let them cost 2.6% of the first 0.4 s after settling; by 100x the time they lose, 1.3%;
    by 200x (PROBE_BUDGET now) the first probe comes after those 0.4 s.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    rates = {2: 1300.0, 1: 1600.0, 0: 4000.0}
    _drive(ctl, clock, rates, 100)  # settles at 0
    assert ctl.settled == 0
    start, lost = clock.now, 0.0
    while clock.now - start < 0.4:
        dt = 1.0 / rates[ctl.limit]
        clock.now += dt
        lost += dt * (1.0 - rates[ctl.limit] / rates[0])
        ctl.on_batch(started=clock.now - (0.003 if ctl.limit else dt))
    assert ctl.settled == 0
    assert lost / (clock.now - start) < 0.02


def test_a_starting_limit_that_lost_spaces_the_first_probe_like_a_lost_probe() -> None:
    """The window at the starting limit was a probe in all but name: its loss is charged.

    Token windows: two workers run at a third of the training thread's rate for the first
    ~6 ms; probing one worker 80 ms later cost ~1% of a 0.4 s run, for a limit that loses too.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    rates = {2: 1300.0, 1: 1600.0, 0: 4000.0}
    first_window_s = 0.0
    while ctl.limit == 2:
        clock.now += 1.0 / rates[2]
        first_window_s += 1.0 / rates[2]
        ctl.on_batch()
    settled_at = clock.now
    while ctl.limit == 0 and clock.now - settled_at < 5.0:
        clock.now += 1.0 / rates[0]
        ctl.on_batch()
    lost = first_window_s * (1.0 - rates[2] / rates[0])
    assert clock.now - settled_at >= 0.9 * PROBE_BUDGET * lost > 0.2


def _epoch_ending_mid_probe(probe_rate: float, probe_batches: int) -> ConcurrencyController:
    """A controller at 2 workers whose epoch ends ``probe_batches`` into its probe of 0."""
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    while ctl.limit == 2:  # the first window, then the probe to the far extreme
        clock.now += 1 / 1300
        ctl.on_batch(started=clock.now - 0.0005)
    assert ctl.limit == 0 and ctl.settled == 2
    for _ in range(probe_batches + 1):  # the first fresh batch opens the window
        clock.now += 1 / probe_rate
        ctl.on_batch(started=clock.now - 0.0001)
    assert ctl.settled == 2, "the probe window must still be open at the epoch's end"
    return ctl


@pytest.mark.parametrize(
    ("probe_rate", "probe_batches", "starts_at"),
    [(4000.0, 20, 0), (4000.0, 2, 2), (600.0, 20, 2)],
    ids=["probe-winning", "too-few-batches", "probe-losing"],
)
def test_next_epoch_concludes_a_probe_its_epoch_cut_short(
    probe_rate: float, probe_batches: int, starts_at: int
) -> None:
    """Epochs of 32 cheap batches end before a 20 ms probe window fills; the next epoch must
    not start at the maximum again (token windows: 400 us a batch, DataLoader(0) 240)."""
    nxt = _epoch_ending_mid_probe(probe_rate, probe_batches).next_epoch()
    assert nxt.limit == starts_at and nxt.settled == starts_at


def test_next_epoch_carries_the_rates_on_and_does_not_probe_the_far_extreme_again() -> None:
    ctl = _epoch_ending_mid_probe(4000.0, 20)
    nxt = ctl.next_epoch()
    assert nxt is not ctl and nxt._rates == ctl._rates and nxt._rates is not ctl._rates
    clock = nxt._clock
    assert isinstance(clock, FakeClock)
    limits = []
    for _ in range(400):  # 0.1 s at 4,000 batches/s: before the probing budget allows a probe
        clock.now += 1 / 4000
        nxt.on_batch(started=clock.now - 0.0001)
        limits.append(nxt.limit)
    assert set(limits) == {0}


def _probe_starts(
    ctl: ConcurrencyController, clock: FakeClock, rates: dict[int, float], seconds: float
) -> list[float]:
    """Drive for ``seconds``; the times at which the limit left the settled one."""
    starts, end = [], clock.now + seconds
    while clock.now < end:
        before = ctl.limit
        clock.now += 1.0 / rates[ctl.limit]
        ctl.on_batch(started=clock.now - 1.0 / rates[ctl.limit])
        if ctl.limit != before and before == ctl.settled:
            starts.append(clock.now)
    return starts


def test_probes_lost_in_a_row_back_off_and_a_win_resets_the_spacing() -> None:
    """The same losing probe, again and again, waits twice as long each time (up to 8x).

    The starting limit's window lost to the first probe, and counts as the first loss of the
    row: the first probe after settling is charged at 2x, the next at 4x, then 8x.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(2, minimum=0, clock=clock, cpus=2)
    losing = {2: 1300.0, 1: 1600.0, 0: 4000.0}
    _drive(ctl, clock, losing, 100)
    assert ctl.settled == 0
    starts = _probe_starts(ctl, clock, losing, 120.0)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(gaps) >= 6, gaps
    assert 1.7 * gaps[0] <= gaps[1] <= 2.3 * gaps[0], gaps  # doubling (2x, then 4x)
    capped = BACKOFF_MAX / 2 * gaps[0]  # 8x, against the first gap's 2x
    assert all(0.9 * capped <= g <= 1.1 * capped for g in gaps[-4:]), gaps  # then capped
    # One worker now wins: it is kept, and the spacing of the next lost probes starts over.
    winning = {2: 1300.0, 1: 8000.0, 0: 4000.0}
    while ctl.settled != 1:
        _drive(ctl, clock, winning, 1)
    after = _probe_starts(ctl, clock, {2: 1000.0, 1: 8000.0, 0: 4000.0}, 20.0)
    again = [b - a for a, b in itertools.pairwise(after)]
    assert again and again[0] < 3 * gaps[0], (again, gaps)


def test_an_epoch_whose_data_changed_learns_afresh() -> None:
    """Epoch 1 waits on I/O (32 threads win), epoch 2 reads a cache it filled (alone wins).

    The carried rates and probe schedule (the last lost probe pushed the next one ~30 s away)
    must not keep epoch 2 at 32 threads: its first window runs 3x faster than epoch 1's did at
    32, so it probes the far extreme at once, as a fresh controller would.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(32, minimum=0, clock=clock, cpus=2)
    remote = {32: 200.0, 0: 6.0}  # batches/s; 160 ms a batch, 5 ms of it CPU (a core in all)
    while clock.now < 8.0:  # the first probe down comes after 40 fetches' time (6.4 s)
        dt = 1.0 / remote[ctl.limit]
        clock.now += dt
        ctl.on_batch(started=clock.now - 0.16, cpu=0.005, wall=0.16)
    assert ctl.settled == 32 and 0 in ctl._rates  # the probe of the training thread alone lost
    nxt = ctl.next_epoch()
    cached = {32: 600.0, 0: 4000.0}  # CPU-bound: the fetching threads take turns at the GIL
    start, limits = clock.now, []
    while clock.now - start < 0.5:
        dt = 1.0 / cached[nxt.limit]
        clock.now += dt
        nxt.on_batch(started=clock.now - dt, cpu=dt, wall=dt)
        limits.append(nxt.limit)
    assert nxt.settled == 0, sorted(set(limits))
    assert limits.count(0) > 0.9 * len(limits)


def test_bursty_deliveries_are_measured_over_two_batch_latencies() -> None:
    """32 threads reading remote objects: one late read holds back every batch after it.

    In-order delivery then comes as a gap and a burst (~290 batches/s on average). A window of
    8 batches over 5 ms that spanned the gap measured 52 batches/s, so the training thread
    alone (55) was kept, and one worker next to it (58) never looked better: epoch 1 of the
    remote cache bench took 8.7 s instead of 6. A window spanning two batch latencies sees the
    burst as well.
    """
    clock = FakeClock()
    ctl = ConcurrencyController(32, minimum=0, clock=clock, cpus=2)
    steady = {0: 55.0, 1: 58.0}
    cpu = 0.011  # per batch: parsing 16 responses
    phase, at_zero, n = 37, 0, 0  # start 3 batches before a late read
    while clock.now < 30.0:
        n += 1
        if ctl.limit in steady:
            dt = 1 / steady[ctl.limit]
            clock.now += dt
            ctl.on_batch(started=clock.now - dt, cpu=cpu, wall=dt)
            at_zero += ctl.limit == 0
            continue
        # A cycle of 100 batches: 40 every 5 ms, a 0.14 s gap, then 60 at once.
        clock.now += 0.005 if phase < 40 else (0.14 if phase == 40 else 0.0)
        latency = 0.16 + (0.14 if 40 <= phase else 0.0)
        ctl.on_batch(started=clock.now - latency, cpu=cpu, wall=latency)
        phase = (phase + 1) % 100
    assert at_zero < 0.05 * n, (at_zero, n)


class _Counting(ConcurrencyController):
    """Stays at its maximum and counts the batches it was shown."""

    shown = 0

    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        super().__init__(maximum, minimum)

    def on_batch(self, *args: float | None) -> int | None:
        type(self).shown += 1
        return None


def test_batches_draining_after_the_sampler_ran_out_are_not_measured(monkeypatch) -> None:
    """The last batches arrive with nothing dispatched behind them: no rate to learn from.

    (32 threads ending an epoch delivered at 8x their rate, and the next epoch compared itself
    with that.) 10 batches, 4 in flight: the last 4 are delivered after the sampler ran out.
    """
    monkeypatch.setattr(threaded, "ConcurrencyController", _Counting)
    _Counting.shown = 0
    loader = ThreadDataLoader(SlowInit(), batch_size=4, num_workers=2, prefetch_factor=2)
    assert torch.equal(torch.cat(list(loader)), torch.arange(40))
    assert _Counting.shown == 10 - 4


class _NamesThreads(Dataset[torch.Tensor]):
    """Records the names of the threads alive while each item is made."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        self.seen.update(t.name for t in threading.enumerate())
        return torch.tensor(i)


@pytest.mark.timeout(30)
def test_an_epoch_that_starts_on_the_lean_path_starts_no_thread(monkeypatch) -> None:
    """Limit 0 from the start and no worker_init_fn: the training thread makes every batch."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)
    dataset = _NamesThreads()
    before = threading.active_count()
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "shuffle": True}
    loader = ThreadDataLoader(dataset, generator=torch.Generator().manual_seed(3), **kwargs)
    ours = collect_epochs(loader, 1)
    assert not [n for n in dataset.seen if n.startswith("threadloader-")]
    assert threading.active_count() == before  # (torch's loader below leaves queue threads)
    expected = torch_epochs(dataset, generator=torch.Generator().manual_seed(3), **kwargs)
    assert_epochs_equal(ours, expected)


@pytest.mark.timeout(30)
def test_worker_init_fn_runs_on_worker_threads_even_when_the_epoch_starts_lean(
    monkeypatch,
) -> None:
    """A worker_init_fn may depend on its thread (affinity, thread-locals): the lean start waits."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)
    ran_on: list[str] = []
    loader = ThreadDataLoader(
        SlowInit(),
        batch_size=4,
        num_workers=2,
        worker_init_fn=lambda i: ran_on.append(threading.current_thread().name),
    )
    assert torch.equal(torch.cat(list(loader)), torch.arange(40))
    assert len(ran_on) == 2 and all("-worker" in name for name in ran_on), ran_on


class _ReadCounts:
    """Shared by every worker's copy of the dataset (a copy is shallow)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0


class CountsConcurrentReads(Dataset[int]):
    """Each item sleeps (releasing the GIL, like a decode); records the most reads at once."""

    def __init__(self, n: int = 24, item_s: float = 0.05) -> None:
        self.n, self.item_s = n, item_s
        self.counts = _ReadCounts()

    @property
    def most(self) -> int:
        return self.counts.most

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        counts = self.counts
        with counts.lock:
            counts.active += 1
            counts.most = max(counts.most, counts.active)
        time.sleep(self.item_s)
        with counts.lock:
            counts.active -= 1
        return index


class _AlwaysOne(_AlwaysZero):
    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        ConcurrencyController.__init__(self, maximum, minimum, initial=1)


class CallerWaitsForCompany(CountsConcurrentReads):
    """Reads on the training thread set ``caller_reading``, then last until another thread
    reads too (10 s at most); other threads' reads take ``item_s``."""

    def __init__(self, caller_reading: threading.Event) -> None:
        super().__init__(item_s=0.05)
        self.caller_reading = caller_reading

    def __getitem__(self, index: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            return super().__getitem__(index)
        counts = self.counts
        with counts.lock:
            counts.active += 1
            counts.most = max(counts.most, counts.active)
        self.caller_reading.set()
        deadline = time.monotonic() + 10
        while self.most < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        with counts.lock:
            counts.active -= 1
        return index


def test_a_worker_waiting_for_its_task_in_the_training_thread_leaves_its_gate_slot(
    monkeypatch,
) -> None:
    """Limit 1, the training thread making worker 0's batch: worker 0's thread must not sit on
    the one slot while it waits, or worker 1 cannot fetch meanwhile (its batch waited)."""
    monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysOne)
    wait_open, enter = Gate.wait_open, Gate.enter
    caller_reading, worker0_entered = threading.Event(), threading.Event()
    started: set[int] = set()

    def late_start(gate: Gate) -> bool:
        if threading.get_ident() not in started:  # each worker, once: ready, but not at its
            started.add(threading.get_ident())  # queue until we make the first batch, and
            caller_reading.wait(10)  # worker 1 not until worker 0 took the one slot
            if not threading.current_thread().name.endswith("worker0"):
                worker0_entered.wait(10)
        return wait_open(gate)

    def entered(gate: Gate) -> bool:
        took = enter(gate)
        if threading.current_thread().name.endswith("worker0"):
            worker0_entered.set()
        return took

    monkeypatch.setattr(Gate, "wait_open", late_start)
    monkeypatch.setattr(Gate, "enter", entered)
    dataset = CallerWaitsForCompany(caller_reading)
    it = iter(ThreadDataLoader(dataset, batch_size=2, num_workers=2))
    next(it)  # made here, as worker 0, until worker 1 fetches alongside
    assert it._stats.snapshot().batches_run_by_caller == 1
    del it
    assert dataset.most == 2  # worker 1 fetched while the training thread did


def test_a_probe_down_waits_until_the_run_has_lasted_many_fetch_times() -> None:
    """6 threads sleeping ~1 ms an item, 146 ms a fetch, next to a 10 ms GPU step.

    A probe to the training thread alone costs about two fetch times (285 ms measured on an
    H200), which in a one-second first epoch made the loop wait 1.4x as long as DataLoader's.
    It comes only after FIRST_PROBE_FETCHES fetch times; it still comes, so a GIL-bound
    dataset with slow batches is still found out.
    """
    from threadloader._primitives.concurrency import FIRST_PROBE_FETCHES

    clock = FakeClock()
    ctl = ConcurrencyController(6, minimum=0, clock=clock, cpus=16)
    fetch_s, cpu = 0.146, 0.02  # 0.14 of each fetch on the CPU: 0.8 cores in all, "contended"
    rates = {6: 41.0, 0: 6.0}
    first_change = None
    while clock.now < 15.0 and first_change is None:
        dt = 1.0 / rates[ctl.limit]
        clock.now += dt
        if ctl.on_batch(started=clock.now - fetch_s, cpu=cpu, wall=fetch_s) is not None:
            first_change = clock.now
    assert first_change is not None and ctl.limit == 0  # the probe came...
    # ...after 40 fetch times: not in the first 80-step epoch (1.2 s), where it came at 0.4 s
    assert first_change >= max(1.2, FIRST_PROBE_FETCHES * fetch_s)


class _Drawn(Dataset[torch.Tensor]):
    """Item i: ``[i, a draw from the worker's torch generator]``."""

    def __len__(self) -> int:
        return 47

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), float(torch.rand(()))])


def _two_epochs_with_a_break(make: Any) -> list[list[torch.Tensor]]:
    """Epoch 1 left after 6 batches, then a whole epoch 2. The sampler draws lazily (in chunks
    of 32, as the loop asks) from the loader's own generator, which also seeds epoch 2."""
    g = torch.Generator().manual_seed(945711)
    sampler = RandomSampler(range(47), replacement=True, num_samples=54, generator=g)
    loader = make(_Drawn(), batch_size=3, num_workers=3, generator=g, sampler=sampler)
    first = []
    for k, batch in enumerate(loader):
        if k == 6:
            break
        first.append(batch)
    return [first, list(loader)]


@pytest.mark.parametrize("lean", [True, False], ids=["training thread alone", "workers"])
def test_a_break_leaves_a_lazily_drawing_sampler_where_torch_leaves_it(
    monkeypatch: pytest.MonkeyPatch, lean: bool
) -> None:
    """torch had drawn prefetch_factor * num_workers indices ahead at the break; so has the
    training thread making each batch itself, which dispatches none ahead: epoch 2, seeded from
    the same generator, is torch's."""
    if lean:
        monkeypatch.setattr(
            ConcurrencyController,
            "on_batch",
            lambda self, *a, **k: self._set(0) if self.minimum == 0 else None,
        )
    theirs = _two_epochs_with_a_break(torch_loader)
    ours = _two_epochs_with_a_break(functools.partial(ThreadDataLoader, isolation="threads"))
    for epoch in range(2):
        assert_epochs_equal(ours[epoch], theirs[epoch])
