"""torch's dispatch and in-order delivery, shared by the in-process and the isolated iterators.

Where the workers run (threads of this process, or threads of a helper process) changes how a
task travels and how its result comes back; nothing else. This base class holds everything else,
written once, following torch's ``_MultiProcessingDataLoaderIter``:

1. Batch ``i`` goes to the next live worker in round-robin order; at most
   ``prefetch_factor * num_workers`` batches are in flight; one new batch is dispatched for each
   one delivered. So an IterableDataset's output order, and which worker fetched which batch,
   are torch's.
2. Delivery is in sampler order (``in_order=True``) through a reorder table keyed by batch number,
   or as completed (``in_order=False``). Batches dispatched to a worker whose IterableDataset ran
   out are skipped.
3. The epoch's index stream starts (and resumes) through ``_state.begin_pass``; round robin
   resumes at the worker after the one that made the last delivered batch (``_state`` point 9).
4. The sampler is drawn at torch's pace on every path: a subclass that holds back from
   dispatching (the training thread making each batch itself, a move about to start) still
   draws each index, with its round-robin worker, when torch would have dispatched it, into
   ``_drawn``; those go out first once it dispatches again. A sampler that draws lazily from a
   generator used elsewhere (``RandomSampler(replacement=True, generator=g)``, ``g`` also the
   loader's) then leaves it where torch's leaves it, whenever the loop stops.

A subclass provides ``_send(worker_id, idx, index)`` (returns what it needs to find the task
again, kept in the reorder table), ``_get_result(in_flight)`` (the next ``Result`` of this
epoch), ``_unpack(result)`` (the batch to hand over), ``_restart_workers()`` (a persistent
epoch's new generation), and ``close()``; and sets ``_resume``, ``_log_every_s`` and
``_primitives.concurrency`` before calling ``_reset(loader, first_iter=True)``.
"""

from __future__ import annotations

import collections
import copy
import itertools
import time
from collections.abc import Callable
from typing import Any, NoReturn

from torch._utils import ExceptionWrapper, KeyErrorMessage
from torch.utils.data import _DatasetKind
from torch.utils.data._utils.worker import _IterableDatasetStopIteration
from torch.utils.data.dataloader import _BaseDataLoaderIter

from threadloader._engine import dataset_state
from threadloader._engine.datapipes import graph_walks, sharding_init_fn
from threadloader._engine.device_epoch import device_prefetch
from threadloader._engine.options import options_of
from threadloader._engine.profiled_next import ProfiledNext
from threadloader._engine.state import (
    Progress,
    ProgressMixin,
    Resume,
    before_sampler_iter,
    begin_pass,
    mixture_sampled,
    start_new_pass,
    undo_seed_draw,
    warn_replay,
    without_predrawn,
)
from threadloader._engine.stats import EpochStats
from threadloader._engine.tasks import Result, WorkerSpec
from threadloader._primitives.concurrency import ConcurrencyController
from threadloader._primitives.finalizers import Finalizer


def prefetch_factor(loader: Any) -> int:
    """The loader's ``prefetch_factor``, checked where torch's worker iterator checks it.

    Raises:
        TypeError: it is None (``num_workers`` was raised after construction, which leaves
            torch's default unset; torch fails comparing None with 0).
        AssertionError: it is not positive (torch's error and message).
    """
    factor = loader.prefetch_factor
    if factor is not None and not isinstance(factor, int):
        # torch fails later, on range() of a float; say which argument it is
        raise TypeError(f"prefetch_factor must be an int, got {factor!r}")
    if factor is None:
        raise TypeError(
            f"prefetch_factor is None with num_workers={loader.num_workers}: the constructor "
            "sets it only when num_workers > 0, so set it too when raising num_workers later"
        )
    if factor <= 0:
        raise AssertionError(
            "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter"
        )
    return int(factor)


def _rng_history(loader: Any, factor: int) -> int:
    """Generator states a worker keeps, one after each of its latest batches and one more:
    enough to go back past every batch the loop has not received (``Worker.start_epoch``).

    Args:
        loader: the loader (its ``device``, ``device_prefetch``).
        factor: its checked ``prefetch_factor`` (``prefetch_factor``).
    """
    held = device_prefetch(loader) if options_of(loader).device is not None else 0
    return factor + held + 2


class DispatchingIter(ProfiledNext, ProgressMixin, _BaseDataLoaderIter):
    """The dispatch / reorder / delivery loop over ``num_workers`` workers (module docstring)."""

    _stats: EpochStats
    _prefetch_factor: int
    _in_order: bool
    _resume: Resume | None
    _log_every_s: float | None
    _concurrency: ConcurrencyController
    _finalizer: Finalizer
    _round_robin_start: int
    _workers_status: list[bool]

    def __init__(self, loader: Any, resume: Resume | None) -> None:
        """torch's iterator set up for ``loader`` (its base seed drawn, or the saved epoch's for
        a ``resume``), with the options every dispatching epoch reads; the workers are the
        subclass's to start."""
        self._progress = Progress()
        before_sampler_iter(self, loader)
        with graph_walks(loader.dataset):  # torch seeds a DataPipe here (datapipes point 5)
            super().__init__(loader)
        undo_seed_draw(self, loader)
        self._resume = resume
        if resume is not None:
            self._base_seed = resume.base_seed  # the workers' seeds are the saved epoch's
        self._prefetch_factor = prefetch_factor(loader)
        self._in_order = loader.in_order

    def _send(self, worker_id: int, idx: int, index: Any) -> Any:
        raise NotImplementedError

    def _get_result(self, in_flight: tuple[Any, ...]) -> Result:
        raise NotImplementedError

    def _unpack(self, result: Result) -> Any:
        return result.data

    def close(self) -> None:
        raise NotImplementedError

    def _shutdown_workers(self) -> None:
        """torch's worker iterator's name for ``close()``: code written for it calls this."""
        self.close()

    def _abandon(self) -> None:
        """End the epoch now (Ctrl-C); waiting at most briefly. ``close()`` unless overridden."""
        self.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran or the epoch ended for good (timeout, Ctrl-C)."""
        return not self._finalizer.alive

    def _restart_workers(self, redispatch: bool = False) -> None:
        """Start the workers' next generation, dropping the tasks they have not started: a
        persistent epoch's (with the iterator's new shared seed), or a redispatch's."""
        raise NotImplementedError

    #: Set by a consumer that closes this epoch itself once it has delivered the end (the
    #: device transfer stage, which may still take back batches and redispatch).
    closed_by_consumer = False

    def _closes_at_end(self) -> bool:
        """Whether the epoch closes (stops its workers) as the sampler's end is reached."""
        return not self._persistent_workers and not self.closed_by_consumer

    def take_back(self, progress: Progress, handed_out: int) -> None:
        """Forget the batches handed out after the first ``handed_out`` of this epoch, which
        a consumer dropped (``device_epoch``'s transfer stage), and go back to ``progress``,
        the epoch's as it handed out the last one kept. ``redispatch`` must follow."""
        self._progress.__dict__.update(progress.__dict__)
        self._rcvd_idx = handed_out

    def redispatch(self, new_pass: bool = False) -> None:
        """Drop every batch dispatched and not delivered, and dispatch again from the sampler.

        For a sampler that was just rewound to the delivered position (a live mixture-weight
        change): in-flight results become stale (new generation) and are discarded on arrival;
        tasks not started are dropped, since they were drawn from the rewound stream.

        Args:
            new_pass: the sampler's pass had ended, and its next ``iter()`` reads from the
                delivered position: draw from a new pass (``state.start_new_pass``).
        """
        if not self._in_order:
            raise ValueError("a live change of the index stream needs in_order=True")
        self._restart_workers(redispatch=True)
        self._forget_in_flight()
        if all(self._workers_status):
            # The round robin gives each batch the worker it had from the start (a worker's
            # generators draw for its own batches in order: ``Worker.start_epoch``), not the
            # one after the dropped batches' workers.
            self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
            for _ in range((self._round_robin_start + self._rcvd_idx) % self._num_workers):
                next(self._worker_queue_idx_cycle)
        self._sampler_done = self._progress.pass_ran_out = False  # rewound
        self._sampler_iter = without_predrawn(self._sampler_iter)  # its early draw is stale
        if new_pass:
            start_new_pass(self)
        self._fill()

    def _worker_spec(
        self, loader: Any, resume: Resume | None, collate_fn: Callable[[Any], Any]
    ) -> WorkerSpec:
        """What this epoch's workers share, wherever they run; ``collate_fn`` is theirs."""
        return WorkerSpec(
            dataset_kind=self._dataset_kind,
            dataset=self._dataset,
            auto_collation=self._auto_collation,
            collate_fn=collate_fn,
            drop_last=self._drop_last,
            worker_init_fn=sharding_init_fn(
                loader.worker_init_fn,
                self._dataset,
                self._world_size,
                self._rank,
            ),
            num_workers=self._num_workers,
            capture_state=dataset_state.tracked(
                self._dataset, self._dataset_kind == _DatasetKind.Iterable
            ),
            resume_states=resume.worker_states if resume is not None else None,
            resume_state_form=resume.worker_state_form if resume is not None else 1,
            resume_finished_epoch=resume is not None and resume.next_epoch,
            resume_ended=frozenset(
                i for i, alive in enumerate(resume.workers_status or []) if not alive
            )
            if resume is not None
            else frozenset(),
            tail_items=loader.batch_size if self._drop_last and loader.batch_size else 1,
            capture_rng=options_of(loader).save_worker_rng,
            # A live change rewinds the stream (``redispatch``) to the loop's position; each
            # worker may have begun up to prefetch_factor dropped batches after its last one
            # delivered, and with device= the transfer stage holds more the loop never got.
            rng_history=_rng_history(loader, self._prefetch_factor)
            if mixture_sampled(loader)
            else 0,
            resume_rng=resume.rng_states if resume is not None else None,
        )

    def _new_stats(self) -> None:
        """Start this epoch's stats (persistent workers start one per epoch)."""
        self._stats = EpochStats(self._num_workers, self._log_every_s)
        self._stats.controller = self._concurrency

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        resume = self._resume if first_iter else None
        self._resume = None
        if not first_iter and not self._progress.exhausted:
            try:
                self._dispatch_as_torch_would()  # from the abandoned epoch's index stream
                self._finish_abandoned()
            except KeyboardInterrupt:
                self._abandon()
                raise
        resumed_pass = resume is not None or getattr(loader, "_first_sampler_iter_resumes", False)
        if not first_iter or not resumed_pass:
            # As torch's worker iterator: the first epoch's sampler iterator is the second one
            # made (_BaseDataLoaderIter.__init__ made one already), which a sampler whose
            # __iter__ counts its calls or draws eagerly can tell. Not when resuming (also the
            # rest of a loaded finished epoch): a second iter() would restart a positional
            # sampler's resumed pass.
            before_sampler_iter(self, loader)
            with graph_walks(loader.dataset):  # a DataPipe is reseeded (_datapipes point 5)
                super()._reset(loader, first_iter)
        if not first_iter:
            self._restart_workers()
            self._new_stats()
        self._start_epoch(loader, resume)

    @property
    def _max_tasks(self) -> int:
        return self._prefetch_factor * self._num_workers

    def _start_epoch(self, loader: Any, resume: Resume | None) -> None:
        """Start (or resume) the index stream and fill the pipeline: points 1 and 3."""
        self._sampler_iter = begin_pass(self, loader, resume)
        self._map_style = self._dataset_kind == _DatasetKind.Map
        self._discard = resume.batches if resume is not None and resume.replay_data else 0
        counts = resume.worker_batches if resume is not None else None
        self._discard_by_worker = (
            list(counts) if self._discard and counts and len(counts) == self._num_workers else None
        )
        if self._discard_by_worker is not None:  # the batches received, and the errors raised
            self._discard = sum(self._discard_by_worker)
        if self._discard:
            warn_replay(self._dataset, self._discard)
        self._raised_a_batchs_error = False
        self._delivered_by = 0
        # Batches the loop received from each worker: those a replay has yet to drop count as
        # received already, so that a state taken before the replay is done is the loaded one.
        self._progress.worker_batches = (
            list(self._discard_by_worker)
            if self._discard_by_worker is not None
            else [0] * self._num_workers
        )
        self._send_idx = 0  # number of the next batch to dispatch
        self._rcvd_idx = 0  # number of the next batch to deliver (in order)
        self._sampler_done = False  # the sampler ran out: what is in flight drains
        self._drawn: collections.deque[tuple[int, Any]] = collections.deque()  # point 4
        # batch number -> (worker_id, in_flight) until its result arrives, then
        # (worker_id, in_flight, result) while parked behind an earlier batch
        self._task_info: dict[int, tuple[Any, ...]] = {}
        self._tasks_outstanding = 0
        ran_on = getattr(self, "_workers_status", None)  # the last epoch's; True: not ended
        self._workers_status = [True] * self._num_workers  # False: its IterableDataset ran out
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        progress = self._progress
        if progress.dataset_states is None or not self._persistent_workers:
            progress.dataset_states = [None] * self._num_workers
        elif self._dataset_kind == _DatasetKind.Iterable:
            # Persistent workers keep their dataset copies, and a new epoch restarts their
            # iterators: until a worker delivers in this epoch, its state is where the last
            # epoch left its copy, which a resume settles before iterating anew. A worker
            # still running when the loop left that epoch dropped its iterator unfinished.
            progress.dataset_states = [
                dataset_state.finished(state, left=bool(ran_on and ran_on[w]))
                for w, state in enumerate(progress.dataset_states)
            ]
        progress.next_worker = 0
        self._round_robin_start = 0  # the worker of this iterator's batch 0
        if resume is not None and resume.worker_states is not None:
            progress.dataset_states = list(resume.worker_states)
            if resume.workers_status is not None:
                self._workers_status = list(resume.workers_status)
        if resume is not None and resume.rng_states is not None:
            progress.rng_states = list(resume.rng_states)
        elif progress.rng_states is None or not self._persistent_workers:
            # Persistent workers keep their generators across epochs: so do their states.
            progress.rng_states = [None] * self._num_workers
        # What a resume that replays this epoch starts the generators from (_state point 10).
        progress.epoch_rng_states = list(progress.rng_states)
        if resume is not None and not resume.replay_data:
            # The round robin resumes at the worker after the one that made the last delivered
            # batch (_state point 9); a replay runs it again from the first worker.
            progress.next_worker = resume.next_worker % self._num_workers
            self._round_robin_start = progress.next_worker
            for _ in range(progress.next_worker):
                next(self._worker_queue_idx_cycle)
        # Which workers' IterableDataset ended as of the batches delivered, for state_dict():
        # a worker's end is behind the loop only once every batch it made before it is.
        progress.workers_alive = list(self._workers_status)
        self._ends: dict[int, Result] = {}  # worker -> its end's result, not yet behind
        self._fill()

    def _in_flight(self) -> int:
        """Batches dispatched and not delivered: results parked in the reorder table count
        (each dispatches its successor when delivered, as in torch)."""
        return self._tasks_outstanding + sum(len(info) == 3 for info in self._task_info.values())

    def _fill(self) -> None:
        """Dispatch until ``prefetch_factor * num_workers`` batches are in flight (or none left)."""
        for _ in range(self._max_tasks - self._in_flight()):
            self._try_put_index()

    def _dispatch_as_torch_would(self) -> None:
        """Top up an abandoned epoch's batches in flight to what torch's iterator keeps in
        flight: the lean path (``threaded``) dispatches none ahead. Persistent workers make
        every batch given to them before the next epoch, as torch's do (``_finish_abandoned``),
        so what those batches draw from a worker's generators is drawn whatever the
        concurrency limit was at the break."""
        while (self._drawn or not self._sampler_done) and self._in_flight() < self._max_tasks:
            sent = self._send_idx
            DispatchingIter._try_put_index(self)  # also on the lean path, which dispatches none
            if self._send_idx == sent:
                return

    def _finish_abandoned(self) -> None:
        """Wait for every batch of the abandoned epoch in flight, as torch's ``_reset`` waits
        for its persistent workers, and keep the state each worker's copy is left in: a state
        taken in the next epoch, before a worker delivers there, holds what those batches did
        to its dataset copy and generators. Their data is dropped."""
        # Parked results (their slots go back with the restart) came before the rest, per worker.
        for _, info in sorted(self._task_info.items()):
            if len(info) == 3:
                self._keep_state_of(info[2])
        while (result := self._next_in_flight()) is not None:
            del self._task_info[result.idx]
            if isinstance(result.data, _IterableDatasetStopIteration):
                self._workers_status[result.worker_id] = False
            self._keep_state_of(result)
            self._drop(result)

    def _next_in_flight(self) -> Result | None:
        """The next result of a batch in flight, waited for; None when no worker still owes one
        (a worker whose IterableDataset ended answers none of its later tasks)."""
        waiting = [
            i
            for i, info in self._task_info.items()
            if len(info) == 2 and self._workers_status[info[0]]
        ]
        if not waiting:
            return None
        result = self._get_result(self._task_info[min(waiting)])
        self._tasks_outstanding -= 1
        return result

    def progress_after_in_flight(self) -> Progress:
        """A copy of the progress whose dataset and generator states are those each worker is
        left in once every batch of this map-style epoch in flight is made, topped up as
        torch's iterator keeps them: where a next epoch on these persistent workers starts
        (``_finish_abandoned``).

        For a state taken after the loop left the epoch and ``set_epoch`` moved on. The batches
        are waited for and parked, not dropped: a loop that goes on still receives them; the
        progress itself stays as of the batches delivered. Called on the training thread.
        """
        self._dispatch_as_torch_would()
        while (result := self._next_in_flight()) is not None:
            self._task_info[result.idx] += (result,)
        after = copy.copy(self._progress)
        after.dataset_states = _copied(after.dataset_states)
        after.rng_states = _copied(after.rng_states)
        for _, info in sorted(self._task_info.items()):
            _keep_state(after, info[2])
        return after

    def _keep_state_of(self, result: Result) -> None:
        """Record the states a batch left its worker's copy and generators in."""
        _keep_state(self._progress, result)

    def _drop(self, result: Result) -> None:
        """Let go of a result that will never be delivered (its slot, in a helper's ring)."""

    def _forget_in_flight(self) -> None:
        """Drop every batch dispatched and not delivered (their results will be stale)."""
        self._drawn.clear()
        self._task_info.clear()
        self._send_idx = self._progress.draws = self._rcvd_idx  # the next draw is sent next
        self._tasks_outstanding = 0
        self._workers_num_tasks = [0] * self._num_workers

    def _try_put_index(self) -> None:
        if self._tasks_outstanding >= self._max_tasks:
            raise AssertionError("more batches in flight than num_workers * prefetch_factor")
        drawn = self._next_drawn()
        if drawn is None:
            return
        worker_id, index = drawn
        in_flight = self._send(worker_id, self._send_idx, index)
        self._task_info[self._send_idx] = (worker_id, in_flight)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _draw(self) -> tuple[int, Any] | None:
        """The next index and its round-robin worker, as torch's ``_try_put_index`` draws them;
        None when the sampler ran out or no worker can take it (torch drops the index then)."""
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_done = self._progress.pass_ran_out = True
            return None
        worker_id = self._next_worker()
        return None if worker_id is None else (worker_id, index)

    def _next_drawn(self) -> tuple[int, Any] | None:
        """The next index to make and its worker: the oldest drawn ahead (point 4), else
        ``_draw``'s."""
        return self._drawn.popleft() if self._drawn else self._draw()

    def _draw_ahead(self) -> None:
        """Draw the index torch would dispatch now, without dispatching it (point 4)."""
        if len(self._drawn) + self._in_flight() >= self._max_tasks:
            return
        drawn = self._draw()
        if drawn is not None:
            self._drawn.append(drawn)

    def _next_worker(self) -> int | None:
        """The next live worker in round-robin order (torch's), or None if none can take more."""
        for _ in range(self._num_workers):
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id] and (
                self._in_order
                or self._workers_num_tasks[worker_id] < self._max_tasks // sum(self._workers_status)
            ):
                return worker_id
        return None

    def _next_index(self) -> Any:
        start = time.perf_counter()
        self._progress.indices_drawn = True
        try:
            index = next(self._sampler_iter)
        finally:
            self._stats.caller.add("sampler", time.perf_counter() - start)
        self._progress.note_draw()
        return index

    def _next_data(self) -> Any:
        self._stats.on_call()
        start = time.perf_counter()
        self._ready, self._ran_here = True, False  # _get_result may clear / set them
        delivered = ended = False
        try:
            data = self._next_replayed_batch()
            delivered = True
            return data
        except StopIteration:
            self._progress.exhausted = ended = True
            raise
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C (or a SIGTERM handler's sys.exit()) while waiting: the epoch is over and the
            # workers must stop, but the user must not wait for one stuck in a slow read (torch
            # raises at once too).
            self._abandon()
            raise
        finally:
            waited = time.perf_counter() - start
            self._stats.on_next(waited, self._ready, self._ran_here, delivered, ended)

    def _next_replayed_batch(self) -> Any:
        """The next batch, past those a replay drops (``_state`` point 4): the batches the loop
        received before the save, and the errors it was raised, which are not raised again."""
        while True:
            self._raised_a_batchs_error = False
            try:
                data = self._next_batch()
            except Exception:
                # Counted among the results the loop received where the state counts each
                # worker's; an older state's count holds the batches alone: raised again.
                if (
                    self._raised_a_batchs_error
                    and self._discard_by_worker is not None
                    and self._replayed()
                ):
                    continue
                raise
            if not self._replayed():
                return data

    def _next_batch(self) -> Any:
        while True:
            # Skip batches dispatched to workers whose IterableDataset ran out before them.
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info is not None:
                    if len(info) == 3 or self._workers_status[info[0]]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if self._drawn:  # drawn ahead and not dispatched yet (point 4): send them
                    sent = self._send_idx
                    self._fill()
                    if self._send_idx != sent:
                        continue
                if self._closes_at_end():
                    self.close()
                raise StopIteration

            info = self._task_info[self._rcvd_idx]
            if len(info) == 3:  # arrived earlier, parked in the reorder table
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process_data(info[2])

            result = self._get_result(info)
            self._tasks_outstanding -= 1
            if isinstance(result.data, _IterableDatasetStopIteration):
                self._workers_status[result.data.worker_id] = False
                self._ends[result.data.worker_id] = result
                self._note_ends()
                self._try_put_index()
                continue
            if result.idx != self._rcvd_idx:
                if not self._in_order:
                    del self._task_info[result.idx]
                    return self._process_data(result)
                self._task_info[result.idx] += (result,)
                continue
            del self._task_info[result.idx]
            self._rcvd_idx += 1
            return self._process_data(result)

    def _note_ends(self) -> None:
        """Mark in the progress the workers whose IterableDataset ended and whose every earlier
        batch was delivered: a state taken now resumes each of the others, their batches still
        to come included (an end can arrive before the worker's last batches are delivered)."""
        task_info = self._task_info
        for worker_id, end in list(self._ends.items()):
            if not any(i < end.idx and info[0] == worker_id for i, info in task_info.items()):
                self._progress.workers_alive[worker_id] = False
                if end.state is None and end.rng is not None:
                    # Its generators as its end left them, what it drew for a partial batch
                    # drop_last dropped included: a resume runs no iterator of a dataset
                    # without state to its end (one with state is, and draws then again).
                    self._progress.rng_states[worker_id] = end.rng  # type: ignore[index]
                del self._ends[worker_id]

    def _process_data(self, result: Result) -> Any:
        self._workers_num_tasks[result.worker_id] -= 1
        self._try_put_index()
        try:
            return self._deliver(result)
        finally:
            # After the batch's own states are kept: an end that arrived before this batch, its
            # worker's last, came after it.
            if self._ends:
                self._note_ends()

    def _replayed(self) -> bool:
        """Whether the batch just taken is one the loop received before the save (replaying an
        IterableDataset without state, ``_state`` point 4): counted off per worker where the
        state says how many of each worker's batches the loop received, since batches
        delivered as completed (``in_order=False``) came in no fixed order. False once the
        replay is done, or where there is none."""
        if not self._discard:
            return False
        by_worker = self._discard_by_worker
        if by_worker is not None:
            worker_id = self._delivered_by
            if not by_worker[worker_id]:
                return False
            by_worker[worker_id] -= 1
            self._progress.worker_batches[worker_id] -= 1  # counted as received from the start
        self._discard -= 1
        return True

    def _deliver(self, result: Result) -> Any:
        """Record what delivering ``result`` changes in the progress; its batch, or its error."""
        worker_id = self._delivered_by = result.worker_id
        progress = self._progress
        progress.worker_batches[worker_id] += 1
        self._keep_state_of(result)
        progress.next_worker = (worker_id + 1) % self._num_workers
        if self._map_style:
            progress.behind(result.idx)  # delivered or raised: its indices are used (_state 7)
        if isinstance(result.data, ExceptionWrapper):
            self._raised_a_batchs_error = True  # a result the worker made: a replay counts it
            reraise(result.data)
        return self._unpack(result)


def _keep_state(progress: Progress, result: Result) -> None:
    """Record in ``progress`` the states ``result``'s batch left its worker's copy and
    generators in."""
    if result.state is not None and progress.dataset_states is not None:
        progress.dataset_states[result.worker_id] = result.state
    if result.rng is not None and progress.rng_states is not None:
        progress.rng_states[result.worker_id] = result.rng


def _copied(states: list[Any] | None) -> list[Any] | None:
    return list(states) if states is not None else None


def reraise(wrapper: ExceptionWrapper) -> NoReturn:
    """Raise what ``ExceptionWrapper.reraise()`` raises: same type, torch's message format; a
    ``BaseException`` that is no ``Exception`` as ``RuntimeError``, as torch's loader raises
    when a worker process dies of one.

    torch's version keeps the new exception in a local of its own frame, which the exception's
    traceback references: a reference cycle that keeps the iterator, and so its workers, alive
    until the cyclic garbage collector happens to run. Here the local is deleted on the way out,
    so dropping the exception is enough to drop the iterator.
    """
    msg = f"Caught {wrapper.exc_type.__name__} {wrapper.where}.\nOriginal {wrapper.exc_msg}"
    exc: BaseException
    if not issubclass(wrapper.exc_type, Exception):
        # SystemExit, a KeyboardInterrupt the code raised, another BaseException: torch's
        # worker process dies of it and its loader raises RuntimeError, which a loop catching
        # Exception to skip a bad batch survives. (A Ctrl-C reaches the training thread only.)
        exc = RuntimeError(msg)
    elif wrapper.exc_type is KeyError:
        exc = KeyError(KeyErrorMessage(msg))
    elif getattr(wrapper.exc_type, "message", None):
        exc = wrapper.exc_type(message=msg)
    else:
        try:
            exc = wrapper.exc_type(msg)
        except Exception:  # noqa: BLE001  # a constructor needing other arguments: torch's fallback
            exc = RuntimeError(msg)
    try:
        raise exc
    finally:
        del exc
