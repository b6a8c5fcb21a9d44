"""``isolation="auto"``: worker threads in this process, or in helper processes when that pays.

Where the code disagrees with these rules, the code is wrong.

1. The first epoch runs its workers as threads of the training process and measures. A long
   one moves into helpers before it ends, under ``mid_epoch``'s rules (which record the move
   here, ``moved``): forked from this process, or, while it runs other Python threads, from
   the zygote or a forkserver that is ready (``unforked_start_s``).
2. Each later epoch (each ``iter()``) is decided from the previous one's ``stats()``. After an
   epoch in threads, the workers move into helper processes (``helpers`` of them, else one per
   worker up to the usable CPUs) when its items held the GIL (``LoaderStats.gil_bound``: worker
   threads took turns instead of running together) or when the training thread's own steps were
   slower while worker threads ran than while they were idle (``LoaderStats.training_slowed``)
   in a loop that waited for data less than ``MAX_WAIT_FOR_STEP`` of the time: a loop that
   mostly waits for its batches is paced by the workers, and a slower step only shortens the
   wait.
3. After an epoch in helpers, the loop's pace (batches per second of wall time, training steps
   included) is compared with the last epoch in threads: if the helpers' is below ``MOVE_BACK``
   times the threads', the workers move back to threads, and move to helpers again (point 2
   still holding) only once an epoch in threads runs at most ``1 / MOVE_BACK`` times the
   helpers' pace.
4. Nothing moves when moving would change the data or cannot help: with ``persistent_workers``
   (workers keep their dataset copy and RNG state from one epoch to the next, and new workers
   would start afresh), with fewer than 2 workers or 2 usable CPUs, after an epoch shorter than
   ``MIN_EPOCH_S`` where helpers would be forked from this process or the zygote (a few tens of
   milliseconds to start), ``MIN_EPOCH_S_SERVER`` where they would come from a forkserver that
   is not ready or spawn (a second or more: an interpreter imports torch); a shorter epoch could
   not win the start back), with a ``multiprocessing_context`` of ``fork`` while this process
   runs other Python threads, or when the dataset, ``collate_fn`` or ``worker_init_fn`` cannot
   be pickled (checked once, into a sink that keeps nothing: a helper may have to receive them
   pickled). So an unpicklable dataset never fails under ``"auto"``: it stays in threads.
   Where helpers would come from a forkserver or spawn, which import ``__main__`` afresh
   (``main_script``), nothing moves either if the main script has no
   ``if __name__ == "__main__":`` block (it would run again in them) or if what is pickled
   names a class or function of a ``__main__`` they cannot import (a notebook, ``python -c``).
   Helpers that fail to start, or to load what they run (a class from a module only this
   process can import; the epoch waits until they have loaded it: ``parent`` point 7), leave
   that epoch and every later one in threads (``helpers_failed``).
5. Where helpers would come from a forkserver (this process runs other Python threads, a
   progress bar's monitor among them, and no zygote runs), the forkserver starts once an
   epoch's measurements say the workers should move and point 4 refuses nothing but the
   epoch's length: mid-way through the first epoch (``mid_epoch`` calls ``warm_up``), or at
   the next ``iter()``. It imports the main script and torch while the epochs go on in threads,
   and once it is ready (``helper_source`` point 5) an epoch of ``MIN_EPOCH_S`` moves, plus the
   time to pickle and unpickle what the helpers run, at most once per helper
   (``PICKLED_BYTES_PER_S``; added to ``MIN_EPOCH_S_SERVER`` and for zygote helpers too). A
   forkserver that exits before it is ready is not started again for a warm-up. Otherwise
   ``"auto"`` starts a forkserver only to start helpers from it: it costs an interpreter with
   torch imported, kept until the training process exits.
6. Batches, their order, seeds and ``state_dict()`` are the same in both modes, so the choice
   never shows in the data; ``stats().mode`` and ``stats().mode_reason`` say what ran and why.
"""

from __future__ import annotations

import dataclasses
import pickle
import types
from typing import Any

from threadloader._engine.options import options_of
from threadloader._engine.stats import LoaderStats
from threadloader._primitives.concurrency import usable_cpus
from threadloader.isolation import zygote
from threadloader.isolation.helper_source import (
    forkserver_foreign,
    forkserver_is_ready,
    forkserver_lost,
    rerun_reason,
    start_method,
    warm_forkserver,
)
from threadloader.isolation.main_script import main_reimported, unguarded_main_script
from threadloader.isolation.main_state import code_of

THREADS = "threads"
PROCESS = "process"
#: Helpers whose epoch ran the loop at less than this share of the threads' pace lose (point 3).
MOVE_BACK = 0.9
#: Epochs shorter than this (wall time, seconds) never move the next one (point 4) ...
#: Helpers forked from this process delivered their first batch 20-50 ms later than threads
#: (2 helpers on 2 cores: 22 against 5 ms on pure-Python items, 31 against 3 ms with a 3M-string
#: dataset, 123 against 78 ms on JPEGs), under a sixth of a 0.3 s epoch; and an epoch in helpers
#: that loses moves back (point 3). The pure-Python items ran a 0.47 s epoch in threads, 0.25 s
#: in helpers.
MIN_EPOCH_S = 0.3
#: ... or than this, where helpers would not be forked from this process or the zygote.
MIN_EPOCH_S_SERVER = 3.0
#: Helpers that receive what they run pickled (from a forkserver or spawn) start later by the
#: time this process takes to pickle it and the helper to unpickle it, counted at this rate:
#: 3M Python strings (65 MB) took 0.63 s to pickle and 0.25 s to unpickle on 2 cores; a 537 MB
#: numpy array 0.32 s and 0.33 s.
PICKLED_BYTES_PER_S = 100e6
#: Why a loader that names ``fork`` stays in threads while other Python threads run (point 4).
FORK_REFUSED = (
    "multiprocessing_context='fork' and this process runs other Python threads: "
    "forking it could copy a lock one of them holds"
)
#: A slowed step moves the workers only in a loop that waited for data less than this share
#: of its wall time (point 2).
MAX_WAIT_FOR_STEP = 0.5


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where one epoch's workers run, and why.

    Attributes:
        mode: ``"threads"`` (in the training process) or ``"process"`` (helper processes).
        reason: the measurement or the rule behind the choice, in a sentence.
        helpers: with ``"process"``, how many helper processes.
    """

    mode: str
    reason: str
    helpers: int | None = None


def held_the_gil(stats: LoaderStats) -> bool:
    """Whether an epoch's measurements say its items held the GIL."""
    return stats.gil_bound


def epoch_signal(stats: LoaderStats, epoch: str = "the last epoch's") -> str | None:
    """What in an epoch's stats says its workers should move into helpers (point 2), or None.

    Args:
        stats: the epoch's stats.
        epoch: how the reason names the epoch, possessive.
    """
    if held_the_gil(stats):
        return f"{epoch} items held the GIL"
    if slowed_the_training(stats):
        busy, idle = stats.step_busy_s * 1e3, stats.step_idle_s * 1e3
        return (
            f"the training step took {busy:.2f} ms while worker threads ran, {idle:.2f} ms "
            "while they were idle"
        )
    return None


def helper_count(loader: Any) -> int:
    """How many helper processes a move starts: ``helpers``, else one per worker up to the
    usable CPUs (point 2)."""
    return int(options_of(loader).helpers or min(loader.num_workers, usable_cpus()))


def too_few_to_help(loader: Any) -> bool:
    """Fewer than 2 workers or 2 usable CPUs: helpers cannot run more at once (point 4)."""
    return bool(loader.num_workers < 2 or usable_cpus() < 2)


def slowed_the_training(stats: LoaderStats) -> bool:
    """Whether an epoch's training steps were slower while its worker threads ran, in a loop
    that the step paces rather than the wait for data (point 2)."""
    return stats.training_slowed and stats.wait_fraction < MAX_WAIT_FOR_STEP


def loop_pace(stats: LoaderStats, since: LoaderStats | None = None) -> float | None:
    """Batches per second of the epoch's wall time, training steps included; None if unknown.

    Args:
        stats: the epoch's stats.
        since: the same epoch's stats at an earlier point: the pace after it (``mid_epoch``).
    """
    batches, wall = stats.batches, stats.wall_s
    if since is not None:
        batches, wall = batches - since.batches, wall - since.wall_s
    if batches < 1 or wall <= 0:
        return None
    return batches / wall


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line. An error raised in a helper carries the
    helper's traceback in its message, whose last line names the original error."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _too_short(last: LoaderStats, least: float) -> str:
    return (
        f"the epoch lasted {last.wall_s:.2f} s, too short to win back starting helper "
        f"processes (epochs of {least:g} s or more move)"
    )


class _Discard:
    """Keeps nothing of what is written to it but its size."""

    def __init__(self) -> None:
        self.nbytes = 0

    def write(self, data: bytes | pickle.PickleBuffer) -> int:
        # Protocol 5 hands a large contiguous buffer (a numpy array) over as a PickleBuffer,
        # which has no len().
        size = memoryview(data).nbytes
        self.nbytes += size
        return size


class _Probe(pickle.Pickler):
    """Pickles into nothing, noting the first class or function it names from ``__main__``."""

    def __init__(self) -> None:
        self.sink = _Discard()
        super().__init__(self.sink, pickle.HIGHEST_PROTOCOL)
        self.from_main: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object but exact ints, floats, strings, bytes and containers; the
        # classes of instances come here too, as the instances' reductions name them.
        named = isinstance(obj, (type, types.FunctionType))
        if named and self.from_main is None and getattr(obj, "__module__", None) == "__main__":
            self.from_main = obj.__qualname__
        return NotImplemented


@dataclasses.dataclass(frozen=True)
class _Pickled:
    """What pickling the dataset, ``collate_fn`` and ``worker_init_fn`` found."""

    problem: str | None  # why one cannot be pickled at all
    from_main: str | None  # "its dataset needs Items": the first that names ``__main__``
    nbytes: int = 0  # the size of all three pickled


def _pickle_check(loader: Any) -> _Pickled:
    """What a helper process could not receive, and what it needs from ``__main__``."""
    from_main, nbytes = None, 0
    for name in ("dataset", "collate_fn", "worker_init_fn"):
        probe = _Probe()
        try:
            probe.dump(getattr(loader, name))
        except Exception as exc:  # noqa: BLE001  # any pickling failure means: stay in threads
            return _Pickled(f"its {name} cannot be pickled ({type(exc).__name__}: {exc})", None)
        if from_main is None and probe.from_main is not None:
            from_main = f"its {name} needs {probe.from_main}"
        nbytes += probe.sink.nbytes
    return _Pickled(None, from_main, nbytes)


class AutoIsolation:
    """The ``isolation="auto"`` policy of one loader (module docstring)."""

    def __init__(self) -> None:
        self.choice = Choice(THREADS, "the first epoch runs in worker threads and measures")
        self._pace: dict[str, float] = {}  # mode -> the loop's pace in its latest epoch
        self._pickled: _Pickled | None = None  # checked once, when a move is first considered
        self._moved_at: LoaderStats | None = None  # the current epoch moved here (``moved``)
        self._start_problem: str | None = None  # helpers failed to start (``helpers_failed``)

    def next_epoch(self, loader: Any, last: LoaderStats | None) -> Choice:
        """Decide where the epoch about to start runs.

        Args:
            loader: the ``ThreadDataLoader`` (its workers, persistence, dataset, helpers).
            last: the previous epoch's stats; None before the first epoch.

        Returns:
            The choice, also kept in ``choice``.
        """
        if loader.persistent_workers:
            # Decided once: a persistent epoch's workers are those of the first iter().
            self.choice = Choice(
                THREADS, "persistent workers keep their state between epochs: they stay threads"
            )
            return self.choice
        if last is None:
            return self.choice
        moved, self._moved_at = self._moved_at, None
        # An epoch that moved mid-way counts for helpers from the move on.
        pace = loop_pace(last) if moved is None else loop_pace(last, since=moved)
        if pace is not None:
            self._pace[self.choice.mode] = pace
        if self.choice.mode == PROCESS:
            lost = self._helpers_lost()
            if lost is not None:
                self.choice = Choice(THREADS, f"{lost}: back to threads")
            elif self._fork_refused(loader):
                self.choice = Choice(THREADS, f"{FORK_REFUSED}: back to threads")
            return self.choice
        signal = epoch_signal(last)
        if signal is None:
            self.choice = Choice(
                THREADS,
                "the last epoch's items released the GIL and the training step kept its pace "
                "while workers ran: threads scale",
            )
            return self.choice
        lost = self._helpers_lost()
        if lost is not None:
            self.choice = Choice(THREADS, f"{signal}, but {lost}")
            return self.choice
        blocker = self._blocker(loader, last)
        if blocker is not None:
            self.choice = Choice(THREADS, f"{signal}, but {blocker}")
            return self.choice
        count = helper_count(loader)
        self.choice = Choice(
            PROCESS,
            f"{signal}: worker threads run in {count} helper process{'es' if count > 1 else ''}",
            helpers=count,
        )
        return self.choice

    def moved(self, choice: Choice, before: LoaderStats, since: LoaderStats | None = None) -> None:
        """Record a move into helpers in the middle of the first epoch (``mid_epoch``).

        Args:
            choice: where the rest of the epoch runs, and why.
            before: the epoch's stats up to the decision to move: the threads' pace.
            since: the epoch's stats as the move began, once the batches in flight were
                delivered (``before`` if None): the helpers' pace counts from there, their
                start included; the threads' last batches count for neither.
        """
        self.choice = choice
        self._moved_at = before if since is None else since
        pace = loop_pace(before)
        if pace is not None:
            self._pace[THREADS] = pace

    def helpers_failed(self, exc: Exception) -> Choice:
        """Helper processes chosen for the epoch about to start could not start, or not load
        what they run: it runs in threads, and so does every later epoch of this loader.

        Args:
            exc: what starting them raised.

        Returns:
            The new choice, also kept in ``choice``.
        """
        self._start_problem = f"helper processes could not start ({one_line(exc)})"
        self.choice = Choice(THREADS, f"{self._start_problem}: the epoch runs in worker threads")
        return self.choice

    def _helpers_lost(self) -> str | None:
        """Why helpers lose to threads on the latest measurements, or None (point 3)."""
        threads, helpers = self._pace.get(THREADS), self._pace.get(PROCESS)
        if threads is None or helpers is None or helpers >= MOVE_BACK * threads:
            return None
        return (
            f"the loop ran {helpers:.1f} batches/s with helper processes against "
            f"{threads:.1f} with threads"
        )

    def warm_up(self, loader: Any) -> None:
        """Start the forkserver the next epoch's helpers would come from (point 5).

        Called by ``mid_epoch`` once the first epoch shows what moves the next one, in a
        process that may not be forked: nothing starts where a move would be refused anyway.

        Args:
            loader: the ``ThreadDataLoader``.
        """
        if self._refusal(loader, forked=False) is None:
            warm_forkserver(loader.multiprocessing_context, code_of(loader))

    def unforked_start_s(self, loader: Any) -> float | None:
        """Seconds that pickling what they run costs helpers not forked from this process, where
        such helpers can start now (``mid_epoch`` point 3); else None.

        They can where the loader names no ``multiprocessing_context``, the dataset's class
        defines no ``__copy__`` (its copies share process-wide state, as ``RemoteFiles``' read
        pool: each copy pickled apart would get its own), they would come from the zygote or
        from a forkserver that is ready (point 5), and nothing refuses them (point 4). The
        seconds are ``_pickled_s``'s.

        Args:
            loader: the ``ThreadDataLoader``.
        """
        if start_method(loader.multiprocessing_context) is not None:
            return None
        if getattr(type(loader.dataset), "__copy__", None) is not None:
            return None  # its copies share process-wide state: pickled apart, they would not
        forked = zygote.running(code_of(loader))
        if not forked and not forkserver_is_ready():
            return None
        if self._refusal(loader, forked) is not None:
            return None
        return self._pickled_s(loader)

    def _pickled_s(self, loader: Any) -> float:
        """Seconds to pickle and unpickle the dataset, ``collate_fn`` and ``worker_init_fn``
        once per helper, one helper after another (point 4), at ``PICKLED_BYTES_PER_S``: an
        upper bound, as a pickle without tensors' descriptors is made once for all helpers."""
        return self._pickle_check(loader).nbytes * helper_count(loader) / PICKLED_BYTES_PER_S

    def _blocker(self, loader: Any, last: LoaderStats) -> str | None:
        lasting = self._lasting(loader)
        if lasting is not None:
            return lasting
        if last.wall_s < MIN_EPOCH_S:
            return _too_short(last, MIN_EPOCH_S)
        method = start_method(loader.multiprocessing_context)
        forking = method in (None, "fork") and zygote.may_fork()  # this process: nothing pickled
        forked = forking or (method is None and zygote.running(code_of(loader)))
        refusal = self._refusal(loader, forked)
        if refusal is not None or forking:
            return refusal
        # Helpers from the zygote, a forkserver or spawn receive what they run pickled; one from
        # a forkserver that is not ready, or from spawn, waits for an interpreter to import
        # torch, unless the forkserver started already (point 5).
        pickled_s = self._pickled_s(loader)
        if forked:
            return self._long_enough(last, MIN_EPOCH_S + pickled_s)
        if last.wall_s >= MIN_EPOCH_S_SERVER + pickled_s:
            return None
        warming = warm_forkserver(loader.multiprocessing_context, code_of(loader))
        if warming and forkserver_is_ready():
            return self._long_enough(last, MIN_EPOCH_S + pickled_s)
        reason = _too_short(last, MIN_EPOCH_S_SERVER + pickled_s)
        if forkserver_foreign():
            return f"{reason}: the forkserver here was started without threadloader's helper"
        if not warming:
            lost = " (the forkserver started for them exited before it was ready)"
            return reason + lost * forkserver_lost()
        return (
            f"the epoch lasted {last.wall_s:.2f} s, and the forkserver helper processes come "
            f"from is still importing torch: epochs of {MIN_EPOCH_S + pickled_s:.2g} s or more "
            f"move once it is ready, of {MIN_EPOCH_S_SERVER + pickled_s:.2g} s or more until then"
        )

    @staticmethod
    def _long_enough(last: LoaderStats, least: float) -> str | None:
        return None if last.wall_s >= least else _too_short(last, least)

    def _lasting(self, loader: Any) -> str | None:
        """Why no helper will ever run this loader's workers, known without pickling."""
        if self._start_problem is not None:
            return self._start_problem
        if too_few_to_help(loader):
            return "helper processes need 2 workers and 2 usable CPUs to help"
        return None

    def _refusal(self, loader: Any, forked: bool) -> str | None:
        """Why no helper may run this loader's workers, whatever the epoch's length (point 4)."""
        lasting = self._lasting(loader)
        if lasting is not None:
            return lasting
        if self._fork_refused(loader):
            return FORK_REFUSED
        stale = _stale_script_code(loader)
        if stale is not None:
            return stale
        problem = self.pickling_problem(loader)
        if problem is not None or forked:
            return problem
        # Helpers from a forkserver or spawn import __main__ afresh, or not at all.
        server = start_method(loader.multiprocessing_context) or "forkserver"
        from_main = self._pickle_check(loader).from_main
        if from_main is not None and main_reimported() is None:
            return (
                f"{from_main}, defined in __main__, which helper processes started with "
                f"{server} cannot import (an interactive session, python -c, or a package's "
                "__main__)"
            )
        script = unguarded_main_script()
        return None if script is None else rerun_reason(script, server)

    @staticmethod
    def _fork_refused(loader: Any) -> bool:
        """The loader names ``fork``, which this process may not use now (point 4)."""
        method = start_method(loader.multiprocessing_context)
        return method == "fork" and not zygote.may_fork()

    def pickling_problem(self, loader: Any) -> str | None:
        """What a helper could not receive pickled, or None (checked once per loader)."""
        return self._pickle_check(loader).problem

    def _pickle_check(self, loader: Any) -> _Pickled:
        if self._pickled is None:
            self._pickled = _pickle_check(loader)
        return self._pickled


def _stale_script_code(loader: Any) -> str | None:
    """Why helpers would not run the main script's code as it is now, or None: they would come
    from a zygote (this process runs other threads) that holds it as it was at its fork, and
    from elsewhere they would run it as the script's top level defines it (``zygote`` point 5).
    """
    if start_method(loader.multiprocessing_context) is not None or zygote.may_fork():
        return None
    lacking = zygote.missing(code_of(loader))
    if not lacking:
        return None
    return f"{zygote.StaleScriptCode.of(lacking)}: helper processes would not run it as it is now"
