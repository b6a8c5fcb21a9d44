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
   items held the GIL, or the workers slowed the training step), and the rest of the epoch, at
   the pace so far, lasts at least ``MIN_REMAINING_S``: long enough to win back starting the
   helpers (20-50 ms each, forked).
3. The helpers are forked from this process, which must then run no Python thread but the
   training thread and the workers about to be joined. Forked, a helper carries on each of its
   workers as they are: its dataset copy, generators, ``worker_init_fn``'s work and fetcher,
   nothing pickled and nothing run again. So batches, their order, which worker made each, the
   workers' random draws and ``state_dict()`` are what the epoch would have given in threads.
   Where forking is not safe, nothing moves; the check repeats (a thread may end). The first
   time the move is due but forking is not safe, the forkserver later epochs' helpers would
   come from starts (``auto`` point 5).
4. Moving: nothing more is dispatched; the batches in flight are delivered; the worker threads
   are joined; the helpers start and the epoch goes on as an ``isolation="process"`` epoch
   (``IsolatedDataLoaderIter.take_over``). If a thread appeared while joining, or a helper
   fails to start (with a ``RuntimeWarning`` naming why), the epoch goes on here instead, the
   training thread making every batch, as it does when it alone is fastest.
5. ``stats().mode`` says ``"process"`` from the move on, and ``mode_reason`` when and why it
   moved. Later epochs start in helpers and follow ``auto``'s rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

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

#: The epoch runs this long (seconds) before a move is considered: the concurrency controller
#: settles in 0.1-0.3 s, and what it settles on is half of the GIL-bound signal.
MEASURE_S = 0.5
#: The move is considered at most this often (it reads the epoch's stats).
CHECK_EVERY_S = 0.25
#: The rest of the epoch must last at least this long (seconds, at the pace so far).
MIN_REMAINING_S = 1.0


def mover_for(
    loader: Any,
    epoch: ThreadedDataLoaderIter,
    on_move: Callable[[Choice, LoaderStats, LoaderStats], None],
    pickling_problem: Callable[[], str | None],
    warm_up: Callable[[], None],
) -> MidEpochMove | None:
    """A ``MidEpochMove`` for ``epoch`` when point 1 allows one, else None.

    Args:
        loader: the ``ThreadDataLoader``.
        epoch: its first epoch's threaded iterator.
        on_move: called once it moved, with the ``Choice``, the stats when the move was decided
            and those when it began (the batches in flight delivered).
        pickling_problem: what a helper could not receive pickled, or None (point 1).
        warm_up: starts the forkserver later epochs' helpers would come from (point 3).
    """
    if (
        loader.persistent_workers
        or options_of(loader).device is not None  # its transfer thread: no fork
        or too_few_to_help(loader)
        or start_method(loader.multiprocessing_context) not in (None, "fork")
        or not epoch.makes_batches_itself
    ):
        return None
    return MidEpochMove(helper_count(loader), on_move, pickling_problem, warm_up)


class MidEpochMove:
    """Moves one threaded epoch's workers into ``helpers`` forked helpers (module docstring).

    Args:
        helpers: how many helper processes.
        on_move: called once moved, with the ``Choice``, the epoch's stats when the move was
            decided and those when it began (the batches in flight delivered).
        pickling_problem: what a helper could not receive pickled, or None.
        warm_up: starts the forkserver later epochs' helpers would come from; called once.
        clock: a monotonic clock in seconds.
    """

    def __init__(
        self,
        helpers: int,
        on_move: Callable[[Choice, LoaderStats, LoaderStats], None],
        pickling_problem: Callable[[], str | None],
        warm_up: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._helpers = helpers
        self._on_move = on_move
        self._pickling_problem = pickling_problem
        self._warm_up: Callable[[], None] | None = warm_up
        self._clock = clock
        self._next_check = 0.0
        self._signal = ""
        self._stats: LoaderStats | None = None

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
        if not zygote.may_fork(besides=epoch.pool.alive_threads):
            warm_up, self._warm_up = self._warm_up, None
            if warm_up is not None:
                warm_up()
            return False
        try:
            remaining = len(epoch) - epoch.delivered
        except TypeError:  # a sampler without a length
            return False
        if remaining * stats.wall_s / stats.batches < MIN_REMAINING_S:
            return False
        if self._pickling_problem() is not None:
            epoch.mover = None  # it never will be picklable: stop asking
            return False
        self._signal, self._stats = signal, stats
        return True

    def move(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Join the threads and carry the workers on in helpers (point 4); False: declined."""
        if not zygote.may_fork(besides=epoch.pool.alive_threads):
            return False  # a thread started since: stay in threads
        began = epoch.stats_so_far()  # the batches in flight were delivered: helpers' from here
        epoch.join_threads()
        if not zygote.may_fork():
            return False  # the training thread makes every batch from here on
        try:
            IsolatedDataLoaderIter.take_over(epoch, self._helpers)
        except Exception as exc:  # noqa: BLE001  # the epoch goes on in this process
            warn_user(
                f"threadloader: isolation='auto' could not start helper processes mid-epoch "
                f"({one_line(exc)}); the epoch goes on in this process",
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
        self._on_move(choice, self._stats, began)
        return True
