"""Fetch a batch and collate it, as torch's ``_utils/fetch.py`` does, timing each stage.

Semantics are torch's fetchers', line for line: ``__getitems__`` when the dataset has it, else
one ``__getitem__`` per index; an IterableDataset's batch ends early at ``StopIteration`` and
raises it when empty (or short, with ``drop_last``). Kept separate from torch's so that fetch
and collate are timed apart without wrapping user callables.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import _DatasetKind

from threadloader._engine import dataset_state
from threadloader._primitives.timing import StageRecorder
from threadloader._primitives.worker_globals import library_code
from threadloader.device.gathered import Gathered, fetch_stacked, parts_getter

#: A batch whose first item took this long checks before each later item whether its epoch
#: was abandoned (``Fetcher._each``).
SLOW_ITEM_S = 0.001


class Abandoned(Exception):
    """The batch's epoch was abandoned while its items were fetched: the rest are not."""


class _Checked:
    """A batch's indices, each given only while ``stopped()`` says False (else ``Abandoned``)."""

    __slots__ = ("_indices", "_stopped")

    def __init__(self, indices: Any, stopped: Callable[[], bool]) -> None:
        self._indices = indices
        self._stopped = stopped

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[Any]:
        stopped = self._stopped
        for index in self._indices:
            if stopped():
                raise Abandoned
            yield index


class Fetcher:
    """Turns one entry of the index stream into a collated batch.

    Args:
        kind: ``_DatasetKind.Map`` or ``_DatasetKind.Iterable``.
        dataset: the dataset (a worker's own copy, for an IterableDataset).
        auto_collation: whether indices come in batches (``batch_size`` or ``batch_sampler``).
        collate_fn: the loader's collate function (``default_convert`` without batching).
        drop_last: drop an IterableDataset's short last batch.
        stopped: asked before each item (where items are slow: ``_each``): True stops the
            batch there (``Abandoned``). A batch the dataset makes whole (``__getitems__``)
            runs whole.

    Raises:
        Exception: whatever ``iter(dataset)`` raises for an IterableDataset.
    """

    def __init__(
        self,
        kind: int,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        drop_last: bool,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        self._dataset = dataset
        self._stopped = stopped
        self._auto = auto_collation
        self._drop_last = drop_last
        self._iterable = kind == _DatasetKind.Iterable
        self._iter: Iterator[Any] | None = iter(dataset) if self._iterable else None
        self._ended = False
        self.recollate(collate_fn)

    def recollate(self, collate_fn: Callable[[Any], Any]) -> None:
        """Collate with ``collate_fn`` from the next batch on; the epoch's iterator stays.

        For a worker carried into a helper process mid-epoch: there its batches go into
        shared memory, where the training process's threads pinned them.
        """
        self._collate = collate_fn
        # Batches built here for our own default collate (_gathered, point 4).
        ours = self._auto and not self._iterable and getattr(collate_fn, "takes_gathered", False)
        self._ours = bool(ours)
        self._stack_into = getattr(collate_fn, "stack_into", None) if ours else None

    @property
    def iterator(self) -> Iterator[Any] | None:
        """The epoch's ``iter(dataset)`` of an IterableDataset; None for a map-style one."""
        return self._iter

    @property
    def ended(self) -> bool:
        """Whether the epoch's iterator raised ``StopIteration`` (while filling a last batch)."""
        return self._ended

    def restore(self, state: Any, form: int) -> None:
        """Load a worker state's iterator part into the epoch's iterator (``dataset_state``
        point 2); one that had run out filling its last batch stays run out (point 3)."""
        dataset_state.restore_iterator(self._iter, state, form)
        if dataset_state.ran_out(state):
            self._ended = True  # its next fetch raises StopIteration

    def fetch(self, index: Any, recorder: StageRecorder) -> Any:
        """The collated batch for ``index``; its fetch and collate durations go to ``recorder``.

        Raises:
            StopIteration: an IterableDataset has no (full, with ``drop_last``) batch left.
        """
        start = time.perf_counter()
        data = self._items(index)
        fetched = time.perf_counter()
        if self._ours:
            with library_code():
                out = self._collate(data)
        else:
            out = self._collate(data)  # the user's: its random draws are the worker's
        done = time.perf_counter()
        recorder.add_pair("fetch", fetched - start, "collate", done - fetched)
        return out

    def _items(self, index: Any) -> Any:
        if self._iter is not None:
            return self._next_items(index)
        dataset = self._dataset
        if not self._auto:
            return dataset[index]
        getitems = getattr(dataset, "__getitems__", None)  # per batch, as torch's fetcher
        if getitems:
            gather = parts_getter(dataset) if self._ours else None
            if gather is not None:
                with library_code():  # threadloader's own datasets' gathering
                    parts = gather(index)
                if parts is not None:
                    return Gathered(parts)
            return getitems(index)
        if self._stack_into is not None:
            return fetch_stacked(dataset, self._checked(index), self._stack_into)
        if self._stopped is None:
            return [dataset[i] for i in index]
        return self._each(dataset, index, self._stopped)

    @staticmethod
    def _each(dataset: Any, index: Any, stopped: Callable[[], bool]) -> list[Any]:
        """``[dataset[i] for i in index]``, stopping before an item once ``stopped()`` says so
        where the first took ``SLOW_ITEM_S`` or more; quick items pay no check (their batch
        ends soon anyway: a generator between the list and the indices costs ~30 ns an item,
        as much as a cheap item itself), so a batch whose first item was quick and whose
        others are slow is made whole."""
        if stopped():
            raise Abandoned
        indices: Any = iter(index)
        start = time.perf_counter()
        items = [dataset[i] for i in itertools.islice(indices, 1)]
        if time.perf_counter() - start >= SLOW_ITEM_S:
            indices = _Checked(indices, stopped)
        items += [dataset[i] for i in indices]
        return items

    def _checked(self, index: Any) -> Any:
        """``index``, stopping between items once ``stopped()`` says so."""
        return index if self._stopped is None else _Checked(index, self._stopped)

    def _next_items(self, index: Any) -> Any:
        assert self._iter is not None
        if self._ended:
            raise StopIteration
        if not self._auto:
            return next(self._iter)
        data = []
        for _ in self._checked(index):
            try:
                data.append(next(self._iter))
            except StopIteration:
                self._ended = True
                break
        if not data or (self._drop_last and len(data) < len(index)):
            raise StopIteration
        return data
