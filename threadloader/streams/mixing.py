"""The schedule of a data mixture: which source each global position draws from, and which sample.

How positions map to samples; where the code disagrees with this, the code is wrong.

1. Weights are apportioned to integer quotas ``q_s`` summing to ``PERIOD = 2**16`` (largest
   remainder; every positive weight gets at least one slot), so a weight is honoured to 1/65536.
2. One period is a fixed pattern of ``PERIOD`` slots in which source ``s`` owns ``q_s`` slots, its
   ``k``-th at the rank of time ``(k + phase_s) / q_s`` among all sources' times (ties by source
   order; ``phase_s`` in ``[0, 1)`` comes from the seed and the source's name). That spreads every
   source evenly: after any ``t`` slots source ``s`` has had ``t * q_s / PERIOD`` slots, give or take
   two, so over any 10,000 consecutive positions each proportion is within 0.05% of its weight.
3. A *regime* is ``(position P0, quotas, counts c at P0)``: position ``P >= P0`` is slot
   ``t = (P - P0) % PERIOD`` of period ``m = (P - P0) // PERIOD``; it draws from ``s = pattern[t]``
   and is that source's sample number ``c_s + m * q_s + (slots of s before t)``. Two table lookups
   and a multiply-add per position, vectorised, for any position: a rank that reads positions
   ``r, r + W, ...`` does O(1) work per sample whatever ``W``.
4. ``set_weights`` at position ``P`` starts a new regime at ``P`` whose counts are the old regime's
   counts at ``P`` (O(#sources + PERIOD) once). Changes at or after ``P`` that were scheduled
   earlier are dropped: the latest call decides the stream from its position on.
5. A source's sample number ``k`` is index ``perm_e(k % n_s)`` of its epoch ``e = k // n_s``, where
   ``perm_e`` is that source's ``ShuffleSampler`` order for epoch ``e``: each source runs through
   its own epochs, each a permutation, whatever the others do.
6. Schedules are immutable; a change builds a new one. Readers take one reference and use it
   throughout, so a concurrent ``set_weights`` is seen whole or not at all, without the GIL.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from threadloader.samplers.feistel import FeistelPermutation

PERIOD_BITS: Final = 16
PERIOD: Final = 1 << PERIOD_BITS
"""Slots of one pattern period: the resolution of the weights, and the size of the pattern table."""

_Ints = npt.NDArray[np.int64]


def check_weights(weights: Mapping[str, Any], names: Sequence[str]) -> tuple[float, ...]:
    """Validate ``weights`` and return them normalised, aligned with ``names`` (missing: 0).

    Raises:
        TypeError: if ``weights`` is not a mapping.
        ValueError: naming the source, for an unknown name or a weight that is negative, not a
            number or infinite; or if every weight is zero.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a dict of source name -> weight, got {type(weights).__name__}"
        )
    unknown = sorted(set(weights) - set(names), key=str)
    if unknown:
        raise ValueError(
            f"unknown source name(s) {unknown} in weights: the sources are {list(names)}"
        )
    values = []
    for name in names:
        raw = weights.get(name, 0.0)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"weight of source {name!r} must be a number, got {raw!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"weight of source {name!r} must be finite and >= 0, got {raw!r}")
        values.append(value)
    try:
        total = math.fsum(values)
    except OverflowError:  # huge finite weights: only their ratios matter
        top = max(values)
        values = [v / top for v in values]
        total = math.fsum(values)
    if total <= 0:
        raise ValueError(f"all weights are zero: at least one of {list(names)} needs a weight > 0")
    return tuple(v / total for v in values)


def apportion(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer quotas summing to ``PERIOD``, proportional to ``weights`` (largest remainder).

    Pure Python on floats: the same quotas on every platform. Every positive weight gets at least
    one slot, so a tiny weight is honoured approximately rather than silently dropped.
    """
    exact = [w * PERIOD for w in weights]
    quotas = [math.floor(x) for x in exact]
    for i, w in enumerate(weights):
        if w > 0 and quotas[i] == 0:
            quotas[i] = 1
    missing = PERIOD - sum(quotas)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (quotas[i] - exact[i], i))
    for i in by_remainder[: max(missing, 0)]:
        quotas[i] += 1
    while missing < 0:  # only after the at-least-one rule: take from the largest quotas
        i = max(range(len(quotas)), key=lambda i: (quotas[i], -i))
        quotas[i] -= 1
        missing += 1
    return tuple(quotas)


def _hash01(seed: int, tag: str, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}\0{tag}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's ``ShuffleSampler``: from the mixture's seed and the source's name."""
    return _hash01(seed, "order", name) >> 1


def phases(seed: int, names: Sequence[str]) -> tuple[float, ...]:
    """Each source's phase in ``[0, 1)``: where in the period its slots fall, seed by seed."""
    return tuple(_hash01(seed, "phase", name) / 2.0**64 for name in names)


@functools.lru_cache(maxsize=16)
def _period(quotas: tuple[int, ...], phase: tuple[float, ...]) -> tuple[_Ints, _Ints]:
    """Return ``(pattern, ordinal)``: each slot's source and its number among that source's slots."""
    q = np.asarray(quotas, dtype=np.int64)
    source = np.repeat(np.arange(len(q), dtype=np.int64), q)
    ordinal = np.arange(PERIOD, dtype=np.int64) - np.repeat(np.cumsum(q) - q, q)
    times = (ordinal + np.asarray(phase)[source]) / q[source]
    order = np.lexsort((source, times))
    pattern, ordinal = source[order], ordinal[order]
    pattern.flags.writeable = ordinal.flags.writeable = False
    return pattern, ordinal


class Regime:
    """Fixed quotas from ``position`` on, starting from ``counts`` samples already drawn per source.

    Args:
        position: first global position the regime decides.
        weights: normalised weights, one per source (kept for reports and the state).
        quotas: ``apportion(weights)``.
        counts: samples each source had given before ``position``.
        phase: ``phases(seed, names)``.
    """

    __slots__ = (
        "_counts",
        "_ordinal",
        "_pattern",
        "_quotas",
        "counts",
        "position",
        "quotas",
        "weights",
    )

    def __init__(
        self,
        position: int,
        weights: tuple[float, ...],
        quotas: tuple[int, ...],
        counts: tuple[int, ...],
        phase: tuple[float, ...],
    ) -> None:
        self.position = position
        self.weights = weights
        self.quotas = quotas
        self.counts = counts
        self._pattern, self._ordinal = _period(quotas, phase)
        self._quotas = np.asarray(quotas, dtype=np.int64)
        self._counts = np.asarray(counts, dtype=np.int64)

    def locate(self, positions: _Ints) -> tuple[_Ints, _Ints]:
        """Return each position's source number and its sample number within that source."""
        offset = positions - self.position
        period, slot = offset >> PERIOD_BITS, offset & (PERIOD - 1)
        source = self._pattern[slot]
        return source, self._counts[source] + period * self._quotas[source] + self._ordinal[slot]

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Samples each source has given before ``position`` (``>= self.position``)."""
        period, slot = divmod(position - self.position, PERIOD)
        within = np.bincount(self._pattern[:slot], minlength=len(self.quotas))
        total = self._counts + period * self._quotas + within
        return tuple(int(c) for c in total)


class Schedule:
    """An immutable list of regimes in increasing position: the whole stream from ``start`` on.

    Args:
        names: the sources, in the order every tuple here follows.
        seed: the mixture's seed (phases).
        regimes: at least one; the first decides positions from its ``position`` on.
    """

    __slots__ = ("_starts", "names", "phase", "regimes", "seed")

    def __init__(self, names: tuple[str, ...], seed: int, regimes: tuple[Regime, ...]) -> None:
        self.names = names
        self.seed = seed
        self.phase = phases(seed, names)
        self.regimes = regimes
        self._starts = np.asarray([r.position for r in regimes], dtype=np.int64)

    @classmethod
    def initial(cls, names: tuple[str, ...], seed: int, weights: tuple[float, ...]) -> Schedule:
        """The schedule of a new mixture: one regime from position 0, nothing drawn yet."""
        phase = phases(seed, names)
        regime = Regime(0, weights, apportion(weights), (0,) * len(names), phase)
        return cls(names, seed, (regime,))

    @property
    def start(self) -> int:
        """First position this schedule can decide (earlier regimes were compacted away)."""
        return self.regimes[0].position

    def regime_at(self, position: int) -> Regime:
        """The regime that decides ``position``."""
        return self.regimes[int(np.searchsorted(self._starts, position, side="right")) - 1]

    def locate(self, positions: _Ints) -> tuple[_Ints, _Ints]:
        """Source number and within-source sample number of each position (any order, any shape).

        Raises:
            ValueError: if a position comes before ``start``.
        """
        if positions.size:
            self._check_decides(int(positions.min()))
        if len(self.regimes) == 1:
            return self.regimes[0].locate(positions)
        which = np.searchsorted(self._starts, positions, side="right") - 1
        source = np.empty_like(positions)
        ordinal = np.empty_like(positions)
        for i, rows in groups(which):
            source[rows], ordinal[rows] = self.regimes[i].locate(positions[rows])
        return source, ordinal

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Samples each source has given before ``position``.

        Raises:
            ValueError: if ``position`` comes before ``start``.
        """
        self._check_decides(position)
        return self.regime_at(position).counts_at(position)

    def _check_decides(self, position: int) -> None:
        if position < self.start:
            raise ValueError(
                f"position {position} is before this schedule's start {self.start}: "
                "its weights were compacted away"
            )

    def changed(self, weights: tuple[float, ...], position: int) -> Schedule:
        """A schedule equal to this one before ``position`` and using ``weights`` from it on."""
        if position < self.start:
            raise ValueError(
                f"cannot change the weights at position {position}: the schedule starts at "
                f"{self.start}"
            )
        counts = self.counts_at(position)
        kept = tuple(r for r in self.regimes if r.position < position)
        regime = Regime(position, weights, apportion(weights), counts, self.phase)
        return Schedule(self.names, self.seed, (*kept, regime))

    def compacted(self, position: int) -> Schedule:
        """Drop the regimes that decide nothing at or after ``position``: O(#sources) again."""
        first = int(np.searchsorted(self._starts, position, side="right")) - 1
        if first <= 0:
            return self
        return Schedule(self.names, self.seed, self.regimes[first:])

    def to_state(self) -> list[dict[str, Any]]:
        """The regimes as plain dicts keyed by source name."""
        return [
            {
                "position": r.position,
                "weights": dict(zip(self.names, r.weights, strict=True)),
                "quotas": dict(zip(self.names, r.quotas, strict=True)),
                "counts": dict(zip(self.names, r.counts, strict=True)),
            }
            for r in self.regimes
        ]

    @classmethod
    def from_state(cls, state: Any, names: tuple[str, ...], seed: int, owner: str) -> Schedule:
        """Rebuild a schedule from ``to_state()``; sources the state lacks get weight 0, count 0.

        Raises:
            ValueError: if the list is empty or malformed, positions do not increase, a regime
                names a source this mixture lacks, or quotas do not sum to ``PERIOD``.
        """
        if not isinstance(state, list) or not state:
            raise ValueError(f"{owner} state 'schedule' must be a non-empty list of regimes")
        phase = phases(seed, names)
        regimes: list[Regime] = []
        for i, entry in enumerate(state):
            where = f"{owner} state schedule[{i}]"
            if not isinstance(entry, Mapping) or not {
                "position",
                "weights",
                "quotas",
                "counts",
            } <= set(entry):
                raise ValueError(f"{where} must be a dict with position, weights, quotas, counts")
            position = _as_int(entry["position"], f"{where}['position']")
            if position < 0:
                raise ValueError(f"{where} position {position} is negative")
            if regimes and position <= regimes[-1].position:
                raise ValueError(
                    f"{where} position {position} does not follow {regimes[-1].position}"
                )
            columns = []
            for key in ("weights", "quotas", "counts"):
                values = entry[key]
                if not isinstance(values, Mapping):
                    raise ValueError(f"{where}[{key!r}] must be a dict of name -> value")  # noqa: TRY004
                unknown = sorted(set(values) - set(names), key=str)
                if unknown:
                    raise ValueError(
                        f"{where} names source(s) {unknown} that this mixture does not have "
                        f"(its sources are {list(names)})"
                    )
                columns.append([values.get(name, 0) for name in names])
            try:
                weights = tuple(float(w) for w in columns[0])
            except (TypeError, ValueError):
                raise ValueError(f"{where} has a weight that is not a number") from None
            if not all(math.isfinite(w) and w >= 0 for w in weights):
                raise ValueError(f"{where} has a negative or non-finite weight: {weights}")
            quotas = tuple(_as_int(q, f"{where} quota") for q in columns[1])
            counts = tuple(_as_int(c, f"{where} count") for c in columns[2])
            if sum(quotas) != PERIOD or min(quotas) < 0 or min(counts) < 0:
                raise ValueError(f"{where} has quotas not summing to {PERIOD} or negative entries")
            regimes.append(Regime(position, weights, quotas, counts, phase))
        return cls(names, seed, tuple(regimes))


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an int, got {type(value).__name__}")  # noqa: TRY004
    return int(value)


class SourceOrders:
    """Each source's own shuffled epochs, and where its indices sit in the concatenation.

    Args:
        lengths: samples per source (each > 0).
        seeds: one ``ShuffleSampler`` seed per source.
    """

    def __init__(self, lengths: Sequence[int], seeds: Sequence[int]) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        # ShuffleSampler(n, seed=s)'s orders: its epoch e is the permutation keyed by (s, e).
        self._orders = [FeistelPermutation(n, s, 0) for n, s in zip(lengths, seeds, strict=True)]

    def indices(self, source: _Ints, ordinal: _Ints) -> _Ints:
        """Concatenated dataset index of sample ``ordinal`` of each ``source`` (rule 5 above)."""
        out = np.empty_like(ordinal)
        for s, rows in groups(source):
            epoch, position = np.divmod(ordinal[rows], int(self.lengths[s]))
            # A small source spans many epochs per block: one pass keys each by its own.
            found = self._orders[s].of_epochs(position.astype(np.uint64), epoch)
            out[rows] = found.view(np.int64) + self.offsets[s]
        return out


def groups(keys: _Ints) -> list[tuple[int, _Ints]]:
    """Return ``(key, rows with that key)`` per distinct key: O(n log n) however many keys."""
    if not keys.size:
        return []
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), keys.size]
    return [(int(ordered[a]), order[a:b]) for a, b in itertools.pairwise(bounds)]
