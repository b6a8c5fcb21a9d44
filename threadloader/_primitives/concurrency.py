"""How many worker threads may fetch at once: a gate, and the controller that sets its limit.

Worker threads only pay off when the dataset lets them overlap: decoding JPEGs or copying large
arrays releases the GIL and scales with threads; slicing token windows or running Python
transforms holds it, and then several threads contending for the GIL are slower than one
(measured on 2 cores: two threads each fetching 16-window batches took 880 us a batch, one
thread alone 250 us). The loader cannot know in advance which kind a dataset is, so it measures.

The controller watches the rate at which the training loop receives batches and hill-climbs the
number of worker threads allowed to fetch at once: it probes one fewer, keeps the lower limit
when the rate holds up (fewer threads also leave more of the GIL to the training loop), probes
one more from time to time, and keeps the higher limit only when the rate clearly improves.
With a limit of 0 (map-style datasets only) the training thread fetches every batch itself when
it asks for it: num_workers=0 speed, with no thread hand-off at all. Batches and their order never
depend on the limit: it only decides *which thread* runs a worker's next task, not which task.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

#: A window is at least this long and this many batches before its rate counts.
WINDOW_S = 0.02
WINDOW_BATCHES = 8
#: The first window (the starting limit, before any probe) may be this short: it is only
#: compared with the far extreme, where a wrong call costs one probe later, while 20 ms of two
#: threads contending for the GIL cost as much as 50 batches of cheap token windows.
FIRST_WINDOW_S = 0.005
#: Keep a lower limit when its rate is at least this fraction of the current one.
KEEP_LOWER = 0.95
#: Keep a higher limit only when its rate is at least this multiple of the current one.
KEEP_HIGHER = 1.08
#: Windows between probes once the limit has settled: starts short, doubles after each probe
#: that changed nothing, up to the maximum (40 windows: 0.8 s when batches are fast).
#: Starting at 4 rather than 2 windows: token windows +1.7% over 1,400 batches (three probes
#: in the first 0.4 s became two), images unchanged within noise (5 interleaved rounds each).
SETTLE_WINDOWS_MIN = 4
SETTLE_WINDOWS_MAX = 40
#: Windows ignored at the start: workers are still starting, and the training thread runs the
#: first batches itself, which would make the initial limit look better than it is.
WARMUP_WINDOWS = 0
#: A probe that is clearly losing ends before its window is full: once it has delivered
#: ``EARLY_BATCHES`` batches over at least ``EARLY_S`` seconds at under ``EARLY_REJECT`` times
#: the settled limit's rate. Probing costs only while it lasts, and most probes lose (measured on
#: tokens: one worker next to the training thread halves the rate, and a full 20 ms window of
#: that cost ~4% of a 0.5 s run; with 32 threads reading 16 objects of 10 ms each, a probe to 0
#: makes the training thread read a whole batch alone, 160 ms, so one batch must suffice).
EARLY_BATCHES = 1
EARLY_S = 0.004
EARLY_REJECT = 0.8
#: After a probe lost, the next one waits at least this many times the time it lost (its
#: length times the fraction of the settled rate it missed), so that probing costs ~1/PROBE_BUDGET
#: of the time however slow batches are. Token windows: a probe of one worker next to the
#: training thread lasts ~5 ms at 40% of the rate, so the next waits >= 0.6 s (with a budget on
#: probe length, 20x: 0.1 s, and probes cost 2% of the first 0.4 s). 200, not 100: the estimate
#: misses what contention costs after the probe, while the batches it started drain (pure
#: Python: a probe estimated at 4 ms lost took 5-20 ms more than the training thread alone).
PROBE_BUDGET = 200
#: Each probe lost in a row doubles the budget the next one waits for, up to this multiple of
#: PROBE_BUDGET; a probe that wins starts again at 1. A workload that does not change keeps
#: losing the same probe: pure Python items, one worker next to the training thread, lost ~5 ms
#: a probe, one every ~0.9 s (-1% against DataLoader(0) over 1.7 s); spaced 2x, 4x, 8x further
#: each time, probing costs less the longer the run, and a changed workload is still noticed
#: within ~10 s (a 5 ms loss at 8x waits 8 s).
BACKOFF_MAX = 8
#: The first probe down waits until the run has lasted this many fetch times (the mean wall time
#: of a batch's fetch, measured). A probe to fewer threads costs about two of them: the batches in
#: flight drain, then the training thread makes one alone (6 threads sleeping ~1 ms an item with a
#: 10 ms GPU step: 146 ms fetches, a probe to 0 lost 285 ms, which in an 80-step first epoch made
#: the loop wait 1.4x as long as DataLoader's). After 40 fetch times it costs ~5% of the run so far,
#: less as the run goes on. Cheap fetches probe as soon as before (pure-Python items: 2.4 ms
#: fetches, first window at 0.16 s).
FIRST_PROBE_FETCHES = 40
#: A probe still running when its epoch ends is judged on its partial window if it holds at
#: least this many batches (``next_epoch``); with fewer, the next epoch starts at the settled limit.
CONCLUDE_BATCHES = 4
#: A new epoch carries the last one's rates on (``next_epoch``) only while its first window runs
#: within this factor of the carried rate at the same limit. Beyond it the data changed (the
#: second epoch reads a cache the first one filled: 32 threads reading objects over HTTP, then
#: from local files) and the epoch learns afresh, far extreme first: with the carried schedule
#: it stayed at 32 threads, whose last lost probe had pushed the next one 30 s away (epoch 2
#: 0.74 s; learning afresh, 0.37 s).
CHANGED_RATE = 1.5
#: Fewer threads can only help when the fetching threads contend for the GIL, which needs the
#: GIL held most of the time: the fetches together use at least a core. Below this many cores
#: of fetch CPU time (threads mostly waiting on I/O: object storage, HTTP), no probe goes down...
CONTENDED_CORES = 0.5
#: ... unless the fetches themselves hardly wait: at least this fraction of their wall time is
#: CPU time. Then they use little CPU per second only because they are cheap, and handing each
#: batch from a worker to the training thread is what bounds the rate; the training thread alone
#: skips the hand-off (measured on 2 cores: four cheap items a batch, 27 us a batch through two
#: workers, 10 us made by the training thread; fetching used 0.1 cores, so no probe went down).
BUSY_FETCH = 0.5
#: Nor while the fetching threads already run in parallel: using at least this fraction of the
#: cores they could use (one each, up to the machine's), they do not take turns at the GIL
#: (measured on 2 cores: JPEG decode and numpy tensors use 1.7-1.9 cores; token windows and
#: pure Python, which hold the GIL, 1.0).
PARALLEL_FRACTION = 0.75


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        affinity = os.sched_getaffinity(0)
        if affinity:
            return len(affinity)
    return os.cpu_count() or 1


class ConcurrencyController:
    """Hill-climbs the gate's limit on the rate at which batches reach the training loop.

    Called from the thread that takes the batches (the training thread, or the transfer
    thread of a loader with ``device=``) and from the training thread at the next ``iter()``
    (``next_epoch``), which may run while an older iterator's transfer thread still takes
    batches: a lock serialises them.

    Args:
        maximum: the number of worker threads.
        minimum: the lowest limit allowed: 0 when the training thread can run tasks itself
            (map-style datasets), else 1.
        clock: a monotonic clock in seconds (tests pass a fake one).
        initial: the limit to start at (clamped to ``[minimum, maximum]``); ``None`` starts
            at ``maximum``. A later epoch of the same loader gets its controller from
            ``next_epoch()`` instead, which also carries the rates measured.
        cpus: the CPUs the process may use (default ``os.cpu_count()``).
    """

    def __init__(
        self,
        maximum: int,
        minimum: int,
        clock: Callable[[], float] = time.perf_counter,
        initial: int | None = None,
        cpus: int | None = None,
    ) -> None:
        self.maximum = maximum
        self.cpus = cpus or usable_cpus()
        self.minimum = min(minimum, maximum)
        self.limit = maximum if initial is None else max(self.minimum, min(initial, maximum))
        self._clock = clock
        self._window_start: float | None = None
        self._window_batches = 0
        self._window_latency = 0.0  # longest start-to-delivery time of a batch in the window
        self._window_cpu = 0.0  # CPU seconds the window's batches took to fetch
        self._window_wall = 0.0  # wall seconds they took (when told)
        self._cores: float | None = None  # fetch CPU seconds per second, last window (if told)
        self._busy: float | None = None  # fetch CPU seconds per fetch wall second (if told)
        self._fetch_s: float | None = None  # mean wall seconds of a fetch, last window (if told)
        self._started = clock()  # the run's start: next_epoch carries it on
        self._probe_started = 0.0
        self._next_probe_at = 0.0  # no periodic probe before this time (the probing budget)
        self._changed_at = float("-inf")  # when the limit last changed (the clock's time)
        self._rates: dict[int, float] = {}
        self._window_s: dict[int, float] = {}  # how long the window behind each rate lasted
        self._settled_at = self.limit  # the limit we return to after a probe
        self._probing = False
        self._windows_since_probe = 0
        self._settle_windows = SETTLE_WINDOWS_MIN
        self._backoff = 1  # the multiple of PROBE_BUDGET the next lost probe is charged at
        self._first_probe = True  # no probe judged yet (next_epoch's controllers: False)
        self._carried: float | None = None  # next_epoch: the carried rate at the start limit
        self._warmup = WARMUP_WINDOWS
        self._direction = -1  # probe down first: fewer threads is the cheaper answer
        self._alone_won = False  # the last comparison of limit 0 with 1 favoured 0
        self._last_batch_at: float | None = None  # when the last counted batch arrived
        self._lock = threading.Lock()

    def on_batch(
        self, started: float | None = None, cpu: float | None = None, wall: float | None = None
    ) -> int | None:
        """Count one delivered batch; returns the new limit when it changes, else None.

        Args:
            started: when the batch's fetch began, on this controller's clock. A batch begun
                before the limit last changed was made under the old limit and is not counted:
                right after a probe to fewer threads, the batches the other threads had already
                made arrive at once and would make the probe look fast (with 32 threads reading
                objects at 10 ms each, a probe to 0 was kept on the strength of them). A window
                therefore starts only once the stale batches have all been delivered.
            cpu: the CPU time (``time.thread_time``) the fetching thread spent on the batch;
                with it, no probe goes down while fetching uses under ``CONTENDED_CORES``...
            wall: ... and the wall time the fetch took: unless it was nearly all CPU time
                (``BUSY_FETCH``), cheap fetches rather than waiting ones.
        """
        with self._lock:
            return self._count(started, cpu, wall)

    def _count(self, started: float | None, cpu: float | None, wall: float | None) -> int | None:
        now = self._clock()
        if started is not None and started < self._changed_at:
            # The window restarts here: a fresh batch is timed from the last stale one, so the
            # first fresh batch already measures the new limit (and fresh batches delivered
            # between stale ones are not timed over the stale ones' gaps).
            self._open_window(now)
            return None
        if self._window_start is None:
            self._window_start = now
            return None
        self._window_batches += 1
        self._last_batch_at = now
        if started is not None and now - started > self._window_latency:
            self._window_latency = now - started
        if cpu is not None:
            self._window_cpu += cpu
            if wall is not None:
                self._window_wall += wall
        elapsed = now - self._window_start
        # A window spans two batch latencies at least: batches that each wait on many reads
        # arrive in bursts, and a shorter window measures a burst or the gap after one.
        shortest = max(WINDOW_S if self._rates else FIRST_WINDOW_S, 2 * self._window_latency)
        if (elapsed < shortest or self._window_batches < WINDOW_BATCHES) and not (
            self._probing and self._losing(elapsed)
        ):
            return None
        rate = self._window_batches / elapsed
        if self._window_cpu:
            self._cores = self._window_cpu / elapsed
            self._busy = self._window_cpu / self._window_wall if self._window_wall else None
        if self._window_wall:
            self._fetch_s = self._window_wall / self._window_batches
        self._open_window(now)
        return self._decide(rate, elapsed)

    def _open_window(self, start: float | None) -> None:
        """Start a new measuring window at ``start`` (None: at the next counted batch)."""
        self._window_start = start
        self._window_batches = 0
        self._window_latency = 0.0
        self._window_cpu = 0.0
        self._window_wall = 0.0

    def _contended(self) -> bool:
        """Whether the fetching threads may be taking turns at the GIL (worth fewer of them)."""
        if self._cores is None:
            return True  # not told the CPU time: let the rates decide
        if self._cores < CONTENDED_CORES:
            # Either they mostly wait (I/O: there is no contention to relieve), or each fetch
            # is cheap and hand-offs bound the rate: then let the rates decide.
            return self._busy is not None and self._busy >= BUSY_FETCH
        fetching = self.limit + (1 if self.minimum == 0 else 0)  # the training thread helps
        return self._cores < PARALLEL_FRACTION * min(fetching, self.cpus)

    @property
    def settled(self) -> int:
        """The limit the controller returns to between probes (what an epoch has learned)."""
        return self._settled_at

    def _losing(self, elapsed: float) -> bool:
        """Whether the probe running now is already clearly worse than the settled limit."""
        if self._window_batches < EARLY_BATCHES or elapsed < EARLY_S:
            return False
        if elapsed < 2 * self._window_latency and self.limit > 0:
            # Slow batches arrive in bursts (one late batch holds back those ordered after
            # it): judge only a window that spans two of them. Not at 0: the training thread
            # makes every fresh batch itself, one after the other, so there are no bursts, and
            # waiting two of its batches cost most (32 threads reading 10 ms objects over HTTP:
            # a batch alone is 160 ms, and the probe lasted 0.7 s at ~3% of the rate).
            return False
        base = self._rates.get(self._settled_at)
        return base is not None and self._window_batches / elapsed < base * EARLY_REJECT

    def threads_do_not_help(self) -> bool:
        """True when the training thread fetching alone beat every measured number of workers.

        That is the GIL-bound signature: with a limit of 1 the training thread still runs the
        batches the worker has not started, so two threads fetch; only at 0 is it one. It is
        what the controller settled on that counts, not the limit of a probe running now.
        """
        return self.minimum == 0 and self._settled_at == 0 and self._alone_won

    def _decide(self, rate: float, elapsed: float) -> int | None:
        if self._warmup:
            self._warmup -= 1
            return None
        carried, self._carried = self._carried, None
        if carried is not None and not carried / CHANGED_RATE <= rate <= carried * CHANGED_RATE:
            self._forget()  # the data changed since the last epoch: learn afresh
        self._rates[self.limit] = rate
        self._window_s[self.limit] = elapsed
        if self._probing:
            lower = self.limit < self._settled_at
            if self._judge_probe(rate):
                return self._probe(-1 if lower else +1)  # keep walking the same way
            return self._set(self._settled_at)
        self._windows_since_probe += 1
        if len(self._rates) == 1:
            # First probe: the other extreme. Rates are often flat between neighbours (with
            # the training thread helping, 1 worker and 2 contend alike for the GIL; with 32
            # threads, the batches of gated workers wait for the training thread in turn) and
            # only the minimum differs, so stepping would stop on the plateau (cached reads,
            # 32 threads: 594 batches/s, 16: 291, the training thread alone: 4,344).
            self._windows_since_probe = 0
            far = self.minimum if self.limit != self.minimum else self.maximum
            if far < self.limit and not self._far_probe_affordable():
                return None  # the next window asks again
            return self._probe(far - self.limit)
        if (
            self._windows_since_probe >= self._settle_windows
            and self._clock() >= self._next_probe_at
        ):
            self._windows_since_probe = 0
            changed = self._probe(self._direction)
            if changed is None:
                changed = self._probe(-self._direction)
            return changed
        return None

    def _far_probe_affordable(self) -> bool:
        """Whether the run has lasted ``FIRST_PROBE_FETCHES`` fetch times (always, if not told)."""
        if self._fetch_s is None:
            return True
        return self._clock() - self._started >= FIRST_PROBE_FETCHES * self._fetch_s

    def _judge_probe(self, rate: float) -> bool:
        """End the probe running now, measured at ``rate``: whether its limit is kept.

        Kept, it becomes the settled limit; lost, the next probe goes the other way, later.
        Either way the loser's time is charged to the probing budget (``_charge``).
        """
        self._probing = False
        self._rates[self.limit] = rate
        base = self._rates.get(self._settled_at, 0.0)
        lower = self.limit < self._settled_at
        if lower:
            # Against the best rate seen at any higher limit, not only the settled one:
            # else losses within KEEP_LOWER compound, one step down after another.
            base = max((r for k, r in self._rates.items() if k > self.limit), default=base)
        keep = rate >= base * (KEEP_LOWER if lower else KEEP_HIGHER)
        if self.limit == 0 or self._settled_at == 0:
            # A comparison between the training thread alone and with workers.
            self._alone_won = keep if self.limit == 0 else not keep
        first, self._first_probe = self._first_probe, False
        if keep:
            self._backoff = 1
            if lower:  # the higher limit, measured before, lost: charge that as a probe
                self._charge(self._settled_at, rate, self._window_s.get(self._settled_at, 0.0))
                if first:  # the starting limit's window lost: the first of a row (BACKOFF_MAX)
                    self._backoff = 2
            self._settled_at = self.limit
            self._settle_windows = SETTLE_WINDOWS_MIN
            return True
        self._direction = +1 if lower else -1
        self._windows_since_probe = 0
        self._settle_windows = min(2 * self._settle_windows, SETTLE_WINDOWS_MAX)
        settled_rate = self._rates.get(self._settled_at, 0.0)
        self._charge(self.limit, settled_rate, self._clock() - self._probe_started)
        self._backoff = min(2 * self._backoff, BACKOFF_MAX)
        return False

    def next_epoch(self) -> ConcurrencyController:
        """A controller for the next epoch of the same loader, carrying on what this one learned.

        It starts at the settled limit, or at the probe's when the probe running now has
        already beaten it over ``CONCLUDE_BATCHES`` batches: an epoch of 32 cheap batches ends
        before a 20 ms window fills, and each epoch would start at the maximum and pay for the
        same probe again (token windows, 32-batch epochs: 400 us a batch against DataLoader(0)'s
        240). The rates measured, the probing budget and the next direction carry on too, so
        the new epoch does not probe the far extreme again first, unless its first window runs
        at a rate ``CHANGED_RATE`` away from the carried one: then the data changed, and it
        starts learning afresh. A copy: two iterators of one loader never share a controller.
        """
        with self._lock:
            return self._next()

    def _next(self) -> ConcurrencyController:
        last = self._last_batch_at
        start = self._window_start
        if (
            self._probing
            and start is not None
            and last is not None
            and last > start
            and self._window_batches >= CONCLUDE_BATCHES
        ):
            self._judge_probe(self._window_batches / (last - start))
        nxt = type(self)(
            self.maximum, self.minimum, clock=self._clock, initial=self._settled_at, cpus=self.cpus
        )
        nxt._rates = dict(self._rates)
        nxt._window_s = dict(self._window_s)
        nxt._settle_windows = self._settle_windows
        nxt._backoff = self._backoff
        nxt._first_probe = False
        nxt._carried = nxt._rates.get(nxt.limit)
        nxt._next_probe_at = self._next_probe_at
        nxt._direction = self._direction
        nxt._alone_won = self._alone_won
        nxt._cores, nxt._busy, nxt._fetch_s = self._cores, self._busy, self._fetch_s
        nxt._started = self._started
        return nxt

    def _forget(self) -> None:
        """Drop the rates and probe schedule carried from the last epoch (``CHANGED_RATE``)."""
        self._rates.clear()
        self._window_s.clear()
        self._next_probe_at = 0.0
        self._settle_windows = SETTLE_WINDOWS_MIN
        self._backoff = 1
        self._direction = -1
        self._windows_since_probe = 0
        self._first_probe = True

    def _charge(self, loser: int, winning_rate: float, seconds: float) -> None:
        """Space the next probe by what ``seconds`` at ``loser`` lost (``PROBE_BUDGET``, backed off).

        Also when ``loser`` was the starting limit and a probe beat it: its first window was a
        probe in all but name (token windows: 6 ms at a third of the training thread's rate, so
        the first probe of one worker waits ~0.8 s at PROBE_BUDGET = 200, rather than 80 ms).
        """
        rate = self._rates.get(loser, 0.0)
        missed = 1.0 - rate / winning_rate if winning_rate > 0 else 1.0
        lost = seconds * min(max(missed, 0.0), 1.0)
        budget = PROBE_BUDGET * self._backoff
        self._next_probe_at = max(self._next_probe_at, self._clock() + budget * lost)

    def _probe(self, step: int) -> int | None:
        target = self.limit + step
        if step == 0 or not self.minimum <= target <= self.maximum:
            return None
        if step < 0 and not self._contended():
            return None
        self._probing = True
        self._direction = 1 if step > 0 else -1
        self._probe_started = self._clock()
        return self._set(target)

    def _set(self, limit: int) -> int | None:
        if limit == self.limit:
            return None
        self.limit = limit
        self._changed_at = self._clock()
        self._open_window(None)  # the next fresh batch starts one
        return limit
