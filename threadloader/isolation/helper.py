"""What runs in the isolation helper process: N runner threads, and the loop feeding them.

``isolation="process"`` moves the worker threads out of the training process, so that their
Python work no longer competes with the training loop for its GIL. The helper is one process
(forked from the training process, the zygote or a forkserver, or spawned: ``parent`` point 2)
that holds its workers' dataset and runs torch's worker semantics in threads, exactly as in-process: ``_workers.Worker`` gives each
worker its ``WorkerInfo``, seeds, ``worker_init_fn`` and IterableDataset copy.

How the helper behaves; where the code disagrees with this, the code is wrong.

1. The training process sends every task on one pipe, in batch order, each naming the worker
   torch's round robin chose. Runner threads claim them from a ``TaskBoard`` (``task_board``):
   any runner runs any worker's task, as that worker (its ``WorkerInfo`` installed, its
   ``busy`` lock held), one worker's tasks one at a time and in order. The runner collates the
   batch into a shared-memory slot (``shm_ring``) and writes the result message itself. An
   epoch message restarts persistent workers and drops the earlier epochs' tasks still queued
   (``task_board`` rule 3).
   How many runners fetch at once is the pacer's number (``_Pacer``): with one, a GIL-holding
   dataset's batches are all made by one thread, with no hand-off between threads per batch.
2. Slots the training process released come back through the ring's mailbox, read when a
   runner takes a slot (``shm_ring`` point 5): no thread wakes up for them.
3. The main thread waits on the control pipe, which carries nothing: its EOF -- the training
   process's ``close()``, or the kernel closing it when that process dies, even by SIGKILL --
   or a change of parent pid ends the process at once with ``os._exit``. Runner threads are not
   joined: one stuck in user code must not keep the process alive, and nothing in the helper
   needs cleaning up (its shared memory has no name). Runners end when the task pipe does.
4. Ctrl-C in a terminal reaches the whole process group; the helper ignores SIGINT and lets the
   training process decide, as torch's workers do.
5. Once the dataset, ``collate_fn`` and ``worker_init_fn`` are in place, and before any worker
   is built, the helper freezes the garbage collector's view of every object it holds
   (``gc.freeze``). A helper forked from the training process inherits all of that process's
   objects; its first full collection would visit each of them, writing to, and so copying,
   every page they share with the training process: on 2 cores, 100-400 ms before the first
   batch of every epoch whose helpers were forked then. Frozen objects are never collected;
   what the helper inherited or was sent lives as long as the helper does anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import ForkingPickler, send_handle
from typing import Any

import torch
from torch._utils import ExceptionWrapper

from threadloader._engine import worker_info
from threadloader._engine.tasks import NOTHING, Result, Task, WorkerSpec
from threadloader._engine.worker import CarriedWorker, Worker
from threadloader._primitives.concurrency import ConcurrencyController
from threadloader._primitives.timing import StageRecorder
from threadloader.device.pinned import pageable_allocator, pinned_collate
from threadloader.isolation.capped import Capped, PayloadTooLarge
from threadloader.isolation.main_state import MainState, by_name_in, script_code
from threadloader.isolation.packing import Packed, pack
from threadloader.isolation.shm_ring import RingWriter, Segment, SlotAllocator
from threadloader.isolation.task_board import EPOCH, TaskBoard
from threadloader.isolation.zygote import StaleScriptCode

# Message tags. Training process -> helper, on the task pipe: ``task_board``'s TASK and EPOCH.
# The control pipe carries nothing: its EOF means "exit". Releases go through the mailbox.
# Helper -> training process, on the result socket:
RESULT = 10  # (RESULT, idx, worker_id, generation, data, state, rng, stage timings, fetch limit,
#              the dataset's stats() snapshot or None)
SEGMENT = 11  # (SEGMENT, seg_id, slot_bytes, count), then the segment's descriptor
RETIRE = 12  # (RETIRE, seg_id)
FATAL = 13  # (FATAL, ExceptionWrapper): the helper could not start, or its own code failed
STARTED = 14  # (STARTED,): the helper loaded its spec and started its workers' threads

#: The training process's ends of every helper's pipes. Every process forked from the training
#: process closes its copies at once (``_close_training_ends``): a helper holding its own control
#: pipe's write end would never see that pipe's EOF (point 3), and neither would any helper
#: while a forked child (torch's DataLoader workers, a user's fork) held the end.
TRAINING_ENDS: weakref.WeakSet[Connection] = weakref.WeakSet()


def _close_training_ends() -> None:
    # In a forked child only: the ends are the parent's; closing the copies closes nothing there.
    for end in list(TRAINING_ENDS):
        end.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_training_ends)

#: Seconds between checks that the training process still exists, when no message arrives.
PARENT_CHECK_S = 1.0
#: Slots per segment beyond the batches in flight: the batch being delivered, the one the
#: training loop still holds, and releases still travelling back with a later task (a worker
#: reads them when it reads that task). A slot costs memory only once written, and free slots
#: are reused last-freed-first, so spare slots cost address space, not memory.
SPARE_SLOTS = 4
#: A dataset's ``stats()`` whose recent calls all took this long (seconds) is taken again only once
#: ``STATS_COST`` times that has passed: it costs the helper at most ~1/STATS_COST of its time.
STATS_SLOW_S = 0.02
STATS_COST = 50
#: How many of its latest calls a ``stats()`` is judged by: its fastest among them.
STATS_RECENT = 3


@dataclasses.dataclass(frozen=True)
class HelperSpec:
    """Everything the helper needs, sent once when it starts.

    Attributes:
        worker: what the worker threads share (the loader's dataset, collate_fn, ...).
        base_seed: torch's per-iterator seed; worker ``i`` gets ``base_seed + i``.
        max_tasks: batches in flight at most for this helper's workers (``prefetch_factor``
            per worker).
        worker_ids: the workers this helper runs (all of them with one helper; worker ``w``
            runs in helper ``w % P`` of ``P``).
        collate_into_slots: ``collate_fn`` is torch's ``default_collate``, so batches can be
            stacked straight into shared memory.
        adopted: the training process's own workers, to carry on as they are (``mid_epoch``):
            the ``Worker`` objects themselves in a helper forked from that process, which has
            them in memory; else each one's ``CarriedWorker``, pickled with this spec.
        main_state: for a helper not forked from the training process, what its main script
            set at run time that the helper's code reads (``main_state``), applied before any
            worker starts.
    """

    worker: WorkerSpec
    base_seed: int
    max_tasks: int
    collate_into_slots: bool
    worker_ids: tuple[int, ...]
    adopted: dict[int, Worker | CarriedWorker] | None = None
    main_state: MainState | None = None


#: Added first where that is because a class was defined again after its instance was made.
REDEFINED_NOTE = (
    "threadloader: the class was defined again after this object was made (a notebook cell "
    "or exec run again): a helper finds a class by its name, which now names the new one; "
    "make the dataset (or collate_fn) again from the class as it is now"
)
#: Added to the error of a dataset, collate_fn or worker_init_fn that cannot be pickled.
UNPICKLABLE_NOTE = (
    "threadloader: helper processes that are not forked from the training process (another "
    "Python thread ran at iter(), or multiprocessing_context names forkserver or spawn) "
    "receive the dataset, collate_fn and worker_init_fn pickled: make them picklable, build "
    "the loader while the script runs one Python thread (helpers are then forked), or pass "
    'isolation="threads"'
)


#: Set on an exception raised while pickling what a helper receives (``unpicklable``).
_PICKLING_FAILED = "_threadloader_pickling_failed"


def unpicklable(exc: BaseException) -> bool:
    """Whether ``exc`` was raised pickling what a helper receives (``PickledOnce``), rather
    than starting the helper or loading it there."""
    return getattr(exc, _PICKLING_FAILED, False) is True


class _Made:
    """What the registered reductions of one pickling met, and what of it serves one process.

    Attributes:
        objects: each object they reduced (torch's tensors and storages among them), kept so
            that what pickling created, and whose descriptor is sent only once the process is
            launched, outlives the pickler's memo.
        descriptors: how many descriptors they added to the process being started.
        per_process: whether one of torch's reductions ran: its tensors serve one process
            each (a descriptor, or a shared file counted once per pickle).
    """

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self.descriptors = 0
        self.per_process = False


class _KeepingPickler(ForkingPickler):
    """``ForkingPickler`` whose registered reductions record what they meet in ``made``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.made = _Made()
        self.dispatch_table = {
            cls: _keeping(reduce, self.made) for cls, reduce in self.dispatch_table.items()
        }


class _WatchingPickler(_KeepingPickler):
    """``_KeepingPickler`` for a helper forked by a zygote whose copy of the main script is not
    the training process's (``zygote`` point 5): refuses code of ``module`` pickled by name
    whose global is among ``stale``, which the helper would find there as it was, or not at all.
    """

    def __init__(self, file: Any, protocol: int, module: str, stale: frozenset[str]) -> None:
        super().__init__(file, protocol)
        self._module = module
        self._stale = stale

    def reducer_override(self, obj: Any) -> Any:
        # Once per object (the memo answers again): the object, and the script's code its own
        # code calls, which the helper looks up in the zygote's __main__ too. Only what can be
        # called is pickled by name (an instance's class is pickled on its own).
        if callable(obj) and by_name_in(obj, self._module) is not None:
            for code in script_code([obj]):
                name = by_name_in(code, self._module) or ""
                if name.partition(".")[0] in self._stale:
                    raise StaleScriptCode.of([name])
        return NotImplemented


def _pickler_for(buffer: Capped) -> _KeepingPickler:
    """The pickler for the process being started: a watching one where it comes from a zygote
    that holds the main script's code other than this process does."""
    popen: Any = get_spawning_popen()
    stale = getattr(popen, "stale_script_code", None)
    if stale:
        return _WatchingPickler(buffer, pickle.HIGHEST_PROTOCOL, popen.script_module, stale)
    return _KeepingPickler(buffer, pickle.HIGHEST_PROTOCOL)


#: The module of torch's reductions for ``ForkingPickler`` (tensors, storages, CUDA events).
_TORCH_REDUCTIONS = "torch.multiprocessing.reductions"


def _keeping(reduce: Callable[[Any], Any], made: _Made) -> Callable[[Any], Any]:
    # Closes over ``made``, not the pickler: no cycle keeps the pickler's buffer alive.
    torch_s = getattr(reduce, "__module__", None) == _TORCH_REDUCTIONS

    def keep_and_reduce(obj: Any) -> Any:
        made.objects.append(obj)
        made.per_process |= torch_s
        before = _descriptors_sent()
        try:
            return reduce(obj)
        finally:
            made.descriptors += _descriptors_sent() - before

    return keep_and_reduce


def _descriptors_sent() -> int:
    # How many descriptors the process being started takes with it so far: multiprocessing's
    # Popen and ``ZygoteProcess`` collect them in ``_fds`` (``duplicate_for_child``).
    return len(getattr(get_spawning_popen(), "_fds", None) or ())


class SharedField:
    """A field of the dataclass several ``PickledOnce`` carry to helpers started together (the
    ``WorkerSpec`` with the dataset): pickled once for all of them where its bytes can serve
    each one, which they can unless pickling made something that serves one process (a
    descriptor travelling beside the bytes; a tensor's shared memory).

    Args:
        name: the field's name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._data: bytes | None = None

    def pickled(self, value: Any, dump: Callable[[Any], tuple[bytes, bool]]) -> bytes:
        """``value``'s bytes: those of an earlier helper's start, or ``dump(value)``'s, kept
        for the next when that made nothing (``dump`` returns the bytes and whether it did)."""
        if self._data is not None:
            return self._data
        data, made = dump(value)
        if not made:
            self._data = data
        return data


class PickledOnce:
    """Carries an object into the helper as bytes, unpickled by the helper's own code.

    Pickled while the process starts (inside multiprocessing's pickling of the process
    object), so torch's reductions can hand tensors over as shared memory instead of copying
    them; unpickled by ``helper_main`` inside a ``try``, so a dataset whose class cannot be
    imported there is reported as an error instead of killing the helper before it can speak.

    Args:
        obj: what to carry.
        limit: the most bytes it may pickle to; beyond, pickling stops with
            ``PayloadTooLarge`` (a large array is refused before it is copied).
        shared: a field of ``obj`` (a dataclass) pickled once for every helper started with
            the same ``SharedField``, apart from the rest of ``obj``; None: ``obj`` is pickled
            whole (what it shares with itself stays shared).
    """

    def __init__(self, obj: Any, limit: int | None = None, shared: SharedField | None = None):
        self.obj = obj
        self._limit = limit
        self._shared = shared
        self._data: bytes | tuple[str, bytes, bytes] | None = None
        self._made: list[Any] = []
        self._picklers: list[_KeepingPickler] = []  # memos kept until the launch (``_dump``)

    def __getstate__(self) -> bytes | tuple[str, bytes, bytes]:
        if self._shared is None:
            return self._dump(self.obj)[0]
        name = self._shared.name
        head = self._shared.pickled(getattr(self.obj, name), self._dump)
        rest, _ = self._dump(dataclasses.replace(self.obj, **{name: None}))
        return name, head, rest

    def _dump(self, obj: Any) -> tuple[bytes, bool]:
        """``obj`` pickled, and whether pickling made something that travels beside it."""
        buffer = Capped(self._limit)
        pickler = _pickler_for(buffer)
        fds = _descriptors_sent()
        try:
            pickler.dump(obj)
        except (PayloadTooLarge, StaleScriptCode):
            raise
        except Exception as exc:
            # The error keeps pickle's type; the note says why pickling was needed at all
            # (torch's fork-started workers need none).
            if hasattr(exc, "add_note"):
                if "not the same object as" in str(exc):
                    exc.add_note(REDEFINED_NOTE)
                exc.add_note(UNPICKLABLE_NOTE)
            with contextlib.suppress(AttributeError):  # an exception class with __slots__
                setattr(exc, _PICKLING_FAILED, True)
            raise
        # What pickling made (a torch.Generator's state tensor) is kept until ``release``: a
        # tensor's shared memory travels as a descriptor sent once the process is launched,
        # after this returns, and a tensor freed before then closes it. The memo, which holds
        # every object pickled (128 MB for 3M strings), goes now unless a descriptor was added
        # outside the registered reductions (a ``__reduce__`` of the user's calling ``DupFd``):
        # its owner may be any object pickling made, alive only in the memo.
        made, sent = pickler.made, _descriptors_sent() - fds
        self._made.extend(made.objects)
        if sent > made.descriptors:
            self._picklers.append(pickler)
        else:
            pickler.clear_memo()
        return buffer.getvalue(), made.per_process or sent > 0

    def release(self) -> None:
        """Drop the object and what pickling made: call once the process started (it has its
        copy, and the descriptors were sent)."""
        self.obj = self._shared = None
        self._made = []
        self._picklers = []

    def __setstate__(self, state: bytes | tuple[str, bytes, bytes]) -> None:
        self.obj = None
        self._data = state

    def load(self) -> Any:
        """The object: unpickled from the bytes received (dropped then), or as it was given to
        a helper forked from the training process, where nothing was pickled."""
        if self._data is None:
            return self.obj
        data, self._data = self._data, None
        if isinstance(data, bytes):
            return pickle.loads(data)
        name, head, rest = data
        del data
        value = pickle.loads(head)
        del head
        return dataclasses.replace(pickle.loads(rest), **{name: value})


class _Sender:
    """The one writer of the result socket: every message goes through ``send`` under a lock."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.ring: RingWriter | None = None

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send ``msg`` (after any pending segment retirements); exit if the parent is gone."""
        self.send_bytes(ForkingPickler.dumps(msg))

    def send_bytes(self, payload: bytes | memoryview) -> None:
        """Send a message pickled by ``ForkingPickler``; exit if the parent is gone."""
        try:
            with self._lock:
                self._flush_retired()
                self._conn.send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            _exit_now(0)

    def announce(self, segment: Segment, fd: int) -> None:
        """Tell the training process about a new segment and pass it the descriptor."""
        try:
            with self._lock:
                self._conn.send((SEGMENT, segment.seg_id, segment.slot_bytes, segment.count))
                send_handle(self._conn, fd, 0)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            _exit_now(0)

    def _flush_retired(self) -> None:
        if self.ring is not None and self.ring.has_retired:
            for seg_id in self.ring.take_retired():
                self._conn.send((RETIRE, seg_id))


class _Timings(StageRecorder):
    """Collects one batch's stage durations, to travel with its result to ``stats()``.

    One per batch, written by the one thread making it: a list, without the recorder's lock.
    """

    def __init__(self) -> None:  # no super().__init__: no lock, no stage table
        self.name = "batch"
        self.events: list[tuple[str, float]] = []

    def add(self, stage: str, seconds: float) -> None:
        self.events.append((stage, seconds))

    def add_pair(self, stage: str, seconds: float, stage2: str, seconds2: float) -> None:
        self.events += ((stage, seconds), (stage2, seconds2))


class _IntoSlot:
    """The collate_fn the helper's workers run: collate, then put the batch into a slot.

    With torch's ``default_collate`` the slot is taken first and the batch is stacked straight
    into it (``pinned_collate`` with a slot allocator); any other ``collate_fn`` runs as the
    user wrote it and its tensors are copied in by ``pack``.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], ring: RingWriter, direct: bool) -> None:
        self._collate_fn = collate_fn
        self._ring = ring
        self._direct = direct
        self.takes_gathered = direct  # _gathered point 4: pinned_collate below

    def __call__(self, batch: Any) -> Packed:
        allocator = None
        if self._direct:
            slot = self._ring.acquire()
            if slot is not None:
                allocator = SlotAllocator(slot)
        if allocator is None:
            if self._direct:  # no slot free: torch's worker semantics all the same
                return pack(
                    pinned_collate(batch, pageable_allocator, as_worker=True), self._ring, None
                )
            return pack(self._collate_fn(batch), self._ring, None)
        try:
            data = pinned_collate(batch, allocator, as_worker=True)
        except BaseException:
            self._ring.release([allocator.slot.key])
            raise
        return pack(data, self._ring, allocator)


class _Pacer:
    """How many runner threads fetch at once: the in-process loader's controller, run here.

    A GIL-holding dataset (token windows, Python transforms) makes two threads slower than
    one, each waiting for the other's GIL hand-offs; a GIL-releasing one (image decode, numpy)
    scales. ``ConcurrencyController`` hill-climbs the limit on the rate at which batches are
    made, keeping fewer threads when more do not help: they also leave more CPU to the
    training process. Batches and their order never depend on it.
    """

    def __init__(
        self,
        num_workers: int,
        clock: Callable[[], float] = time.perf_counter,
        cpus: int | None = None,
    ) -> None:
        self._controller = ConcurrencyController(num_workers, minimum=1, clock=clock, cpus=cpus)
        self._lock = threading.Lock()

    @property
    def limit(self) -> int:
        return self._controller.limit

    def on_batch(
        self,
        started: float,
        cpu: float | None,
        wall: float | None = None,
        apply: Callable[[int], object] | None = None,
    ) -> int | None:
        """Count one batch made; the new limit when it changes, else None.

        Args:
            started: when the batch's fetch began (``time.perf_counter``).
            cpu: the thread CPU time the fetch took.
            wall: the wall-clock time the fetch took.
            apply: called with a new limit before any other runner's batch is counted, so that
                limits reach the task board in the order they were decided.

        They matter as in-process: ``started`` keeps batches made under the previous limit out
        of the new limit's window, ``cpu`` and ``wall`` keep the controller from trying fewer
        threads while they mostly wait (I/O) or already run in parallel (``_primitives.concurrency``).
        """
        with self._lock:
            limit = self._controller.on_batch(started, cpu, wall)
            if limit is not None and apply is not None:
                apply(limit)
            return limit


def sendable(error: ExceptionWrapper) -> ExceptionWrapper:
    """``error``, or, when its exception's class cannot be pickled (a class made at run time,
    as botocore makes ``NoSuchKey``), a copy naming the nearest base class that can: the
    message and the original traceback travel either way.

    Returns:
        What the training process can unpickle and raise (``dispatch.reraise``).
    """
    for base in error.exc_type.__mro__:
        try:
            pickle.dumps(base)
        except Exception:  # noqa: BLE001, S112  # try its base class
            continue
        if base is error.exc_type:
            return error
        copy = ExceptionWrapper.__new__(ExceptionWrapper)
        copy.exc_type, copy.exc_msg = base, error.exc_msg
        copy.where = f"{error.where} (a {error.exc_type.__name__}, whose class cannot be pickled)"
        return copy
    return error  # unreachable: BaseException pickles


def _runner_loop(first: Worker, helper: _Helper) -> None:
    """A runner thread's body; a failure of the helper's own code ends the helper, loudly."""
    try:
        _run_tasks(first, helper)
    except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
        where = f"in threadloader's isolation helper process, runner thread {first.id}"
        helper.sender.send((FATAL, sendable(ExceptionWrapper(where=where))))
        _exit_now(1)


def _run_tasks(first: Worker, helper: _Helper) -> None:
    """What one runner thread runs: start worker ``first``, then any worker's tasks in order.

    Which thread runs a task does not matter to the dataset: each task runs as its worker, with
    that worker's ``WorkerInfo`` installed and its ``busy`` lock held (``task_board``).
    """
    with first.busy:
        # Whichever runner gets there first starts a worker: another runner may claim its
        # first task before the runner started for it has run at all.
        first.initialize_here()
    board, pacer, sender = helper.board, helper.pacer, helper.sender
    done: int | None = None
    while True:
        msg = board.take(done)
        if msg is None:
            return  # the training process closed the pipe: the helper is ending
        worker = helper.workers[msg[1]]
        done = worker.id
        if msg[0] == EPOCH:
            with worker.busy:
                worker.initialize_here()
                worker.start_epoch(msg[2], msg[3], msg[4])
            continue
        _, _, idx, generation, index = msg
        if generation != worker.generation:
            continue  # an abandoned epoch's
        timings = _Timings()
        with worker.busy:
            worker.initialize_here()
            result = worker.run_timed(Task(idx, index, generation), timings)
        if result.data is not NOTHING:
            dataset_stats = helper.dataset_stats()
            _send_result(sender, result, timings.events, pacer.limit, dataset_stats)
            started = result.started  # set by run_timed
            if started is not None:
                pacer.on_batch(started, result.cpu, result.wall, apply=board.set_limit)
        del result, msg  # a blocked take() must not pin the last batch


def _send_result(
    sender: _Sender, result: Result, timings: Any, limit: int, dataset_stats: Any
) -> None:
    head = (RESULT, result.idx, result.worker_id, result.generation)
    data = sendable(result.data) if isinstance(result.data, ExceptionWrapper) else result.data
    msg = (*head, data, result.state, result.rng, timings, limit, dataset_stats)
    try:
        if (
            type(data) is Packed
            and result.state is None
            and result.rng is None
            and dataset_stats is None
        ):
            # Bytes, ints, strings and dtypes only: plain pickle, without ForkingPickler's
            # per-call copy of the reducer table (torch's reducers are for tensors).
            payload: bytes | memoryview = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
        else:
            payload = ForkingPickler.dumps(msg)
    except Exception:  # noqa: BLE001  # e.g. an unpicklable IterableDataset state: say so
        where = f"in threadloader worker thread {result.worker_id}, batch {result.idx}"
        error = ExceptionWrapper(where=where)
        payload = ForkingPickler.dumps((*head, error, None, None, timings, limit, None))
    sender.send_bytes(payload)


class _Helper:
    """The helper's state: the ring, the task board, the workers and the runner threads."""

    def __init__(self, spec: HelperSpec, tasks: Connection, sender: _Sender, mailbox: int) -> None:
        self.sender = sender
        self.ring = RingWriter(sender.announce, 2 * spec.max_tasks + SPARE_SLOTS, mailbox)
        sender.ring = self.ring
        collate = _IntoSlot(spec.worker.collate_fn, self.ring, spec.collate_into_slots)
        worker_spec = dataclasses.replace(spec.worker, collate_fn=collate)
        ids = spec.worker_ids
        # A dataset with stats() (RemoteFiles) counts its reads here: they travel with the
        # results, for the training process's loader.stats() (``dataset_stats``).
        stats = getattr(spec.worker.dataset, "stats", None)
        self._dataset_stats: Callable[[], Any] | None = stats if _no_arguments(stats) else None
        self._stats_lock = threading.Lock()
        self._stats_taken = 0
        self._stats_due = 0.0
        self._stats_recent_s: deque[float] = deque(maxlen=STATS_RECENT)
        self.pacer = _Pacer(len(ids))
        self.board = TaskBoard(tasks, ids, limit=self.pacer.limit)
        adopted = spec.adopted
        self.workers = {
            i: Worker(worker_spec, i, spec.base_seed, 1, StageRecorder(f"worker{i}"))
            if adopted is None
            else adopted[i].adopt(worker_spec, StageRecorder(f"worker{i}"))
            for i in ids
        }
        # One runner per worker: each starts its worker, then runs any worker's tasks.
        self.threads = [
            threading.Thread(
                target=_runner_loop,
                args=(w, self),
                name=f"threadloader-helper-runner{w.id}",
                daemon=True,
            )
            for w in self.workers.values()
        ]
        for t in self.threads:
            t.start()

    def dataset_stats(self) -> tuple[int, Any] | None:
        """The dataset's counters now, numbered: runner threads send results in any order, and
        the training process keeps the latest-numbered snapshot, not the last to arrive.

        Taken with every batch while it is fast (a counter snapshot, as ``RemoteFiles``'
        takes microseconds); where even the fastest of its last ``STATS_RECENT`` calls took
        ``STATS_SLOW_S`` or more (a method of the user's that happens to be named ``stats``,
        computing something over the data), only once ``STATS_COST`` times that has passed.
        Not by the latest call alone: one that waited for the GIL or a CPU on a loaded machine
        would stop the snapshots for a second, and an epoch ending then would report stale
        counters. A ``stats()`` that
        raises is not called again: the helper's batches go on, and ``loader.stats().dataset``
        keeps its last snapshot.

        Returns:
            ``(number, stats)``, or None when there is none to send with this batch.
        """
        if self._dataset_stats is None or time.perf_counter() < self._stats_due:
            return None
        with self._stats_lock:
            stats = self._dataset_stats
            if stats is None or time.perf_counter() < self._stats_due:
                return None  # another runner took it meanwhile
            began = time.perf_counter()
            try:
                snapshot = stats()
            except Exception:  # noqa: BLE001  # not the batch's error: stop asking
                self._dataset_stats = None
                return None
            ended = time.perf_counter()
            self._stats_recent_s.append(ended - began)
            fastest = min(self._stats_recent_s)
            if fastest >= STATS_SLOW_S:
                self._stats_due = ended + STATS_COST * fastest
            self._stats_taken += 1
            return self._stats_taken, snapshot


def _no_arguments(method: Any) -> bool:
    """Whether ``method`` can be called with no arguments, as ``loader.stats()`` calls a
    dataset's ``stats()``."""
    if not callable(method):
        return False
    try:
        inspect.signature(method).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): try it
        return True
    return True


def _wait_for_the_end(control: Connection, ring: RingWriter) -> None:
    """Return when the control pipe ends or the parent is gone (point 3)."""
    parent = os.getppid()
    while True:
        try:
            if control.poll(PARENT_CHECK_S):
                return  # EOF: nothing else is ever sent
        except OSError:
            return
        if os.getppid() != parent:
            return
        ring.read_mailbox()  # keep it from filling while no worker needs a slot


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110  # a closed stream must not stop the exit
            pass
    os._exit(code)


def helper_main(
    spec: PickledOnce,
    control: Connection,
    mailbox: Connection,
    tasks: Connection,
    results: Connection,
) -> None:
    """The helper process's entry point (a ``multiprocessing.Process`` target).

    Args:
        spec: the ``HelperSpec``, still pickled.
        control: read end of the control pipe, whose EOF means "exit".
        mailbox: read end of the release mailbox (``shm_ring`` point 5).
        tasks: read end of the task pipe (``task_board``).
        results: this process's end of the result socket.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _close_training_ends()  # a helper forked from the training process closed them already
    torch.set_num_threads(1)  # as torch's workers: N threads already use the cores
    worker_info.install()
    sender = _Sender(results)
    try:
        os.set_blocking(mailbox.fileno(), False)
        helper_spec = spec.load()
        if helper_spec.main_state is not None:
            helper_spec.main_state.apply()
        gc.freeze()  # point 5
        helper = _Helper(helper_spec, tasks, sender, mailbox.fileno())
    except BaseException:  # noqa: BLE001  # delivered to the training thread, not lost
        error = ExceptionWrapper(where="in threadloader's isolation helper process, starting")
        sender.send((FATAL, sendable(error)))
        _exit_now(1)
        return
    sender.send((STARTED,))
    try:
        _wait_for_the_end(control, helper.ring)
    finally:
        _exit_now(0)
