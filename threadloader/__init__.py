"""threadloader: torch's DataLoader with worker threads instead of worker processes.

Change one import and get the batches ``torch.utils.data.DataLoader`` gives, without forking a
process per worker, pickling batches through shared memory, or copying the dataset into every
worker::

    from threadloader import ThreadDataLoader   # was: from torch.utils.data import DataLoader
"""

from threadloader.loader import ThreadDataLoader
from threadloader.samplers import DistributedShuffleSampler, ShuffleSampler
from threadloader.stats import LoaderStats, StageStats

__all__ = [
    "DistributedShuffleSampler",
    "LoaderStats",
    "ShuffleSampler",
    "StageStats",
    "ThreadDataLoader",
]
assert sorted(__all__) == __all__
