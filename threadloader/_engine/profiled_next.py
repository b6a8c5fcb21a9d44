"""torch's ``_BaseDataLoaderIter.__next__``, with its profiler range opened the cheap way.

torch wraps every ``next()`` in ``torch.autograd.profiler.record_function``, a Python context
manager that dispatches two profiler ops whether or not a profiler is running: 4.3 us a batch on
2 cores, as much as the rest of the lean path's bookkeeping, and 6% of a 75 us batch of token
windows. ``torch._C._profiler._RecordFunctionFast`` opens the same user-scope range (same name,
same place in a trace) from C++ for 0.2 us; torch uses it itself for compiled graphs. The
experimental CUPTI monitor that ``record_function`` also annotates is annotated here too
(0.5 us in all). The
rest of the body is torch's: lazy ``_reset``, the ``_num_yielded`` count and the warning when an
IterableDataset yields more than its ``__len__``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import profiler as _profiler
from torch.utils.data import _DatasetKind

_Range = Callable[[str], AbstractContextManager[Any]]
_FAST: _Range | None = getattr(torch._C._profiler, "_RecordFunctionFast", None)
_monitor: Callable[[], Any] = getattr(_profiler, "_maybe_cupti_monitor", lambda: None)


class _CuptiAnnotated:
    """``_RecordFunctionFast(name)`` plus the CUPTI monitor's user annotation, as torch does."""

    __slots__ = ("_monitor", "_name", "_pushed", "_range")

    def __init__(self, name: str, monitor: Any) -> None:
        assert _FAST is not None
        self._range: Any = _FAST(name)
        self._name, self._monitor, self._pushed = name, monitor, None

    def __enter__(self) -> None:
        self._range.__enter__()
        self._pushed = self._monitor.push_user_annotation(self._name)

    def __exit__(self, *exc: object) -> None:
        if self._pushed is not None:
            self._monitor.pop_user_annotation()
        self._range.__exit__(*exc)


def profile_range(name: str) -> AbstractContextManager[Any]:
    """The profiler range torch opens around each ``next()``, named ``name``."""
    if _FAST is None:  # a torch without the fast path: torch's own context manager
        return _profiler.record_function(name)
    monitor = _monitor()
    if monitor is None:
        return _FAST(name)
    return _CuptiAnnotated(name, monitor)


class ProfiledNext:
    """Mixin for a ``_BaseDataLoaderIter`` subclass: torch's ``__next__`` (module docstring)."""

    _profile_name: str
    _sampler_iter: Any
    _num_yielded: int
    _dataset_kind: int
    _IterableDataset_len_called: Any
    _dataset: Any
    _num_workers: int

    if TYPE_CHECKING:  # torch's, through the class this is mixed into

        def _reset(self, loader: Any, first_iter: bool = False) -> None: ...

        def _next_data(self) -> Any: ...

    def __next__(self) -> Any:
        with profile_range(self._profile_name):
            if self._sampler_iter is None:
                self._reset()  # type: ignore[call-arg]  # as torch calls it
            data = self._next_data()
            self._num_yielded += 1
            if (
                self._dataset_kind == _DatasetKind.Iterable
                and self._IterableDataset_len_called is not None
                and self._num_yielded > self._IterableDataset_len_called
            ):
                msg = (
                    f"Length of IterableDataset {self._dataset} was reported to be "
                    f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                    f"{self._num_yielded} samples have been fetched. "
                )
                if self._num_workers > 0:
                    msg += (
                        "For multiprocessing data-loading, this could be caused by not properly "
                        "configuring the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                        "for examples."
                    )
                warnings.warn(msg, stacklevel=2)
            return data
