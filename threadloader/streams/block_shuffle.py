"""BlockShuffleSampler: a global shuffle of blocks of consecutive windows, for costly random reads.

Epoch ``e`` permutes the ``length // block_size`` full blocks by a ``ShuffleSampler`` order keyed
by ``(seed, e)``, puts the shorter tail block at a slot of its own drawn from the same key, and
keeps the windows inside each block in order (``_block_order``): O(1) memory, vectorised, every
window once per epoch. The sampler is a ``DistributedShuffleSampler`` whose stream of positions
goes through that order, so rank striding, padding, state and rescaling are the parent's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

import numpy as np
import numpy.typing as npt

from threadloader.samplers.distributed import DistributedShuffleSampler
from threadloader.samplers.shuffle import ShuffleSampler, int_argument
from threadloader.streams.args import default_world


def _block_order(length: int, block: int, seed: int, epoch: int) -> Any:
    """Return the map from positions (uint64) to indices (uint64) of one block-shuffled epoch.

    ``length // block`` full blocks are permuted by a ``ShuffleSampler`` order; the tail block of
    ``length % block`` windows sits at a slot of its own, drawn from ``(seed, epoch)`` among the
    ``full + 1`` slots. Windows inside a block keep their order. O(1) memory, vectorised.
    """
    full, tail = divmod(length, block)
    blocks = ShuffleSampler(full, seed=seed)
    cut = full * block
    if tail and full:
        cut = int(ShuffleSampler(full + 1, seed=seed + 1).index_at([full], epoch=epoch)[0]) * block

    def order(positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        p = positions.astype(np.int64)
        in_tail = (p >= cut) & (p < cut + tail)
        shifted = np.where(p >= cut + tail, p - tail, p)
        out = np.empty_like(p)
        rest = ~in_tail
        if full:
            q = shifted[rest]
            out[rest] = blocks.index_at(q // block, epoch=epoch) * block + q % block
        out[in_tail] = full * block + (p[in_tail] - cut)
        return out.astype(np.uint64)

    return order


class BlockShuffleSampler(DistributedShuffleSampler):
    """A global shuffle of blocks of ``block_size`` consecutive windows: locality for slow storage.

    Epoch ``e`` permutes the blocks (a ``ShuffleSampler`` order keyed by ``(seed, e)``) and reads
    each block's windows in order, so a run of ``block_size`` consecutive samples reads one
    contiguous byte range: one request per block from object storage, readahead that is used on
    disks. The price is randomness: samples of one block land in the same and neighbouring
    batches. Memory stays O(1), every window is read once per epoch, and everything else
    (world-size-independent order, rank striding, padding, ``state_dict`` and rescaling) is
    ``DistributedShuffleSampler``'s. Rank ``r`` of ``W`` reads every ``W``-th window of the stream,
    so each rank still reads within ``W`` neighbouring blocks at a time.

    Args:
        dataset: the dataset (e.g. ``TokenWindows``) or anything with ``len``.
        block_size: windows per block; 1 is a full shuffle.
        num_replicas: world size; torch.distributed's when initialised, else 1.
        rank: this rank; torch.distributed's when initialised, else 0.
        seed: the same on every rank.
        drop_last: as ``DistributedShuffleSampler``.

    Raises:
        ValueError: if ``block_size < 1`` or the rank is out of range.
    """

    def __init__(
        self,
        dataset: Sized,
        block_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        block_size = int_argument(block_size, "block_size")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        num_replicas, rank = default_world(num_replicas, rank)
        self.block_size = block_size
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last)

    def _stream(self, epoch: int) -> Any:
        length = self._length
        order = _block_order(length, self.block_size, self.seed, epoch)

        def stream(positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
            if positions.size and int(positions.max()) >= length:
                positions = positions % np.uint64(length)  # padding wraps, as the parent's does
            return order(positions)

        return stream

    def state_dict(self) -> dict[str, int | bool]:
        """``DistributedShuffleSampler``'s state plus ``block_size``."""
        return {**super().state_dict(), "block_size": self.block_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume as ``DistributedShuffleSampler`` does, after checking the block size.

        Raises:
            ValueError: if the state has another ``block_size``, or the parent rejects it.
        """
        saved = state.get("block_size") if isinstance(state, Mapping) else None
        if saved != self.block_size:
            raise ValueError(
                f"{type(self).__name__} state was saved with block_size={saved}, this sampler "
                f"has block_size={self.block_size}"
            )
        super().load_state_dict(state)
