"""``isolation="auto"`` within its first epoch: moving the worker threads into helpers mid-epoch.

``auto`` decides each epoch from the one before (``auto``), so its first epoch runs in threads
to the end. A run of one long epoch (pretraining over a token stream, a single pass over a large
dataset) would never move. This module moves it once the epoch has measured enough. Where the
code disagrees with these rules, the code is wrong.

1. Only the first epoch of an ``"auto"`` loader, when ``auto``'s own rules would move the next
   one anyway (point 4 there): not with persistent workers, fewer than 2 workers or 2 usable
   CPUs, a ``multiprocessing_context`` other than ``fork``, or a dataset, ``collate_fn`` or
   ``worker_init_fn`` that cannot be pickled (checked once the move would be due: the later
   epochs' helpers may have to receive them pickled); and only for an epoch whose training
   thread can make any batch itself (map-style, ``in_order=True``, no ``timeout``:
   ``threaded`` point 7).
2. After each batch, at most every ``CHECK_EVERY_S``, once the epoch has run ``MEASURE_S``: the
   move is due when the epoch so far shows what moves the next epoch (``auto`` point 2: the
   items held the GIL, or the workers slowed the training step), helpers can start now (point
   3), and the rest of the epoch, at the pace so far, lasts at least ``MIN_REMAINING_S`` plus,
   for helpers that are not forked, the time to pickle what they receive
   (``auto.PICKLED_BYTES_PER_S``) and to run ``worker_init_fn`` again (point 3): long enough
   to win back starting them (20-50 ms each, forked or from a ready forkserver).
3. Where this process runs no Python thread but the training thread and the workers about to
   be joined, the helpers are forked from it: a helper carries on each of its workers as they
   are, its dataset copy, generators, ``worker_init_fn``'s work and fetcher, nothing pickled
   and nothing run again. Otherwise (a progress bar's monitor thread runs), unless the loader
   names ``fork``, they come from the zygote or from a forkserver once it is ready
   (``auto.AutoIsolation.unforked_start_s``, which refuses what ``auto`` point 4 refuses such
   helpers: an unguarded main script, a class of a ``__main__`` they cannot import, point 5's),
   and receive each worker pickled (``Worker.carried``): its dataset copy as it stands, with
   what the batches so far did to it, and its generators themselves. Either way, batches,
   their order, which worker made each, the workers' random draws and ``state_dict()`` are what
   the epoch would have given in threads. A ``worker_init_fn`` runs once more per worker in
   its helper, on a scratch copy with fresh generators (``CarriedWorker.adopt``), for what it
   did outside the copy (a module's global that items read); each helper's workers one after
   another, each counted at the time its run took in the threads. The first time the move is
   due but no helper can start, the forkserver starts (``auto`` point 5); the check repeats.
4. Moving: nothing more is dispatched; the batches in flight are delivered. Forked: the worker
   threads are joined and the helpers start. Pickled: the helpers start and load the workers
   while the idle threads wait, which are joined once every helper has loaded its workers.
   Then the epoch goes on as an ``isolation="process"`` epoch
   (``IsolatedDataLoaderIter.take_over``). A worker's dataset copy that cannot be pickled (a
   handle ``worker_init_fn`` or an item opened on it) keeps the epoch in its threads, as
   point 5 does; the next epoch sends the dataset as built. So does a global of the main
   script that the dataset's code reads and that cannot be sent (``main_state`` point 2). If
   a helper fails to start or to
   load its workers (a class only this process can import; ``CARRIED_WAIT_S`` passed), a
   ``RuntimeWarning`` names why and the epoch goes on in its threads; if that happens once the
   threads were joined (forked), or a thread appeared while joining them, the training thread
   makes every later batch itself, as it does when it alone is fastest.
5. Pickled, each helper may receive at most what the rest of the epoch wins back at
   ``auto.PICKLED_BYTES_PER_S`` (beyond ``MIN_REMAINING_S``; never less than the dataset once
   plus ``CARRIED_SLACK_BYTES``), and at most the dataset once plus once per worker it
   carries, plus ``CARRIED_SLACK_BYTES``: workers' copies that hold
   more (a file ``worker_init_fn`` mapped, which each helper would receive copied) stay in
   threads, checked while pickling, before anything large is copied (``PayloadTooLarge``);
   ``mode_reason`` says so, and the next epoch, which sends the dataset and runs
   ``worker_init_fn`` in the helpers, moves instead. So does a dataset whose class defines
   ``__copy__`` (its copies share process-wide state, as ``RemoteFiles``' read pool, which
   pickling would split): ``auto.unforked_start_s``.
6. ``stats().mode`` says ``"process"`` from the move on, and ``mode_reason`` when and why it
   moved. Later epochs start in helpers and follow ``auto``'s rules.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from threadloader._engine.options import options_of
from threadloader._engine.stats import LoaderStats
from threadloader._engine.threaded import ThreadedDataLoaderIter
from threadloader._primitives.warn import warn_user
from threadloader.isolation import zygote
from threadloader.isolation.auto import (
    PICKLED_BYTES_PER_S,
    PROCESS,
    Choice,
    epoch_signal,
    helper_count,
    one_line,
    too_few_to_help,
)
from threadloader.isolation.capped import PayloadTooLarge
from threadloader.isolation.helper import unpicklable
from threadloader.isolation.helper_source import start_method
from threadloader.isolation.parent import GlobalsLeftOut, IsolatedDataLoaderIter

if TYPE_CHECKING:
    from threadloader._engine.worker import CarriedWorker

#: The epoch runs this long (seconds) before a move is considered: the concurrency controller
#: settles in 0.1-0.3 s, and what it settles on is half of the GIL-bound signal.
MEASURE_S = 0.5
#: The move is considered at most this often (it reads the epoch's stats).
CHECK_EVERY_S = 0.25
#: The rest of the epoch must last at least this long (seconds, at the pace so far).
MIN_REMAINING_S = 1.0
#: Helpers that receive the workers pickled may take this long to load them (seconds), plus
#: four times what pickling the dataset and running ``worker_init_fn`` again take (points 3
#: and 4); then the epoch stays in threads.
CARRIED_WAIT_S = 10.0
#: What each helper may receive pickled beyond the dataset and its workers' copies of it
#: (point 5): what their items cached, ``worker_init_fn``'s additions.
CARRIED_SLACK_BYTES = 64 * 2**20


class MovePolicy(Protocol):
    """What a move asks of the loader's ``"auto"`` policy (``auto.AutoIsolation``)."""

    def moved(self, choice: Choice, before: LoaderStats, since: LoaderStats) -> None:
        """Record that the epoch moved: the ``Choice``, the stats when the move was decided and
        those when it began (the batches in flight delivered)."""

    def pickling_problem(self) -> str | None:
        """What a helper could not receive pickled, or None (point 1)."""

    def warm_up(self) -> None:
        """Start the forkserver later epochs' helpers would come from (point 3)."""

    def unforked_start_s(self) -> float | None:
        """Seconds that pickling what they run costs helpers that are not forked from this
        process, where such helpers can start now; else None (point 3)."""

    def declined(self, reason: str) -> None:
        """Record why a move that was due did not happen: the epoch goes on in threads."""


def mover_for(
    loader: Any, epoch: ThreadedDataLoaderIter, policy: MovePolicy
) -> MidEpochMove | None:
    """A ``MidEpochMove`` for ``epoch`` when point 1 allows one, else None.

    Args:
        loader: the ``ThreadDataLoader``.
        epoch: its first epoch's threaded iterator.
        policy: the loader's ``"auto"`` policy.
    """
    if (
        loader.persistent_workers
        or options_of(loader).device is not None  # its transfer thread: no fork
        or too_few_to_help(loader)
        or start_method(loader.multiprocessing_context) not in (None, "fork")
        or not epoch.makes_batches_itself
    ):
        return None
    return MidEpochMove(helper_count(loader), policy, loader.num_workers)


class MidEpochMove:
    """Moves one threaded epoch's workers into ``helpers`` helper processes (module docstring).

    Args:
        helpers: how many helper processes.
        policy: the loader's ``"auto"`` policy.
        workers: how many workers the epoch runs.
        clock: a monotonic clock in seconds.
    """

    def __init__(
        self,
        helpers: int,
        policy: MovePolicy,
        workers: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._helpers = helpers
        self._policy = policy
        self._workers = workers
        self._limit: int | None = None  # the most bytes each helper may receive pickled
        self._wait_s = CARRIED_WAIT_S
        self._warmed = False
        self._clock = clock
        self._next_check = 0.0
        self._signal = ""
        self._stats: LoaderStats | None = None
        self._forked = True  # whether the due move forks this process (point 3)

    def due(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Whether the epoch should move now (point 2)."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_EVERY_S
        if not epoch.workers_ready:
            return False
        stats = epoch.stats_so_far()
        if stats.wall_s < MEASURE_S or stats.batches < 1:
            return False
        signal = epoch_signal(stats, "the epoch's")
        if signal is None:
            return False
        forked = zygote.may_fork(besides=epoch.pool.alive_threads)
        start_s = 0.0 if forked else self._policy.unforked_start_s()
        if start_s is None:
            if not self._warmed:
                self._warmed = True
                self._policy.warm_up()
            return False
        rerun_s = 0.0  # each helper runs its workers' worker_init_fn again, one after another
        if not forked:
            rerun_s = math.ceil(self._workers / self._helpers) * max(
                w.init_s for w in epoch.pool.workers
            )
        try:
            remaining = len(epoch) - epoch.delivered
        except TypeError:  # a sampler without a length
            return False
        remaining_s = remaining * stats.wall_s / stats.batches
        if remaining_s < MIN_REMAINING_S + start_s + rerun_s:
            return False
        if self._policy.pickling_problem() is not None:
            epoch.mover = None  # it never will be picklable: stop asking
            return False
        self._signal, self._stats, self._forked = signal, stats, forked
        if not forked:
            budget_s = remaining_s - MIN_REMAINING_S - rerun_s
            self._limit = self._carried_limit(start_s, budget_s)
            self._wait_s = CARRIED_WAIT_S + 4 * (start_s + rerun_s)
        return True

    def _carried_limit(self, start_s: float, budget_s: float) -> int:
        """The most bytes each helper may receive pickled (point 5)."""
        helpers = self._helpers
        dataset = start_s * PICKLED_BYTES_PER_S / helpers  # the dataset, as each helper gets it
        copies = dataset * (1 + math.ceil(self._workers / helpers)) + CARRIED_SLACK_BYTES
        wins_back = budget_s * PICKLED_BYTES_PER_S / helpers
        return int(min(max(wins_back, dataset + CARRIED_SLACK_BYTES), copies))

    def move(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Carry on the workers in helpers (point 4); False: declined."""
        if self._forked:
            return self._move_forked(epoch)
        if self._policy.unforked_start_s() is None:
            return False  # the zygote exited since: a forkserver might not be ready
        began = epoch.stats_so_far()
        carried = epoch.carry_workers()
        return self._take_over(epoch, began, carried, "in its worker threads")

    def _move_forked(self, epoch: ThreadedDataLoaderIter) -> bool:
        if not zygote.may_fork(besides=epoch.pool.alive_threads):
            return False  # a thread started since: stay in threads
        began = epoch.stats_so_far()  # the batches in flight were delivered: helpers' from here
        epoch.join_threads()
        if not zygote.may_fork():
            return False  # the training thread makes every batch from here on
        return self._take_over(epoch, began, None, "in this process")

    def _take_over(
        self,
        epoch: ThreadedDataLoaderIter,
        began: LoaderStats,
        carried: list[CarriedWorker] | None,
        instead: str,
    ) -> bool:
        try:
            IsolatedDataLoaderIter.take_over(
                epoch, self._helpers, carried, limit=self._limit, wait_s=self._wait_s
            )
        except PayloadTooLarge as exc:
            self._policy.declined(
                f"{self._signal} over the first epoch's first {epoch.delivered} batches, but "
                f"{exc}, more than the rest of the epoch wins back or the dataset holds: the "
                "epoch goes on in worker threads"
            )
            return False
        except Exception as exc:  # noqa: BLE001  # the epoch goes on in this process
            script = (GlobalsLeftOut, zygote.StaleScriptCode)  # the script's state or code
            if carried is not None and (unpicklable(exc) or isinstance(exc, script)):
                what = (
                    str(exc)
                    if isinstance(exc, script)
                    else f"a worker's dataset copy cannot be pickled ({one_line(exc)})"
                )
                self._policy.declined(
                    f"{self._signal} over the first epoch's first {epoch.delivered} batches, "
                    f"but {what}: the epoch goes on in worker threads"
                )
                return False
            warn_user(
                f"threadloader: isolation='auto' could not start helper processes mid-epoch "
                f"({one_line(exc)}); the epoch goes on {instead}",
                RuntimeWarning,
            )
            return False
        assert self._stats is not None
        count = self._helpers
        choice = Choice(
            PROCESS,
            f"{self._signal} over the first epoch's first {self._stats.batches} batches "
            f"({self._stats.wall_s:.1f} s): from there on, worker threads run in {count} helper "
            f"process{'es' if count > 1 else ''}",
            helpers=count,
        )
        self._policy.moved(choice, self._stats, began)
        return True
