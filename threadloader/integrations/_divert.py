"""The diversion behind ``threadloader.patch()``: a ``DataLoader.__new__`` hook, and in which
threads, with which options, a ``DataLoader(...)`` call builds a ThreadDataLoader.

Two sources of options, the innermost wins: the active ``patch()`` layers (process-wide), and
``building_like(loader)`` (this thread only, while an integration rebuilds ``loader``). See
``threadloader.integrations.patch`` for what is diverted and why construction, not names.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import dataloader as _torch_dataloader

from threadloader._engine.options import options_of
from threadloader.isolation.helper_source import check_isolation
from threadloader.loader import ThreadDataLoader

_DataLoader: Any = _torch_dataloader.DataLoader  # the real class, never replaced
_SIGNATURE = inspect.signature(ThreadDataLoader.__init__)
#: ThreadDataLoader's keyword-only options a patch may set as defaults for diverted builds.
OPTION_NAMES = (
    "isolation",
    "helpers",
    "device",
    "device_prefetch",
    "log_every_s",
    "save_worker_rng",
)
_STATEFUL_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"

lock = threading.RLock()
#: (token, options) of each active ``patch()``, innermost last; changed under ``lock``.
layers: list[tuple[object, dict[str, Any]]] = []
_local = threading.local()  # .templates: options of loaders Accelerate is rebuilding (this thread)
_hook_installed = False
#: Called with every ThreadDataLoader built while a patch or template is active (``--report``).
build_listeners: list[Callable[[ThreadDataLoader[Any], str], None]] = []


#: Set (True) on a loader that a ``patch()`` diverted: code written for torch's DataLoader.
BUILT_BY_PATCH = "_threadloader_built_by_patch"


def _current_options() -> tuple[dict[str, Any], bool] | None:
    """(options, whether from a patch rather than a rebuild) for builds in this thread now;
    None when nothing is diverted."""
    templates = getattr(_local, "templates", None)
    if templates:
        return templates[-1], False
    try:  # without the lock: one read of the last item, which another thread may remove
        return layers[-1][1], True
    except IndexError:
        return None


def _is_stateful_dataloader(cls: type) -> bool:
    module = sys.modules.get(_STATEFUL_MODULE)
    return module is not None and cls is getattr(module, "StatefulDataLoader", None)


def _caller() -> str:
    """``file:line`` of the first frame outside this module: the code that built the loader."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _notify(loader: ThreadDataLoader[Any]) -> None:
    """Tell the listeners about a loader being built (its ``__init__`` has not run yet)."""
    if build_listeners:
        where = _caller()
        for listener in tuple(build_listeners):  # another thread may add one
            listener(loader, where)


def _dataloader_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``DataLoader.__new__`` while the hook is installed: divert, else ``object.__new__``."""
    if args or kwargs:  # a call with no arguments is copy/pickle re-creating an instance
        options = _current_options()
        if options is not None:  # (options, by_patch)
            if cls is _DataLoader:
                diverted = object.__new__(_Diverted)
                diverted.__dict__["_threadloader_divert"] = options
                _notify(diverted)
                return diverted  # type.__call__ runs _Diverted.__init__ with the call's arguments
            if _is_stateful_dataloader(cls):
                diverted = object.__new__(_Diverted)
                diverted.__dict__["_threadloader_divert"] = options
                _notify(diverted)
                # Not an instance of cls, so type.__call__ will not run __init__: run it here.
                _Diverted.__init__(diverted, *args, **kwargs)
                return diverted
            if issubclass(cls, ThreadDataLoader):
                loader = object.__new__(cls)
                _notify(loader)
                return loader
    return object.__new__(cls)


class _Diverted(ThreadDataLoader[Any]):
    """A ThreadDataLoader while a diverted call builds it; ``ThreadDataLoader`` once built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given, by_patch = self.__dict__.pop("_threadloader_divert")
        options = dict(given)
        try:
            bound = _SIGNATURE.bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # ThreadDataLoader.__init__ below raises it, as torch's would
            bound = {}
        workers = bound.get("num_workers", 0)
        if not workers:  # our worker options need workers: a num_workers=0 loader stays valid
            options.pop("isolation", None)
            options.pop("save_worker_rng", None)
            options.pop("helpers", None)
        default = _SIGNATURE.parameters["isolation"].default
        isolation = kwargs.get("isolation", options.get("isolation", default))
        if isolation not in ("process", "auto"):
            options.pop("helpers", None)
        elif "helpers" in options and isinstance(workers, int):
            options["helpers"] = min(options["helpers"], workers)  # at most one per worker
        if "isolation" in options:
            try:
                check_isolation(options["isolation"], bound.get("multiprocessing_context"))
            except ValueError as e:
                warnings.warn(
                    f"threadloader.patch: this loader runs without isolation: {e}", stacklevel=3
                )
                options.pop("isolation")
                options.pop("helpers", None)
        for name, value in options.items():
            kwargs.setdefault(name, value)
        ThreadDataLoader.__init__(self, *args, **kwargs)
        if by_patch:
            self.__dict__[BUILT_BY_PATCH] = True
        self.__class__ = ThreadDataLoader  # type: ignore[assignment]


# Code that reads the arguments of a loader's construction by the constructor's signature (as
# Lightning does to build it again with its own sampler) sees ThreadDataLoader's parameters, so
# that the positional ones (``dataset``) keep their names.
_Diverted.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]


class _NewHook:
    """What ``DataLoader.__new__`` is once hooked: a descriptor, so that
    ``inspect.signature(cls)`` of DataLoader and of subclasses without their own ``__init__``
    stays their ``__init__``'s rather than the hook's ``(*args, **kwargs)``."""

    def __get__(self, instance: object, owner: type) -> _BoundNew:
        return _BoundNew(owner)


class _BoundNew:
    __slots__ = ("owner",)

    def __init__(self, owner: type) -> None:
        self.owner = owner

    def __call__(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        return _dataloader_new(cls, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        owner: Any = self.owner
        return inspect.signature(owner.__init__)


def install_hook() -> None:
    """Give ``DataLoader`` the ``__new__`` hook, once (it stays: see ``integrations.patch``)."""
    global _hook_installed
    with lock:
        if not _hook_installed:
            _DataLoader.__new__ = _NewHook()
            _hook_installed = True


@contextlib.contextmanager
def building_like(loader: ThreadDataLoader[Any]) -> Iterator[None]:
    """In this thread, divert DataLoader builds to ThreadDataLoaders with ``loader``'s options.

    For integrations that rebuild a loader from its parts (Accelerate's ``prepare``): the
    rebuilt loader keeps the worker threads and every option of the one it was given.
    """
    install_hook()
    given = options_of(loader)  # a subclass's own attributes of these names are not options
    options = {name: getattr(given, name) for name in OPTION_NAMES}
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    templates = getattr(_local, "templates", None)
    if templates is None:
        templates = _local.templates = []
    templates.append(options)
    try:
        yield
    finally:
        templates.pop()
