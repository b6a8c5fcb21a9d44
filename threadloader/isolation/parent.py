"""One epoch with the worker threads in a helper process: ``isolation="process"``.

On a GIL build of Python, worker threads compete with the training thread for the GIL: the
training loop's own Python work (launching kernels, optimizer steps) gets slower even when the
loader is fast. Isolation moves the N worker threads into P helper processes
(``helper``; ``helpers=P``, one by default, worker ``w`` in helper ``w % P``) and brings
batches back through a shared-memory slot ring per helper (``shm_ring``): the training process
only draws indices, writes one small message per batch and reads one back. Compared with torch's
N worker processes: P copies of the dataset instead of N, threads that share each, and no
per-tensor shared-memory file per batch. With P > 1, Python-bound item code runs on P GILs.

How an epoch behaves; where the code disagrees with this, the code is wrong.

1. The sampler runs here, in the training process, and dispatch follows torch's
   ``_MultiProcessingDataLoaderIter`` exactly (as ``_engine.threaded`` does): batch ``i`` goes to the
   next live worker in round-robin order, at most ``prefetch_factor * num_workers`` batches are
   in flight, one new batch is dispatched for each delivered. So batches, their order, which
   worker made which batch, seeds and resume (``_state.begin_pass``) are those of the threaded
   iterator, and of torch.
2. Helpers come from this process forked while it runs one Python thread, else from the zygote,
   a forkserver or spawn (``helper_source``); then the dataset, ``collate_fn`` and
   ``worker_init_fn`` are pickled for the helpers (``PickledOnce``): once for all of those an
   ``iter()`` starts (``SharedField``), unless the pickle carries tensors' descriptors.
3. Delivery is in sampler order through a reorder table of *messages* (a parked batch is not
   rebuilt until its turn), or as completed (``in_order=False``). A delivered batch views its
   slot, and the slot goes back to the helper only when nothing references the batch any more
   (``shm_ring`` point 4); released slots go into the ring's mailbox when the next task is
   sent (point 5 there).
4. A worker error is raised from ``__next__`` at that batch's turn with the original type, the
   worker id, the batch's indices and the original traceback text; the epoch goes on if
   ``next()`` is called again, as in torch. A helper dying (killed, out of memory) raises
   ``RuntimeError`` naming its pid and exit code, and ends the others. A ``timeout`` expiring
   ends the epoch.
5. Drained, abandoned (``break``, ``del``, garbage collection), ``KeyboardInterrupt``, timeout,
   interpreter exit: every helper is told to exit, its pipes are closed, and it is joined (then
   killed if it has not exited within ``CLOSE_WAIT_S``). The finalizer holds the link to the
   helper, never this iterator; a Ctrl-C landing in it kills the helper and reaches the loop
   (``_primitives.finalizers`` point 2). The helper also exits on its own when this process dies, even
   by SIGKILL (``helper`` point 3).
6. Waiting for a result: when the last wait was shorter than ``SPIN_S`` and the helper's
   fetching threads leave a CPU free, the training thread polls the result socket for up to
   ``SPIN_S`` before it goes to sleep. Waking a sleeping process costs the process that wakes
   it, and not only the system call: on the 2-core machine of bench/, each result sent to a sleeping
   training process cost the helper ~70 us more on its next batch (token windows: 37k -> 46k
   samples/s with the polling). The training thread polls only while it would wait for data
   anyway, stops polling once waits grow longer than ``SPIN_S`` (batches that take
   milliseconds, where a wake-up is cheap by comparison) or the helper needs every CPU, and
   releases the GIL and yields the CPU on every poll.
7. Each helper says when it has loaded what it runs and started its workers. With
   ``confirm_start`` (``isolation="auto"``), the iterator waits for that before it dispatches,
   so a helper that cannot load the dataset (a class from a module only this process can
   import) fails the iterator's construction, which ``"auto"`` answers with threads, instead of
   the loop's ``next()``. Otherwise the message is only noted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data._utils.collate import default_collate

from threadloader._engine.dispatch import DispatchingIter
from threadloader._engine.options import options_of
from threadloader._engine.state import Resume
from threadloader._engine.tasks import Result, WorkerSpec
from threadloader._engine.worker import CarriedWorker
from threadloader._engine.worker_handles import HelperHandle
from threadloader._primitives.concurrency import ConcurrencyController
from threadloader._primitives.finalizers import Finalizer
from threadloader._primitives.warn import warn_user
from threadloader.device.pinned import pin_batch, pinned_allocator
from threadloader.isolation import main_state, zygote
from threadloader.isolation.helper import HelperSpec, SharedField
from threadloader.isolation.helper_source import helper_context, start_forkserver
from threadloader.isolation.link import Links, _Link
from threadloader.isolation.main_script import main_reimported
from threadloader.isolation.main_state import MainState
from threadloader.isolation.packing import Packed
from threadloader.isolation.task_board import EPOCH, TASK
from threadloader.isolation.zygote import ZygoteContext

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class GlobalsLeftOut(RuntimeError):
    """Globals of the main script that the helpers' code reads cannot be sent to helpers that
    are not forked from this process (``main_state`` point 2): ``"auto"`` stays in threads."""


def _refuse_an_unimportable_main(ctx: Any, code: list[Any]) -> None:
    """Refuse helpers that would fail to unpickle the script's classes and functions.

    Helpers from a forkserver or spawn find them by importing the main script
    (``main_script.main_reimported``); an interactive session, ``python -c`` or a package's
    ``__main__`` has none to import, and every helper would fail with ``AttributeError``.

    Raises:
        RuntimeError: naming them and what to do instead.
    """
    method = ctx.get_start_method()
    if method not in ("forkserver", "spawn") or not code or main_reimported() is not None:
        return
    names = ", ".join(sorted({obj.__qualname__ for obj in code}))
    raise RuntimeError(
        f"threadloader: helper processes started with {method} cannot import {names}, defined "
        "in __main__ (an interactive session, python -c, or a package's __main__: "
        "multiprocessing imports no main script there). Define it in a module, or pass "
        'isolation="threads" (the default, "auto", keeps such a loader in threads)'
    )


def _main_state(
    ctx: Any, spec: WorkerSpec, code: list[Any], named: bool, strict: bool
) -> MainState | None:
    """What helpers started by ``ctx`` need of the main script's run-time state
    (``main_state`` point 4): None for forked ones, or where the user named the context.
    ``code``: ``main_state.code_of(spec)``.

    Without ``strict`` (``isolation="process"``), such a global is named in a
    ``RuntimeWarning``: the helpers run with its value as their copy of the script has it.

    Raises:
        GlobalsLeftOut: with ``strict``, a global their code reads could not be sent.
    """
    if named or ctx.get_start_method() == "fork":
        return None
    # The zygote has the classes as at its fork; an import, as its top level.
    forked = isinstance(ctx, ZygoteContext)
    whole = [] if forked else main_state.main_classes(code)
    attributes = zygote.changed_data(code) if forked else main_state.class_attributes(whole)
    state = main_state.capture(
        (spec.dataset, spec.collate_fn),
        init=spec.worker_init_fn,
        attributes=attributes,
        whole=whole,
    )
    if not state.left_out:
        return state
    attributes_only = all("." in name for name in state.left_out)  # Class.name
    kind = "class attribute" if attributes_only else "global"
    what = (
        f"the main script's {kind}{'s' if len(state.left_out) > 1 else ''} "
        f"{', '.join(state.left_out)}, which the dataset's code reads, cannot be sent to "
        "helper processes that are not forked from this process (it cannot be pickled, or it "
        f"is beyond {main_state.LIMIT_BYTES // 2**20} MB)"
    )
    if strict:
        raise GlobalsLeftOut(what)
    warn_user(
        f"threadloader: {what}: they see it as their copy of the script has it. Build the "
        "loader while the script runs one Python thread (helpers are then forked), or pass "
        'isolation="threads"',
        RuntimeWarning,
    )
    return state


def _start_links(
    ctx: Any,
    owner: object,
    worker_spec: WorkerSpec,
    count: int,
    adopted: list[Any] | None = None,
    limit: int | None = None,
    state: MainState | None = None,
) -> list[_Link]:
    """Start ``count`` helpers, worker ``w`` in helper ``w % count``; none left if one fails.

    With ``adopted`` (this process's workers, or their ``CarriedWorker``), each helper takes
    over its workers as they are instead of building new ones. ``limit``: the most bytes each
    helper's spec may pickle to (``PickledOnce``). ``state``: the main script's run-time state
    the helpers apply (``main_state``).
    """
    it: Any = owner
    links: list[_Link] = []
    # Helpers starting each epoch anew receive the same workers' spec: pickled once for all
    # where it can be. Carried workers are pickled with the dataset they share objects with.
    shared = SharedField("worker") if adopted is None else None
    try:
        for helper in range(count):
            ids = tuple(range(helper, it._num_workers, count))
            spec = HelperSpec(
                worker=worker_spec,
                base_seed=int(it._base_seed),
                max_tasks=it._prefetch_factor * len(ids),
                collate_into_slots=it._auto_collation and it._collate_fn is default_collate,
                worker_ids=ids,
                adopted={i: adopted[i] for i in ids} if adopted is not None else None,
                main_state=state,
            )
            name = f"threadloader-helper-{id(owner):x}" + (f"-{helper}" if count > 1 else "")
            links.append(_Link(ctx, spec, name=name, limit=limit, shared=shared))
    except BaseException:
        Links(links).reap()
        raise
    return links


def _wait_started(links: Links, timeout: float | None) -> None:
    """Wait until every helper has loaded what it runs (point 7); kill them all if one cannot
    (one still loading would not see the end of its control pipe).

    Raises:
        RuntimeError: ``timeout`` expired first, or a helper exited (``SystemExit``: an import
            it ran called ``sys.exit``; this process goes on).
        Exception: what a helper raised loading its spec, with the original type.
    """
    try:
        try:
            links.wait_started(timeout)
        except TimeoutError:
            raise RuntimeError(
                f"threadloader: helper processes had not started after {timeout} seconds"
            ) from None
    except BaseException as exc:
        links.reap()
        if isinstance(exc, (Exception, KeyboardInterrupt)):
            raise
        raise RuntimeError(f"threadloader: a helper process exited starting: {exc!r}") from exc


def combined_stats(snapshots: list[Any]) -> Any:
    """The dataset's ``stats()`` over every helper's copy: their sum where the type adds up.

    Args:
        snapshots: each helper's latest snapshot, None for a helper that sent none yet.

    Returns:
        The one snapshot there is, the sum of all of them (``RemoteStats`` adds up), or the
        latest helper's when the type does not support ``+``.
    """
    present = [s for s in snapshots if s is not None]
    if len(present) <= 1:
        return present[0] if present else None
    total = present[0]
    for snapshot in present[1:]:
        try:
            total = total + snapshot
        except TypeError:
            return present[-1]
    return total


class IsolatedDataLoaderIter(DispatchingIter):
    """The iterator of ``ThreadDataLoader(..., num_workers=N, isolation="process")``, N > 0.

    Same interface as ``ThreadedDataLoaderIter``: a ``Progress`` the loader keeps for
    ``state_dict()``, an ``EpochStats`` in ``_stats`` for ``stats()``, and ``close()``.

    Args:
        loader: the loader this epoch belongs to.
        resume: a checked state to resume from (``ThreadDataLoader.load_state_dict``).
        helpers: how many helper processes; None: the loader's ``helpers``, else one.
        confirm_start: wait until every helper has loaded the dataset, ``collate_fn`` and
            ``worker_init_fn`` before dispatching (point 7).

    Raises:
        ValueError: the loader's ``multiprocessing_context`` starts processes with ``fork``.
        RuntimeError: with ``confirm_start``, ``timeout`` expired before the helpers started.
        Exception: whatever pickling the dataset, collate_fn or worker_init_fn raises, or, with
            ``confirm_start``, a helper raised loading them.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        resume: Resume | None = None,
        *,
        helpers: int | None = None,
        confirm_start: bool = False,
    ) -> None:
        super().__init__(loader, resume)
        self._log_every_s = options_of(loader).log_every_s
        worker_spec = self._worker_spec(loader, resume, self._collate_fn)
        count = min(helpers or options_of(loader).helpers or 1, self._num_workers)
        try:
            links = self._start(loader, worker_spec, count)
        except zygote.StaleScriptCode as exc:  # ``zygote`` point 5
            links = self._start_elsewhere(loader, worker_spec, count, exc)
        self._attach(links)
        if confirm_start:
            self._confirm_start()
        self._generation = 0
        self._new_stats()
        self._reset(loader, first_iter=True)

    def _start(
        self,
        loader: DataLoader[Any],
        spec: WorkerSpec,
        count: int,
        use_zygote: bool = True,
        warning: str | None = None,
    ) -> Links:
        """Start ``count`` helpers for ``spec`` from where ``helper_context`` says; ``warning``:
        a ``RuntimeWarning`` to give once they may start."""
        code = main_state.code_of(spec)
        ctx = helper_context(loader.multiprocessing_context, code, use_zygote)
        _refuse_an_unimportable_main(ctx, code)
        if warning is not None:
            warn_user(warning, RuntimeWarning)
        auto = options_of(loader).isolation == "auto"
        # "auto"'s batches never depend on where the workers run: its helpers see what its
        # threads see, whichever context the user named.
        named = loader.multiprocessing_context is not None and not auto
        state = _main_state(ctx, spec, code, named, strict=auto)
        start_forkserver(ctx)  # if it uses one: preloading the main script, once
        return Links(_start_links(ctx, self, spec, count, state=state))

    def _start_elsewhere(
        self, loader: DataLoader[Any], spec: WorkerSpec, count: int, stale: Exception
    ) -> Links:
        """Start the helpers from the forkserver (or spawn): the zygote's copy of the main script
        lacks what they run as it is now (``stale``). They see that code as the script's top
        level defines it, which is not what the training process runs where the script changed
        it further down: ``"auto"`` stays in threads, ``"process"`` warns.

        Raises:
            zygote.StaleScriptCode: for ``"auto"``.
        """
        if options_of(loader).isolation == "auto":
            raise stale
        warning = (
            f"threadloader: {stale}; helper processes from the forkserver run it as the "
            "script's top level defines it. Build the loader while the script runs one Python "
            'thread (a new zygote then forks), or pass isolation="threads"'
        )
        return self._start(loader, spec, count, use_zygote=False, warning=warning)

    def _confirm_start(self) -> None:
        """Wait until every helper has loaded what it runs (point 7); kill them if one cannot
        (one still loading would not see the end of its control pipe).

        Raises:
            RuntimeError: ``timeout`` expired first.
            Exception: what a helper raised loading its spec, with the original type.
        """
        try:
            _wait_started(self._links, self._timeout if self._timeout > 0 else None)
        except BaseException:
            self._finalizer.detach()
            raise

    @classmethod
    def take_over(
        cls,
        epoch: Any,
        count: int,
        carried: list[CarriedWorker] | None = None,
        *,
        limit: int | None = None,
        wait_s: float | None = None,
    ) -> None:
        """Carry on ``epoch``, a threaded iterator with nothing in flight, with its workers in
        ``count`` helper processes (``mid_epoch``).

        Its progress, index stream and stats go on as they are, and the helpers carry on the
        workers as they are (dataset copies, generators, ``worker_init_fn``'s work).

        Args:
            epoch: the threaded iterator.
            count: how many helpers.
            carried: None: the worker threads were joined, and the helpers are forked from
                this process, the workers in memory. Else the workers as they stand
                (``carry_workers``), pickled to helpers from the zygote or a forkserver; the
                worker threads are joined once every helper has loaded its workers.
            limit: with ``carried``, the most bytes each helper may receive pickled.
            wait_s: with ``carried``, how long the helpers may take to load their workers.

        Raises:
            PayloadTooLarge: a helper would receive more than ``limit`` bytes.
            Exception: whatever starting a helper or loading the workers in it raises, or
                ``RuntimeError`` when they took longer than ``wait_s``; the epoch is then
                unchanged (its threads still run, if they did).
        """
        spec = dataclasses.replace(epoch._pool.workers[0].spec, collate_fn=epoch._collate_fn)
        if carried is None:
            ctx = multiprocessing.get_context("fork")
            links = Links(_start_links(ctx, epoch, spec, count, adopted=epoch._pool.workers))
        else:
            # The zygote or a forkserver that is ready (``mid_epoch``): nothing to start first.
            code = main_state.code_of(spec)
            ctx = helper_context(code=code)
            state = _main_state(ctx, spec, code, named=False, strict=True)
            links = Links(
                _start_links(ctx, epoch, spec, count, adopted=carried, limit=limit, state=state)
            )
            try:
                _wait_started(links, wait_s)
                epoch.join_threads()
            except BaseException:
                links.reap()
                raise
        epoch.__class__ = cls
        epoch._attach(links)
        epoch._stats.workers_active = None  # what the training thread's steps are timed by
        epoch._stats.controller = epoch._concurrency

    def _attach(self, links: Links) -> None:
        """Make ``links`` this epoch's helpers."""
        count = len(links.links)
        self._links = links
        # The finalizer holds the links, never self: break, del and GC all end the helpers.
        self._finalizer = Finalizer(self, self._links.close, on_interrupt=self._links.kill)
        # torch's iterator lists its worker processes here: each worker's stand-in is its helper.
        self._workers = [
            HelperHandle(self._links.for_worker(i).process, i) for i in range(self._num_workers)
        ]
        # Each helper adapts how many of its threads fetch at once and reports it with each
        # result; this controller only carries their sum to stats().
        self._limits = [1] * count
        self._dataset_stats: list[Any] = [None] * count
        self._stats_numbers = [0] * count  # of each helper's latest snapshot kept
        self._concurrency = ConcurrencyController(self._num_workers, minimum=count)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} delivered={self._rcvd_idx} dispatched={self._send_idx} "
            f"in_flight={self._tasks_outstanding} {self._links!r}>"
        )

    @property
    def helper_pid(self) -> int | None:
        """The first helper process's pid (None before it started)."""
        return self._links.links[0].process.pid

    @property
    def helper_pids(self) -> list[int | None]:
        """Every helper process's pid; worker ``w`` runs in helper ``w % len(helper_pids)``."""
        return [link.process.pid for link in self._links.links]

    def close(self) -> None:
        """End the helper process now. Idempotent; later ``next()`` calls raise RuntimeError.

        Raises:
            KeyboardInterrupt: Ctrl-C while waiting for the helper (which is killed then).
        """
        if self._finalizer.detach() is not None:
            self._links.close()

    def _restart_workers(self, redispatch: bool = False) -> None:
        self._generation += 1
        parked = self._parked_slots()
        seed = None if redispatch else self._shared_seed
        rewind = self._rcvd_idx if redispatch else None  # Worker.start_epoch
        with self._ending_if_a_helper_is_lost():
            for i, link in enumerate(self._links.links):
                link.reader.give_back(parked.get(i, ()))
                link.reader.send_released()
                link.send((EPOCH, self._generation, seed, rewind))

    def _parked_slots(self) -> dict[int, list[Any]]:
        """Slots of batches parked in the reorder table of an abandoned epoch, by helper."""
        task_info = getattr(self, "_task_info", {})
        count = len(self._links.links)
        parked: dict[int, list[Any]] = {}
        for info in task_info.values():
            if len(info) == 3 and isinstance(info[2].data, Packed) and info[2].data.key is not None:
                parked.setdefault(info[2].worker_id % count, []).append(info[2].data.key)
        return parked

    def _drop(self, result: Result) -> None:
        if isinstance(result.data, Packed):
            self._links.for_worker(result.worker_id).reader.discard(result.data)

    def _send(self, worker_id: int, idx: int, index: Any) -> None:
        link = self._links.for_worker(worker_id)
        with self._ending_if_a_helper_is_lost():
            link.reader.send_released()
            link.send((TASK, worker_id, idx, self._generation, index))

    @contextlib.contextmanager
    def _ending_if_a_helper_is_lost(self) -> Iterator[None]:
        """Close the epoch when what it ran raised because a helper is gone (it sent the error
        that ended it, or it died): the workers it ran cannot go on, and a persistent loader's
        next ``iter()`` then starts new helpers instead of resetting this epoch."""
        try:
            yield
        except BaseException:
            if any(link.closed for link in self._links.links):
                self.close()
            raise

    def _get_result(self, in_flight: tuple[Any, ...]) -> Result:
        """The next result of this epoch from a helper; stale epochs' are given back."""
        links = self._links
        if not links.ready():
            self._ready = False
        wait = self._timeout if self._timeout > 0 else None
        while True:
            try:
                with self._ending_if_a_helper_is_lost():
                    msg = links.receive(wait)
            except TimeoutError:
                self.close()
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None
            _, idx, worker_id, generation, data, state, rng, timings, limit, dataset_stats = msg
            helper = worker_id % len(links.links)
            if dataset_stats is not None and dataset_stats[0] > self._stats_numbers[helper]:
                self._stats_numbers[helper], self._dataset_stats[helper] = dataset_stats
                self._stats.dataset = combined_stats(self._dataset_stats)
            self._limits[helper] = limit
            self._concurrency.limit = sum(self._limits)  # the helpers', for stats()
            if generation == self._generation:
                # Only this epoch's timings: an abandoned epoch's belong to no snapshot.
                recorder = self._stats.workers[worker_id]
                for stage, seconds in timings:
                    recorder.add(stage, seconds)
                return Result(idx, worker_id, generation, data, state, rng=rng)
            if isinstance(data, Packed):
                links.for_worker(worker_id).reader.discard(data)

    def _unpack(self, result: Result) -> Any:
        data = self._links.for_worker(result.worker_id).reader.unpack(result.data)
        if self._pin_memory:
            start = time.perf_counter()
            data = pin_batch(data, pinned_allocator)  # the one copy pinning needs frees the slot
            self._stats.caller.add("pin", time.perf_counter() - start)
        return data
