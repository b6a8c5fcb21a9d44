"""A loader's state: what to save, how to check it, and how an epoch resumes from it.

How state works; where the code disagrees with this, the code is wrong.

1. The state is *consumer-aligned*: it describes the batches the training loop received from
   ``__next__``, never those prefetched by workers.
2. The index stream of an epoch is fixed by the RNG state at the moment the sampler starts
   drawing (the loader's ``generator``, or torch's global RNG when there is none) plus the
   sampler's own state. The loader snapshots it there, and on resume puts it back at the same
   point, so the same permutation comes out. With a ``generator``, the global RNG is snapshotted
   too (a sampler without one, like ``RandomSampler(replacement=True)``, seeds its epoch from
   the global RNG) and the first indices are drawn under it; the user's global RNG is given back,
   unless the state was taken before the pass drew an index (``num_workers=0`` draws at the
   first ``next()``): then the global RNG saved with the user's checkpoint never saw the draw,
   and it is left as the draw leaves it, as in the uninterrupted run.
   A generator of the sampler's own (``RandomSampler(generator=g)``, or the one Accelerate gives
   a sampler it shards over processes) is snapshotted and put back the same way. A sampler that
   draws in ``__iter__`` itself (``return iter(torch.randperm(n).tolist())``) draws when torch's
   iterator calls ``iter()`` on it, before that point: the global RNG is snapshotted right
   before the ``iter()`` call whose iterator the epoch uses, and a resume that replays the
   sampler makes its iterator again under that state (the resumed process's own ``iter()``
   drew from its RNG as torch's does, and that iterator is dropped).
3. Map-style resume never re-reads data. Positional samplers (``threadloader.samplers``: they
   offer ``state_dict_at``) resume at their cursor in O(1), also on a new world size; the cursor
   counts in the pass this iterator begins (when it is made, with or without workers), never in
   an earlier pass of the same epoch. Any other sampler is replayed: its indices for the
   batches already delivered are drawn and dropped.
4. A dataset with ``state_dict``/``load_state_dict`` (map-style or iterable), and an
   IterableDataset's stateful iterator, resume each worker's copy from the state it had when
   its last delivered batch was made, in StatefulDataLoader's order (``dataset_state``). Any
   other IterableDataset is replayed: its first batches are fetched again and
   dropped, with a warning; as many of each worker's as the loop had received from it (its
   batches, and the errors it raised, which the replay does not raise again), so a replay is
   exact also after delivery as completed (``in_order=False``). A map-style
   dataset's states resume on the same number of workers; on another number each copy keeps
   its own state, with a warning.
5. A state for another dataset length, dataset kind, format, or (where it matters) world size or
   number of workers raises ``ValueError`` naming the mismatch.
6. With ``save_worker_rng=True`` each worker's own generators (``WorkerInfo.rng``) are saved as
   of its last delivered batch and put back after its ``worker_init_fn`` on resume, so with
   point 9 every later batch is made by the same worker from the same generator state as
   without the interruption. On another number of workers the generators start fresh, with a
   warning.
7. Map-style positions: a batch is behind the loop once ``__next__`` returned it *or raised its
   error* (the loop may catch the error and go on: its indices were used, as in torch). The state
   holds the first position not behind the loop and, with ``in_order=False``, the positions after
   it already delivered; a resume continues at the first and skips the others, so a batch is
   never lost nor repeated. ``batches_yielded`` stays torch's count of returned batches.
8. Between epochs, what the next epoch inherits is saved with the state: without workers, the
   loader's dataset; with persistent workers, each worker's dataset state and (with
   ``save_worker_rng``) generators as of its last delivered batch, and the epoch's base seed,
   which the saving loader's workers would have kept. The resumed next epoch starts its workers
   from them, with fresh iterators, and draws its indices as a new epoch does.
9. On as many workers as the saved loader had, round robin resumes at the worker after the one
   that made the last delivered batch, as StatefulDataLoader's does, so each later batch is made
   by the worker that would have made it (``get_worker_info().id``, its seed). A replayed
   IterableDataset instead runs the round robin again from the first worker; on another number
   of workers it starts at the first.
10. A replayed IterableDataset (point 4) draws again what its batches drew: from freshly seeded
   generators in a first epoch, and, with persistent workers, from those the workers carried in
   from the epoch before. With ``save_worker_rng`` the state holds the latter (as of each
   worker's last batch delivered before the epoch), and a resume restores them before the
   replay, which brings them to the saved states by itself.
11. A sampler (or batch sampler) of the user's with its own ``state_dict``/``load_state_dict``
   is trusted to resume itself mid-pass, as StatefulDataLoader trusts it: its state is taken
   after each batch's indices are drawn, and a mid-epoch state holds the one taken after the
   last position behind the loop (``Progress.sampler_cursor``); a resume loads it and draws
   on, skipping the later positions already delivered, instead of replaying. Before the first
   position of a pass is behind the loop, and between epochs, the state holds the sampler's
   state after the last draw of its previous pass, marked ``sampler_ended``: a resume loads it
   and runs that pass out (``run_out``: what the pass does after its last index, an epoch
   counter, a reseed), so the next ``iter()`` starts the same pass as without the interruption.
   A pass the loop left early (``break``) is run out too, though the uninterrupted run dropped
   it: what the sampler does after its last index then runs once more than it did. A pass that
   ended having drawn nothing is run out from the state it began with (its ``__iter__`` ran
   all the same, and may have moved an epoch counter on).
   A sampler's first pass in a process has no previous one: nothing is saved, and the resumed
   process's sampler starts as it was built. torch's and torchdata's samplers draw from torch
   generators and are replayed (point 3).
"""

from __future__ import annotations

import copy
import itertools
import pickle
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, _DatasetKind
from torch.utils.data.dataloader import _get_distributed_settings

from threadloader._engine import dataset_state, global_rng
from threadloader._engine.options import options_of
from threadloader._engine.state_codec import encode_rng
from threadloader._engine.worker_rng import as_plain

STATE_VERSION = 1
KINDS = {_DatasetKind.Map: "map", _DatasetKind.Iterable: "iterable"}


@dataclass(frozen=True)
class SamplerSnapshot:
    """A sampler's ``state_dict()`` as it was when taken (point 11): pickled, which costs a
    sixth of a deep copy and is how a state is saved anyway; else deep-copied, else as it is.
    """

    pickled: bytes | None
    kept: Any = None

    @classmethod
    def of(cls, state: Any) -> SamplerSnapshot:
        try:
            return cls(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - a state that does not pickle: copy it instead
            try:
                return cls(None, copy.deepcopy(state))
            except Exception:  # noqa: BLE001 - nor copy: keep it, as StatefulDataLoader does
                return cls(None, state)

    def thaw(self) -> Any:
        """The state: a new copy where it pickled."""
        return pickle.loads(self.pickled) if self.pickled is not None else self.kept


def thawed(snapshot: SamplerSnapshot | None) -> Any:
    return snapshot.thaw() if snapshot is not None else None


@dataclass
class Resume:
    """A checked state, waiting for the next ``iter()`` to resume from it."""

    batches: int  # batches returned before the save (torch's _num_yielded)
    base_seed: int
    rng_source: str
    rng_state: torch.Tensor
    replay_indices: bool  # map-style with a non-positional sampler: draw and drop indices
    replay_data: bool  # IterableDataset without state_dict: fetch and drop batches
    worker_states: list[Any] | None = None  # per-worker dataset states (point 4)
    worker_state_form: int = dataset_state.FORM  # how they are written (_dataset_state)
    next_worker: int = 0
    workers_status: list[bool] | None = None
    rng_states: list[Any] | None = None  # per-worker generator states (point 6)
    position: int = 0  # map-style: where the index stream resumes (point 7)
    skips: tuple[int, ...] = ()  # map-style: later positions already delivered (point 7)
    global_rng_state: torch.Tensor | None = None  # with a generator: the global RNG (point 2)
    sampler_rng_state: torch.Tensor | None = None  # the sampler's own generator (point 2)
    iter_rng_state: torch.Tensor | None = None  # the global RNG before iter(sampler) (point 2)
    indices_drawn: bool = True  # the pass drew its first index before the save (point 2)
    worker_batches: list[int] | None = None  # results received from each worker (point 4)
    # A state taken between epochs of persistent workers (point 8): a new epoch, whose workers
    # start from the saved dataset and generator states; nothing else is resumed.
    next_epoch: bool = False
    # Point 11: the state loaded into the sampler, which resumes itself (taken before the load)
    own_sampler_state: SamplerSnapshot | None = None
    own_sampler_ended: bool = False  # ... after running out the pass it is the state of


@dataclass
class Progress:
    """How far the training loop got in an epoch; shared by an iterator and its loader.

    The iterator writes it as it delivers batches; the loader keeps it, so ``state_dict()``
    still answers after the iterator was dropped (``break``, ``del``).
    """

    batches: int = 0  # batches __next__ returned this epoch (torch's _num_yielded)
    # Of those, the ones delivered before a positional sampler's resumed pass began: its cursor
    # already counts them, so only ``batches - resumed_batches`` come from the current pass.
    resumed_batches: int = 0
    exhausted: bool = False
    # What the epoch's index stream started from (point 2): set by begin_pass.
    base_seed: int = 0
    rng_source: str = "global"
    rng_state: torch.Tensor | None = None
    # With a loader generator, the global RNG as well: a sampler may draw from it (point 2).
    global_rng_state: torch.Tensor | None = None
    sampler_rng_state: torch.Tensor | None = None  # the sampler's own generator (point 2)
    # The global RNG right before iter() made the sampler iterator this epoch uses (point 2).
    iter_rng_state: torch.Tensor | None = None
    indices_drawn: bool = False  # the pass drew an index yet (point 2)
    worker_batches: list[int] = field(default_factory=list)  # delivered from each worker
    # Per-worker dataset states as of each one's last delivered batch (point 4).
    dataset_states: list[Any] | None = None
    next_worker: int = 0
    workers_alive: list[bool] = field(default_factory=list)
    # The workers' own generators as of each one's last delivered batch (point 6).
    rng_states: list[Any] | None = None
    # ... and as the epoch began, where persistent workers carried them in (point 10).
    epoch_rng_states: list[Any] | None = None
    # Map-style (point 7): every position below ``done`` is behind the loop, and so are those in
    # ``ahead`` (sorted; out-of-order delivery, or a resume's skipped positions).
    done: int = 0
    ahead: tuple[int, ...] = ()
    # The position this iterator's index stream starts at, and the later ones it skips.
    pass_start: int = 0
    pass_skips: tuple[int, ...] = ()
    # Batches a positional sampler's resumed pass yields (its remaining() as the pass began).
    pass_total: int | None = None
    # The sampler's epoch as this iterator began (``sampler_moved_on``).
    pass_epoch: int | None = None
    # A positional sampler's ``passes_begun`` as this iterator began: a later pass is its own.
    sampler_passes: int | None = None
    # Point 11: a sampler with its own state, the batches this pass drew, its state after each
    # drawn batch not yet behind the loop (by the position after it), and the latest state
    # at or before ``done`` with the position it resumes at.
    own_sampler: Any = None
    draws: int = 0
    sampler_snapshots: dict[int, SamplerSnapshot] = field(default_factory=dict)
    sampler_state: SamplerSnapshot | None = None
    sampler_cursor: int = 0
    sampler_ended: bool = False  # ``sampler_state`` is of the previous pass (point 11)
    last_drawn_state: SamplerSnapshot | None = None  # after the latest draw, of any pass
    # The sampler's state as this pass began: a pass that ends having drawn nothing is run out
    # from it (``pass_end_state``).
    pass_start_state: SamplerSnapshot | None = None
    pass_ran_out: bool = False  # the sampler's iterator ended (workers draw ahead of the loop)
    # The state after the pass's last index, taken before a final partial batch is drawn
    # (``own_batches``); that draw then saves it rather than the state after the pass ended.
    last_index_state: SamplerSnapshot | None = None

    def pass_positions(self) -> int:
        """Positions drawn from the sampler's current pass and behind the loop, in order."""
        return self.done - self.resumed_batches

    def position_of(self, pass_index: int) -> int:
        """The epoch position of the ``pass_index``-th batch of this iterator's stream."""
        position = self.pass_start + pass_index
        for skipped in self.pass_skips:  # the stream left these out: count past them
            if skipped > position:
                break
            position += 1
        return position

    def behind(self, pass_index: int) -> None:
        """Record that the loop is past the ``pass_index``-th batch of this iterator's stream."""
        position = self.position_of(pass_index)
        if position != self.done:
            self.ahead = tuple(sorted((*self.ahead, position)))
            return
        self.done = position + 1
        self.absorb_ahead()
        if self.sampler_snapshots:
            self._keep_sampler_state()

    def absorb_ahead(self) -> None:
        """Move ``done`` past the positions ahead that now follow it."""
        done, ahead = self.done, self.ahead
        while ahead and ahead[0] == done:
            ahead, done = ahead[1:], done + 1
        self.done, self.ahead = done, ahead

    def note_draw(self) -> None:
        """Record that the stream yielded its next batch (point 11: the sampler's state after, a
        snapshot: a sampler may hand out its live dict and change it as it draws on)."""
        pass_index, self.draws = self.draws, self.draws + 1
        if self.own_sampler is not None:
            position = self.position_of(pass_index)
            state = self.last_index_state or SamplerSnapshot.of(self.own_sampler.state_dict())
            self.last_index_state = None
            self.last_drawn_state = self.sampler_snapshots[position + 1] = state

    def pass_end_state(self) -> SamplerSnapshot | None:
        """The state a resume loads and runs out to be where this pass left the sampler (point
        11): after its last draw; for a pass that ran out having drawn nothing (its ``__iter__``
        still ran, and may have moved an epoch counter on), as it began."""
        ran_out = self.exhausted or self.pass_ran_out
        if ran_out and self.draws == 0 and self.pass_start_state is not None:
            return self.pass_start_state
        return self.last_drawn_state

    def _keep_sampler_state(self) -> None:
        kept = [cursor for cursor in self.sampler_snapshots if cursor <= self.done]
        if kept:
            cursor = max(kept)
            self.sampler_state, self.sampler_cursor = self.sampler_snapshots[cursor], cursor
            self.sampler_ended = False
            for behind in kept:
                del self.sampler_snapshots[behind]


class ProgressMixin:
    """Routes torch's ``_num_yielded`` counter into a ``Progress`` the loader can keep."""

    _progress: Progress

    @property
    def _num_yielded(self) -> int:
        return self._progress.batches

    @_num_yielded.setter
    def _num_yielded(self, value: int) -> None:
        self._progress.batches = value


def positional_sampler(loader: Any) -> tuple[Any, int] | None:
    """The sampler that can describe its own position, and how many of its indices make a batch.

    Returns:
        ``(sampler, indices_per_batch)`` when the loader's indices come from a sampler with
        ``state_dict_at`` (ours), through torch's ``BatchSampler`` or directly; else None.
    """
    index_sampler = loader._index_sampler
    if hasattr(index_sampler, "state_dict_at"):
        return index_sampler, 1
    if type(index_sampler) is BatchSampler and hasattr(loader.sampler, "state_dict_at"):
        return loader.sampler, int(index_sampler.batch_size)
    return None


def _sampler_int(loader: Any, name: str) -> int | None:
    """The int attribute ``name`` of the sampler the loader reads its share through: its
    positional sampler, its sampler, or the sampler inside a batch sampler of the user's (a
    batch sampler's own attributes may mean anything, a length bucket: they are not read)."""
    positional = positional_sampler(loader)
    candidates = (
        positional[0] if positional is not None else None,
        loader.sampler,
        getattr(loader.batch_sampler, "sampler", None),
    )
    for sampler in candidates:
        value = getattr(sampler, name, None)
        if type(value) is int:
            return value
    return None


def sampler_rank(loader: Any, default: int) -> int:
    """The rank whose share of the epoch the loader reads: its sampler's ``rank`` where it has
    one (it may be given apart from torch.distributed), else ``default``."""
    rank = _sampler_int(loader, "rank")
    return default if rank is None else rank


def sampler_ranks(loader: Any, default: int) -> int:
    """The number of ranks the loader's sampler shares the epoch over: its ``num_replicas``
    where it has one (a data-parallel group smaller than the world), else ``default``."""
    ranks = _sampler_int(loader, "num_replicas")
    return default if ranks is None else ranks


def resumes_a_finished_epoch(loader: Any) -> bool:
    """Whether the loader's next ``iter()`` is the empty rest of a loaded finished epoch, which
    ``set_epoch`` named again (a loop that restarts at its checkpoint's epoch, as
    ``StatefulDataLoader`` resumes such a state): its positional sampler's state ended that
    epoch; or torch's ``DistributedSampler``, whose epoch is set only by ``set_epoch``, stands
    at the epoch the loaded state ended (``ended_sampler_epoch``), which ``begin_pass`` then
    makes empty (``loader._empty_pass``)."""
    positional = positional_sampler(loader)
    if positional is None:
        ended = getattr(loader, "_ended_sampler_epoch", None)
        return (
            ended is not None
            and type(loader.sampler) is DistributedSampler
            and sampler_epoch(loader) == ended
        )
    check = getattr(positional[0], "_resumes_a_finished_epoch", None)
    return bool(check()) if check is not None else False


def mixture_sampled(loader: Any) -> bool:
    """Whether the loader samples with a ``MixtureSampler``: its index stream may be rewound
    during an epoch (``ThreadDataLoader.set_mixture_weights``), and its state checks each
    source's length by name."""
    from threadloader.streams import MixtureSampler

    return isinstance(loader.sampler, MixtureSampler)


def own_state_sampler(loader: Any) -> Any:
    """The loader's batch sampler or sampler with its own ``state_dict``/``load_state_dict``
    (point 11), or None; torch's and torchdata's draw from torch generators and are replayed,
    ours are positional."""
    if positional_sampler(loader) is not None:
        return None
    for sampler in (loader.batch_sampler, loader.sampler):
        module = type(sampler).__module__
        if dataset_state.is_stateful(sampler) and not module.startswith(("torchdata.", "torch.")):
            return sampler
    return None


def own_batches(
    sampler: Any, batch_size: int, drop_last: bool, progress: Progress, resumed_at: int = 0
) -> Iterator[list[Any]]:
    """torch's ``BatchSampler`` over a sampler with its own state (point 11): the same batches,
    and the sampler's state taken after its ``len()``-th index when that index starts or fills
    a partial last batch. torch's batching asks for one index more before it yields that
    batch, which runs what the sampler does once its pass ends; the state saved for the batch
    must be the one before (``Progress.last_index_state``). A pass the sampler resumed from a
    loaded state at ``resumed_at`` indices yields the rest of its ``len()``; a count that
    turns out wrong keeps no state (an index comes after it, or none reaches it)."""
    indices = iter(sampler)
    if drop_last:
        for full in zip(*[indices] * batch_size, strict=False):
            yield [*full]
        return
    length = length_of(sampler)
    last = length - resumed_at if length is not None else None
    count = 0
    while True:
        batch: list[Any] = []
        for index in indices:
            batch.append(index)
            count += 1
            progress.last_index_state = None  # an index past len(): not the pass's last
            if len(batch) == batch_size:
                break
            if count == last:
                progress.last_index_state = SamplerSnapshot.of(sampler.state_dict())
        if not batch:
            return
        yield batch


def rng_source(loader: Any) -> str:
    return "generator" if loader.generator is not None else "global"


def snapshot_rng(loader: Any) -> tuple[str, torch.Tensor]:
    source = rng_source(loader)
    if source == "generator":
        return source, loader.generator.get_state()
    return source, torch.get_rng_state()


def sampler_generator(loader: Any) -> torch.Generator | None:
    """A ``torch.Generator`` the loader's sampler draws from that is not the loader's own (point
    2): ``RandomSampler(generator=g)``, also inside a ``BatchSampler`` or a wrapper that keeps it
    as ``.sampler`` / ``.batch_sampler`` (Accelerate's ``BatchSamplerShard``); None if none."""
    found = [loader.batch_sampler if loader.batch_sampler is not None else loader.sampler]
    for _ in range(4):
        nested = []
        for obj in found:
            generator = getattr(obj, "generator", None)
            if isinstance(generator, torch.Generator):
                return None if generator is loader.generator else generator
            nested += [getattr(obj, name, None) for name in ("sampler", "batch_sampler")]
        found = [obj for obj in nested if obj is not None]
    return None


def before_sampler_iter(it: Any, loader: Any) -> None:
    """Note on iterator ``it`` what the ``iter()`` of ``loader``'s sampler it is about to make
    changes: the global RNG (point 2) and a positional sampler's count of passes (point 3)."""
    it._iter_rng_state = torch.get_rng_state()
    positional = positional_sampler(loader)
    it._passes_before = getattr(positional[0], "passes_begun", None) if positional else None


def begin_pass(it: Any, loader: Any, resume: Resume | None) -> Iterator[Any]:
    """Start an epoch's index stream, resuming it if asked; returns the stream to draw from.

    Called by both iterators right before their first index is drawn (point 2).
    """
    sampler_iter: Iterator[Any] = it._sampler_iter
    if getattr(loader, "_empty_pass", False):  # the rest of a finished epoch (above)
        loader._empty_pass = False
        sampler_iter = iter(())
    progress: Progress = it._progress
    # Point 11: the sampler's previous pass (this loader's latest epoch, possibly this very
    # progress, reused by persistent workers), read before the new pass resets it.
    previous: Progress | None = getattr(loader, "_progress", None)
    previous_end = previous.pass_end_state() if previous is not None else None
    if previous_end is not None:
        loader._sampler_pass_end = previous_end
    progress.exhausted = False
    progress.pass_ran_out = False
    progress.resumed_batches = 0
    progress.done = progress.pass_start = 0
    progress.ahead = progress.pass_skips = ()
    progress.pass_total = None
    progress.pass_epoch = sampler_epoch(loader)
    progress.sampler_passes = getattr(it, "_passes_before", None)
    progress.indices_drawn = False
    progress.last_index_state = None
    progress.own_sampler = (
        own_state_sampler(loader) if it._dataset_kind == _DatasetKind.Map else None
    )
    progress.draws = 0
    progress.sampler_snapshots = {}
    own_sampler = progress.own_sampler
    progress.pass_start_state = (
        SamplerSnapshot.of(own_sampler.state_dict()) if own_sampler is not None else None
    )
    index_sampler = loader._index_sampler
    if progress.own_sampler is loader.sampler and type(index_sampler) is BatchSampler:
        # torch's batching of it, not started yet: the same, keeping the state point 11 needs
        resumed_at = 0  # indices the sampler's loaded state is past (it yields the rest)
        if resume is not None and resume.own_sampler_state is not None:
            resumed_at = 0 if resume.own_sampler_ended else resume.position
        sampler_iter = own_batches(
            loader.sampler,
            index_sampler.batch_size,
            index_sampler.drop_last,
            progress,
            resumed_at * index_sampler.batch_size,
        )
    # Point 11: until a position of this pass is behind the loop, the state after the last draw
    # of the sampler's previous pass (this loader's latest epoch, or a loaded state's).
    pass_end = getattr(loader, "_sampler_pass_end", None)
    progress.sampler_state, progress.sampler_cursor = pass_end, 0
    progress.sampler_ended, progress.last_drawn_state = pass_end is not None, pass_end
    own = sampler_generator(loader)
    if resume is None or resume.next_epoch:
        progress.base_seed = int(it._base_seed)
        progress.rng_source, progress.rng_state = snapshot_rng(loader)
        progress.global_rng_state = (
            torch.get_rng_state() if progress.rng_source == "generator" else None
        )
        progress.sampler_rng_state = own.get_state() if own is not None else None
        progress.iter_rng_state = getattr(it, "_iter_rng_state", None)
        return _begin_positional_pass(loader, sampler_iter)
    progress.base_seed = resume.base_seed
    progress.rng_source, progress.rng_state = resume.rng_source, resume.rng_state
    progress.global_rng_state = resume.global_rng_state
    progress.sampler_rng_state = resume.sampler_rng_state
    progress.iter_rng_state = resume.iter_rng_state
    if resume.iter_rng_state is not None:
        # Point 2: the sampler's iterator as the saved epoch made it, for one that draws in
        # __iter__ itself; the one made here drew from this process's RNG.
        mine = torch.get_rng_state()
        torch.set_rng_state(resume.iter_rng_state)
        try:
            sampler_iter = iter(index_sampler)
        finally:
            torch.set_rng_state(mine)
    global_state = resume.rng_state if resume.rng_source == "global" else resume.global_rng_state
    if resume.rng_source == "generator":
        loader.generator.set_state(resume.rng_state)
    if own is not None and resume.sampler_rng_state is not None:
        own.set_state(resume.sampler_rng_state)
    if global_state is not None:
        # Draw the first indices under the saved global RNG (a sampler seeds its epoch from it
        # at its first draw), then give the user theirs back. Positional samplers draw from
        # their own seeds: drawing early would only run their pass out before the loop asks
        # (a short rest, which a live mixture-weight change then could not rewind).
        draws = positional_sampler(loader) is None
        mine = torch.get_rng_state()
        torch.set_rng_state(global_state)
        try:
            first = list(itertools.islice(sampler_iter, 1)) if draws else []
        finally:
            if resume.indices_drawn:  # else the user's RNG, saved with the state, never saw it
                torch.set_rng_state(mine)
        if draws:
            sampler_iter = Predrawn(first, sampler_iter)
            progress.indices_drawn = True
    if resume.replay_indices:
        for _ in itertools.islice(sampler_iter, resume.position):
            pass
    progress.dataset_states = resume.worker_states
    progress.batches = resume.batches
    progress.done = progress.pass_start = resume.position
    progress.ahead = progress.pass_skips = resume.skips
    progress.absorb_ahead()  # an own-state sampler's cursor may be a position delivered ahead
    progress.sampler_state = resume.own_sampler_state
    progress.sampler_cursor, progress.sampler_ended = resume.position, resume.own_sampler_ended
    if progress.sampler_state is not None:
        progress.last_drawn_state = progress.sampler_state  # the latest state there is
    if positional_sampler(loader) is not None:
        progress.resumed_batches = resume.position  # the sampler resumes at its own cursor
        progress.pass_total = _resumed_pass_batches(loader)
        sampler_iter = _begin_positional_pass(loader, sampler_iter)
    if resume.skips:
        sampler_iter = _skipping(sampler_iter, [s - resume.position for s in resume.skips])
    return sampler_iter


def run_out(sampler: Any) -> None:
    """Run a sampler, just loaded with the state after its pass's last draw, to that pass's end
    (point 11), as the uninterrupted run's loop did: at most ``len(sampler)`` items; a sampler
    without a length is left as loaded (its pass may never end)."""
    most = length_of(sampler)
    if most is not None:
        dataset_state.run_to_end(iter(sampler), most + 1)


def start_new_pass(it: Any) -> None:
    """Draw on from a new pass of the positional sampler, which starts at the first position
    not behind the loop: its last pass had ended and was rewound there (a live mixture-weight
    change after the last index was drawn). Counted as a resumed pass (``resumed_batches``)."""
    progress: Progress = it._progress
    it._sampler_iter = iter(it._index_sampler)
    progress.resumed_batches = progress.done
    progress.pass_total = len(it._index_sampler)  # a positional sampler counts its pending pass


def without_predrawn(stream: Iterator[Any]) -> Iterator[Any]:
    """``stream`` without a ``Predrawn`` head: what a sampler rewound to the delivered position
    (a live mixture-weight change) yields; the head was drawn before the rewind."""
    return stream.rest if isinstance(stream, Predrawn) else stream


class Predrawn(Iterator[Any]):
    """``head`` (drawn early, under the saved RNG), then ``rest``: the stream ``begin_pass`` made.

    A sampler rewound before the head was delivered (a live mixture-weight change right after
    ``iter()``) makes the head stale: ``rest`` is the rewound stream without it.
    """

    def __init__(self, head: list[Any], rest: Iterator[Any]) -> None:
        self.head, self.rest = head, rest

    def __next__(self) -> Any:
        if self.head:
            return self.head.pop(0)
        return next(self.rest)


def undo_seed_draw(it: Any, loader: Any) -> None:
    """Undo a new iterator's base-seed draw where the saving loader's would have drawn none.

    Called right after torch's iterator ``__init__`` drew it, before the epoch's pass begins. A
    resumed epoch's base seed is the saved one. A state taken between epochs of a loader with
    persistent workers starts the next epoch, which that loader would have run on its existing
    iterator (``_reset``: no new base seed). The draw came from the generator, or from the
    global RNG without one; restoring that RNG as it was before the draw, and the saved base
    seed, makes the next epoch's order (and worker seeds) the uninterrupted run's.
    """
    saved = loader._undo_seed_draw
    if saved is None:
        return
    loader._undo_seed_draw = None
    if rng_source(loader) == "generator":
        loader.generator.set_state(saved[0])
    else:
        torch.set_rng_state(saved[0])
    it._base_seed = saved[1]


def sampler_moved_on(loader: Any, progress: Progress) -> bool:
    """Whether ``set_epoch`` moved the sampler to another epoch since ``progress`` began: its
    pass, begun or not, is then the next epoch's, and nothing of it is behind the loop."""
    return sampler_epoch(loader) != progress.pass_epoch


def epoch_left_for_the_next(loader: Any, progress: Progress) -> bool:
    """Whether the loop left this unfinished epoch and ``set_epoch`` moved the sampler on since
    it began (a ``break``, then the next epoch set): the next ``iter()`` starts that epoch.

    Only samplers whose epoch ``set_epoch`` alone changes are read so (``_epoch_set_only``).
    """
    if progress.exhausted or not sampler_moved_on(loader, progress):
        return False
    return _epoch_set_only(loader)


def loaded_epoch_left(loader: Any, loaded: Mapping[str, Any] | None) -> bool:
    """Whether a mid-epoch state was loaded and ``set_epoch`` then moved the sampler to another
    epoch (a loop that goes on at the next epoch): the loaded epoch was left, and the next
    ``iter()`` starts the epoch set, as after a ``break`` and ``set_epoch``."""
    if loaded is None or not loaded.get("in_progress") or not _epoch_set_only(loader):
        return False
    saved = loaded.get("sampler_epoch")
    return saved is not None and sampler_epoch(loader) != saved


def _epoch_set_only(loader: Any) -> bool:
    """Whether ``set_epoch`` alone changes the epoch of the loader's sampler: positional ones
    and torch's ``DistributedSampler``. Others may move their own epoch on as their pass ends
    (Accelerate's ``SeedableRandomSampler``), which workers drawing ahead of the loop reach
    before the loop has the epoch's last batch."""
    return positional_sampler(loader) is not None or type(loader.sampler) is DistributedSampler


def epoch_complete(loader: Any, progress: Progress) -> bool:
    """Every batch of this map-style epoch was delivered, though ``next()`` may not have raised
    ``StopIteration`` yet (Lightning checkpoints at the epoch's last step so).

    Counted, never probed (drawing ahead would move the sampler's RNG draws): the pass's length
    is the index sampler's ``len()`` (a whole epoch, also for a replayed resume), or for a
    positional sampler resumed mid-pass its ``remaining()`` indices in batches, read as the pass
    began. Unknown lengths answer False (the state stays in progress, as before).
    """
    if loader._dataset_kind != _DatasetKind.Map or progress.exhausted or progress.ahead:
        return False
    if progress.resumed_batches:
        total = progress.pass_total
    else:
        total = length_of(loader._index_sampler)  # None: a sampler without len()
    return total is not None and progress.done - progress.resumed_batches >= total


def ran_out_and_delivered(it: Any, loader: Any, progress: Progress) -> bool:
    """Every batch of this map-style epoch was delivered and its sampler's iterator has ended:
    the workers drew ahead of the loop to the end of a sampler whose ``len()`` is unknown
    (``epoch_complete`` answers False), and nothing drawn waits in ``it``. Known, not probed:
    without workers (nothing drawn ahead) the state stays in the epoch."""
    return (
        loader._dataset_kind == _DatasetKind.Map
        and progress.pass_ran_out
        and not progress.exhausted
        and not progress.ahead
        and not getattr(it, "_task_info", True)
        and not getattr(it, "_drawn", True)
    )


def _resumed_pass_batches(loader: Any) -> int | None:
    """Batches a positional sampler's pass yields, read as it begins (None: it cannot say)."""
    positional = positional_sampler(loader)
    if positional is None:
        return None
    sampler, per_batch = positional
    remaining = getattr(sampler, "remaining", None)
    if not callable(remaining):
        return None
    indices = int(remaining())
    if per_batch == 1:
        return indices
    return indices // per_batch if loader._index_sampler.drop_last else -(-indices // per_batch)


def stream_ended(it: Any, loader: Any) -> bool:
    """Whether the iterator's index stream ``it._sampler_iter`` is at its end, ending it.

    Called only once every batch was counted delivered (``epoch_complete``): the draw runs what
    the sampler does when it ends, as the loop's next ``next()`` would; should the loop leave
    the epoch instead, what that did to the generators is undone at the next ``iter()``
    (``EndRanEarly``). A stream that still yields keeps that item for its turn (``Predrawn``),
    and is asked no more while it holds one.
    """
    stream = it._sampler_iter
    if isinstance(stream, Predrawn) and stream.head:
        return False
    generators = [g for g in (loader.generator, sampler_generator(loader)) if g is not None]
    before = [g.get_state() for g in generators]
    try:
        head = next(stream)
    except StopIteration:
        after = [g.get_state() for g in generators]
        if not all(torch.equal(a, b) for a, b in zip(after, before, strict=True)):
            loader._end_ran_early = EndRanEarly(generators, before, after, it._progress)
        return True
    it._sampler_iter = Predrawn([head], stream)
    return False


class EndRanEarly:
    """The end of an epoch's sampler pass that ``state_dict()`` ran before the loop got there.

    torch's ``RandomSampler`` draws one more permutation from its generator as it ends, which
    the loop's ``next()`` after the epoch's last batch makes; a loop that leaves the epoch then
    (``break``) never makes it. The end stays done (a loop that goes on finds it done, and
    draws of its own from the generator meanwhile keep their order's count); ``undo`` at the
    next ``iter()`` puts the generators back if the loop left before the end and nothing drew
    from them since. A sampler's own state is not put back: loading a user's sampler state
    may mean something else than where its pass stands.
    """

    def __init__(
        self,
        generators: list[torch.Generator],
        before: list[torch.Tensor],
        after: list[torch.Tensor],
        progress: Progress,
    ) -> None:
        self._generators, self._before, self._after = generators, before, after
        self._progress = progress

    def undo(self) -> None:
        """Undo the end, unless the loop reached it or the generators moved on since."""
        if self._progress.exhausted:
            return
        now = [g.get_state() for g in self._generators]
        if all(torch.equal(n, a) for n, a in zip(now, self._after, strict=True)):
            for generator, state in zip(self._generators, self._before, strict=True):
                generator.set_state(state)


def _begin_positional_pass(loader: Any, sampler_iter: Iterator[Any]) -> Iterator[Any]:
    """A positional sampler's pass, begun now, batched as torch's ``BatchSampler`` batches it.

    Workers draw at ``iter()``; without them torch's batching would call ``iter()`` on the
    sampler at the first ``next()``. Begun here either way, an iterator dropped before its first
    batch has used a loaded resume up, and the next ``iter()`` reads what it reads with workers.
    """
    index_sampler = loader._index_sampler
    if type(index_sampler) is not BatchSampler or positional_sampler(loader) is None:
        return sampler_iter
    return _batches(iter(loader.sampler), index_sampler.batch_size, index_sampler.drop_last)


def _batches(indices: Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    """torch's ``BatchSampler`` batching over an iterator already made."""
    while batch := list(itertools.islice(indices, size)):
        if drop_last and len(batch) < size:
            return
        yield batch


def _skipping(stream: Iterator[Any], offsets: list[int]) -> Iterator[Any]:
    """``stream`` without its items at ``offsets`` (sorted): batches delivered before the save."""
    for offset, item in enumerate(stream):
        if offsets and offset == offsets[0]:
            offsets.pop(0)
            continue
        yield item


def warn_replay(dataset: Any, batches: int) -> None:
    warnings.warn(
        f"{type(dataset).__name__} has no state_dict()/load_state_dict(): resuming by fetching "
        f"and dropping the first {batches} batches of the epoch again",
        stacklevel=3,
    )


def build_state(loader: Any, progress: Progress | None, complete: bool = False) -> dict[str, Any]:
    """The state of ``loader`` as of the batches its training loop received (point 1).

    ``complete``: every batch of the epoch was delivered, though ``next()`` has not raised
    ``StopIteration`` yet, or ``set_epoch`` moved the sampler on since the epoch began; the
    state then starts the next epoch, as after the end.
    """
    world_size, rank = _get_distributed_settings()
    kind = KINDS[loader._dataset_kind]
    fresh = progress is None or progress.exhausted or progress.rng_state is None or complete
    batches = 0 if fresh or progress is None else progress.batches
    map_style = kind == "map"
    # Point 7: where a map-style stream resumes (an iterable one resumes by its batch count).
    position = progress.done if map_style and not fresh and progress is not None else batches
    ahead = list(progress.ahead) if map_style and not fresh and progress is not None else []
    if fresh or progress is None or progress.rng_state is None:
        source, rng_state = snapshot_rng(loader)
        base_seed = progress.base_seed if progress is not None else 0
    else:
        source, rng_state, base_seed = progress.rng_source, progress.rng_state, progress.base_seed
    positional = positional_sampler(loader)
    sampler_state = None
    if positional is not None:
        sampler, per_batch = positional
        # A finished epoch's state holds its end: the sampler starts the epoch over at the next
        # iter(), as torch's do, unless set_epoch names that epoch again (shuffle point 3).
        ended = progress is not None and (progress.exhausted or complete)
        done = progress.done if ended and progress is not None else position
        this_pass = done - (progress.resumed_batches if progress is not None else 0)
        # A finished epoch's end includes the indices drop_last left out of a batch: on another
        # world size they would make one more batch of that epoch. The sampler stops at its end;
        # once set_epoch moved it to the next epoch, that one's start is where it stands.
        if ended and progress is not None and sampler_moved_on(loader, progress):
            consumed = 0
        else:
            consumed = sys.maxsize if ended else max(this_pass, 0) * per_batch
        since = progress.sampler_passes if progress is not None else None
        if since is None:
            sampler_state = sampler.state_dict_at(consumed)
        else:  # this iterator's pass, not an earlier one of the same epoch (point 3)
            sampler_state = sampler.state_dict_at(consumed, since=since)
    live = not fresh and progress is not None
    sampler_ended = False
    if live and progress.own_sampler is not None:  # type: ignore[union-attr]
        # Point 11: the sampler resumes at the cursor of its state, skipping what is behind.
        sampler_state = thawed(progress.sampler_state)  # type: ignore[union-attr]
        sampler_ended = progress.sampler_ended  # type: ignore[union-attr]
        position = progress.sampler_cursor  # type: ignore[union-attr]
        end = progress.pass_end_state()  # type: ignore[union-attr]
        if end is not progress.last_drawn_state:  # type: ignore[union-attr]
            # This pass ran out having drawn nothing (workers draw ahead of the loop): a resume
            # runs it out again from where it began, as between epochs.
            sampler_state, sampler_ended = thawed(end), True
        ahead = [*range(position, progress.done), *ahead]  # type: ignore[union-attr]
    elif fresh and progress is not None and progress.own_sampler is not None:
        # Between epochs: the state after the finished (or left) pass's last draw.
        sampler_state = thawed(progress.pass_end_state())
        sampler_ended = sampler_state is not None
    # Between epochs, what carries state into the next one: without workers, the loader's own
    # dataset; with persistent workers, their dataset copies and generators (point 8). Other
    # workers' copies start each epoch from the loader's dataset.
    carried = progress is not None and (
        (loader.num_workers == 0 and (progress.exhausted or complete))
        or (loader.num_workers > 0 and loader.persistent_workers)
    )
    worker_states = None
    saved = progress.dataset_states if live or carried else None  # type: ignore[union-attr]
    if saved is not None and any(state is not None for state in saved):
        worker_states = list(saved)
    return {
        "version": STATE_VERSION,
        "epoch": loader._epochs_started,
        "in_progress": not fresh,
        "batches_yielded": batches,
        "position": position,
        "delivered_ahead": ahead,
        # Delivered as completed (point 7): another rank's state may hold batches ahead.
        "in_order": bool(loader.in_order) or loader.num_workers <= 1 if live else True,
        "base_seed": base_seed,
        "rng_source": source,
        "rng_state": encode_rng(rng_state),
        "batch_size": loader.batch_size,
        "sampler_type": type_name(loader.sampler),
        "sampler": sampler_state,
        "sampler_ended": sampler_ended,
        # Mid-epoch, the epoch of the pass the loop is in: a sampler may have moved its own
        # epoch on as workers drew its pass to the end (Accelerate's SeedableRandomSampler).
        "sampler_epoch": progress.pass_epoch if live else sampler_epoch(loader),  # type: ignore[union-attr]
        # The epoch a state taken at its last step, before StopIteration, ended
        # (``resumes_a_finished_epoch``). A state after the end starts the next epoch however
        # the sampler stands, as StatefulDataLoader's does.
        "ended_sampler_epoch": (
            progress.pass_epoch
            if progress is not None and complete and not progress.exhausted
            else None
        ),
        "dataset_kind": kind,
        "dataset_length": length_of(loader.dataset) if kind == "map" else None,
        "num_workers": loader.num_workers,
        "world_size": world_size,
        "rank": rank,
        "sampler_rank": sampler_rank(loader, rank),
        "sampler_ranks": sampler_ranks(loader, world_size),
        "worker_states": worker_states,
        "worker_state_form": dataset_state.FORM,
        "next_worker": progress.next_worker if live else 0,  # type: ignore[union-attr]
        "workers_status": list(progress.workers_alive) if live else None,  # type: ignore[union-attr]
        "worker_rng_states": _rng_states(loader, progress) if live or carried else None,
        "worker_rng_states_at_start": _rng_states_at_start(loader, progress, kind, worker_states)
        if live
        else None,
        "global_rng_state": (
            encode_rng(progress.global_rng_state)  # type: ignore[union-attr]
            if live and progress.global_rng_state is not None  # type: ignore[union-attr]
            else None
        ),
        "sampler_rng_state": _sampler_rng_state(loader, progress if live else None),
        "iter_rng_state": (
            encode_rng(progress.iter_rng_state)  # type: ignore[union-attr]
            if live
            and progress.iter_rng_state is not None  # type: ignore[union-attr]
            and positional is None
            and progress.own_sampler is None  # type: ignore[union-attr]
            else None
        ),
        "indices_drawn": progress.indices_drawn if live else True,  # type: ignore[union-attr]
        "worker_batches": (
            list(progress.worker_batches)  # type: ignore[union-attr]
            if live and kind == "iterable" and worker_states is None and loader.num_workers > 0
            else None
        ),
        **global_rng.saved(loader),
    }


def _sampler_rng_state(loader: Any, progress: Progress | None) -> str | None:
    """Point 2: the sampler's own generator as the epoch began (``progress``), or as it is now,
    for a state that starts the next epoch (None)."""
    if progress is not None:
        saved = progress.sampler_rng_state
        return encode_rng(saved) if saved is not None else None
    own = sampler_generator(loader)
    return encode_rng(own.get_state()) if own is not None else None


def _rng_states(loader: Any, progress: Progress | None) -> list[Any] | None:
    """Point 6: the saved generator states, when the loader saves them and has any yet."""
    if not options_of(loader).save_worker_rng or progress is None:
        return None
    return _plain_states(progress.rng_states)


def _rng_states_at_start(
    loader: Any, progress: Progress | None, kind: str, worker_states: list[Any] | None
) -> list[Any] | None:
    """Point 10: the generators the epoch began with, for a resume that replays its batches."""
    if not options_of(loader).save_worker_rng or progress is None:
        return None
    if kind != "iterable" or worker_states is not None:
        return None
    return _plain_states(progress.epoch_rng_states)


def _plain_states(states: list[Any] | None) -> list[Any] | None:
    """Generator states as a loader state holds them; None when no worker has one."""
    if not states or all(s is None for s in states):
        return None
    return [as_plain(s) if s is not None else None for s in states]


def length_of(obj: Any) -> int | None:
    """``len(obj)``, or None for a dataset or sampler without a length."""
    try:
        return len(obj)
    except TypeError:
        return None


def sampler_epoch(loader: Any) -> int | None:
    epoch = getattr(loader.sampler, "epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def type_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"
