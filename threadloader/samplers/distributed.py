"""DistributedShuffleSampler: one global shuffled order dealt to ranks by stride, so a state saved
on W ranks resumes on any W' (``shuffle`` says how state works for both samplers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from threadloader.samplers.feistel import FeistelPermutation
from threadloader.samplers.shuffle import (
    STATE_VERSION,
    _as_positions,
    _check_common,
    _EpochResume,
    _length_of,
    _state_int,
    int_argument,
)


class DistributedShuffleSampler(_EpochResume, Sampler[int]):
    """torch's ``DistributedSampler``, with an order that does not depend on the world size.

    Same arguments, defaults, errors, ``set_epoch``, ``num_samples`` and ``total_size`` as
    ``torch.utils.data.DistributedSampler``. The difference is the global stream: the epoch's
    ``ShuffleSampler`` order (or ``0..N-1`` with ``shuffle=False``), padded like torch by wrapping
    around to its start (``drop_last=False``) or cut (``drop_last=True``) to a multiple of the world
    size ``W``, and rank ``r`` reads global positions ``r, r + W, r + 2W, ...``. With
    ``shuffle=False`` each rank gets exactly torch's indices; with ``shuffle=True`` the same counts,
    padding and dropping, from another permutation.

    Rescaling. Each rank saves its own state without communication: the global cursor is
    ``start + cursor_local * num_replicas``, which assumes ranks advance in lockstep, as they do in
    data-parallel training (every rank has taken the same number of steps when it checkpoints), so
    every rank saves the same state. Loaded on ``W'`` ranks, rank ``r'`` resumes at global
    positions ``start + r', start + r' + W', ...`` until the rest of the epoch is used up:

    - ``drop_last=False``: each rank takes ``ceil((N - start) / W')`` positions; the ones past
      ``N`` wrap to the start of the stream (padding, as torch does).
    - ``drop_last=True``: each rank takes ``(N - start) // W'`` positions; the last
      ``(N - start) % W'`` samples are dropped.

    Across the whole epoch (before and after the resume) every sample is then read exactly once,
    plus the padding, or minus the dropped tail, of the world size that finished the epoch. Chained
    resumes compose the same way. (So with ``drop_last=True``, a state saved at the very end of an
    epoch on ``W`` ranks and loaded on fewer ranks reads the fewer than ``W`` samples that ``W``
    dropped: call ``set_epoch`` with the next epoch to skip them.) With ``num_replicas=1`` the
    order is ``ShuffleSampler``'s for the same seed and epoch. ``len()`` is always ``num_samples``
    (torch's full-epoch share, which trainers count epochs with); ``remaining()`` is the number
    of indices a pending or running resumed pass yields on this rank.

    Args:
        dataset: the dataset; its length is read once, here.
        num_replicas: world size; ``torch.distributed.get_world_size()`` by default.
        rank: this process's rank; ``torch.distributed.get_rank()`` by default.
        shuffle: shuffle with a Feistel permutation keyed by ``(seed, epoch)``, else keep order.
        seed: the same on every rank.
        drop_last: drop the tail to make the stream divisible by the world size, else pad.

    Raises:
        RuntimeError: if ``num_replicas`` or ``rank`` are not given and torch.distributed is not
            available.
        ValueError: if ``rank`` is not in ``[0, num_replicas - 1]``, or the length is above
            ``2**63 - 1``.
        TypeError: if ``num_replicas``, ``rank`` or ``seed`` is not an int.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            if not dist.is_available():
                raise RuntimeError("Requires distributed package to be available")
            num_replicas = dist.get_world_size()
        if rank is None:
            if not dist.is_available():
                raise RuntimeError("Requires distributed package to be available")
            rank = dist.get_rank()
        num_replicas = int_argument(num_replicas, "num_replicas")
        rank = int_argument(rank, "rank")
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = int_argument(seed, "seed")
        self._length = _length_of(dataset)
        # torch's arithmetic, in integers (torch's float ceil is off by one past 2**53).
        self.num_samples = self._pass_length(0)
        self.total_size = self.num_samples * self.num_replicas
        self._pending: tuple[int, int] | None = None  # (epoch, global start) from load_state_dict
        self._kept = False  # set_epoch named the pending resume's epoch (shuffle point 3)
        self._pass = None

    def __len__(self) -> int:
        """Return ``num_samples``: this rank's share of a whole epoch, as torch's sampler does.

        Also during a resumed epoch, which yields only ``remaining()`` indices: trainers count
        the batches delivered before the resume themselves and compare with ``len()``
        (Lightning ends the epoch early when ``len()`` shrinks).
        """
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        """Start this rank's pass over the current epoch: from the loaded position once, else 0."""
        start = self._start()
        pass_ = self._new_pass(start, 0, self._pass_length(start))
        stream = self._stream(self.epoch)
        offset, stride = start + self.rank, self.num_replicas

        def make_block(lo: int, hi: int) -> npt.NDArray[np.uint64]:
            positions = np.arange(lo, hi, dtype=np.uint64)
            positions *= np.uint64(stride)
            positions += np.uint64(offset)
            return stream(positions)

        return pass_.iterate(make_block)

    def index_at(self, positions: npt.ArrayLike, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """Map global stream positions to dataset indices, vectorised.

        Positions past ``N`` wrap around to the start of the stream, as padding does, so
        ``index_at(np.arange(rank, total_size, num_replicas))`` is this rank's epoch.

        Args:
            positions: non-negative integer array-like; any shape.
            epoch: which epoch's order; the sampler's current epoch by default.

        Returns:
            int64 array of the same shape.

        Raises:
            TypeError: if ``positions`` are not integers.
            IndexError: if a position is negative, or any is given for an empty dataset.
        """
        array = _as_positions(positions)
        if array.size and self._length == 0:
            raise IndexError("positions given for an empty dataset")
        stream = self._stream(self.epoch if epoch is None else epoch)
        return stream(array.ravel()).view(np.int64).reshape(array.shape)

    def state_dict(self) -> dict[str, int | bool]:
        """Return this rank's state; the same on every rank when ranks advance in lockstep.

        Returns:
            ``{"version", "seed", "epoch", "cursor", "num_replicas", "length", "shuffle"}``, where
            ``cursor`` is the number of global stream positions consumed by all ranks, computed
            locally as ``start + cursor_local * num_replicas`` (for the rest of an epoch loaded
            at its end, the length: the padding of the world size that saved it is not this
            one's).
        """
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self._global_cursor(),
            "num_replicas": self.num_replicas,
            "length": self._length,
            "shuffle": self.shuffle,
        }

    def state_dict_at(self, consumed: int, since: int | None = None) -> dict[str, int | bool]:
        """This rank's state once ``consumed`` indices of its latest ``iter()`` have been *used*.

        See ``ShuffleSampler.state_dict_at`` (``since`` too): the global cursor is computed from
        the indices the training loop received, not those a loader prefetched.
        """
        state = self.state_dict()
        current, start, pending = self._counted(since)
        if current is not None:
            state["cursor"] = current.start + min(consumed, current.stop) * self.num_replicas
        elif consumed > 0 or pending is None:  # in the pass iter() will make
            state["cursor"] = start + min(consumed, self._pass_length(start)) * self.num_replicas
        else:
            state["cursor"] = pending  # as loaded
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` resume the saved epoch at its global position, on any world size.

        The saved seed replaces this sampler's; ``num_replicas`` may differ from the saved one.

        Args:
            state: a dict from ``state_dict()`` of any rank, saved with any world size. (A
                loader state whose batches were delivered out of order resumes on the same
                world size only.)

        Raises:
            ValueError: if the format version, dataset length or ``shuffle`` differ from this
                sampler's, or an entry is missing, not an int, or out of range.
        """
        owner = type(self).__name__
        _check_common(state, owner, self._length)
        if "shuffle" not in state:
            raise ValueError(f"{owner} state has no 'shuffle' entry: got keys {sorted(state)}")
        if bool(state["shuffle"]) != self.shuffle:
            raise ValueError(
                f"{owner} state was saved with shuffle={bool(state['shuffle'])}, this sampler has "
                f"shuffle={self.shuffle}"
            )
        saved_replicas = _state_int(state, "num_replicas", owner)
        if saved_replicas < 1:
            raise ValueError(f"{owner} state num_replicas must be >= 1, got {saved_replicas}")
        cursor = _state_int(state, "cursor", owner)
        # A pass that saved it ends before length + its world size (padding included).
        if not 0 <= cursor <= max(self._length + saved_replicas - 1, 0):
            raise ValueError(
                f"{owner} state cursor {cursor} is outside [0, {self._length + saved_replicas - 1}]"
                f" for length {self._length} saved on {saved_replicas} replicas"
            )
        self.seed = _state_int(state, "seed", owner)
        self.epoch = _state_int(state, "epoch", owner)
        # Past the length is padding of the world size that saved it: the epoch's end. Kept as
        # the length, so that a state saved again on fewer ranks loads (its padding was not
        # theirs).
        self._pending = (self.epoch, min(cursor, self._length))
        self._pending_ended = self._pass_length(cursor, saved_replicas) == 0
        self._kept = False
        self._pass = None

    def _rest_length(self, cursor: int) -> int:
        return self._pass_length(cursor)

    def _pass_length(self, start: int, replicas: int | None = None) -> int:
        """Return how many positions each rank takes from global position ``start`` to epoch end,
        on ``replicas`` ranks (this sampler's world size by default)."""
        remaining = max(self._length - start, 0)
        ranks = self.num_replicas if replicas is None else replicas
        if self.drop_last:
            return remaining // ranks
        return -(-remaining // ranks)

    def _global_cursor(self) -> int:
        pending, current = self._pending, self._pass
        if pending is not None and pending[0] == self.epoch:
            return pending[1]
        if current is not None and current.epoch == self.epoch:
            return current.start + current.next_step() * self.num_replicas
        return 0

    def _stream(self, epoch: int) -> Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.uint64]]:
        """Return the map from global stream positions (uint64) to indices for ``epoch``."""
        length, shuffle = self._length, self.shuffle
        permutation = FeistelPermutation(length, self.seed, epoch)

        def stream(positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
            if positions.size and int(positions.max()) >= length:
                positions = positions % np.uint64(length)  # padding wraps around, like torch
            return permutation(positions) if shuffle else positions

        return stream

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(length={self._length}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, "
            f"drop_last={self.drop_last}, cursor={self._global_cursor()})"
        )
