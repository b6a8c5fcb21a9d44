"""Each worker's own view of the dataset object, as a worker process has its own copy.

A torch worker process gets the dataset by fork or pickle, so what a ``worker_init_fn`` sets on
``get_worker_info().dataset``, a handle a ``__getitem__`` opens lazily, or a worker id it caches
on ``self`` belongs to that worker alone, and what the training process changes later is not
seen. Worker threads get the same from a copy made when the worker is created:

1. A DataPipe graph that sharding changes in place is deep-copied (``_datapipes.graph_copy``).
2. A map-style dataset is shallow-copied with ``copy.copy``: the copy has its own ``__dict__``,
   and the arrays, lists, memory maps and tensors it references stay shared, so memory stays
   what one dataset costs (the worker only reads items through it). ``copy.copy`` honours a
   class's ``__copy__`` and ``__getstate__``/``__setstate__`` (a handle a dataset drops when
   pickled is reopened per worker, as in a spawned worker process); a class that keeps
   process-wide state, like ``RemoteFiles``' read pool and counters, says so with a ``__copy__``.
3. An ``IterableDataset`` gets an independent copy, as a spawned worker process unpickles one:
   its iteration state lives in its members (a stream's position, a shard list a
   ``worker_init_fn`` narrows, a Hugging Face stream's inner iterable), so no mutable member
   may be shared between workers or with the user's object. It is pickled and unpickled in
   memory, except that data no worker can change is passed through as the same object: numpy
   arrays that are not writeable, ``bytes`` and ``str`` of 4 KiB or more, pyarrow data; and
   file-backed memory (``np.memmap``, ``mmap``), which worker processes share too. A writeable
   array or a tensor is copied, as a worker process's would be: set
   ``array.flags.writeable = False`` on a large one to share it. What pickle cannot take (a
   lambda, a lock) falls back to ``copy.deepcopy``.
4. A dataset that cannot be copied so is shared by the worker threads, with one
   ``RuntimeWarning`` per type naming the error.
"""

from __future__ import annotations

import copy
import io
import mmap
import pickle
import threading
import warnings
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from threadloader._engine.datapipes import graph_copy

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
        if isinstance(dataset, IterableDataset):
            return independent_copy(dataset)
        return copy.copy(dataset)
    except Exception as error:  # noqa: BLE001  # point 4: shared, with a warning
        with _warned_lock:
            first = type(dataset) not in _warned
            _warned.add(type(dataset))
        if first:
            warnings.warn(
                f"threadloader: cannot copy {type(dataset).__name__} for each worker thread "
                f"({error!r}), so every worker thread shares this one dataset object: what a "
                "worker sets on it is every worker's. Give the class a __copy__ (map-style) or "
                "make it picklable (IterableDataset) to have a copy per worker.",
                RuntimeWarning,
                stacklevel=2,
            )
        return dataset


#: Below this many bytes an immutable object is cheaper to copy than to look up again.
_SHARE_MIN_BYTES = 4096


def _is_shared(obj: Any) -> bool:
    """Whether ``obj`` crosses into a worker's copy as the same object (point 3)."""
    if isinstance(obj, (np.memmap, mmap.mmap)):
        return True  # file-backed: worker processes share what they write through it as well
    if isinstance(obj, np.ndarray):
        return not obj.flags.writeable
    if isinstance(obj, (bytes, str)):
        return len(obj) >= _SHARE_MIN_BYTES
    module = type(obj).__module__
    return module == "pyarrow" or module.startswith("pyarrow.")


class _SharingPickler(pickle.Pickler):
    def __init__(self, buffer: io.BytesIO, shared: list[Any]) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self._shared = shared

    def persistent_id(self, obj: Any) -> int | None:
        if _is_shared(obj):
            self._shared.append(obj)
            return len(self._shared) - 1
        return None


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, buffer: io.BytesIO, shared: list[Any]) -> None:
        super().__init__(buffer)
        self._shared = shared

    def persistent_load(self, pid: Any) -> Any:
        return self._shared[pid]


def independent_copy(dataset: Any) -> Any:
    """A copy of ``dataset`` sharing no mutable member with it (point 3).

    Raises:
        Exception: what ``copy.deepcopy`` raises when pickling failed too.
    """
    shared: list[Any] = []
    buffer = io.BytesIO()
    try:
        _SharingPickler(buffer, shared).dump(dataset)
    except Exception:  # noqa: BLE001  # a lambda, a lock: deepcopy may still manage
        return copy.deepcopy(dataset)
    buffer.seek(0)
    return _SharingUnpickler(buffer, shared).load()
