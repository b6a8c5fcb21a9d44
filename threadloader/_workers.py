"""Worker threads: what one worker is, what its thread runs, and the pool that owns them all.

A worker is torch's worker process turned into a thread of the training process:

- it gets a ``WorkerInfo`` of its own (``worker_method="thread"``, ``rng`` set), installed in a
  thread-local that torch's ``get_worker_info()`` consults (see ``_worker_info``);
- its seed is ``base_seed + worker_id`` as in torch, which seeds *its own* generators
  (``random.Random``, ``torch.Generator``, numpy ``Generator`` and legacy ``RandomState``); it
  never calls ``torch.set_num_threads`` (that would change the whole process);
- each worker sees its own copy of the dataset object (``_dataset_copy``: shallow, so the data
  it references is in memory once), and its thread's global RNG functions reach its own
  generators (``_worker_globals``), as a worker process has its own of both.

The pool owns every thread it starts and joins them in ``close()``, which is idempotent and safe
from a finalizer, from an interpreter-exit hook and from one of its own threads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.random  # else imported on first use: 5 ms into each isolation helper's start
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils.worker import (
    _RNG,
    WorkerInfo,
    _generate_state,
    _IterableDatasetStopIteration,
)

from threadloader import _dataset_state, _exit_hook, _worker_globals, _worker_info
from threadloader._concurrency import Gate
from threadloader._datapipes import reseed
from threadloader._dataset_copy import worker_copy
from threadloader._fetch import Fetcher
from threadloader._queues import BoundedQueue, QueueClosed
from threadloader._timing import StageRecorder
from threadloader._worker_globals import WorkerRNGs
from threadloader._worker_rng import load_rng_state, rng_state

#: Seconds ``close()`` waits in all for threads to finish their current task. A thread still
#: inside a slow ``__getitem__`` after that is left to finish it on its own (it is a daemon and
#: will fetch nothing more): shutdown must not hang on user code.
JOIN_TIMEOUT_S = 10.0


class Task:
    """One unit of work: the batch numbered ``idx`` in this epoch, and what to fetch for it.

    A plain class with slots rather than a frozen dataclass: one is made per batch on the
    training thread's hot path, where a frozen dataclass's ``__init__`` costs several times more.
    Compared by identity (the queues look for *this* task).
    """

    __slots__ = ("generation", "idx", "index")

    def __init__(self, idx: int, index: Any, generation: int) -> None:
        self.idx = idx
        self.index = index  # a list of indices (auto-collation), one index, or None (iterable)
        self.generation = generation

    def __repr__(self) -> str:
        return f"Task(idx={self.idx}, index={self.index!r}, generation={self.generation})"


@dataclass(frozen=True)
class NewEpoch:
    """Control message for persistent workers: start over on a fresh dataset iterator."""

    generation: int
    seed: int | None = None  # an IterDataPipe's new shared seed (_datapipes point 4)


class _Nothing:
    """What a worker whose IterableDataset already ran out makes of a task: nothing to send.

    Not ``None``: a dataset or a ``collate_fn`` may legitimately make a ``None`` batch.
    """

    def __repr__(self) -> str:
        return "NOTHING"

    def __reduce__(self) -> str:
        return "NOTHING"  # one object in every process


NOTHING: Final = _Nothing()


class Result:
    """What a worker hands back: batch ``idx`` of ``generation``, produced by ``worker_id``.

    Slots, not a dataclass, for the same reason as ``Task``.
    """

    __slots__ = ("cpu", "data", "generation", "idx", "rng", "started", "state", "wall", "worker_id")

    def __init__(
        self,
        idx: int,
        worker_id: int,
        generation: int,
        data: Any,
        state: Any = None,
        started: float | None = None,
        cpu: float | None = None,
        wall: float | None = None,
        rng: Any = None,
    ) -> None:
        self.idx = idx
        self.worker_id = worker_id
        self.generation = generation
        self.data = data  # the batch, an ExceptionWrapper, or _IterableDatasetStopIteration
        self.state = state  # the worker's IterableDataset state right after making it
        self.started = started  # time.perf_counter() when its fetch began (the controller's)
        self.cpu = cpu  # CPU seconds (time.thread_time) the fetch took
        self.wall = wall  # wall-clock seconds it took (with ``cpu``: how much of it was waiting)
        self.rng = rng  # the worker's generators right after making it (``save_worker_rng``)

    def __repr__(self) -> str:
        return f"Result(idx={self.idx}, worker_id={self.worker_id}, generation={self.generation})"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the workers of one loader share; read-only once the pool starts."""

    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    worker_init_fn: Callable[[int], None] | None
    num_workers: int
    capture_state: bool = False  # snapshot the dataset's state after each batch (_dataset_state)
    resume_states: list[Any] | None = None  # per-worker dataset states to resume from
    resume_state_form: int = 1  # how ``resume_states`` are written (_dataset_state point 3)
    capture_rng: bool = False  # snapshot the worker's generators after each batch
    resume_rng: list[Any] | None = None  # per-worker generator states to resume from


def _make_rngs(base_seed: int, worker_id: int) -> tuple[_RNG, WorkerRNGs]:
    """The worker's ``WorkerInfo.rng`` and its process-global RNGs, seeded as torch seeds a
    worker process.

    torch's worker process runs ``random.seed(seed)``, ``torch.manual_seed(seed)`` and
    ``np.random.seed(_generate_state(base_seed, worker_id))``: the same seeds, here for the
    worker's own generators, which its thread's global RNG functions reach (``_worker_globals``).
    """
    seed = base_seed + worker_id
    numpy_seed = _generate_state(base_seed, worker_id)
    rng = _RNG(
        random_generator=random.Random(seed),
        torch_generator=torch.Generator().manual_seed(seed),
        numpy_generator=np.random.default_rng(numpy_seed),
    )
    return rng, WorkerRNGs(rng, np.random.RandomState(numpy_seed))


class Worker:
    """One worker: its info, its task queue, and the lock held while one of its tasks runs.

    ``busy`` serialises the worker's tasks whoever runs them: the worker thread, or the training
    thread when it takes a task the worker has not started (``_iterator``). Per-worker state (the
    dataset iterator, the worker's generators) is therefore never used by two threads at once,
    and a worker's tasks run in dispatch order, so its random draws are reproducible.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        worker_id: int,
        base_seed: int,
        capacity: int,
        recorder: StageRecorder,
    ) -> None:
        self.id = worker_id
        self.recorder = recorder  # this epoch's; replaced (not mutated) by a new epoch
        self.spec = spec
        _worker_globals.install()
        rng, self.rngs = _make_rngs(base_seed, worker_id)
        # Made as this worker: a __setstate__ or __copy__ that draws must not move the
        # training thread's RNGs (a worker process unpickles its copy itself).
        outer = _worker_globals.swap(self.rngs)
        try:
            dataset = worker_copy(spec.dataset)
        finally:
            _worker_globals.swap(outer)
        self.info = WorkerInfo(
            id=worker_id,
            num_workers=spec.num_workers,
            seed=base_seed + worker_id,
            dataset=dataset,
            rng=rng,
            worker_method="thread",
        )
        self.tasks: BoundedQueue[Task | NewEpoch] = BoundedQueue(capacity, f"worker{worker_id}")
        self.busy = threading.Lock()
        self.ready = False  # worker_init_fn ran and the fetcher exists (set under `busy`)
        self.generation = 0
        self._fetcher: Any = None
        self._pending_error: ExceptionWrapper | None = None
        self._ended = False  # the IterableDataset ran out this epoch

    def _where(self) -> str:
        return f"in threadloader worker thread {self.id}"

    def start_epoch(self, generation: int, seed: int | None = None) -> None:
        """(Re)create the dataset fetcher; errors surface with this worker's next task.

        Args:
            generation: the epoch's generation.
            seed: a later epoch's shared seed for an IterDataPipe graph (``_datapipes``).
        """
        self.generation = generation
        self._ended = False
        try:
            reseed(self.info.dataset, seed)
            self._fetcher = Fetcher(
                self.spec.dataset_kind,
                self.info.dataset,
                self.spec.auto_collation,
                self.spec.collate_fn,
                self.spec.drop_last,
            )
        except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
            self._pending_error = ExceptionWrapper(where=self._where())

    def initialize(self) -> None:
        """Run ``worker_init_fn`` and create the fetcher, as torch's worker does at start."""
        try:
            if self.spec.worker_init_fn is not None:
                self.spec.worker_init_fn(self.id)
            resume = self.spec.resume_states
            state = resume[self.id] if resume is not None else None
            form = self.spec.resume_state_form
            _dataset_state.restore_dataset(self.info.dataset, state, form)
            # After worker_init_fn: the saved state already includes what it drew.
            rng = self.spec.resume_rng
            if rng is not None and rng[self.id] is not None:
                load_rng_state(self.rngs, rng[self.id])
        except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
            self._pending_error = ExceptionWrapper(where=self._where())
        else:
            self.start_epoch(self.generation)
            if self._fetcher is not None and state is not None:
                try:  # after iter(dataset), as StatefulDataLoader (_dataset_state point 2)
                    _dataset_state.restore_iterator(self._fetcher.iterator, state, form)
                except BaseException:  # noqa: BLE001  # delivered to the training thread
                    self._pending_error = ExceptionWrapper(where=self._where())
        self.ready = True

    def initialize_here(self) -> None:
        """``initialize`` on the calling thread, as this worker, unless it ran; holding ``busy``.

        For a thread that is not this worker's own (its ``WorkerInfo`` is installed for the
        call): the training thread starting an epoch without threads, or whichever isolation
        runner first claims one of this worker's tasks.
        """
        if self.ready:
            return
        previous = current_context()
        try:
            self.enter()
            self.initialize()
        finally:
            leave(previous)

    def enter(self) -> tuple[WorkerInfo | None, WorkerRNGs | None]:
        """Make the calling thread act as this worker: its WorkerInfo and global RNGs.

        Returns:
            What to hand ``leave`` to make the thread what it was before (``current_context``
            read before the call is the same, and safe against a Ctrl-C inside it).
        """
        return _worker_info.swap(self.info), _worker_globals.swap(self.rngs)

    def snapshot(self) -> Any:
        """This worker's dataset state now (``_dataset_state``), if the loader tracks it."""
        if not self.spec.capture_state:
            return None
        iterator = self._fetcher.iterator if self._fetcher is not None else None
        return _dataset_state.snapshot(self.info.dataset, iterator)

    def run_timed(self, task: Task, recorder: StageRecorder, cpu_time: bool = True) -> Result:
        """``run`` on the calling thread as this worker (its WorkerInfo installed), timed.

        Whichever thread runs it (this worker's, the training thread, an isolation runner),
        holding ``busy``. The result carries when the fetch began and, with ``cpu_time``, the
        thread CPU time and the wall time it took: what the concurrency controller judges a
        limit by.
        """
        previous = current_context()  # read first: a Ctrl-C inside enter() still leaves
        started = time.perf_counter()
        cpu = time.thread_time() if cpu_time else None
        state = rng = None
        try:
            self.enter()
            data = self.run(task, recorder)
            wall = None
            if cpu is not None:
                cpu = time.thread_time() - cpu
                wall = time.perf_counter() - started
            if data is not NOTHING and not isinstance(data, ExceptionWrapper):
                try:  # user code (state_dict(), as this worker): its error is the batch's
                    state = self.snapshot()
                    if self.spec.capture_rng:
                        rng = rng_state(self.rngs)
                except BaseException:  # noqa: BLE001  # delivered to the training thread
                    data = ExceptionWrapper(
                        where=f"{self._where()}, batch {task.idx}, saving the dataset's state"
                    )
                    state = rng = None
        finally:
            leave(previous)
        return Result(task.idx, self.id, task.generation, data, state, started, cpu, wall, rng)

    def run(self, task: Task, recorder: StageRecorder) -> Any:
        """Fetch and collate ``task``'s batch (pinned, when the collate pins); holding ``busy``.

        Args:
            task: the batch to make.
            recorder: where the stage durations go: the running thread's.

        Returns:
            The batch; an ``ExceptionWrapper`` naming this worker and the batch's indices;
            ``_IterableDatasetStopIteration`` when the IterableDataset just ran out; or
            ``NOTHING`` when it had already run out (torch's worker sends nothing then either).
            ``None`` is a batch like any other (a dataset or collate_fn may return it).
        """
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            return error
        if self._ended:
            return NOTHING
        if self._fetcher is None:
            # Its start failed and that error was raised with its first batch; say so again
            # for each later one (torch's worker process fails on an unbound name there).
            try:
                raise RuntimeError(
                    f"threadloader worker thread {self.id} failed to start (worker_init_fn or "
                    f"the dataset's setup raised; that error came with an earlier batch), so it "
                    f"cannot make batch {task.idx}"
                )
            except RuntimeError:
                return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}")
        try:
            return self._fetcher.fetch(task.index, recorder)
        except StopIteration:
            if self.spec.dataset_kind != _DatasetKind.Iterable:
                return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}")
            self._ended = True
            return _IterableDatasetStopIteration(self.id)
        except KeyboardInterrupt:
            if threading.current_thread() is threading.main_thread():
                raise  # Ctrl-C while the training thread makes a batch itself: the loop's own
            return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}{_indices(task)}")
        except BaseException:  # noqa: BLE001  # a SystemExit must not silently kill the thread
            return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}{_indices(task)}")


def current_context() -> tuple[WorkerInfo | None, WorkerRNGs | None]:
    """The calling thread's worker context now, for a later ``leave``."""
    return _worker_info.current(), _worker_globals.current()


def leave(previous: tuple[WorkerInfo | None, WorkerRNGs | None]) -> None:
    """Undo ``Worker.enter`` on the calling thread."""
    _worker_globals.swap(previous[1])
    _worker_info.swap(previous[0])


def _indices(task: Task) -> str:
    if task.index is None:
        return ""
    text = repr(task.index)
    return f", indices {text if len(text) <= 200 else text[:197] + '...'}"


def _worker_loop(worker: Worker, gate: Gate, results: BoundedQueue[Result]) -> None:
    """What one worker thread runs: wait for a task and a gate slot, run it, hand it back.

    The task stays at the head of the worker's queue until the worker holds a gate slot and its
    ``busy`` lock, so that meanwhile the training thread may take it and run it itself.
    """
    previous = current_context()
    try:
        worker.enter()  # for the thread's whole life
        _serve(worker, gate, results)
    finally:
        # Nothing left on this thread's torch mode stack when it ends (ours, or one user code
        # left): an object there is released by a C++ thread-local destructor, which aborts the
        # process if Python is finalizing.
        leave(previous)
        _worker_globals.clear_modes()


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
                    worker.start_epoch(msg.generation, msg.seed)
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
        self._name = name
        _exit_hook.track(self)
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
                    t = threading.Thread(
                        target=_worker_loop,
                        args=(w, self.gate, self.results),
                        name=f"{self._name}-worker{w.id}",
                        daemon=True,  # never block exit; the exit hook joins them first
                    )
                    t.start()
                    self._threads.append(t)
            except BaseException as e:  # noqa: BLE001  # re-raised below, once closed
                error = e
        if error is not None:
            self.close()  # joins the threads that did start
            raise error

    def __repr__(self) -> str:
        alive = sum(t.is_alive() for t in self._threads)
        return f"<WorkerPool {len(self._threads)} threads, {alive} alive, closed={self._closed}>"

    def new_epoch(self, seed: int | None = None) -> int:
        """Drop every task not started, and restart each worker's fetcher (persistent workers).

        Args:
            seed: the iterator's new shared seed, for an IterDataPipe graph (``_datapipes``).

        Returns:
            The new generation: results of earlier generations are stale.
        """
        self.generation += 1
        generation = self.generation
        for w in self.workers:
            w.tasks.replace_all(NewEpoch(generation, seed))
        # Results the training thread never read (a break, a live weight change) would hold
        # room the new tasks need: the queue's bound counts one stale result per worker only.
        self.results.drop_where(lambda r: r.generation != generation)
        return generation

    def close(self, wait: bool = True, redeliver: bool = False) -> None:
        """Stop every worker and join its thread. Idempotent; safe from a finalizer or exit hook.

        Args:
            wait: join the threads, for at most ``JOIN_TIMEOUT_S`` in all. A thread still inside
                user code after that finishes that call on its own and exits, having nothing
                left to fetch. With ``False``, join none now: the pool stays with the exit hook,
                whose ``close()`` joins what is left at interpreter exit (a later ``close()``
                joins too).
            redeliver: called from a finalizer, which drops exceptions: a Ctrl-C during the
                join is sent to the main thread again (``_exit_hook.redeliver_interrupt``).

        Raises:
            KeyboardInterrupt: Ctrl-C while joining, unless ``redeliver``.
        """
        with self._lock:
            self._closed = True
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
            for t in self._threads:
                if t is not me:
                    t.join(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            # Ctrl-C while joining: stop waiting (the rest exit on their own, and the exit
            # hook joins them), and make sure the main thread raises it: a finalizer would not.
            if not redeliver:
                raise
            _exit_hook.redeliver_interrupt()
            return
        _exit_hook.untrack(self)
