"""Each worker's own view of the dataset object, as a worker process has its own copy.

A torch worker process gets the dataset by fork or pickle, so what a ``worker_init_fn`` sets on
``get_worker_info().dataset``, a handle a ``__getitem__`` opens lazily, or a worker id it caches
on ``self`` belongs to that worker alone, and what the training process changes later is not
seen. Worker threads get the same from a copy made when the worker is created:

1. A DataPipe graph that sharding changes in place is deep-copied (``_datapipes.graph_copy``).
2. Any other dataset, map-style or iterable, is shallow-copied with ``copy.copy``: the copy has
   its own ``__dict__``, and the arrays, lists, memory maps and tensors it references stay shared,
   so memory stays what one dataset costs. ``copy.copy`` honours a class's ``__copy__`` and
   ``__getstate__``/``__setstate__`` (a handle a dataset drops when pickled is reopened per
   worker, as in a spawned worker process); a class that keeps process-wide state, like
   ``RemoteFiles``' read pool and counters, says so with a ``__copy__``.
3. A dataset that ``copy.copy`` cannot copy is shared by the worker threads, as before there
   were copies, with one ``RuntimeWarning`` per type naming the error.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

from threadloader._datapipes import graph_copy

_warned: set[type] = set()
_warned_lock = threading.Lock()


def worker_copy(dataset: Any) -> Any:
    """The dataset object a worker sees as ``get_worker_info().dataset`` and fetches from.

    Raises:
        RuntimeError: a DataPipe graph that cannot be deep-copied (naming why).
    """
    graph = graph_copy(dataset)
    if graph is not None:
        return graph
    try:
        return copy.copy(dataset)
    except Exception as error:  # noqa: BLE001  # point 3: shared, with a warning
        with _warned_lock:
            first = type(dataset) not in _warned
            _warned.add(type(dataset))
        if first:
            warnings.warn(
                f"threadloader: copy.copy({type(dataset).__name__}) failed ({error!r}), so "
                "every worker thread shares this one dataset object: what a worker sets on "
                "it is every worker's. Give the class a __copy__ to have a copy per worker.",
                RuntimeWarning,
                stacklevel=2,
            )
        return dataset
