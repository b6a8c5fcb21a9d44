"""Hugging Face Accelerate: ``accelerator.prepare(ThreadDataLoader(...))`` keeps the threads.

``Accelerator.prepare`` does not wrap the loader it is given: ``prepare_data_loader`` rebuilds it
from its parts as a ``DataLoaderShard`` (or ``DataLoaderDispatcher``) adapter, whose
``DataLoaderAdapter.__init__`` constructs a new ``torch.utils.data.DataLoader`` (or torchdata's
``StatefulDataLoader`` with ``DataLoaderConfiguration(use_stateful_dataloader=True)``) from
torch's keyword arguments only. A ThreadDataLoader handed in came back as a loader with worker
processes, without ``stats()`` and without our options.

Accelerate (1.x) has no public hook that chooses the class of that inner loader:
``DataLoaderConfiguration`` selects only between DataLoader and StatefulDataLoader, and the
adapter classes build it themselves. So this module wraps the two public ``Accelerator``
methods that rebuild loaders, ``prepare_data_loader`` (``prepare()`` calls it for every loader)
and ``skip_first_batches``. Given a loader backed by a ThreadDataLoader, the wrapper runs
Accelerate's own method unchanged inside ``threadloader.integrations._divert.building_like``: the
DataLoader (or StatefulDataLoader) Accelerate constructs there is built as a ThreadDataLoader
with the same arguments plus the given loader's options (``isolation``, ``device``,
``log_every_s``, ...). Sharding (``BatchSamplerShard``, ``IterableDatasetShard``), device
placement, RNG synchronisation, ``end_of_dataloader`` and gradient accumulation stay Accelerate's.
Loaders that are not ThreadDataLoaders pass through untouched.

Checkpoints: a ThreadDataLoader the user built is stateful, as a StatefulDataLoader is: the
prepared adapter is marked ``use_stateful_dataloader = True``, the attribute
``Accelerator.save_state`` / ``load_state`` read to save and restore a loader's ``state_dict()``
(``dl_state_dict.bin`` beside the model). The adapter snapshots the inner loader's
consumer-aligned state before each batch it yields, so a state saved after N batches resumes at
batch N+1 of the same epoch, on each process its own shard; a ``DataLoaderDispatcher``
(``dispatch_batches=True``) keeps the state of the step boundary (``_keep_step_states``). A
loader ``threadloader.patch()`` built from a ``DataLoader(...)`` call was written for torch's
DataLoader and keeps its checkpoint semantics: not marked, so ``save_state`` stores no loader
state and Accelerate's documented ``load_state`` + ``skip_first_batches`` resume skips once, not
twice. (With
``DataLoaderConfiguration(use_stateful_dataloader=True)`` Accelerate marks every loader itself.)

Installed by ``import threadloader.integrations.accelerate``, by ``threadloader.patch()`` when
Accelerate is imported, and by building a ThreadDataLoader while Accelerate is imported (the
usual order: ``from accelerate import Accelerator`` at the top of the script).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher

from threadloader.integrations._divert import BUILT_BY_PATCH, building_like
from threadloader.loader import ThreadDataLoader

__all__ = ["install", "thread_loader_of"]

_lock = threading.Lock()
_installed = False


def thread_loader_of(loader: Any) -> ThreadDataLoader[Any] | None:
    """The ThreadDataLoader that ``loader`` is or that an Accelerate adapter wraps, else None.

    Args:
        loader: a loader, possibly one ``Accelerator.prepare`` returned.

    Returns:
        The ThreadDataLoader producing its batches, or None.
    """
    base = getattr(loader, "__dict__", {}).get("base_dataloader", loader)  # not __getattr__'s
    return base if issubclass(type(base), ThreadDataLoader) else None


def _keep_step_states(dispatcher: Any) -> None:
    """Make a ``DataLoaderDispatcher`` over a ThreadDataLoader save the state of a step boundary.

    The dispatcher fetches the next step's inner batches (``_fetch_batches``: one per process,
    or one with ``split_batches``) before it yields the current step, taking the inner loader's
    state before each, and Accelerate corrects the last one by taking ``num_processes - 1`` off
    StatefulDataLoader's own counters, which a ThreadDataLoader state does not have: it stayed
    that many batches ahead, and a resume lost them. ``adjust_state_dict_for_prefetch`` is
    Accelerate's place for a loader's own correction: within each fetch it keeps the state taken
    before the fetch's first inner batch, exactly the steps yielded so far; a state taken
    outside a fetch (the epoch's end) stands as it is.
    """
    fetch = dispatcher._fetch_batches
    fetching = False
    kept: dict[str, Any] | None = None

    def fetch_batches(iterator: Any) -> Any:
        nonlocal fetching, kept
        fetching, kept = True, None
        try:
            return fetch(iterator)
        finally:
            fetching = False

    def adjust_state_dict_for_prefetch() -> None:
        nonlocal kept
        if not fetching:
            return
        if kept is None:
            kept = dispatcher.dl_state_dict
        else:
            dispatcher.dl_state_dict = kept

    dispatcher._fetch_batches = fetch_batches
    dispatcher.adjust_state_dict_for_prefetch = adjust_state_dict_for_prefetch


def _wrap(method: Any) -> Any:
    @functools.wraps(method)
    def rebuild_with_threads(self: Any, dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        template = thread_loader_of(dataloader)
        if template is None:
            return method(self, dataloader, *args, **kwargs)
        if "base_dataloader" in vars(dataloader):  # a prepared loader: keep what it was
            stateful = bool(vars(dataloader).get("use_stateful_dataloader", False))
        else:  # built by code written for torch's DataLoader: keep torch's checkpoints
            stateful = not vars(template).get(BUILT_BY_PATCH, False)
        with building_like(template):
            rebuilt = method(self, dataloader, *args, **kwargs)
        if (
            stateful
            and thread_loader_of(rebuilt) is not None
            and "base_dataloader" in vars(rebuilt)
        ):
            rebuilt.use_stateful_dataloader = True  # save_state/load_state take its state
        if thread_loader_of(rebuilt) is not None and issubclass(
            type(rebuilt), DataLoaderDispatcher
        ):
            _keep_step_states(rebuilt)
        return rebuilt

    rebuild_with_threads.__threadloader_wrapped__ = method  # type: ignore[attr-defined]
    return rebuild_with_threads


def install() -> None:
    """Make ``Accelerator.prepare`` and ``skip_first_batches`` keep ThreadDataLoaders' threads.

    Idempotent and thread-safe; see the module docstring for what it wraps and why.
    """
    global _installed
    with _lock:
        if _installed:
            return
        for name in ("prepare_data_loader", "skip_first_batches"):
            method = getattr(Accelerator, name)
            if not hasattr(method, "__threadloader_wrapped__"):
                setattr(Accelerator, name, _wrap(method))
        _installed = True


install()
