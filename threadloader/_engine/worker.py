"""One worker: its own ``WorkerInfo``, seeds, global RNGs and dataset copy, its task queue, and how
it runs one task.

A worker is torch's worker process turned into a thread of the training process (``workers``
says what that means); ``Worker.enter`` makes the calling thread act as this worker, and
``leave`` undoes it.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import numpy.random  # else imported on first use: 5 ms into each isolation helper's start
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils.worker import (
    _generate_state,
    _IterableDatasetStopIteration,
)

from threadloader._engine import dataset_state, worker_info, worker_threads
from threadloader._engine.datapipes import reseed
from threadloader._engine.dataset_copy import worker_copy
from threadloader._engine.fetch import Abandoned, Fetcher
from threadloader._engine.tasks import NOTHING, NewEpoch, Result, Task, WorkerSpec
from threadloader._engine.worker_rng import as_plain, load_rng_state, rng_state
from threadloader._primitives import intra_op, worker_globals
from threadloader._primitives.queues import BoundedQueue
from threadloader._primitives.timing import StageRecorder
from threadloader._primitives.worker_globals import RNG, WorkerRNGs

#: What ``current_context`` reads and ``leave`` puts back: the WorkerInfo, the global RNGs and
#: the intra-op thread count of the calling thread.
Context = tuple[Any, WorkerRNGs | None, int]  # the first: what worker_info.swap returned


def _make_rngs(base_seed: int, worker_id: int) -> tuple[Any, WorkerRNGs]:
    """The worker's ``WorkerInfo.rng`` and its process-global RNGs, seeded as torch seeds a
    worker process.

    torch's worker process runs ``random.seed(seed)``, ``torch.manual_seed(seed)`` and
    ``np.random.seed(_generate_state(base_seed, worker_id))``: the same seeds, here for the
    worker's own generators, which its thread's global RNG functions reach (``_primitives.worker_globals``).
    """
    seed = base_seed + worker_id
    numpy_seed = _generate_state(base_seed, worker_id)
    rng = RNG(
        random_generator=random.Random(seed),
        torch_generator=torch.Generator().manual_seed(seed),
        numpy_generator=np.random.default_rng(numpy_seed),
    )
    return rng, WorkerRNGs(rng, numpy_seed)


@dataclasses.dataclass(frozen=True)
class CarriedWorker:
    """A map-style worker as it stands between two batches, for a helper process that receives
    it pickled and carries it on (``isolation.mid_epoch``): its dataset copy, with what
    ``worker_init_fn`` and its batches so far did to it, and its generators' state.

    Attributes:
        worker_id: the worker's id.
        base_seed: the epoch's base seed (the worker's seed is ``base_seed + worker_id``).
        dataset: the worker's dataset copy.
        generation: the epoch generation the worker runs.
        rngs: its generators, themselves: pickled with the dataset copy, a generator the
            copy holds stays the worker's own.
        rng_history: the generator states kept for a rewind (``Worker.start_epoch``), if any.
        pending_error: an error its start raised that its next batch still has to deliver.
        started: its start made a fetcher (it did unless ``worker_init_fn`` or the dataset's
            setup raised).
    """

    worker_id: int
    base_seed: int
    dataset: Any
    generation: int
    rngs: WorkerRNGs
    rng_history: list[tuple[int, dict[str, Any]]] | None
    pending_error: ExceptionWrapper | None
    started: bool

    def adopt(self, spec: WorkerSpec, recorder: StageRecorder) -> Worker:
        """The worker, carried on with this process's ``spec`` and stage recorder.

        Its ``worker_init_fn`` ran where it was made: what it did to the dataset copy and the
        generators travels with them, so it must not run on them again (``dataset.start +=
        ...`` would shard twice). What it did outside them (a module's global that items read,
        a library it configured) did not travel: it runs again here first, as this worker at
        its epoch's start, on a scratch copy of the dataset with freshly seeded generators,
        both dropped after (a thread it starts keeps them: it runs as that scratch worker).
        Not for a worker whose start failed (its error is pending).

        Raises:
            BaseException: what ``worker_init_fn`` raised: the helper cannot carry on the worker
                (the training process raises it as ``dispatch.reraise`` does).
        """
        if self.started and spec.worker_init_fn is not None:
            scratch = Worker(spec, self.worker_id, self.base_seed, 1, recorder)
            previous = current_context()
            try:
                scratch.enter()
                spec.worker_init_fn(self.worker_id)
            finally:
                leave(previous)
        return Worker(spec, self.worker_id, self.base_seed, 1, recorder, carried=self)


class Worker:
    """One worker: its info, its task queue, and the lock held while one of its tasks runs.

    ``busy`` serialises the worker's tasks whoever runs them: the worker thread, or the training
    thread when it takes a task the worker has not started (``threaded``). Per-worker state (the
    dataset iterator, the worker's generators) is therefore never used by two threads at once,
    and a worker's tasks run in dispatch order, so its random draws are reproducible.

    Args:
        spec: what the loader's workers share.
        worker_id: this worker's id.
        base_seed: the epoch's base seed.
        capacity: how many tasks its queue holds.
        recorder: where its stage timings go.
        carried: a worker made elsewhere, to carry on as it stands (its dataset copy and
            generators, ready, ``worker_init_fn`` not run again) instead of a new one.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        worker_id: int,
        base_seed: int,
        capacity: int,
        recorder: StageRecorder,
        carried: CarriedWorker | None = None,
    ) -> None:
        self.id = worker_id
        self.recorder = recorder  # this epoch's; replaced (not mutated) by a new epoch
        self.spec = spec
        worker_globals.install()
        worker_threads.install()  # threads its items start are part of it
        if carried is not None:
            dataset, self.rngs = carried.dataset, carried.rngs
            rng = self.rngs.rng
        else:
            rng, self.rngs = _make_rngs(base_seed, worker_id)
            # Made as this worker: a __setstate__ or __copy__ that draws must not move the
            # training thread's RNGs (a worker process unpickles its copy itself).
            outer = worker_globals.swap(self.rngs)
            try:
                dataset = worker_copy(spec.dataset)
            finally:
                worker_globals.swap(outer)
        self.info = worker_info.WorkerInfo(
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
        self.init_s = 0.0  # how long its worker_init_fn took (a pickled move runs it again)
        self.generation = 0
        self._fetcher: Any = None
        self._pending_error: ExceptionWrapper | None = None
        self._ended = False  # the IterableDataset ran out this epoch
        # Set when its pool is abandoned (a Ctrl-C, a break): a batch being made stops before
        # its next item, so the thread ends after the item it is in (``fetch.Abandoned``). An
        # Event, whose bound is_set the fetcher holds: a closure over the worker would make a
        # cycle, and the epoch's dataset copy (its open files) would wait for the cyclic GC.
        self.abandoned = threading.Event()
        # (batch idx, the generators' state after it), the epoch's start as idx -1: what a
        # rewind goes back to (``start_epoch``).
        self._rng_history: collections.deque[tuple[int, dict[str, Any]]] | None = (
            collections.deque(maxlen=spec.rng_history) if spec.rng_history else None
        )
        if carried is not None:
            self._carry_on(carried)

    def _carry_on(self, carried: CarriedWorker) -> None:
        """Take up ``carried``'s epoch where it stands: ready, its fetcher made anew (a
        map-style fetcher holds nothing of the epoch)."""
        self.generation = carried.generation
        self._pending_error = carried.pending_error
        if self._rng_history is not None and carried.rng_history is not None:
            self._rng_history.extend(carried.rng_history)
        if carried.started:
            self._fetcher = self._new_fetcher()
        self.ready = True

    def _new_fetcher(self) -> Fetcher:
        """A fetcher of this worker's dataset copy for a new epoch (``iter(dataset)`` for an
        IterableDataset), with the spec's collate_fn."""
        spec = self.spec
        return Fetcher(
            spec.dataset_kind,
            self.info.dataset,
            spec.auto_collation,
            spec.collate_fn,
            spec.drop_last,
            stopped=self.abandoned.is_set,
        )

    def carried(self) -> CarriedWorker:
        """This worker as it stands, for a helper that receives it pickled; holding ``busy``,
        between two batches of a map-style epoch, once it is ready."""
        history = self._rng_history
        return CarriedWorker(
            worker_id=self.id,
            base_seed=self.info.seed - self.id,
            dataset=self.info.dataset,
            generation=self.generation,
            rngs=self.rngs,
            # Plain: a generator state's tensor would travel as one file descriptor each.
            rng_history=[(i, as_plain(st)) for i, st in history] if history is not None else None,
            pending_error=self._pending_error,
            started=self._fetcher is not None,
        )

    def _where(self) -> str:
        return f"in threadloader worker thread {self.id}"

    def adopt(self, spec: WorkerSpec, recorder: StageRecorder) -> Worker:
        """Carry on this worker in a process forked mid-epoch, with that process's ``spec``
        (its ``collate_fn``) and stage recorder; everything else stays as the fork found it:
        the dataset copy, the generators, the epoch's fetcher and ``worker_init_fn``'s work.

        Returns:
            This worker.
        """
        self.spec = spec
        self.recorder = recorder
        if self._fetcher is not None:
            self._fetcher.recollate(spec.collate_fn)
        return self

    def start_epoch(
        self,
        generation: int,
        seed: int | None = None,
        rewind: int | None = None,
        begins: bool | None = None,
    ) -> None:
        """(Re)create the dataset fetcher, as this worker whichever thread calls it (an
        IterableDataset's ``__iter__`` runs here and may shard by ``get_worker_info()``, or draw
        from the global RNGs); holding ``busy``. Errors surface with this worker's next task.

        Args:
            generation: the epoch's generation.
            seed: a later epoch's shared seed for an IterDataPipe graph (``datapipes``).
            rewind: the first batch the loop has not received, when the index stream was
                rewound there (a live mixture-weight change): the worker's generators go back
                to their state after its last batch before it, so that the batches it makes
                again, and the later ones, draw what they would have drawn had the stream been
                so from the start, however many dropped batches it had begun.
            begins: a new epoch begins (after the rewind, if both): batch numbers count from 0
                again. By default, unless ``rewind`` is given.
        """
        self.generation = generation
        self._ended = False
        previous = current_context()
        try:
            self.enter()
            reseed(self.info.dataset, seed)
            self._fetcher = self._new_fetcher()
        except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
            self._pending_error = ExceptionWrapper(where=self._where())
        finally:
            leave(previous)
        history = self._rng_history
        if history is None:
            return
        if rewind is not None:
            while history and history[-1][0] >= rewind:
                history.pop()
            if history:
                load_rng_state(self.rngs, history[-1][1])
        if rewind is None if begins is None else begins:
            history.clear()
            history.append((-1, rng_state(self.rngs)))

    def initialize(self) -> None:
        """Run ``worker_init_fn`` and create the fetcher, as torch's worker does at start."""
        try:
            if self.spec.worker_init_fn is not None:
                began = time.perf_counter()
                self.spec.worker_init_fn(self.id)
                self.init_s = time.perf_counter() - began
            # After worker_init_fn: the saved state already includes what it drew. Before the
            # dataset is settled: running its iterator to its end draws as the worker did then.
            rng = self.spec.resume_rng
            if rng is not None and rng[self.id] is not None:
                load_rng_state(self.rngs, rng[self.id])
            resume = self.spec.resume_states
            state = resume[self.id] if resume is not None else None
            form = self.spec.resume_state_form
            if self.spec.resume_finished_epoch or dataset_state.is_finished(state):
                iterable = self.spec.dataset_kind == _DatasetKind.Iterable
                run_out = 0 if dataset_state.was_left(state) else self.spec.tail_items
                dataset_state.settle_dataset(self.info.dataset, state, form, iterable, run_out)
                state = None  # the epoch's own iterator starts afresh
            else:
                dataset_state.restore_dataset(self.info.dataset, state, form)
        except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
            self._pending_error = ExceptionWrapper(where=self._where())
        else:
            self.start_epoch(self.generation)
            if self._fetcher is not None and state is not None:
                try:  # after iter(dataset), as StatefulDataLoader (_dataset_state point 2)
                    self._fetcher.restore(state, form)
                    if self.id in self.spec.resume_ended and not self._fetcher.ended:
                        # never asked again this epoch
                        dataset_state.run_to_end(self._fetcher.iterator, self.spec.tail_items)
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

    def enter(self) -> Context:
        """Make the calling thread act as this worker: its WorkerInfo, its global RNGs, and
        one intra-op thread for torch's CPU ops (``intra_op.as_worker``).

        Returns:
            What to hand ``leave`` to make the thread what it was before (``current_context``
            read before the call is the same, and safe against a Ctrl-C inside it).
        """
        return worker_info.swap(self.info), worker_globals.swap(self.rngs), intra_op.as_worker()

    def snapshot(self) -> Any:
        """This worker's dataset state now (``dataset_state``), if the loader tracks it."""
        if not self.spec.capture_state:
            return None
        fetcher = self._fetcher
        iterator = fetcher.iterator if fetcher is not None else None
        ended = fetcher is not None and fetcher.ended
        return dataset_state.snapshot(self.info.dataset, iterator, ended)

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
            failed = isinstance(data, ExceptionWrapper)
            if data is not NOTHING:
                try:  # user code (state_dict(), as this worker): its error is the batch's
                    # After a failed batch, the dataset's state is not taken, as in
                    # StatefulDataLoader; the generators' is: what the batch drew before it
                    # raised is drawn in an uninterrupted run too.
                    state = None if failed else self.snapshot()
                    if self.spec.capture_rng or self._rng_history is not None:
                        rng = rng_state(self.rngs)
                        if self._rng_history is not None:
                            self._rng_history.append((task.idx, rng))
                        if not self.spec.capture_rng:
                            rng = None
                except BaseException:  # noqa: BLE001  # delivered to the training thread
                    if not failed:
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
        except Abandoned:
            return NOTHING  # nobody waits for this batch any more
        except StopIteration:
            if self.spec.dataset_kind != _DatasetKind.Iterable:
                return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}")
            self._ended = True
            return _IterableDatasetStopIteration(self.id)
        except (KeyboardInterrupt, SystemExit) as error:
            # The training thread making a batch itself runs signal handlers between any two of
            # the item code's bytecodes, and what they raise is the loop's, as torch's waiting
            # loop gets it: a Ctrl-C, a SIGTERM handler's sys.exit() (preemption). Item code's
            # own SystemExit is a worker's error, as a worker process's death is in torch.
            if threading.current_thread() is threading.main_thread() and (
                isinstance(error, KeyboardInterrupt) or _raised_by_signal_handler(error)
            ):
                raise
            return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}{_indices(task)}")
        except BaseException:  # noqa: BLE001  # a SystemExit must not silently kill the thread
            return ExceptionWrapper(where=f"{self._where()}, batch {task.idx}{_indices(task)}")


def _raised_by_signal_handler(error: BaseException) -> bool:
    """Whether ``error`` went through a frame of a Python signal handler installed now."""
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def current_context() -> Context:
    """The calling thread's worker context now, for a later ``leave``."""
    return worker_info.current(), worker_globals.current(), torch.get_num_threads()


def leave(previous: Context) -> None:
    """Undo ``Worker.enter`` on the calling thread."""
    intra_op.restore(previous[2])
    worker_globals.swap(previous[1])
    worker_info.swap(previous[0])


def _indices(task: Task) -> str:
    """The batch's indices for an error's message; none for an IterableDataset's batch (its
    index stream is placeholders, as torch's fetcher's)."""
    if task.index is None or (
        isinstance(task.index, list) and all(index is None for index in task.index)
    ):
        return ""
    text = repr(task.index)
    return f", indices {text if len(text) <= 200 else text[:197] + '...'}"
