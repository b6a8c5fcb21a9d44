"""Stateful, O(1)-memory, rescalable shuffle samplers.

The shuffled order is a keyed bijection of ``[0, N)`` (``feistel``), so any position maps to its
index directly, memory does not grow with ``N``, and the global order does not depend on the
number of ranks: a state saved on ``W`` ranks resumes on any ``W'`` (``shuffle`` says how; ``distributed`` deals the order to ranks).
"""

from threadloader.samplers.distributed import DistributedShuffleSampler
from threadloader.samplers.shuffle import ShuffleSampler

__all__ = ["DistributedShuffleSampler", "ShuffleSampler"]
