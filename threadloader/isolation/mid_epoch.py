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
   3), and the rest of the epoch, at the pace so far, lasts at least ``MIN_REMAINING_S`` plus
   the time to pickle what helpers that are not forked receive (``auto.PICKLED_BYTES_PER_S``):
   long enough to win back starting them (20-50 ms each, forked or from a ready forkserver).
3. Where this process runs no Python thread but the training thread and the workers about to
   be joined, the helpers are forked from it: a helper carries on each of its workers as they
   are, its dataset copy, generators, ``worker_init_fn``'s work and fetcher, nothing pickled
   and nothing run again. Otherwise (a progress bar's monitor thread runs), unless the loader
   names ``fork``, they come from the zygote or from a forkserver once it is ready (``auto.AutoIsolation.unforked_start_s``, which
   refuses what ``auto`` point 4 refuses such helpers: an unguarded main script, a class of a
   ``__main__`` they cannot import), and receive each worker pickled (``Worker.carried``): its
   dataset copy as it stands, with what ``worker_init_fn`` and the batches so far did to it,
   and its generators themselves; ``worker_init_fn`` does not run again. Either way, batches,
   their order, which worker made each, the workers' random draws and ``state_dict()`` are what
   the epoch would have given in threads. The first time the move is due but no helper can
   start, the forkserver starts (``auto`` point 5); the check repeats.
4. Moving: nothing more is dispatched; the batches in flight are delivered. Forked: the worker
   threads are joined and the helpers start. Pickled: the helpers start and load the workers
   while the idle threads wait, which are joined once every helper has loaded its workers.
   Then the epoch goes on as an ``isolation="process"`` epoch
   (``IsolatedDataLoaderIter.take_over``). If a helper fails to start or to load its workers
   (a worker's dataset copy that cannot be pickled), a ``RuntimeWarning`` names why and the
   epoch goes on in its threads; if that happens once the threads were joined (forked), or a
   thread appeared while joining them, the training thread makes every later batch itself, as
   it does when it alone is fastest.
5. ``stats().mode`` says ``"process"`` from the move on, and ``mode_reason`` when and why it
   moved. Later epochs start in helpers and follow ``auto``'s rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from threadloader._engine.options import options_of
from threadloader._engine.stats import LoaderStats
from threadloader._engine.threaded import ThreadedDataLoaderIter
from threadloader._primitives.warn import warn_user
from threadloader.isolation import zygote
from threadloader.isolation.auto import (
    PROCESS,
    Choice,
    epoch_signal,
    helper_count,
    one_line,
    too_few_to_help,
)
from threadloader.isolation.helper_source import start_method
from threadloader.isolation.parent import IsolatedDataLoaderIter

if TYPE_CHECKING:
    from threadloader._engine.worker import CarriedWorker

#: The epoch runs this long (seconds) before a move is considered: the concurrency controller
#: settles in 0.1-0.3 s, and what it settles on is half of the GIL-bound signal.
MEASURE_S = 0.5
#: The move is considered at most this often (it reads the epoch's stats).
CHECK_EVERY_S = 0.25
#: The rest of the epoch must last at least this long (seconds, at the pace so far).
MIN_REMAINING_S = 1.0


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
    return MidEpochMove(helper_count(loader), policy)


class MidEpochMove:
    """Moves one threaded epoch's workers into ``helpers`` helper processes (module docstring).

    Args:
        helpers: how many helper processes.
        policy: the loader's ``"auto"`` policy.
        clock: a monotonic clock in seconds.
    """

    def __init__(
        self,
        helpers: int,
        policy: MovePolicy,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._helpers = helpers
        self._policy = policy
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
        try:
            remaining = len(epoch) - epoch.delivered
        except TypeError:  # a sampler without a length
            return False
        if remaining * stats.wall_s / stats.batches < MIN_REMAINING_S + start_s:
            return False
        if self._policy.pickling_problem() is not None:
            epoch.mover = None  # it never will be picklable: stop asking
            return False
        self._signal, self._stats, self._forked = signal, stats, forked
        return True

    def move(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Carry on the workers in helpers (point 4); False: declined."""
        if self._forked:
            return self._move_forked(epoch)
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
            IsolatedDataLoaderIter.take_over(epoch, self._helpers, carried)
        except Exception as exc:  # noqa: BLE001  # the epoch goes on in this process
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
