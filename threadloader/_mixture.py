"""Mixture and MixtureSampler: named sources mixed by weights that can change mid-run.

``Mixture`` is the dataset: its sources concatenated in sorted name order, each source's shuffled
orders, and the schedule of weight regimes (``_mixing`` has the rules; schedules are immutable, a
change builds a new one under the mixture's lock). ``MixtureSampler`` walks one infinite global
stream: rank ``r`` of ``W`` reads positions ``r, r + W, ...``, resolved to concatenated indices
``MIXTURE_BLOCK`` positions at a time from the seed, the position and the weights in force there,
so the stream does not depend on the world size and a state saved on ``W`` ranks resumes on any
``W'``. A sampler binds itself to its mixture: ``Mixture.set_weights`` defaults to the sampler's
next position and may rewind its current pass (``_StreamPass``), whose iterator resolves the rest
of its block again as soon as it sees the new schedule. ``MixtureSampler``'s docstring says how
its state works.
"""

from __future__ import annotations

import bisect
import operator
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset, Sampler

from threadloader import _gathered, _mixing
from threadloader._stream_args import Ints, as_indices, default_world
from threadloader._token_windows import TokenWindows

STATE_VERSION: Final = 1
MIXTURE_BLOCK: Final = 4096
"""Positions a ``MixtureSampler`` resolves per numpy block (~0.3 µs a position)."""


_GATHERING = frozenset({"__getitems__", "_inputs_targets", "windows", "token_starts"})


def _plain_windows_width(sources: Sequence[Any]) -> int | None:
    """``seq_len + 1`` when every source is a plain ``TokenWindows`` (no subclass, no method
    replaced on the instance) and all have one ``seq_len``; else None."""
    widths = set()
    for source in sources:
        if (
            type(source) is not TokenWindows  # a subclass may change any step of its gathering
            or _gathered.parts_getter(source) is None
            or _GATHERING & vars(source).keys()
        ):
            return None
        widths.add(source.seq_len + 1)
    return widths.pop() if len(widths) == 1 else None


class Mixture(Dataset[Any]):
    """Named map-style datasets mixed in given proportions, with weights that change live.

    As a dataset, a ``Mixture`` is the concatenation of its sources in sorted name order
    (``__getitem__``/``__getitems__``; a batch is fetched with one ``__getitems__`` per source
    when the source has it). The order comes from a ``MixtureSampler``: each global stream
    position draws from the source the low-discrepancy schedule gives it (any 10,000 consecutive
    positions match the weights within 0.05%), and that source's next sample in its own shuffled
    epoch; a source that runs out starts its own next epoch.

    ``set_weights`` changes the weights from a given global position on. Like every loader call
    it belongs to the training thread (the thread that iterates the loader).

    Only its ``MixtureSampler`` mixes: any other sampler reads the concatenation and ignores the
    weights, so ``ThreadDataLoader`` refuses a ``Mixture`` sampled any other way (torch's
    ``DataLoader`` cannot check this).

    Args:
        sources: source name -> map-style dataset with ``len`` (e.g. ``TokenWindows``).
        weights: source name -> weight >= 0 (normalised; names left out get 0).
        seed: keys every source's shuffle and the interleaving.

    Raises:
        ValueError: naming the source, for an empty source, an unknown name in ``weights``, a
            negative or non-finite weight; or if all weights are zero or no source is given.
        TypeError: naming the source, for a source without ``len`` (an iterable dataset).
    """

    def __init__(
        self, sources: Mapping[str, Any], weights: Mapping[str, float], seed: int = 0
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty dict of name -> dataset")
        names = tuple(sorted(sources))
        if not all(isinstance(n, str) for n in names) or len(names) > _mixing.PERIOD:
            raise ValueError(f"source names must be strings, at most {_mixing.PERIOD}")
        lengths = []
        for name in names:
            source = sources[name]
            if not isinstance(source, Sized):
                raise TypeError(f"source {name!r} has no len(): a Mixture mixes map-style datasets")
            if len(source) == 0:
                raise ValueError(f"source {name!r} is empty")
            lengths.append(len(source))
        self.names = names
        self.sources = {name: sources[name] for name in names}
        self.seed = seed
        self._lengths = tuple(lengths)
        self._orders = _mixing.SourceOrders(lengths, [_mixing.source_seed(seed, n) for n in names])
        self._offsets = self._orders.offsets.tolist()
        self._schedule = _mixing.Schedule.initial(
            names, seed, _mixing.check_weights(weights, names)
        )
        self._lock = threading.Lock()  # serialises writers of _schedule; readers take a reference
        self._sampler: weakref.ref[MixtureSampler] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the lock and the sampler link (a worker or helper process's copy
        serves ``__getitems__``; the schedule changes in the training process's sampler)."""
        state = self.__dict__.copy()
        del state["_lock"]
        state["_sampler"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Total samples over all sources (the concatenated index space)."""
        return self._offsets[-1]

    def __getitem__(self, index: int) -> Any:
        """Return sample ``index`` of the concatenation (``source_of`` tells which it is)."""
        name, local = self.source_of(index)
        return self.sources[name][local]

    @_gathered.gathered_by("_gather_windows")
    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Return a batch: one ``__getitems__`` (or item loop) per source, in the asked order.

        ThreadDataLoader's default collate takes the gathered windows instead when every source
        is a plain ``TokenWindows`` of one ``seq_len`` (``_gather_windows``).
        """
        index, source = self._sources_of(indices)
        out: list[Any] = [None] * index.size
        for s, rows in _mixing.groups(source):
            local = (index[rows] - self._offsets[s]).tolist()
            dataset = self.sources[self.names[s]]
            getitems = getattr(dataset, "__getitems__", None)
            items = getitems(local) if getitems is not None else [dataset[i] for i in local]
            for row, item in zip(rows.tolist(), items, strict=True):
                out[row] = item
        return out

    def _sources_of(self, indices: Sequence[int]) -> tuple[Ints, Ints]:
        """The indices as an array, and the source number of each (vectorised)."""
        index = as_indices(indices, len(self))
        return index, np.searchsorted(self._orders.offsets, index, side="right") - 1

    def _gather_windows(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...] | None:
        """The batch's inputs and targets from one gather per source into one array, or None.

        ``_gathered`` point 1 for a mixture of ``TokenWindows`` whose gathering is
        ``TokenWindows``' own (a subclass that changes it, or any other source, gets None: the
        fetcher then calls ``__getitems__``), all of one ``seq_len``.
        """
        sources = [self.sources[name] for name in self.names]
        width = _plain_windows_width(sources)
        if width is None:
            return None
        index, source = self._sources_of(indices)
        rows = np.empty((index.size, width), dtype=np.int64)
        for s, at in _mixing.groups(source):
            rows[at] = sources[s].windows(index[at] - self._offsets[s])
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def source_of(self, index: int) -> tuple[str, int]:
        """Return ``(source name, index in that source)`` of a concatenated index.

        Raises:
            IndexError: if ``index`` is outside ``[0, len(self))``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} samples")
        s = bisect.bisect_right(self._offsets, index) - 1
        return self.names[s], index - self._offsets[s]

    @property
    def weights(self) -> dict[str, float]:
        """The normalised weights of the latest change (or the initial ones)."""
        return dict(zip(self.names, self._schedule.regimes[-1].weights, strict=True))

    @property
    def schedule(self) -> list[tuple[int, dict[str, float]]]:
        """``(position, weights)`` of each change still recorded, oldest first."""
        return [
            (r.position, dict(zip(self.names, r.weights, strict=True)))
            for r in self._schedule.regimes
        ]

    def set_weights(self, weights: Mapping[str, float], at_position: int | None = None) -> int:
        """Use ``weights`` from global stream position ``at_position`` on; return that position.

        The change is part of the stream's definition: it is recorded in the sampler's state with
        its position, so a resume reproduces it, and every rank must make the same call with the
        same position. Positions before it keep their samples; each source continues its epoch
        where it was. A later call whose position is at or before a change already scheduled
        replaces that change.

        Args:
            weights: source name -> weight >= 0 (normalised; names left out get 0).
            at_position: first global position to use the new weights. Default: the bound
                sampler's ``next_position``, the first position it has not handed out yet (the
                batches already prefetched keep the old weights; with no sampler, the schedule's
                start). A position before ``next_position`` but within the sampler's current pass
                rewinds the sampler's iterator to it: its next index is the first of this rank
                at or after ``at_position``, and the caller must discard the indices it got from
                there on (a loader drops the batches in flight, see ``MixtureSampler``).

        Returns:
            the position the new weights take effect from.

        Raises:
            ValueError: naming the source, for an unknown name, a negative or non-finite weight;
                if all weights are zero; if ``at_position`` comes before the current pass of the
                sampler or before the recorded schedule.
        """
        values = _mixing.check_weights(weights, self.names)
        with self._lock:
            sampler = self._sampler() if self._sampler is not None else None
            if at_position is None:
                at_position = sampler.next_position if sampler is not None else self._schedule.start
            schedule = self._schedule.changed(values, at_position)
            if sampler is not None:
                sampler._prepare_change(at_position)
            self._schedule = schedule
        return at_position

    def counts_at(self, position: int) -> dict[str, int]:
        """Samples each source gives before global position ``position`` under the current schedule.

        ``counts_at(b) - counts_at(a)`` are the realised counts of positions ``a ... b - 1``.
        """
        counts = self._schedule.counts_at(position)
        return dict(zip(self.names, counts, strict=True))

    def indices_at(self, positions: npt.ArrayLike) -> Ints:
        """Return the concatenated index each global stream position reads (vectorised).

        Raises:
            ValueError: if a position precedes the recorded schedule.
        """
        positions = np.asarray(positions, dtype=np.int64)
        return self._indices(self._schedule, positions.reshape(-1)).reshape(positions.shape)

    def _indices(self, schedule: _mixing.Schedule, positions: Ints) -> Ints:
        return self._orders.indices(*schedule.locate(positions))

    def _load(self, seed: int, schedule_state: Any, start: int, owner: str) -> None:
        schedule = _mixing.Schedule.from_state(schedule_state, self.names, seed, owner)
        if start < schedule.start:
            raise ValueError(
                f"{owner} state starts its epoch at {start}, before its schedule's start "
                f"{schedule.start}"
            )
        with self._lock:
            if seed != self.seed:  # the saved seed wins, as for the samplers
                self.seed = seed
                seeds = [_mixing.source_seed(seed, n) for n in self.names]
                self._orders = _mixing.SourceOrders(self._lengths, seeds)
            self._schedule = schedule

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={len(self.sources[n])}:{w:.3f}" for n, w in self.weights.items())
        return f"{type(self).__name__}({parts}, seed={self.seed})"


class _StreamPass:
    """One ``iter()`` of a ``MixtureSampler``: ``count`` local indices from global ``start``.

    As in ``threadloader.samplers._Pass``, ``progress`` is (end of the current block, the block's
    iterator), replaced by one assignment, and the consumer's position is read from the iterator's
    length hint: nothing is counted per index.
    """

    __slots__ = ("count", "done", "progress", "start")

    def __init__(self, start: int, count: int) -> None:
        self.start = start
        self.count = count
        self.done = False
        self.progress: tuple[int, Iterator[int]] = (0, iter(()))

    def next_local(self) -> int:
        end, block = self.progress
        return end - operator.length_hint(block)


class MixtureSampler(Sampler[int]):
    """The global stream of a ``Mixture``, strided over ranks, resumable on any world size.

    The stream is infinite: positions ``0, 1, 2, ...``, each resolved by the mixture's schedule to
    a source and a sample of that source's current epoch (sources roll over their own epochs).
    The sampler's epochs are consecutive stretches of it: epoch ``e`` covers global positions
    ``[start, end)``, ``samples_per_epoch // num_replicas`` per rank, and ``set_epoch(e + 1)``
    moves on to the stretch that begins at ``end``. Rank ``r`` reads ``start + r + j * W``.
    As with torch's ``DistributedSampler``, ``iter()`` without ``set_epoch`` reads the same epoch
    again.

    How state works; where the code disagrees with this, the code is wrong.

    1. ``state_dict()`` is a plain dict: ``version``, ``seed``, ``epoch``, ``start``, ``cursor``,
       ``end``, ``num_replicas``, ``sources`` (name -> length) and ``schedule``. ``cursor`` counts
       the epoch's positions handed out by all ranks together (ranks advance in lockstep, so every
       rank saves the same state, without communication); ``state_dict_at(consumed)`` counts only
       the first ``consumed`` indices of this rank's latest ``iter()``, for a loader that saves
       what its training loop received rather than what it prefetched.
    2. ``schedule`` lists the weight regimes ``{position, weights, quotas, counts}`` from the
       epoch's ``start`` on: O(#sources), plus one entry per change made during the epoch.
    3. ``load_state_dict`` makes the next ``iter()`` resume at ``start + cursor`` on this sampler's
       world size ``W'``: each rank takes ``(end - start - cursor) // W'`` positions, and the
       epoch's ``end`` becomes the position after them, so the next epoch starts right there:
       across any number of resumes, each position of the stream is read exactly once, so each
       sample of every source's epoch is. ``set_epoch`` with the saved epoch keeps the resume.
    4. A state for another format version, or naming a source this mixture lacks or with another
       length, raises ``ValueError`` naming it. Sources the state lacks join with weight 0.

    Args:
        mixture: the ``Mixture``; the sampler binds itself to it (``set_weights``' default).
        num_replicas: world size; torch.distributed's when initialised, else 1.
        rank: this rank; torch.distributed's when initialised, else 0.
        samples_per_epoch: global positions per epoch; ``len(mixture)`` by default.

    Raises:
        ValueError: if the rank is out of range or ``samples_per_epoch < num_replicas``.
    """

    def __init__(
        self,
        mixture: Mixture,
        num_replicas: int | None = None,
        rank: int | None = None,
        samples_per_epoch: int | None = None,
    ) -> None:
        self.num_replicas, self.rank = default_world(num_replicas, rank)
        self.samples_per_epoch = len(mixture) if samples_per_epoch is None else samples_per_epoch
        if self.samples_per_epoch < self.num_replicas:
            raise ValueError(
                f"samples_per_epoch must be >= num_replicas ({self.num_replicas}), got "
                f"{self.samples_per_epoch}"
            )
        self.mixture = mixture
        self.epoch = 0
        self._start, self._end = 0, self._epoch_span()  # the epoch's global [start, end)
        self._pending: int | None = None  # global position to resume at, from load_state_dict
        self._pass: _StreamPass | None = None
        mixture._sampler = weakref.ref(self)

    def _epoch_span(self) -> int:
        return self.samples_per_epoch // self.num_replicas * self.num_replicas

    def __len__(self) -> int:
        """Indices the next (or current) pass of this epoch yields on this rank."""
        current = self._pass
        if self._pending is None and current is not None and not current.done:
            return current.count
        first = self._start if self._pending is None else self._pending
        return max(self._end - first, 0) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        """Read the epoch from its start, or once from the loaded position (point 3)."""
        first = self._start if self._pending is None else self._pending
        self._pending = None
        count = max(self._end - first, 0) // self.num_replicas
        self._end = first + count * self.num_replicas  # the next epoch starts right after
        mixture = self.mixture
        with mixture._lock:
            mixture._schedule = mixture._schedule.compacted(self._start)
        pass_ = _StreamPass(first, count)
        self._pass = pass_
        return self._generate(pass_)

    def _generate(self, pass_: _StreamPass) -> Iterator[int]:
        mixture, stride, offset = self.mixture, self.num_replicas, pass_.start + self.rank
        while (first := pass_.next_local()) < pass_.count:
            schedule = mixture._schedule
            end = min(first + MIXTURE_BLOCK, pass_.count)
            positions = np.arange(first, end, dtype=np.int64) * stride + offset
            block = iter(mixture._indices(schedule, positions).tolist())
            pass_.progress = (end, block)
            for index in block:
                yield index
                if mixture._schedule is not schedule:
                    break  # weights changed: resolve the rest again (and maybe rewind)
        pass_.done = True

    def set_epoch(self, epoch: int) -> None:
        """Move to epoch ``epoch``: the stretch of the stream after the current epoch's end.

        Skipped epochs are skipped stretches of the stream. Setting the current epoch keeps a
        loaded resume.

        Raises:
            ValueError: if ``epoch`` is before the current one: the stream only moves forward.
        """
        if epoch == self.epoch:
            return
        if epoch < self.epoch:
            raise ValueError(
                f"{type(self).__name__} is at epoch {self.epoch}: a stream cannot go back to "
                f"epoch {epoch}"
            )
        self._start = self._end + (epoch - self.epoch - 1) * self._epoch_span()
        self._end = self._start + self._epoch_span()
        self.epoch = epoch
        self._pending = None
        self._pass = None

    @property
    def next_position(self) -> int:
        """The global position of this sampler's next not-yet-handed-out index (its row's start).

        The loaded position before a resumed pass, the epoch's start before its first pass, the
        epoch's end once its pass has handed everything out.
        """
        if self._pending is not None:
            return self._pending
        current = self._pass
        if current is None:
            return self._start
        if current.done:
            return self._end
        return current.start + current.next_local() * self.num_replicas

    def position_after(self, consumed: int) -> int:
        """The global position after the first ``consumed`` indices of this rank's latest ``iter()``.

        With ``consumed`` = the indices in the batches the training loop received, this is where
        the loop stands: the position a loader passes to ``Mixture.set_weights`` so that a change
        takes effect from the next batch the loop requests.
        """
        if self._pending is not None or self._pass is None:
            return self.next_position + consumed * self.num_replicas
        return self._pass.start + min(consumed, self._pass.count) * self.num_replicas

    def _prepare_change(self, position: int) -> None:
        """Check a weight change at ``position``; rewind the current pass if it handed that out."""
        if position >= self.next_position:
            return
        current = self._pass
        if self._pending is not None or current is None or current.done or position < current.start:
            raise ValueError(
                f"cannot change the weights at position {position}: this sampler has already "
                f"handed out positions up to {self.next_position} outside a pass it can rewind"
            )
        local = max(0, -(-(position - current.start - self.rank) // self.num_replicas))
        current.progress = (local, iter(()))

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's state (point 1); the same on every rank in lockstep training."""
        return self._state(self.next_position)

    def state_dict_at(self, consumed: int) -> dict[str, Any]:
        """The state once ``consumed`` indices of this rank's latest ``iter()`` have been used.

        A loader hands indices to workers ahead of the training loop; this counts only those the
        loop received. Before any pass of the epoch, or with a resume pending, it is
        ``state_dict()``.
        """
        if self._pending is not None or self._pass is None:
            return self.state_dict()
        return self._state(self.position_after(consumed))

    def _state(self, position: int) -> dict[str, Any]:
        mixture = self.mixture
        return {
            "version": STATE_VERSION,
            "seed": mixture.seed,
            "epoch": self.epoch,
            "start": self._start,
            "cursor": position - self._start,
            "end": self._end,
            "num_replicas": self.num_replicas,
            "sources": dict(zip(mixture.names, mixture._lengths, strict=True)),
            "schedule": mixture._schedule.compacted(self._start).to_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` resume at the saved position, with the saved schedule and seed.

        The state may come from any rank and any world size (point 3).

        Args:
            state: a dict from ``state_dict()`` or ``state_dict_at()``.

        Raises:
            ValueError: naming the mismatch, for another format version, a source the mixture
                lacks or whose length differs, or a missing, mistyped or out-of-range entry.
        """
        owner = type(self).__name__
        if not isinstance(state, Mapping):
            raise ValueError(f"{owner} state must be a dict, got {type(state).__name__}")  # noqa: TRY004
        keys = ("version", "seed", "epoch", "start", "cursor", "end")
        missing = sorted({*keys, "sources", "schedule"} - set(state))
        if missing:
            raise ValueError(f"{owner} state lacks {missing}: got keys {sorted(state)}")
        values = {}
        for key in keys:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(  # noqa: TRY004  # a corrupted state, as in threadloader.samplers
                    f"{owner} state[{key!r}] must be an int, got {type(value).__name__}"
                )
            values[key] = int(value)
        if values["version"] != STATE_VERSION:
            raise ValueError(
                f"{owner} state has format version {values['version']}, this threadloader reads "
                f"version {STATE_VERSION}"
            )
        start, cursor, end = values["start"], values["cursor"], values["end"]
        if not 0 <= start <= end or cursor < 0:
            raise ValueError(
                f"{owner} state has start {start}, cursor {cursor}, end {end}: expected "
                "0 <= start <= end and cursor >= 0"
            )
        self._check_sources(state["sources"], owner)
        self.mixture._load(values["seed"], state["schedule"], start, owner)
        self.epoch = values["epoch"]
        self._start, self._end = start, end
        self._pending = start + cursor
        self._pass = None

    def _check_sources(self, sources: Any, owner: str) -> None:
        if not isinstance(sources, Mapping):
            raise ValueError(f"{owner} state['sources'] must be a dict of name -> length")  # noqa: TRY004
        mine = dict(zip(self.mixture.names, self.mixture._lengths, strict=True))
        for name, length in sources.items():
            if name not in mine:
                raise ValueError(
                    f"{owner} state has source {name!r}, which this mixture lacks "
                    f"(its sources are {list(mine)})"
                )
            if length != mine[name]:
                raise ValueError(
                    f"{owner} state has source {name!r} of length {length}, this mixture's has "
                    f"length {mine[name]}"
                )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_replicas={self.num_replicas}, rank={self.rank}, "
            f"samples_per_epoch={self.samples_per_epoch}, epoch={self.epoch}, "
            f"next_position={self.next_position})"
        )
