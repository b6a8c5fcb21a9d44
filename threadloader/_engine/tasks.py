"""What travels between the training thread and the worker threads: tasks, results, and the
read-only spec every worker of one loader shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final


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
    """Control message: start over on a fresh dataset iterator (persistent workers), or go back
    to the first batch not delivered (``rewind``: a live change of the index stream), or both,
    in that order (messages a worker had not read yet, merged: ``WorkerPool.new_epoch``)."""

    generation: int
    seed: int | None = None  # an IterDataPipe's new shared seed (_datapipes point 4)
    # The first batch the loop has not received: each worker's generators go back to their
    # state after its last batch before it (``Worker.start_epoch``).
    rewind: int | None = None
    # A new epoch begins (after the rewind, if both): batch numbers count from 0 again.
    begins: bool = True


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
    # The states are where a finished epoch left persistent workers' copies (_state point 8):
    # each copy is settled there (_dataset_state point 4), and the new epoch iterates anew.
    resume_finished_epoch: bool = False
    # Workers whose IterableDataset had ended when the state was taken: settled the same way.
    resume_ended: frozenset[int] = frozenset()
    # Items a worker may take from its IterableDataset after its last delivered batch: the
    # batch size with ``drop_last`` (the partial batch it dropped), else 1 (the end).
    tail_items: int = 1
    capture_rng: bool = False  # snapshot the worker's generators after each batch
    # Keep each worker's generator states after its latest batches, this many, so that a live
    # change of the index stream can rewind them (``Worker.start_epoch``); 0 keeps none.
    rng_history: int = 0
    resume_rng: list[Any] | None = None  # per-worker generator states to resume from
