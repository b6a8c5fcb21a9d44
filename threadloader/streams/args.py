"""What the token-stream classes check and default alike: batches of indices, a sampler's world.

``as_indices`` turns any batch of indices (a list, a tensor, an array) into one flat int64 array,
checked against the dataset's length, for the vectorised reads of ``TokenWindows`` and
``Mixture`` (``integer_array`` refuses floats, also for ``Mixture.indices_at``'s stream
positions). ``default_world`` gives ``BlockShuffleSampler`` and ``MixtureSampler`` the world of
torch.distributed when it is initialised, else a world of one, and checks the rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist

from threadloader.samplers.shuffle import int_argument

Ints = npt.NDArray[np.int64]


def integer_array(values: Any, what: str) -> Ints:
    """``values`` (a list, a tensor, an array) as an int64 array of the same shape.

    Raises:
        TypeError: naming ``what``, if they are not integers (floats would be truncated).
    """
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def as_indices(indices: Any, length: int) -> Ints:
    array = integer_array(indices, "indices").reshape(-1)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= length):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise IndexError(f"index {bad} is out of range for {length} items")
    return array


def default_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """torch.distributed's world when it is initialised, else a world of one."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    num_replicas, rank = int_argument(num_replicas, "num_replicas"), int_argument(rank, "rank")
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank
