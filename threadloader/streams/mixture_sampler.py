"""MixtureSampler: one infinite global stream over a ``Mixture``, strided over ranks, resumable on
any world size (its docstring says how its state works).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

import numpy as np
from torch.utils.data import Sampler

from threadloader.samplers.shuffle import counts_in_current, int_argument
from threadloader.streams.args import default_world
from threadloader.streams.mixture import MIXTURE_BLOCK, STATE_VERSION, Mixture

#: Global stream positions a state may name are below this (they are read as int64).
_POSITIONS = 2**62


class _StreamPass:
    """One ``iter()`` of a ``MixtureSampler``: ``count`` local indices from global ``start``.

    As in ``threadloader.samplers.shuffle._Pass``, ``progress`` is (end of the current block, the block's
    iterator), replaced by one assignment, and the consumer's position is read from the iterator's
    length hint: nothing is counted per index.
    """

    __slots__ = ("count", "done", "progress", "serial", "start")

    def __init__(self, start: int, count: int, serial: int) -> None:
        self.start = start
        self.count = count
        self.serial = serial  # how many passes of its sampler began before it, plus one
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
       A state saved at its epoch's end resumes that epoch's empty rest only once ``set_epoch``
       named that epoch again; without it the next ``iter()`` reads the epoch from its start,
       as without a resume.
    4. A state for another format version, or naming a source this mixture lacks or with another
       length, raises ``ValueError`` naming it. Sources the state lacks join with weight 0.

    Args:
        mixture: the ``Mixture``; the sampler binds itself to it (``set_weights``' default).
        num_replicas: world size; torch.distributed's when initialised, else 1.
        rank: this rank; torch.distributed's when initialised, else 0.
        samples_per_epoch: global positions per epoch; ``len(mixture)`` by default.

    Raises:
        ValueError: if the rank is out of range or ``samples_per_epoch < num_replicas``.
        TypeError: if ``mixture`` is no ``Mixture``, or a number is not an int.
    """

    def __init__(
        self,
        mixture: Mixture,
        num_replicas: int | None = None,
        rank: int | None = None,
        samples_per_epoch: int | None = None,
    ) -> None:
        if not isinstance(mixture, Mixture):
            raise TypeError(f"MixtureSampler samples a Mixture, got {type(mixture).__name__}")
        self.num_replicas, self.rank = default_world(num_replicas, rank)
        self.samples_per_epoch = (
            len(mixture)
            if samples_per_epoch is None
            else int_argument(samples_per_epoch, "samples_per_epoch")
        )
        if self.samples_per_epoch < self.num_replicas:
            raise ValueError(
                f"samples_per_epoch must be >= num_replicas ({self.num_replicas}), got "
                f"{self.samples_per_epoch}"
            )
        self.mixture = mixture
        self.epoch = 0
        self._start, self._end = 0, self._epoch_span()  # the epoch's global [start, end)
        self._pending: int | None = None  # global position to resume at, from load_state_dict
        self._kept = False
        self._pass: _StreamPass | None = None
        self._passes = 0  # passes begun so far
        mixture._sampler = weakref.ref(self)

    def _epoch_span(self) -> int:
        return self.samples_per_epoch // self.num_replicas * self.num_replicas

    def __len__(self) -> int:
        """Indices the next (or current) pass of this epoch yields on this rank."""
        current = self._pass
        if self._pending is None and current is not None and not current.done:
            return current.count
        return self._next_pass()[1]

    def _next_pass(self) -> tuple[int, int]:
        """The global position the next ``iter()`` starts at, and how many indices it yields
        on this rank: the epoch from its start, or once the rest from a loaded position."""
        first = self._start if self._pending is None else self._pending
        if self._pending is not None and first >= self._end and not self._kept:
            first = self._start  # a finished epoch's state without set_epoch: read it again
        return first, max(self._end - first, 0) // self.num_replicas

    def remaining(self) -> int:
        """Indices the next (or current) pass of this epoch yields on this rank: ``len()``, which
        for this sampler already counts what is left after a resume."""
        return len(self)

    def _resumes_a_finished_epoch(self) -> bool:
        """Whether the next ``iter()`` is the empty rest of a loaded finished epoch, which
        ``set_epoch`` named again (point 3)."""
        return self._kept and self._pending is not None and self._pending >= self._end

    @property
    def passes_begun(self) -> int:
        """How many passes (``iter()`` calls) began. A loader reads it before it makes its
        iterator and gives it to ``state_dict_at``, ``pass_end`` and ``leave_earlier_pass``, to
        tell that iterator's pass from an earlier one of the same epoch (torch's
        ``BatchSampler`` calls ``iter()`` at its first draw)."""
        return self._passes

    def __iter__(self) -> Iterator[int]:
        """Read the epoch from its start, or once from the loaded position (point 3)."""
        first, count = self._next_pass()
        self._end = first + count * self.num_replicas  # the next epoch starts right after
        mixture = self.mixture
        with mixture._lock:
            mixture._schedule = mixture._schedule.compacted(self._start)
        pass_ = _StreamPass(first, count, self._passes + 1)
        self._passes = pass_.serial
        self._pass = pass_
        self._pending = None
        return self._generate(pass_)

    def _snapshot(self) -> tuple[_StreamPass | None, int | None, int, int, int]:
        """``(pass, pending, first, count, end)`` read together: the current pass, the pending
        position, where the pass ``iter()`` will make starts and how many indices it yields, and
        the epoch's end. The reads repeat until none changed meanwhile: a loader's transfer
        thread may begin a pass while the training thread saves a state."""
        while True:
            current, pending, end = self._pass, self._pending, self._end
            first, count = self._next_pass()
            if self._pass is current and self._pending == pending and self._end == end:
                return current, pending, first, count, end

    @staticmethod
    def _counts_in(
        current: _StreamPass | None, pending: int | None, since: int | None
    ) -> TypeGuard[_StreamPass]:
        """Whether a consumer's count is in ``current``, not in the pass ``iter()`` will make:
        no position is pending, and with ``since`` (``passes_begun`` read before the consumer
        made its iterator) the pass began after that."""
        return current is not None and counts_in_current(current.serial, pending, since)

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
            self._kept = self._pending is not None
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
        takes effect from the next batch the loop requests. Before a pass of the epoch, or with
        a loaded state waiting for its ``iter()``, in the pass ``iter()`` will make (from the
        epoch's start for a finished epoch's state that ``set_epoch`` did not name again).
        """
        if self._pending is not None or self._pass is None:
            return self._next_pass()[0] + consumed * self.num_replicas
        return self._pass.start + min(consumed, self._pass.count) * self.num_replicas

    def leave_earlier_pass(self, since: int) -> None:
        """Let go of the current pass if it began no later than ``since`` (``passes_begun`` read
        before the caller made its iterator) and no position is pending: that iterator, which has
        not begun its pass yet, will begin the one ``iter()`` makes, and a weight change before
        its first draw applies from that pass's start rather than rewinding the pass it left.
        A pending position already stands for the pass ``iter()`` will make."""
        current = self._pass
        if current is not None and current.serial <= since and self._pending is None:
            self._pass = None

    def pass_end(self, since: int | None = None) -> int:
        """The global position after this rank's current pass: where the next epoch starts.

        Before the epoch's first pass, or with a loaded state waiting for its ``iter()``, after
        the pass that ``iter()`` will make; ``since`` as for ``state_dict_at``.
        """
        current, pending, first, count, _ = self._snapshot()
        if self._counts_in(current, pending, since):
            return current.start + current.count * self.num_replicas
        return first + count * self.num_replicas

    def _prepare_change(self, position: int) -> None:
        """Check a weight change at ``position``; rewind the current pass if it handed that out.

        A pass that already handed out its last index cannot be rewound: the next ``iter()``
        then reads the epoch's rest from ``position`` (no longer ``pass_ended``), and a loader
        starts that new pass.
        """
        if position >= self.next_position:
            return
        if (self._pending is not None or self._pass is None) and position >= self._next_pass()[0]:
            return  # in the pass iter() will make: nothing of it was handed out
        current = self._pass
        if self._pending is not None or current is None or position < current.start:
            raise ValueError(
                f"cannot change the weights at position {position}: this sampler has already "
                f"handed out positions up to {self.next_position} outside a pass it can rewind"
            )
        if current.done:
            self._pending = position
            return
        local = max(0, -(-(position - current.start - self.rank) // self.num_replicas))
        current.progress = (local, iter(()))

    @property
    def pass_ended(self) -> bool:
        """Whether the current pass handed out its last index (and no position is pending)."""
        return self._pending is None and self._pass is not None and self._pass.done

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's state (point 1); the same on every rank in lockstep training."""
        return self._state(self.next_position)

    def state_dict_at(self, consumed: int, since: int | None = None) -> dict[str, Any]:
        """The state once ``consumed`` indices of this rank's latest ``iter()`` have been used.

        A loader hands indices to workers ahead of the training loop; this counts only those the
        loop received. Before any pass of the epoch, or with a resume pending, it counts them
        in the pass ``iter()`` will make (a loader without workers starts it at the first
        ``next()``, so an epoch of no batch ends before its pass began). ``consumed`` and
        ``since`` are as for ``ShuffleSampler.state_dict_at``.
        """
        current, pending, first, count, end = self._snapshot()
        if self._counts_in(current, pending, since):
            position = current.start + min(consumed, current.count) * self.num_replicas
            return self._state(position, end=end)
        if consumed <= 0 and (pending is not None or current is None):  # as state_dict()
            return self._state(first if pending is None else pending, end=end)
        position = first + min(consumed, count) * self.num_replicas
        return self._state(position, end=first + count * self.num_replicas)

    def _state(self, position: int, end: int | None = None) -> dict[str, Any]:
        """The state at global ``position`` of an epoch that ends at ``end`` (its end now)."""
        mixture = self.mixture
        return {
            "version": STATE_VERSION,
            "seed": mixture.seed,
            "epoch": self.epoch,
            "start": self._start,
            "cursor": position - self._start,
            "end": self._end if end is None else end,
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
        if not 0 <= start <= start + cursor <= end < _POSITIONS:
            raise ValueError(
                f"{owner} state has start {start}, cursor {cursor}, end {end}: expected "
                "0 <= start <= start + cursor <= end < 2**62 (positions are int64)"
            )
        self._check_sources(state["sources"], owner)
        self.mixture._load(values["seed"], state["schedule"], start, owner)
        self.epoch = values["epoch"]
        self._start, self._end = start, end
        self._pending = start + cursor
        self._kept = False  # set_epoch named the loaded epoch (a finished one's rest is empty)
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
