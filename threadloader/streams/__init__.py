"""Token streams for LLM pretraining: zero-build token windows, block shuffle, live data mixing.

::

    web = TokenWindows("data/web/*.bin", seq_len=1024)          # opens 10,000 shards in ~0.1 s
    code = TokenWindows("data/code/*.npy", seq_len=1024)
    mix = Mixture({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=0)
    sampler = MixtureSampler(mix, num_replicas=world_size, rank=rank)
    loader = ThreadDataLoader(mix, batch_size=16, sampler=sampler, num_workers=2)
    ...
    mix.set_weights({"web": 0.5, "code": 0.5})   # live; recorded in sampler.state_dict()

- ``TokenWindows`` reads only file sizes (``.npy``: headers) when opened, maps each file on its first
  read, and slices whole batches at once (``__getitems__``). Any sampler works: ``ShuffleSampler``
  or ``DistributedShuffleSampler`` for a global shuffle in O(1) memory, ``BlockShuffleSampler`` to
  shuffle blocks of consecutive windows when random reads are costly.
- ``Mixture`` concatenates named map-style datasets; ``MixtureSampler`` decides, for every position
  of one infinite global stream, which source it draws from and which sample, from the seed, the
  position and the weights in force there. Rank ``r`` of ``W`` reads positions ``r, r + W, ...``,
  so the stream does not depend on the world size and a state saved on ``W`` ranks resumes on any
  ``W'``.

Where the pieces live: ``token_windows`` (``TokenWindows``; ``token_files`` reads and maps the
files), ``block_shuffle`` (``BlockShuffleSampler``), ``mixture`` (``Mixture``),
``mixture_sampler`` (``MixtureSampler``; ``mixing`` has the schedule's rules) and ``args`` (the index and
world checks they share).
"""

from __future__ import annotations

from threadloader.streams.block_shuffle import BlockShuffleSampler
from threadloader.streams.mixture import Mixture
from threadloader.streams.mixture_sampler import MixtureSampler
from threadloader.streams.token_windows import TokenWindows

__all__ = ["BlockShuffleSampler", "Mixture", "MixtureSampler", "TokenWindows"]
