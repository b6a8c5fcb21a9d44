"""Stateful, O(1)-memory, rescalable samplers.

Why not ``torch.randperm``: torch's ``RandomSampler`` and ``DistributedSampler`` materialise
``randperm(N)`` every epoch, 8 bytes an index: 8 GB per rank at ``N = 10**9``, and the order that
``DistributedSampler`` deals to a rank depends on the world size, so a checkpoint taken on 4 ranks
cannot say what 3 ranks should read next. Here the shuffled order is a keyed bijection of
``[0, N)`` (a Feistel network with cycle walking, see ``threadloader.samplers.feistel``), keyed by
``(seed, epoch)``:

- any position maps to its index directly (``index_at``), so resuming mid-epoch is O(1) work: start
  at the cursor, replay nothing;
- indices are produced in vectorised numpy blocks of ``BLOCK_SIZE``, so memory is O(1) in ``N``
  (``N = 10**12`` works) and throughput is tens of millions of indices a second;
- the global order does not depend on the number of ranks: rank ``r`` of ``W`` reads global
  positions ``r, r + W, r + 2W, ...``, so a state saved on ``W`` ranks resumes on any ``W'``.

How state works here; where the code disagrees with this, the code is wrong.

1. ``state_dict()`` is a plain dict of Python ints and bools with a format ``version``. Its
   ``cursor`` counts positions of the epoch's stream already handed out: by this sampler for
   ``ShuffleSampler``, by all ranks together for ``DistributedShuffleSampler``.
2. The cursor advances as indices are handed out by the iterator (not when they are computed), and
   tracks the most recent ``iter()``.
3. ``load_state_dict(state)`` makes the *next* ``iter()`` resume at the saved cursor, once. Calling
   ``set_epoch`` with the saved epoch in between keeps the resume (training loops do that at the
   top of every epoch); any other epoch drops it. A state saved at its epoch's end resumes an
   empty rest of that epoch only once ``set_epoch`` named that epoch again (a loop that saved
   the epoch it was in at its last step); without a ``set_epoch`` the next ``iter()`` starts
   the epoch over, as point 4.
4. Without a pending resume, ``iter()`` starts the current epoch from position 0, also after a
   completed epoch: as with torch's ``DistributedSampler``, only ``set_epoch`` changes the epoch.
5. A state for another dataset length, format version or ``shuffle`` setting, or a corrupted one,
   raises ``ValueError`` naming the mismatch; nothing resumes silently at the wrong place.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, Final, SupportsIndex

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

from threadloader.samplers.feistel import MAX_LENGTH, FeistelPermutation

#: The longest dataset a sampler takes: what ``len()`` can return (``sys.maxsize``, 2**63 - 1).
MAX_SAMPLER_LENGTH: Final = min(sys.maxsize, MAX_LENGTH)

__all__ = ["ShuffleSampler"]

STATE_VERSION: Final = 1
BLOCK_SIZE: Final = 1 << 15
"""Indices computed per numpy block: big enough to amortise numpy's per-call cost, small enough that
the block's temporaries stay in L2 cache (measured in bench/bench_samplers.py)."""

_Block = Callable[[int, int], npt.NDArray[np.uint64]]


def counts_in_current(serial: int, pending: object, since: int | None) -> bool:
    """Whether a consumer's count is in a sampler's current pass, of serial number ``serial``,
    rather than in the pass ``iter()`` will make: nothing loaded is ``pending`` for that
    ``iter()``, and with ``since`` (``passes_begun`` read before the consumer made its
    iterator) the pass began after that. ``ShuffleSampler`` and ``MixtureSampler`` both ask."""
    return pending is None and (since is None or serial > since)


class _Pass:
    """One ``iter()`` over an epoch, and how far its consumer has read.

    The pass walks steps ``first <= k < stop`` (what a step means is the sampler's business) in
    blocks. ``_progress`` is replaced by one assignment per block, so a reader on another thread
    always sees a matching (block end, block iterator) pair, and the iterator's length hint says how
    many of the block's indices are still unread: the consumer's position costs nothing per index.
    """

    __slots__ = ("_progress", "done", "epoch", "first", "serial", "start", "stop")

    def __init__(self, epoch: int, start: int, first: int, stop: int, serial: int) -> None:
        self.epoch = epoch
        self.start = start  # the global stream position this pass resumed from
        self.first = first
        self.stop = stop
        self.serial = serial  # how many passes of its sampler began before it, plus one
        self.done = False
        self._progress: tuple[int, Iterator[int]] = (first, iter(()))

    def next_step(self) -> int:
        """Return the first step not yet handed out to the consumer."""
        end, block = self._progress
        return end - operator.length_hint(block)

    def iterate(self, make_block: _Block) -> Iterator[int]:
        """Return an iterator over the pass's indices; ``make_block(lo, hi)`` computes steps lo..hi."""
        # chain() pulls each index from a list iterator in C: ~1.5x faster than `yield from`.
        return itertools.chain.from_iterable(self._blocks(make_block))

    def _blocks(self, make_block: _Block) -> Iterator[Iterator[int]]:
        for lo in range(self.first, self.stop, BLOCK_SIZE):
            hi = min(lo + BLOCK_SIZE, self.stop)
            block = iter(make_block(lo, hi).tolist())
            self._progress = (hi, block)
            yield block
        self.done = True


def _length_of(data_source_or_len: object) -> int:
    if isinstance(data_source_or_len, Sized):
        length = len(data_source_or_len)
    elif isinstance(data_source_or_len, SupportsIndex):
        length = operator.index(data_source_or_len)
    else:
        raise TypeError(
            f"expected a dataset with __len__ or an int, got {type(data_source_or_len).__name__}"
        )
    if not 0 <= length <= MAX_SAMPLER_LENGTH:
        raise ValueError(f"dataset length must be in [0, 2**63 - 1], got {length}")
    return length


def _as_positions(positions: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Validate integer, non-negative positions; return them as uint64 (same shape)."""
    array = np.asarray(positions)
    if array.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got an array of dtype {array.dtype}")
    if array.size and array.dtype.kind == "i" and int(array.min()) < 0:
        raise IndexError(f"positions must be >= 0, got {int(array.min())}")
    return array.astype(np.uint64)


def int_argument(value: object, name: str) -> int:
    """``value`` as an int, for an argument that must be one (an index, a seed, a size).

    Raises:
        TypeError: naming the argument, if ``value`` is not an integer (a float would
            otherwise truncate, or fail later with an error that names none).
    """
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _state_int(state: Mapping[str, Any], key: str, owner: str) -> int:
    if key not in state:
        raise ValueError(f"{owner} state has no {key!r} entry: got keys {sorted(state)}")
    if isinstance(state[key], bool):  # operator.index(True) is 1: a corrupted state
        raise ValueError(f"{owner} state[{key!r}] must be an int, got bool")  # noqa: TRY004
    try:
        return operator.index(state[key])
    except TypeError:
        raise ValueError(
            f"{owner} state[{key!r}] must be an int, got {type(state[key]).__name__}"
        ) from None


def _check_common(state: Mapping[str, Any], owner: str, length: int) -> None:
    if not isinstance(state, Mapping):  # a corrupted state: ValueError like every other (issue 6)
        raise ValueError(f"{owner} state must be a dict, got {type(state).__name__}")  # noqa: TRY004
    version = _state_int(state, "version", owner)
    if version != STATE_VERSION:
        raise ValueError(
            f"{owner} state has format version {version}, this threadloader reads version "
            f"{STATE_VERSION}"
        )
    saved_length = _state_int(state, "length", owner)
    if saved_length != length:
        raise ValueError(
            f"{owner} state is for a dataset of length {saved_length}, this sampler's dataset has "
            f"length {length}"
        )


class _EpochResume:
    """An epoch-keyed sampler's resume of a loaded state, waiting for its ``iter()`` (point 3).

    ``load_state_dict`` sets ``_pending`` to ``(epoch, cursor)`` and ``_pending_ended`` to whether
    that epoch had ended where it was saved (on the saving world size: on another, a rest may be
    empty that was not an end); ``set_epoch`` keeps it for that epoch only, and ``_kept`` says
    whether it was named (a finished epoch's state then yields an empty rest rather than
    starting over).
    """

    epoch: int
    _pending: tuple[int, int] | None
    _pending_ended = False
    _kept: bool
    _pass: _Pass | None
    _passes = 0  # passes begun so far

    @property
    def passes_begun(self) -> int:
        """How many passes (``iter()`` calls) began. A loader reads it before it makes its
        iterator and gives it to ``state_dict_at``, to tell that iterator's pass from an
        earlier one of the same epoch (torch's ``BatchSampler`` calls ``iter()`` at its first
        draw)."""
        return self._passes

    def _new_pass(self, start: int, first: int, stop: int) -> _Pass:
        """Begin a pass of the current epoch from global position ``start``, using up a pending
        resume."""
        pass_ = _Pass(self.epoch, start, first, stop, self._passes + 1)
        self._passes = pass_.serial
        self._pass = pass_
        self._pending = None
        return pass_

    def _counted(self, since: int | None) -> tuple[_Pass | None, int, int | None]:
        """What ``state_dict_at`` counts indices in: ``(pass, start, pending)``.

        ``pass`` is the current pass, or None for the one ``iter()`` will make, which starts at
        ``start``; ``pending``: the cursor of a loaded resume waiting for that ``iter()`` (a
        finished epoch's cursor too, though that pass then starts at 0), else None. With
        ``since`` (``passes_begun`` read before the caller made its iterator), only a pass begun
        after that is the current one. The reads repeat until neither the pass nor the resume
        changed meanwhile: a loader's transfer thread may begin a pass while the training thread
        saves a state.
        """
        while True:
            current, pending = self._pass, self._pending
            start = self._start()
            if self._pass is current and self._pending == pending:
                break
        cursor = pending[1] if pending is not None else None
        if current is None or current.epoch != self.epoch:
            return None, start, cursor
        mine = counts_in_current(current.serial, pending, since)
        return (current if mine else None), start, cursor

    def set_epoch(self, epoch: int) -> None:
        """Choose the order of the next ``iter()``: each epoch has its own permutation.

        Args:
            epoch: epoch number. Setting the epoch of a just-loaded state keeps its resume; any
                other epoch drops it (point 3).
        """
        self.epoch = epoch
        if self._pending is not None and self._pending[0] != epoch:
            self._pending = None
        self._kept = self._pending is not None

    def _start(self) -> int:
        """Where the next ``iter()`` starts the current epoch: the loaded cursor (once), else 0;
        a finished epoch's cursor only if ``set_epoch`` named that epoch (point 3)."""
        pending = self._pending
        start = pending[1] if pending is not None and pending[0] == self.epoch else 0
        if start > 0 and self._pending_ended and not self._kept:
            return 0  # a finished epoch's state without set_epoch: start over
        return start

    def _resumes_a_finished_epoch(self) -> bool:
        """Whether the next ``iter()`` is the empty rest of a loaded finished epoch, which
        ``set_epoch`` named again (point 3)."""
        return self._start() > 0 and self._pending_ended

    def remaining(self) -> int:
        """How many indices the pending or running pass of the current epoch yields in all: a
        whole epoch's, or after a resume what is left of it from the loaded cursor. ``len()``
        stays the whole epoch's, as trainers count epochs with it."""
        current = self._pass
        running = current is not None and current.epoch == self.epoch and not current.done
        if current is not None and running and self._pending is None:
            return current.stop - current.first
        return self._rest_length(self._start())

    def _rest_length(self, cursor: int) -> int:
        """Indices a pass of the current epoch resumed at ``cursor`` yields."""
        raise NotImplementedError


class ShuffleSampler(_EpochResume, Sampler[int]):
    """Yield ``[0, N)`` in a new pseudo-random order each epoch, in O(1) memory, resumable in O(1).

    The order of epoch ``e`` is a Feistel bijection of ``[0, N)`` keyed by ``(seed, e)`` (module
    docstring: why not ``randperm``). It is computed ``BLOCK_SIZE`` indices at a time, so ``N`` can
    be ``10**12``, and position ``i`` maps to its index directly (``index_at``), so a resume starts
    at the saved cursor instead of replaying the epoch. The same ``(seed, epoch, N)`` gives the same
    order on every machine (the keys are derived in pure Python, the network in uint64 numpy).

    Args:
        data_source_or_len: the dataset (anything with ``len``) or its length. The length is read
            once, here.
        seed: keys the permutation together with the epoch; any int.

    Raises:
        ValueError: if the length is negative or above ``2**63 - 1``.
        TypeError: if ``data_source_or_len`` is neither sized nor an int, or ``seed`` is no int.
    """

    def __init__(self, data_source_or_len: Sized | int, seed: int = 0) -> None:
        self.length = _length_of(data_source_or_len)
        self.seed = int_argument(seed, "seed")
        self.epoch = 0
        self._pending: tuple[int, int] | None = None  # (epoch, cursor) from load_state_dict
        self._kept = False  # set_epoch named the pending resume's epoch (point 3)
        self._pass: _Pass | None = None

    def __len__(self) -> int:
        """Return ``N``, the dataset length (also while a resumed epoch yields fewer indices)."""
        return self.length

    def __iter__(self) -> Iterator[int]:
        """Start a pass over the current epoch: from the loaded cursor once, else from 0."""
        start = self._start()
        permutation = self._permutation(self.epoch)
        pass_ = self._new_pass(start, start, self.length)
        return pass_.iterate(lambda lo, hi: permutation(np.arange(lo, hi, dtype=np.uint64)))

    def index_at(self, positions: npt.ArrayLike, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """Map positions of an epoch's order to dataset indices, vectorised, in O(len(positions)).

        ``index_at(np.arange(N))`` is the whole epoch; rank striding and resume use arbitrary
        positions.

        Args:
            positions: integer array-like, each in ``[0, N)``; any shape.
            epoch: which epoch's order; the sampler's current epoch by default.

        Returns:
            int64 array of the same shape: the index at each position.

        Raises:
            TypeError: if ``positions`` are not integers.
            IndexError: if a position is outside ``[0, N)``.
        """
        array = _as_positions(positions)
        if array.size and int(array.max()) >= self.length:
            raise IndexError(
                f"position {int(array.max())} is out of range for length {self.length}"
            )
        permutation = self._permutation(self.epoch if epoch is None else epoch)
        return permutation(array.ravel()).view(np.int64).reshape(array.shape)

    def state_dict(self) -> dict[str, int]:
        """Return where this sampler stands: ``{"version", "seed", "epoch", "cursor", "length"}``.

        ``cursor`` counts the indices of ``epoch`` already handed out by the latest ``iter()`` (or
        the loaded cursor, before the ``iter()`` that resumes from it); ``N`` after a full epoch.
        """
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self._cursor(),
            "length": self.length,
        }

    def state_dict_at(self, consumed: int, since: int | None = None) -> dict[str, int]:
        """The state once ``consumed`` indices of the latest ``iter()`` have been *used*.

        A loader hands indices to workers ahead of the training loop; it saves the state of the
        indices the loop actually received, which ``state_dict()`` (counting those handed out)
        cannot know. Before a pass of the current epoch, or with a resume pending, it counts them
        in the pass ``iter()`` will make (a loader without workers starts it at the first
        ``next()``, so an epoch of no batch ends before its pass began).

        Args:
            consumed: indices of the pass the loop received.
            since: ``passes_begun`` read before the loader made its iterator: a pass begun
                no later is an earlier one, and the indices count in the pass that iterator
                will begin.
        """
        state = self.state_dict()
        current, start, pending = self._counted(since)
        if current is not None:
            state["cursor"] = min(current.first + consumed, current.stop)
        elif consumed > 0 or pending is None:
            state["cursor"] = min(start + consumed, self.length)
        else:
            state["cursor"] = pending  # as loaded
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` resume ``state``'s epoch at its cursor, with O(1) work.

        The saved seed replaces this sampler's: the cursor only means something in its order.

        Args:
            state: a dict from ``state_dict()``.

        Raises:
            ValueError: if the format version or dataset length differ from this sampler's, the
                state was saved unshuffled, or an entry is missing, not an int, or out of range.
        """
        owner = type(self).__name__
        _check_common(state, owner, self.length)
        if "shuffle" in state and not state["shuffle"]:  # a DistributedShuffleSampler's
            raise ValueError(
                f"{owner} state was saved with shuffle=False, in dataset order; a {owner} "
                "always shuffles"
            )
        cursor = _state_int(state, "cursor", owner)
        if not 0 <= cursor <= self.length:
            raise ValueError(f"{owner} state cursor {cursor} is outside [0, {self.length}]")
        self.seed = _state_int(state, "seed", owner)
        self.epoch = _state_int(state, "epoch", owner)
        self._pending, self._pending_ended = (self.epoch, cursor), cursor >= self.length
        self._kept = False
        self._pass = None

    def _rest_length(self, cursor: int) -> int:
        return max(self.length - cursor, 0)

    def _cursor(self) -> int:
        pending, current = self._pending, self._pass
        if pending is not None and pending[0] == self.epoch:
            return pending[1]
        if current is not None and current.epoch == self.epoch:
            return current.next_step()
        return 0

    def _permutation(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.length, self.seed, epoch)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(length={self.length}, seed={self.seed}, epoch={self.epoch}, "
            f"cursor={self._cursor()})"
        )
