"""Mixture and MixtureSampler: named sources mixed by weights that can change mid-run.

``Mixture`` is the dataset: its sources concatenated in sorted name order, each source's shuffled
orders, and the schedule of weight regimes (``mixing`` has the rules; schedules are immutable, a
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
import threading
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from threadloader.device import gathered as _gathered
from threadloader.streams import mixing
from threadloader.streams.args import Ints, as_indices, integer_array
from threadloader.streams.token_windows import TokenWindows

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


class _BoundSampler(Protocol):
    """What a ``Mixture`` asks of the ``MixtureSampler`` bound to it."""

    @property
    def next_position(self) -> int: ...

    def _prepare_change(self, position: int) -> None: ...


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
        if not all(isinstance(n, str) for n in names) or len(names) > mixing.PERIOD:
            raise ValueError(f"source names must be strings, at most {mixing.PERIOD}")
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
        self._orders = mixing.SourceOrders(lengths, [mixing.source_seed(seed, n) for n in names])
        self._offsets = self._orders.offsets.tolist()
        self._schedule = mixing.Schedule.initial(names, seed, mixing.check_weights(weights, names))
        self._lock = threading.Lock()  # serialises writers of _schedule; readers take a reference
        self._sampler: Callable[[], _BoundSampler | None] | None = None  # a weak reference

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
        for s, rows in mixing.groups(source):
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

        ``device.gathered`` point 1 for a mixture of ``TokenWindows`` whose gathering is
        ``TokenWindows``' own (a subclass that changes it, or any other source, gets None: the
        fetcher then calls ``__getitems__``), all of one ``seq_len``.
        """
        sources = [self.sources[name] for name in self.names]
        width = _plain_windows_width(sources)
        if width is None:
            return None
        index, source = self._sources_of(indices)
        rows = np.empty((index.size, width), dtype=np.int64)
        for s, at in mixing.groups(source):
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
        values = mixing.check_weights(weights, self.names)
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
            TypeError: if the positions are not integers.
        """
        array = integer_array(positions, "positions")
        return self._indices(self._schedule, array.reshape(-1)).reshape(array.shape)

    def _indices(self, schedule: mixing.Schedule, positions: Ints) -> Ints:
        return self._orders.indices(*schedule.locate(positions))

    def _load(self, seed: int, schedule_state: Any, start: int, owner: str) -> None:
        schedule = mixing.Schedule.from_state(schedule_state, self.names, seed, owner)
        if start < schedule.start:
            raise ValueError(
                f"{owner} state starts its epoch at {start}, before its schedule's start "
                f"{schedule.start}"
            )
        with self._lock:
            if seed != self.seed:  # the saved seed wins, as for the samplers
                self.seed = seed
                seeds = [mixing.source_seed(seed, n) for n in self.names]
                self._orders = mixing.SourceOrders(self._lengths, seeds)
            self._schedule = schedule

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={len(self.sources[n])}:{w:.3f}" for n, w in self.weights.items())
        return f"{type(self).__name__}({parts}, seed={self.seed})"
