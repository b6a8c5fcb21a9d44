"""threadloader: torch's DataLoader with worker threads instead of worker processes.

Change one import and get the batches ``torch.utils.data.DataLoader`` gives, without forking a
process per worker, pickling batches through shared memory, or copying the dataset into every
worker::

    from threadloader import ThreadDataLoader   # was: from torch.utils.data import DataLoader

Code that does not build its own loader (Hugging Face Trainer, Accelerate, a library's
``create_loader``): ``python -m threadloader run train.py`` or ``threadloader.patch()`` makes
every ``torch.utils.data.DataLoader(...)`` it builds a ThreadDataLoader.

Beyond the loader: O(1)-memory rescalable samplers (``samplers``), token streams and live data
mixing (``streams``), remote objects with retries and a cache (``remote``), pinned-memory
collation and a CUDA-stream transfer stage (``memory``, ``transfer``), and per-epoch stats.
"""

__version__ = "0.1.0"
"""The release; pyproject.toml reads it from here (the one place it is written)."""

from threadloader._engine.stats import LoaderStats, StageStats
from threadloader.device.pinned import BufferPool, pinned_collate
from threadloader.device.transfer import DevicePrefetcher
from threadloader.integrations.patch import is_patched, patch, patched, unpatch
from threadloader.loader import ThreadDataLoader
from threadloader.remote.files import RemoteFiles
from threadloader.samplers.distributed import DistributedShuffleSampler
from threadloader.samplers.shuffle import ShuffleSampler
from threadloader.streams import BlockShuffleSampler, Mixture, MixtureSampler, TokenWindows

__all__ = [
    "BlockShuffleSampler",
    "BufferPool",
    "DevicePrefetcher",
    "DistributedShuffleSampler",
    "LoaderStats",
    "Mixture",
    "MixtureSampler",
    "RemoteFiles",
    "ShuffleSampler",
    "StageStats",
    "ThreadDataLoader",
    "TokenWindows",
    "is_patched",
    "patch",
    "patched",
    "pinned_collate",
    "unpatch",
]
assert sorted(__all__) == __all__
