"""Worker threads: what one worker is, what its thread runs, and the pool that owns them all.

A worker is torch's worker process turned into a thread of the training process:

- it gets a ``WorkerInfo`` of its own (``worker_method="thread"``, ``rng`` set), installed in a
  thread-local that torch's ``get_worker_info()`` consults (see ``worker_info``);
- its seed is ``base_seed + worker_id`` as in torch, which seeds *its own* generators
  (``random.Random``, ``torch.Generator``, numpy ``Generator`` and legacy ``RandomState``);
- like a worker process, it runs torch's CPU ops on one intra-op thread (``intra_op``), which
  leaves the training thread's number alone;
- each worker sees its own copy of the dataset object (``dataset_copy``: shallow, so the data
  it references is in memory once), and its thread's global RNG functions reach its own
  generators (``_primitives.worker_globals``), as a worker process has its own of both.

The pool owns every thread it starts and joins them in ``close()``, which is idempotent and safe
from a finalizer, from an interpreter-exit hook and from one of its own threads.
"""

from __future__ import annotations

import threading
import time

from torch.utils.data import get_worker_info as current_worker_info

from threadloader._engine.tasks import NOTHING, NewEpoch, Result, Task, WorkerSpec
from threadloader._engine.worker import Worker, current_context, leave
from threadloader._primitives import exit_hook, worker_globals
from threadloader._primitives.gate import Gate
from threadloader._primitives.intra_op import single_intra_op_thread
from threadloader._primitives.queues import BoundedQueue, QueueClosed
from threadloader._primitives.timing import StageRecorder

#: Seconds ``close()`` waits in all for threads to finish their current task. A thread still
#: inside a slow ``__getitem__`` after that is left to finish it on its own (it is a daemon and
#: will fetch nothing more): shutdown must not hang on user code.
JOIN_TIMEOUT_S = 10.0


def _worker_loop(
    worker: Worker, gate: Gate, results: BoundedQueue[Result], finished: threading.Event
) -> None:
    """What one worker thread runs: wait for a task and a gate slot, run it, hand it back.

    The task stays at the head of the worker's queue until the worker holds a gate slot and its
    ``busy`` lock, so that meanwhile the training thread may take it and run it itself.
    ``finished`` is set as the thread ends.
    """
    try:
        single_intra_op_thread()
        previous = current_context()
        try:
            worker.enter()  # for the thread's whole life
            _serve(worker, gate, results)
        finally:
            # Nothing left on this thread's torch mode stack when it ends (ours, or one user
            # code left): an object there is released by a C++ thread-local destructor, which
            # aborts the process if Python is finalizing.
            leave(previous)
            worker_globals.clear_modes()
    finally:
        finished.set()


def _serve(worker: Worker, gate: Gate, results: BoundedQueue[Result]) -> None:
    with worker.busy:
        if not worker.ready:  # else the training thread did (``WorkerPool(start=False)``)
            worker.initialize()
    while True:
        if not gate.wait_open():
            return
        try:
            msg = worker.tasks.peek()
        except QueueClosed:
            return
        if isinstance(msg, NewEpoch):
            with worker.busy:
                if worker.tasks.take_head_if(msg):
                    worker.start_epoch(msg.generation, msg.seed, msg.rewind, msg.begins)
            continue
        if not gate.enter():
            return
        if not worker.busy.acquire(blocking=False):
            # The training thread is running this worker's task: wait for it without holding
            # a slot of the gate, which another worker can use meanwhile.
            gate.exit()
            with worker.busy:
                pass
            del msg
            continue
        try:
            if not worker.tasks.take_head_if(msg):
                continue  # the training thread ran it, or a new epoch dropped it
            if msg.generation == worker.generation:
                result = worker.run_timed(msg, worker.recorder)
                if result.data is not NOTHING:
                    results.put(result)
                del result
        finally:
            worker.busy.release()
            gate.exit()
        del msg  # a blocked peek() must not pin the last batch's task (CPython's thread.py)


class WorkerPool:
    """The worker threads of one iterator: started together, closed and joined together.

    Args:
        spec: what the workers share.
        base_seed: torch's per-iterator seed; worker ``i`` gets ``base_seed + i``.
        max_tasks: the dispatcher's bound on tasks in flight (``num_workers * prefetch_factor``).
        name: thread-name prefix, e.g. ``threadloader-7f3a``, so a stack dump reads on its own.
        recorders: one stage recorder per worker, for ``stats()``.
        start: start the threads now. ``False`` (an epoch that begins with the training thread
            fetching alone, and no ``worker_init_fn``): the calling thread initializes every
            worker now, and the threads start on the first ``start()``, if ever.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        base_seed: int,
        max_tasks: int,
        name: str,
        recorders: list[StageRecorder],
        start: bool = True,
    ) -> None:
        n = spec.num_workers
        # Bounds (see _queues): each worker holds at most max_tasks tasks plus one NewEpoch;
        # results hold at most the tasks in flight plus one stale result per worker.
        self.results: BoundedQueue[Result] = BoundedQueue(max_tasks + 2 * n, f"{name}-results")
        self.workers = [Worker(spec, i, base_seed, max_tasks + 1, recorders[i]) for i in range(n)]
        self.gate = Gate(n)
        self.generation = 0
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        # Set as each thread ends: what close() waits for. CPython 3.11 marks a thread whose
        # join a Ctrl-C interrupted as stopped, and a later join of it returns at once.
        self._finished: list[threading.Event] = []
        self._name = name
        exit_hook.track(self)
        if start:
            self.start()
            return
        try:
            for w in self.workers:
                # No user code runs here (no worker_init_fn): only the fetcher is made, and
                # which thread makes it cannot be told apart.
                with w.busy:
                    w.initialize_here()
        except BaseException:  # a KeyboardInterrupt: untrack the pool before it is dropped
            self.close()
            raise

    def start(self) -> None:
        """Start the worker threads, unless started (or closed) already; from the owner only."""
        error: BaseException | None = None
        with self._lock:
            if self._threads or self._closed:
                return
            try:
                for w in self.workers:
                    finished = threading.Event()
                    t = threading.Thread(
                        target=_worker_loop,
                        args=(w, self.gate, self.results, finished),
                        name=f"{self._name}-worker{w.id}",
                        daemon=True,  # never block exit; the exit hook joins them first
                    )
                    t.start()
                    self._threads.append(t)
                    self._finished.append(finished)
            except BaseException as e:  # noqa: BLE001  # re-raised below, once closed
                error = e
        if error is not None:
            self.close()  # joins the threads that did start
            raise error

    def serves_current_thread(self) -> bool:
        """Whether the calling thread runs one of this pool's workers now: one of its threads,
        or the training thread making a batch as one of them (``current_context``)."""
        info = current_worker_info()
        return info is not None and any(info is w.info for w in self.workers)

    @property
    def alive_threads(self) -> int:
        """How many of the pool's threads run now (a snapshot)."""
        return sum(t.is_alive() for t in self._threads)

    def __repr__(self) -> str:
        alive = self.alive_threads
        return f"<WorkerPool {len(self._threads)} threads, {alive} alive, closed={self._closed}>"

    def new_epoch(self, seed: int | None = None, rewind: int | None = None) -> int:
        """Drop every task not started, and restart each worker's fetcher (persistent workers).

        A persistent epoch's restart finds none of a live worker's tasks queued: the iterator
        waited for every batch of the abandoned epoch first, as torch's ``_reset`` does
        (``dispatch``). A redispatch's queued tasks were drawn from a rewound sampler.

        Args:
            seed: the iterator's new shared seed, for an IterDataPipe graph (``datapipes``).
            rewind: a redispatch's first batch not delivered (``Worker.start_epoch``).

        Returns:
            The new generation: results of earlier generations are stale.
        """
        self.generation += 1
        generation = self.generation

        def restart(dropped: list[Task | NewEpoch]) -> NewEpoch:
            # The control messages the worker has not read yet come first, merged into one: it
            # makes nothing between them. Rewinds up to the first new epoch (its own included:
            # a merged message rewinds, then begins) go back to the earliest of them; from a
            # new epoch on, the worker has made nothing to go back past, and that epoch starts
            # from the state the rewinds left.
            messages = [m for m in dropped if isinstance(m, NewEpoch)]
            messages.append(NewEpoch(generation, seed, rewind, begins=rewind is None))
            begin = next((i for i, m in enumerate(messages) if m.begins), len(messages))
            rewinds = [m.rewind for m in messages[: begin + 1] if m.rewind is not None]
            seeds = [m.seed for m in messages if m.seed is not None]
            return NewEpoch(
                generation,
                seeds[-1] if seeds else None,
                min(rewinds) if rewinds else None,
                begins=begin < len(messages),
            )

        for w in self.workers:
            w.tasks.replace_all(restart)
        # Results the training thread never read (a break, a live weight change) would hold
        # room the new tasks need: the queue's bound counts one stale result per worker only.
        self.results.drop_where(lambda r: r.generation != generation)
        return generation

    def close(self, wait: bool = True, redeliver: bool = False, keep: bool = False) -> None:
        """Stop every worker and join its thread. Idempotent; safe from a finalizer or exit hook.

        Args:
            wait: join the threads, for at most ``JOIN_TIMEOUT_S`` in all. A thread still inside
                user code after that finishes that call on its own and exits, having nothing
                left to fetch. With ``False``, join none now: the pool stays with the exit hook,
                whose ``close()`` joins what is left at interpreter exit (a later ``close()``
                joins too).
            redeliver: called from a finalizer, which drops exceptions: a Ctrl-C during the
                join is sent to the main thread again (``exit_hook.redeliver_interrupt``).
            keep: the workers go on elsewhere (a move: ``threaded`` point 7), with nothing in
                flight. Otherwise a batch a thread is making stops before its next item: a
                Ctrl-C or ``break`` does not wait for the rest of a batch nobody will take.

        Raises:
            KeyboardInterrupt: Ctrl-C while joining, unless ``redeliver``.
        """
        with self._lock:
            self._closed = True
        if not keep:
            for w in self.workers:
                w.abandoned.set()
        # Every call wakes the threads again (each close is idempotent): a Ctrl-C may have
        # stopped an earlier call halfway (_finalizers point 2).
        for w in self.workers:
            w.tasks.close()
        self.gate.close()
        self.results.close()
        if not wait:
            return  # still tracked: the exit hook joins a thread still in user code then
        me = threading.current_thread()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            for t, finished in zip(self._threads, self._finished, strict=True):
                if t is not me:
                    finished.wait(max(0.0, deadline - time.monotonic()))
                    t.join(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            # Ctrl-C while joining: stop waiting (the rest exit on their own, and the exit
            # hook joins them), and make sure the main thread raises it: a finalizer would not.
            if not redeliver:
                raise
            exit_hook.redeliver_interrupt()
            return
        exit_hook.untrack(self)
