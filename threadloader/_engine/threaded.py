"""One pass over the data with worker threads of this process.

Dispatch, reorder and delivery are torch's, in ``_dispatch.DispatchingIter``; this module moves
tasks to worker threads and results back, and decides who runs a batch. How an epoch behaves;
where the code disagrees with this, the code is wrong.

1. When the batch the training loop needs was dispatched to a worker that has not started it
   (its thread has not been scheduled yet, or it is parked at the concurrency gate), the training
   thread runs it itself, as that worker: with the worker's ``WorkerInfo`` installed and the
   worker's ``busy`` lock held, so the worker's tasks still run one at a time and in order.
   Waiting instead would cost a thread hand-off per batch, which for cheap GIL-holding items
   costs more than the item. Map-style datasets only (an IterableDataset's iterator lives in its
   worker), with ``in_order=True`` only (out of order, the loop takes whichever batch a worker
   finishes first), and never under a ``timeout``.
2. Drained: the last batch is delivered, the workers are joined (unless persistent, or with
   ``device=``, whose epoch closes this one when the loop reaches its end), and
   ``StopIteration`` is raised.
3. Worker error: raised by ``__next__`` at that batch's turn, with the worker id, the batch's
   indices and the original traceback; as in torch, the epoch goes on if ``next()`` is called
   again. A ``timeout`` expiring ends the epoch instead (torch would let ``next()`` wait again):
   its threads are released at once, since the error's traceback keeps this iterator alive.
4. Abandoned (``break``, ``del``, garbage collection, ``KeyboardInterrupt``, interpreter exit):
   nothing new is fetched, not even the rest of a batch a thread is in (``fetch.Abandoned``),
   and every thread is joined. The workers never reference this object,
   so dropping it is enough for the finalizer to run.
5. Lean path: while the fetching limit is 0 (the controller found that the training thread alone
   is fastest: a GIL-bound dataset), nothing is dispatched ahead. Once the batches in flight are
   delivered, each ``next()`` makes the next index's batch right here, as the worker the round
   robin gave it to (point 1's rules), with no task, queue or reorder entry: per batch, the
   bookkeeping of ``num_workers=0`` plus the worker's ``WorkerInfo``. Indices are still drawn as
   torch dispatches them, ``prefetch_factor * num_workers`` ahead (``dispatch`` point 4). When
   the limit rises, dispatching resumes from the next index, so the batches, their order and
   which worker made each are the same on either path.
6. An epoch that starts on the lean path (the last epoch settled at 0) with no
   ``worker_init_fn`` starts no thread: the training thread makes each worker's fetcher (no
   user code runs, so which thread does cannot be told), and the threads start when the limit
   first rises above 0. Starting and joining two threads cost ~1 ms an epoch: a 32-batch epoch
   of token windows, 30 us a batch.
7. A move (``mover``, set by the loader: ``isolation="auto"``'s first epoch) may take the
   workers out of this process mid-epoch. Once it is due, nothing more is dispatched; once
   every batch in flight was delivered, the move carries the workers on elsewhere (this
   iterator then becomes that kind of epoch), or declines, and the epoch goes on here: in
   threads if they still run, else on the training thread (point 5). Helpers forked from this
   process take the workers after their threads were joined; helpers that receive them pickled
   (``carry_workers``) load them while the threads wait, idle, and the threads are joined only
   once the helpers have.
   Map-style epochs only (point 1's), since the training thread must be able to make every
   batch itself if the move declines after the threads were joined.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

from torch.utils.data import _DatasetKind

from threadloader._engine.device_epoch import host_collate
from threadloader._engine.dispatch import DispatchingIter
from threadloader._engine.state import Resume
from threadloader._engine.stats import LoaderStats
from threadloader._engine.tasks import NewEpoch, Result, Task
from threadloader._engine.worker import CarriedWorker, Worker
from threadloader._engine.worker_handles import ThreadHandle
from threadloader._engine.workers import WorkerPool
from threadloader._primitives.concurrency import ConcurrencyController, usable_cpus
from threadloader._primitives.finalizers import Finalizer
from threadloader._primitives.queues import QueueClosed

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

#: How often the training thread, waiting for a batch it could not run itself, looks again.
RETRY_S = 0.02


class Mover(Protocol):
    """Takes an epoch's workers out of this process mid-epoch (point 7)."""

    def due(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Whether to start the move; asked after each batch delivered."""
        ...

    def move(self, epoch: ThreadedDataLoaderIter) -> bool:
        """Move, with nothing in flight; False when it declined: the epoch goes on here, in
        threads unless it called ``join_threads`` first."""
        ...


def _controller(loader: DataLoader[Any], num_workers: int, minimum: int) -> ConcurrencyController:
    """This epoch's controller: the previous epoch's carried on, if it had as many workers."""
    previous = getattr(loader, "_stats", None)
    controller = previous.controller if previous is not None else None
    if controller is not None and (controller.maximum, controller.minimum) == (
        num_workers,
        minimum,
    ):
        return controller.next_epoch()
    return ConcurrencyController(num_workers, minimum=minimum, cpus=usable_cpus())


class ThreadedDataLoaderIter(DispatchingIter):
    """The iterator ``iter(ThreadDataLoader(..., num_workers=N))`` returns for N > 0.

    Through ``DispatchingIter`` it subclasses torch's ``_BaseDataLoaderIter``, so that
    ``__next__`` (length warning for IterableDatasets, profiler range), seed drawing and
    pin-memory warnings are torch's own.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        resume: Resume | None = None,
        *,
        log_every_s: float | None = None,
    ) -> None:
        super().__init__(loader, resume)
        # The training thread may run a map-style batch itself (point 1 above), except under a
        # timeout: a batch that takes too long must raise, as torch's does, not block here; and
        # except with in_order=False, whose batches come as the workers finish them: running one
        # here would wait for it, however slow, as torch's workers never make the loop do.
        self._run_here = (
            loader._dataset_kind == _DatasetKind.Map and not loader.timeout and loader.in_order
        )
        spec = self._worker_spec(
            loader, resume, host_collate(loader, self._collate_fn, self._pin_memory)
        )
        # Fewer fetching workers than num_workers is only safe when the training thread can run
        # the batches they leave waiting: else one worker stuck in a slow read would stall the
        # batches queued behind the gate (and a timeout would fire on the wrong batch).
        self._concurrency = _controller(
            loader, self._num_workers, minimum=0 if self._run_here else self._num_workers
        )
        self._log_every_s = log_every_s
        self._new_stats()
        self._pool = WorkerPool(
            spec,
            base_seed=int(self._base_seed),
            max_tasks=max(1, self._prefetch_factor * self._num_workers),
            name=f"threadloader-{id(self):x}",
            recorders=self._stats.workers,
            # Point 6: an epoch that starts on the lean path starts its threads only if needed.
            start=not (
                self._run_here and self._concurrency.limit == 0 and loader.worker_init_fn is None
            ),
        )
        self._pool.gate.set_limit(self._concurrency.limit)
        self._stats.workers_active = self._pool.gate.active
        # torch's iterator lists its worker processes here; ours lists the worker threads.
        self._workers = [ThreadHandle(self._pool, i) for i in range(self._num_workers)]
        # The finalizer holds the pool, never self: break, del and GC all end the threads. A
        # Ctrl-C landing in it stops the join and reaches the loop (_finalizers point 2).
        self._finalizer = Finalizer(
            self, self._pool.close, on_interrupt=functools.partial(self._pool.close, wait=False)
        )
        self._generation = 0
        self._all_ready = False  # every worker ran its worker_init_fn (then stays True)
        self.mover: Mover | None = None  # point 7; only for epochs with _run_here
        self._draining = False  # a move is due: dispatch nothing, deliver what is in flight
        self._threadless = False  # the threads were joined for a move that declined
        self._reset(loader, first_iter=True)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} delivered={self._rcvd_idx} dispatched={self._send_idx} "
            f"in_flight={self._tasks_outstanding} {self._pool!r}>"
        )

    def close(self) -> None:
        """Stop and join the worker threads now. Idempotent; later ``next()`` calls raise.

        Raises:
            KeyboardInterrupt: Ctrl-C while joining (the threads left exit on their own).
        """
        if self._finalizer.detach() is not None:
            self._pool.close()

    def _abandon(self) -> None:
        """End the epoch now, without waiting for a worker inside user code (timeout, Ctrl-C)."""
        self._finalizer.detach()
        self._pool.close(wait=False)

    def _restart_workers(self, redispatch: bool = False) -> None:
        if redispatch:
            self._generation = self._pool.new_epoch(None, rewind=self._rcvd_idx)
        else:
            self._generation = self._pool.new_epoch(self._shared_seed)

    def in_its_worker(self) -> bool:
        """Whether the calling thread runs one of this epoch's workers (the dataset's code)."""
        return self._pool.serves_current_thread()

    def _new_stats(self) -> None:
        super()._new_stats()
        pool = getattr(self, "_pool", None)  # absent on the first call, from __init__
        if pool is not None:
            for worker, recorder in zip(pool.workers, self._stats.workers, strict=True):
                worker.recorder = recorder
            self._stats.workers_active = pool.gate.active

    def _send(self, worker_id: int, idx: int, index: Any) -> Task:
        task = Task(idx, index, self._generation)
        self._pool.workers[worker_id].tasks.put(task)
        return task

    def _get_result(self, needed: tuple[Any, ...]) -> Result:
        """The next result of this epoch: run the needed batch here if no worker started it."""
        if not self._pool.results:
            self._ready = False  # for stats() only: a snapshot that may be stale at once
        while True:
            if self._run_here:
                result = self._run_if_not_started(*needed)
                if result is not None:
                    self._ready, self._ran_here = False, True
                    return result
                # Its worker is busy (starting up, or on an earlier task) and may then park at
                # the gate, leaving the batch to us: look again soon rather than wait for it.
                wait: float | None = RETRY_S
            else:
                wait = self._timeout if self._timeout > 0 else None
            try:
                result = self._pool.results.get(wait)
            except TimeoutError:
                if self._run_here:
                    continue
                # A worker is stuck in user code: end the epoch without waiting for it (it exits
                # when that call returns), so the caller is not blocked past its own timeout.
                self._abandon()
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None
            except QueueClosed:
                raise RuntimeError(
                    "this threadloader iterator was closed (KeyboardInterrupt or close()); "
                    "start a new epoch with iter(loader)"
                ) from None
            if result.generation == self._generation:
                return result

    def _run_if_not_started(self, worker_id: int, task: Task) -> Result | None:
        worker = self._pool.workers[worker_id]
        if not worker.busy.acquire(blocking=False):
            return None  # the worker is running something: let it
        try:
            if not worker.ready:
                return None
            taken = worker.tasks.take_head_if(task) or (
                _start_pending_epoch(worker) and worker.tasks.take_head_if(task)
            )
            return worker.run_timed(task, self._stats.caller) if taken else None
        finally:
            worker.busy.release()

    # -- the lean path (point 5 of the module docstring) --------------------------------------

    def _lean(self) -> bool:
        return self._run_here and (self._threadless or self._concurrency.limit == 0)

    def _try_put_index(self) -> None:
        if self._lean() or self._draining:
            self._draw_ahead()  # nothing is dispatched, but the sampler goes at torch's pace
        else:
            super()._try_put_index()

    def _next_batch(self) -> Any:
        if self._draining and not self._task_info:  # point 7: nothing in flight, move now
            self._draining = False
            mover, self.mover = self.mover, None
            assert mover is not None
            if mover.move(self):
                self._fill()  # as the epoch it became
                return self._next_batch()
            self._fill()  # declined: dispatch ahead again (a no-op on the lean path)
        if not self._task_info and self._lean():  # every batch dispatched was delivered
            if self._workers_ready():
                return self._fetch_here()
            super()._try_put_index()  # a worker is still starting: hand it its batch as usual
        return super()._next_batch()

    def _workers_ready(self) -> bool:
        if not self._all_ready:
            self._all_ready = all(w.ready for w in self._pool.workers)
        return self._all_ready

    def _fetch_here(self) -> Any:
        """Make the next batch here, as its round-robin worker: the one drawn ahead for it
        (``dispatch`` point 4), or the next index now."""
        drawn = self._next_drawn()
        if drawn is None:  # the sampler ran out (every live worker has room: none is in flight)
            if self._closes_at_end():
                self.close()
            raise StopIteration
        worker_id, index = drawn
        worker = self._pool.workers[worker_id]
        task = Task(self._send_idx, index, self._generation)
        self._send_idx += 1
        self._rcvd_idx = self._send_idx
        with worker.busy:  # waits only for a stale task the worker is finishing
            if worker.generation != self._generation:
                _start_pending_epoch(worker)
            # No CPU timing: the controller needs it only to try fewer threads than 0.
            result = worker.run_timed(task, self._stats.caller, cpu_time=False)
        self._ready, self._ran_here = False, True
        self._draw_ahead()  # torch dispatches one more as it delivers one (even an error)
        return self._deliver(result)

    def _unpack(self, result: Result) -> Any:
        if self._sampler_done:
            # The last batches drain with nothing dispatched behind them: their rate says
            # nothing about the limit (32 threads ending an epoch delivered at 8x their rate,
            # and the next epoch took that for the rate to compare itself with).
            return result.data
        if self._threadless:
            return result.data
        limit = self._concurrency.on_batch(result.started, result.cpu, result.wall)
        if limit is not None:
            if limit > 0:
                self._pool.start()  # a no-op once started (point 6)
            self._pool.gate.set_limit(limit)
            self._fill()  # leaving the lean path: dispatch ahead again (a no-op on it)
        if self.mover is not None and not self._draining and self.mover.due(self):
            self._draining = True  # point 7
        return result.data

    def join_threads(self) -> None:
        """Join the worker threads for a move (point 7), keeping the workers; from here on,
        unless the move carries them on elsewhere, the training thread makes every batch.

        Raises:
            KeyboardInterrupt: Ctrl-C while joining (the threads left exit on their own).
        """
        for worker in self._pool.workers:
            with worker.busy:
                _start_pending_epoch(worker)
        self._threadless = True
        self._pool.close(keep=True)
        self._finalizer.detach()  # after the join: a Ctrl-C in it leaves the pool to the finalizer

    def carry_workers(self) -> list[CarriedWorker]:
        """Every worker as it stands, for helpers that receive them pickled (point 7). Called
        with nothing in flight, so their threads wait, idle; they are joined only once the
        helpers have loaded the workers (``join_threads``), and go on if the move declines.
        """
        carried = []
        for worker in self._pool.workers:
            with worker.busy:
                _start_pending_epoch(worker)
                carried.append(worker.carried())
        return carried

    @property
    def workers_ready(self) -> bool:
        """Whether every worker has run its ``worker_init_fn`` and made its fetcher."""
        return self._workers_ready()

    @property
    def makes_batches_itself(self) -> bool:
        """Whether the training thread may make any batch itself (point 1): a move's condition."""
        return self._run_here

    @property
    def delivered(self) -> int:
        """Batches this iterator has returned so far."""
        return int(self._num_yielded)

    def stats_so_far(self) -> LoaderStats:
        """The epoch's stats up to now, as ``loader.stats()`` gives them."""
        return self._stats.snapshot()

    @property
    def pool(self) -> WorkerPool:
        """The epoch's worker pool (its workers, and how many of its threads run)."""
        return self._pool


def _start_pending_epoch(worker: Worker) -> bool:
    """Start the new epoch a parked worker has not seen yet, on its behalf (holding ``busy``).

    A live change of the index stream restarted every worker, and on the lean path only those
    the training thread made a batch for have started the new epoch: a move, which drops the
    others' restarts with the pool, starts them first, as a helper runs only a worker's current
    epoch.
    """
    head = worker.tasks.head()
    if isinstance(head, NewEpoch) and worker.tasks.take_head_if(head):
        worker.start_epoch(head.generation, head.seed, head.rewind, head.begins)
        return True
    return False
