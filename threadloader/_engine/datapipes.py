"""torch DataPipes in worker threads: each worker's own graph, sharded and seeded as torch does.

torch's DataLoader shards an ``IterDataPipe``/``MapDataPipe`` graph across ranks and workers
(``graph_settings.apply_sharding``: each ``sharding_filter`` keeps every n-th element) and seeds
its shuffles with one seed shared by all workers, so that they shuffle alike and then each keeps
its own shard. A worker process does that to its own unpickled (or forked) copy of the graph.

Worker threads share the process, and ``apply_sharding`` changes the graph's nodes in place (an
``IterDataPipe`` also allows one live iterator at a time), so the shallow copy every other
IterableDataset gets per worker would make the workers overwrite each other's shard. Each worker
thread gets a deep copy of the graph instead, made when the worker is created (after the
iterator seeded the loader's graph, as torch's workers receive it).

Where the code disagrees with these points, the code is wrong:

1. ``graph_copy`` returns a deep copy of an ``IterDataPipe`` (and of a ``MapDataPipe`` whose
   graph holds a sharding node), and None for any other dataset (``dataset_copy`` copies
   those).
2. With workers, ``sharding_init_fn`` wraps the ``worker_init_fn`` in torch's own
   ``_sharding_worker_init_fn`` (shard by ``num_workers * world_size``, worker ``id * world_size
   + rank``, then the user's function), exactly as torch's worker iterator does.
3. Without workers, ``shard_here`` shards the loader's graph by ``world_size`` and ``rank``, as
   torch's single-process iterator does, before the fetcher first iterates it.
4. Persistent workers: every later epoch, each worker's graph is reseeded from the iterator's new
   shared seed (``reseed``) before it is iterated again, as torch's ``_ResumeIteration`` does.
5. torch walks a graph (``traverse_dps``, under ``apply_sharding``, ``apply_random_seed`` and the
   copy of a pipe) by installing pickle hooks on the DataPipe *classes*: two threads walking
   graphs at once break each other ("Attempt to override existing reduce_ex_hook", or a copy
   that holds stubs). Every walk that threadloader starts, in a worker thread or in torch's
   iterator code on the training thread (``graph_walks``), holds ``_GRAPH_LOCK``; the user's
   ``worker_init_fn`` runs outside it, and so does iterating a graph (which walks nothing). A
   walk started elsewhere (user code pickling a DataPipe on another thread) is not covered.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings
from torch.utils.data.dataloader import _sharding_worker_init_fn
from torch.utils.data.datapipes.datapipe import _IterDataPipeSerializationWrapper
from torch.utils.data.datapipes.iter.sharding import _ShardingIterDataPipe
from torch.utils.data.graph import traverse_dps

_GRAPH_LOCK = threading.Lock()  # point 5


def _is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def graph_walks(dataset: Any) -> contextlib.AbstractContextManager[Any]:
    """Hold the graph-walk lock while torch's iterator code seeds a DataPipe (point 5)."""
    return _GRAPH_LOCK if _is_datapipe(dataset) else contextlib.nullcontext()


def _has_sharding(datapipe: Any) -> bool:
    """Whether a graph holds a node that ``apply_sharding`` changes (a map graph may wrap one)."""
    with _GRAPH_LOCK:
        nodes = graph_settings.get_all_graph_pipes(traverse_dps(datapipe))
    return any(isinstance(node, _ShardingIterDataPipe) for node in nodes)


def graph_copy(dataset: Any) -> Any:
    """A worker thread's own deep copy of a DataPipe graph that needs one, else None (point 1).

    Raises:
        RuntimeError: a DataPipe graph that cannot be deep-copied (naming why).
    """
    if isinstance(dataset, IterDataPipe) or (
        isinstance(dataset, MapDataPipe) and _has_sharding(dataset)
    ):
        try:
            with _GRAPH_LOCK:
                if isinstance(dataset, _IterDataPipeSerializationWrapper):
                    # The wrapper DataLoader puts around a pipe copies it by pickling, which
                    # fails on a lambda (torch's forked workers never pickle): copy the pipe.
                    return type(dataset)(copy.deepcopy(dataset._datapipe))
                return copy.deepcopy(dataset)
        except Exception as error:
            raise RuntimeError(
                "threadloader: each worker thread needs its own copy of a DataPipe graph "
                f"(sharding changes the graph in place), and copy.deepcopy failed: {error!r}"
            ) from error
    return None


def sharding_init_fn(
    init_fn: Callable[[int], None] | None, dataset: Any, world_size: int, rank: int
) -> Callable[[int], None] | None:
    """``init_fn``, preceded by torch's DataPipe sharding when ``dataset`` is one (point 2)."""
    if not _is_datapipe(dataset):
        return init_fn
    return functools.partial(_shard_worker, init_fn, world_size, rank)


def _shard_worker(
    init_fn: Callable[[int], None] | None, world_size: int, rank: int, worker_id: int
) -> None:
    with _GRAPH_LOCK:  # point 5
        _sharding_worker_init_fn(None, world_size, rank, worker_id)
    if init_fn is not None:
        init_fn(worker_id)


def shard_here(dataset: Any, world_size: int, rank: int) -> None:
    """Shard a DataPipe graph across ranks, for an iterator without workers (point 3)."""
    if _is_datapipe(dataset):
        with _GRAPH_LOCK:
            graph_settings.apply_sharding(dataset, world_size, rank)


def reseed(dataset: Any, seed: int | None) -> None:
    """Seed an ``IterDataPipe`` graph's shuffles from a new shared seed (point 4)."""
    if seed is not None and isinstance(dataset, IterDataPipe):
        with _GRAPH_LOCK:
            graph_settings.apply_random_seed(dataset, torch.Generator().manual_seed(seed))
