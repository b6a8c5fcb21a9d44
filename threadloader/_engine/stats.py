"""Where the time goes: a snapshot of one epoch, from ``ThreadDataLoader.stats()``.

The number that matters most is ``wait_fraction``: the share of wall time the training loop
spent blocked in ``next()``. Near 0 the loader keeps up and the accelerator never starves; near 1
the loop is data-bound, and the stage timings say which stage to speed up.

GIL-bound detection (``gil_bound``, decided by ``is_gil_bound``), from measurements on 2 cores
with 2 workers (``tests/test_stats.py`` holds the rule to these numbers):

- a pure-Python dataset: the concurrency controller settled on 0 fetching workers (the training
  thread alone was fastest) and the process used 1.0 core;
- a dataset sleeping 0.5 ms an item (I/O-like, GIL released): both workers busy all the time,
  0.12 cores used, the controller kept 2 workers;
- numpy matmuls (GIL released, BLAS already using both cores): the controller settled on 0 too,
  but the process used 1.7 cores: more threads cannot help, yet the GIL is not the reason.

So the dataset is called GIL-bound when the process uses at most 1.3 cores and either the
controller found one thread fastest, or the workers were busy for more than 1.5 threads' worth of
wall time while the process used at least 0.7 cores (threads waiting for the GIL are "busy" but
only one runs; threads waiting on I/O are busy and use almost no CPU).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from threadloader._primitives.concurrency import ConcurrencyController
from threadloader._primitives.timing import STAGES, StageRecorder

__all__ = ["LoaderStats", "StageStats"]

logger = logging.getLogger("threadloader")

GIL_BUSY_THREADS = 1.5
GIL_CPU_RANGE = (0.7, 1.3)


@dataclasses.dataclass(frozen=True)
class StageStats:
    """Timings of one pipeline stage, over every thread that ran it.

    Attributes:
        count: how many times the stage ran (once per batch).
        total_s: summed duration; above wall time when threads overlapped.
        mean_s: ``total_s / count``.
        p50_s: median of the recent durations (the last ~1,000 per thread).
        p90_s: 90th percentile of the recent durations.
        p99_s: 99th percentile of the recent durations.
    """

    count: int
    total_s: float
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A frozen snapshot of the current (or last) epoch; keep it, compare it, log it.

    Attributes:
        batches: batches delivered to the training loop this epoch.
        wall_s: seconds from the epoch's iterator's creation to the loop's ``StopIteration``
            (to now, while the epoch runs).
        wait_s: seconds the training loop spent inside ``next()``.
        wait_fraction: ``wait_s / wall_s``: how data-bound the loop is.
        ready_fraction: share of ``next()`` calls that found their batch already made.
        stages: per-stage timings (``sampler``, ``fetch``, ``collate``, ``pin``, ``transfer``);
            stages that did not run are absent. Large tensor samples copied into the batch as
            they arrive (worker threads) are timed as ``fetch``; their ``collate`` is ~0.
        worker_busy_s: seconds each worker thread spent fetching, collating and pinning.
        caller_busy_s: seconds the training thread spent on the loader's stages: drawing
            indices (``sampler``), running batches itself, pinning (``isolation="process"``) and
            issuing transfers (``device=``): loader work that delays the training step.
        batches_run_by_caller: batches the training thread ran because no worker had started them.
        num_workers: the loader's worker threads.
        concurrency_limit: how many workers may currently fetch at once (adaptive).
        cpu_cores_used: process CPU time over wall time: how many cores' worth were busy
            (up to the epoch's end, like ``wall_s``).
        gil_bound: the workers' throughput does not grow with threads (see module docstring).
        advice: what to do about the bottleneck, in a sentence; None when there is nothing to do.
        dataset: the dataset's own ``stats()`` snapshot, when it has that method
            (``RemoteFiles``: reads, retries, skipped items, cache hits, misses and bytes);
            None otherwise. With ``isolation="process"`` it is the helper's copy's, as of the
            last batch received (the training process's copy reads nothing).
        mode: where the epoch's workers ran: ``"threads"`` (this process) or ``"process"``
            (helper processes).
        mode_reason: why (``isolation="auto"``: the measurement behind the choice).
        step_busy_s: the training loop's mean time between ``next()`` calls (its own step)
            over steps that began and ended with a worker thread running a task; 0.0 when none.
        step_idle_s: the same over steps that began and ended with every worker idle (the
            prefetched batches were all made).
        steps_busy: how many steps ``step_busy_s`` averages.
        steps_idle: how many steps ``step_idle_s`` averages.
        training_slowed: the training thread's own steps were slower while worker threads ran
            than while they were idle (``step_slowed``): the threads take the GIL from it.
    """

    batches: int
    wall_s: float
    wait_s: float
    wait_fraction: float
    ready_fraction: float
    stages: dict[str, StageStats]
    worker_busy_s: tuple[float, ...]
    caller_busy_s: float
    batches_run_by_caller: int
    num_workers: int
    concurrency_limit: int
    cpu_cores_used: float
    gil_bound: bool
    advice: str | None
    dataset: Any = None
    mode: str = "threads"
    mode_reason: str | None = None
    step_busy_s: float = 0.0
    step_idle_s: float = 0.0
    steps_busy: int = 0
    steps_idle: int = 0
    training_slowed: bool = False

    def __str__(self) -> str:
        lines = [
            (
                f"threadloader: {self.batches} batches in {self.wall_s:.2f} s "
                f"({self.batches / self.wall_s if self.wall_s else 0.0:.1f} batches/s)"
            ),
            (
                f"  data wait   {self.wait_s:8.3f} s  {self.wait_fraction:6.1%} of wall time  "
                f"(batch ready on {self.ready_fraction:.0%} of next() calls)"
            ),
            (
                f"  workers     {self.num_workers} threads, up to {self.concurrency_limit} fetching at "
                f"once; {self.batches_run_by_caller} batches run by the training thread; "
                f"{self.cpu_cores_used:.2f} cores busy"
            ),
            "  stage           count    total s     mean ms    p50 ms    p90 ms    p99 ms",
        ]
        for name, s in self.stages.items():
            lines.append(
                f"  {name:<12} {s.count:8d} {s.total_s:10.3f} {s.mean_s * 1e3:11.3f} "
                f"{s.p50_s * 1e3:9.3f} {s.p90_s * 1e3:9.3f} {s.p99_s * 1e3:9.3f}"
            )
        busy = ", ".join(f"{b:.2f}" for b in self.worker_busy_s)
        lines.append(f"  busy s      workers [{busy}], training thread {self.caller_busy_s:.2f}")
        if self.steps_busy or self.steps_idle:
            lines.append(
                f"  loop step   {self.step_busy_s * 1e3:.3f} ms with workers running "
                f"({self.steps_busy} steps), {self.step_idle_s * 1e3:.3f} ms with them idle "
                f"({self.steps_idle})" + ("; slowed by the workers" if self.training_slowed else "")
            )
        if self.dataset is not None:
            lines.append(f"  dataset     {self.dataset}")
        if self.mode_reason:
            lines.append(f"  mode        {self.mode}: {self.mode_reason}")
        if self.advice:
            lines.append(f"  advice      {self.advice}")
        return "\n".join(lines)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


#: Steps of each kind (workers running, workers idle) needed before they are compared.
MIN_STEPS = 8
#: How much slower the training thread's steps must be while workers run to count as slowed.
STEP_SLOWDOWN = 1.2
#: ... and by at least this many seconds: a few microseconds of noise on a tiny step is not it.
STEP_SLOWDOWN_MIN_S = 20e-6
#: ... and the time lost over the busy steps must be at least this share of the epoch's wall
#: time: a loop that does almost nothing between batches loses nothing worth a helper process.
STEP_LOSS_SHARE = 0.05


def step_slowed(
    busy_s: float, steps_busy: int, idle_s: float, steps_idle: int, wall_s: float
) -> bool:
    """Whether the training loop's own steps were slower while worker threads ran.

    Steps are the times between ``next()`` calls. On a GIL build a worker thread running Python
    code takes the GIL from the training thread, whose step (launching kernels, the optimizer's
    Python) then takes longer; while the prefetched batches are all made and the workers idle,
    it runs at its own pace. Helper processes leave it that pace.

    Args:
        busy_s: mean step while a worker ran, in seconds.
        steps_busy: how many such steps.
        idle_s: mean step while every worker was idle, in seconds.
        steps_idle: how many such steps.
        wall_s: the epoch's wall time so far, in seconds.

    Returns:
        True when both kinds were seen ``MIN_STEPS`` times and the busy ones were at least
        ``STEP_SLOWDOWN`` times, and ``STEP_SLOWDOWN_MIN_S`` seconds, longer, losing at least
        ``STEP_LOSS_SHARE`` of the wall time in all.
    """
    if steps_busy < MIN_STEPS or steps_idle < MIN_STEPS:
        return False
    lost = (busy_s - idle_s) * steps_busy
    return (
        busy_s > STEP_SLOWDOWN * idle_s
        and busy_s - idle_s > STEP_SLOWDOWN_MIN_S
        and lost >= STEP_LOSS_SHARE * wall_s
    )


class EpochStats:
    """The live counters of one epoch; ``snapshot()`` turns them into a ``LoaderStats``.

    Written by the training thread (``on_next``) and by each fetching thread (its own
    ``StageRecorder``). Holds no reference to the iterator, so the loader may keep it.
    """

    def __init__(self, num_workers: int, log_every_s: float | None = None) -> None:
        self.workers = [StageRecorder(f"worker{i}") for i in range(num_workers)]
        self.caller = StageRecorder("caller")
        self.num_workers = num_workers
        self.controller: ConcurrencyController | None = None  # set by the threaded iterator
        self.dataset: Any = None  # isolation: the helper's dataset stats() (LoaderStats.dataset)
        # Set by the threaded iterator: how many worker threads run a task right now.
        self.workers_active: Callable[[], int] | None = None
        self._last_return: float | None = None  # when next() last returned a batch
        self._busy_at_return = False
        self._step_n = [0, 0]  # steps with the workers [idle, running]
        self._step_s = [0.0, 0.0]  # their seconds
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()
        self._wait = 0.0
        self._nexts = 0
        self._ready = 0
        self._batches = 0
        self._caller_batches = 0
        self._log_every = log_every_s
        self._last_log = self._start
        self._end: float | None = None  # the epoch's end: wall time stops there
        self._cpu_end = 0.0  # process CPU time at _end
        # With device=, the loop waits on the transfer stage, not on the epoch iterator (which
        # the transfer thread drains): then this, not _wait, is the loop's data wait.
        self._consumer_wait: float | None = None
        self._consumer_batches = 0

    def on_call(self) -> None:
        """Record the training loop's step that ends as it calls ``next()`` (``step_slowed``).

        Called by the training thread only, first thing in ``next()``.
        """
        active, last = self.workers_active, self._last_return
        if active is None or last is None:
            return
        step = time.perf_counter() - last
        busy = active() > 0
        if busy == self._busy_at_return:  # the same at both ends: count it as that kind
            with self._lock:
                self._step_n[busy] += 1
                self._step_s[busy] += step

    def on_next(
        self, waited: float, ready: bool, ran_here: bool, delivered: bool, ended: bool
    ) -> None:
        """Record one ``next()`` call of the epoch iterator.

        Args:
            waited: seconds the call took.
            ready: its batch was made before the call asked for it.
            ran_here: the calling thread made the batch itself.
            delivered: it returned a batch (False: raised).
            ended: it raised ``StopIteration``: the epoch's clocks stop here, unless a device
                stage consumes the epoch (then the loop's own ``StopIteration`` stops them).
        """
        with self._lock:
            self._wait += waited
            self._nexts += 1
            self._ready += ready
            self._batches += delivered
            self._caller_batches += ran_here
            if ended and self._consumer_wait is None:
                self._mark_end()
        active = self.workers_active
        if active is not None:
            self._busy_at_return = active() > 0
            self._last_return = time.perf_counter() if delivered else None
        if self._log_every is not None:
            now = time.perf_counter()
            if now - self._last_log >= self._log_every:
                self._last_log = now
                s = self.snapshot()
                logger.info(
                    "threadloader: %d batches, %.1f batches/s, data wait %.1f%%, %d/%d fetching",
                    s.batches,
                    s.batches / s.wall_s if s.wall_s else 0.0,
                    100 * s.wait_fraction,
                    s.concurrency_limit,
                    s.num_workers,
                )

    def attach_consumer(self) -> None:
        """A device stage consumes this epoch: the loop's waits and end are its (``device=``)."""
        with self._lock:
            self._consumer_wait = 0.0

    def on_consumer_wait(self, waited: float, delivered: bool, ended: bool) -> None:
        """Record the training loop's wait for one batch from the device stage."""
        with self._lock:
            self._consumer_wait = (self._consumer_wait or 0.0) + waited
            self._consumer_batches += delivered
            if ended:
                self._mark_end()

    def _mark_end(self) -> None:  # holding _lock
        if self._end is None:
            self._end, self._cpu_end = time.perf_counter(), time.process_time()

    def snapshot(self) -> LoaderStats:
        with self._lock:
            if self._end is not None:
                end, cpu_end = self._end, self._cpu_end
            else:
                end, cpu_end = time.perf_counter(), time.process_time()
        wall = max(end - self._start, 1e-9)
        cpu = (cpu_end - self._cpu_start) / wall
        merged: dict[str, tuple[int, float, list[float]]] = {}
        for rec in [*self.workers, self.caller]:
            for stage, (count, total, recent) in rec.read().items():
                c, t, r = merged.get(stage, (0, 0.0, []))
                merged[stage] = (c + count, t + total, r + recent)
        stages = {
            name: StageStats(
                count=c,
                total_s=t,
                mean_s=t / c if c else 0.0,
                p50_s=_percentile(r, 0.5),
                p90_s=_percentile(r, 0.9),
                p99_s=_percentile(r, 0.99),
            )
            for name in STAGES
            if name in merged
            for c, t, r in [merged[name]]
        }
        worker_busy = tuple(w.busy() for w in self.workers)
        with self._lock:
            wait, nexts, ready = self._wait, self._nexts, self._ready
            batches, caller_batches = self._batches, self._caller_batches
            if self._consumer_wait is not None:
                wait, batches = self._consumer_wait, self._consumer_batches
            idle_n, busy_n = self._step_n
            idle_t, busy_t = self._step_s
        step_busy = busy_t / busy_n if busy_n else 0.0
        step_idle = idle_t / idle_n if idle_n else 0.0
        controller = self.controller
        gil_bound = is_gil_bound(
            num_workers=self.num_workers,
            cores=_cores(),
            cpu_cores_used=cpu,
            busy_threads=sum(worker_busy) / wall,
            alone_is_best=controller is not None and controller.threads_do_not_help(),
        )
        return LoaderStats(
            batches=batches,
            wall_s=wall,
            wait_s=wait,
            wait_fraction=min(wait / wall, 1.0),
            ready_fraction=ready / nexts if nexts else 0.0,
            stages=stages,
            worker_busy_s=worker_busy,
            caller_busy_s=self.caller.busy(),
            batches_run_by_caller=caller_batches,
            num_workers=self.num_workers,
            concurrency_limit=controller.limit if controller is not None else 0,
            cpu_cores_used=cpu,
            gil_bound=gil_bound,
            advice=_advice(gil_bound, wait / wall, stages),
            step_busy_s=step_busy,
            step_idle_s=step_idle,
            steps_busy=busy_n,
            steps_idle=idle_n,
            training_slowed=step_slowed(step_busy, busy_n, step_idle, idle_n, wall),
        )


def is_gil_bound(
    *,
    num_workers: int,
    cores: int,
    cpu_cores_used: float,
    busy_threads: float,
    alone_is_best: bool,
) -> bool:
    """The ``gil_bound`` verdict on an epoch's numbers (the rule in the module docstring).

    Args:
        num_workers: the loader's worker threads; fewer than 2 cannot take turns.
        cores: the CPUs the process may use; on one, threads cannot run together anyway.
        cpu_cores_used: process CPU time over wall time.
        busy_threads: the workers' summed busy time over wall time.
        alone_is_best: the concurrency controller settled on the training thread alone.
    """
    cpu_low, cpu_high = GIL_CPU_RANGE
    busy_but_one_core = busy_threads > GIL_BUSY_THREADS and cpu_cores_used >= cpu_low
    return (
        num_workers >= 2
        and cores >= 2
        and cpu_cores_used <= cpu_high  # a dataset using several cores is not GIL-bound
        and (alone_is_best or busy_but_one_core)
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _advice(gil_bound: bool, wait_fraction: float, stages: dict[str, Any]) -> str | None:
    if gil_bound and wait_fraction > 0.1:
        return (
            "the dataset holds the GIL: worker threads take turns instead of running together. "
            "Move per-item work into numpy/torch/PIL calls that release the GIL, batch it in "
            "__getitems__, or pass isolation='process' so the workers' Python runs in a helper "
            "process and leaves the training thread's GIL alone."
        )
    if wait_fraction > 0.2 and stages:
        slowest = max(stages, key=lambda k: stages[k].total_s)
        return f"the loop waits for data {wait_fraction:.0%} of the time; the slowest stage is {slowest}"
    return None
