"""``threadloader.patch()``: code that builds ``torch.utils.data.DataLoader`` gets a ThreadDataLoader.

Most training code never constructs a loader where a user could change the import: Hugging
Face ``Trainer``, Accelerate's ``prepare``, timm's ``create_loader`` build theirs inside a library,
from a name bound when that library was imported. So the patch does not replace module
attributes (a name bound before the patch would keep the original); it diverts construction:

- ``DataLoader.__new__`` is given a hook. While a patch is active, a call of the class
  ``torch.utils.data.DataLoader`` itself, reached through any name (``torch.utils.data.DataLoader``,
  ``torch.utils.data.dataloader.DataLoader``, ``from torch.utils.data import DataLoader`` before or
  after the patch), builds a ``ThreadDataLoader`` from the same arguments. So does torchdata's
  ``StatefulDataLoader`` (ThreadDataLoader has its ``state_dict`` / ``load_state_dict`` and
  accepts ``snapshot_every_n_steps``).
- ``isinstance(loader, DataLoader)`` stays true (ThreadDataLoader subclasses the real
  DataLoader, which is never replaced); ``type(loader)`` is ``ThreadDataLoader``.
  ``isinstance(loader, StatefulDataLoader)`` is false for a diverted StatefulDataLoader.
- Subclasses of DataLoader (``class MyLoader(DataLoader)``), defined before or after the patch,
  are built as themselves, with worker processes: their methods were written for torch's
  iterator, so replacing their base class under them is not safe. What a subclass gets does not
  depend on when it was defined. ``ThreadDataLoader`` and its subclasses are built as
  themselves with their own arguments; the patch's options apply only to diverted builds.
- Arguments torch would reject are rejected with torch's message (``__init__`` is torch's);
  only an unexpected keyword's ``TypeError`` names ``ThreadDataLoader.__init__``.

The hook stays on the class after the last ``unpatch()`` and then passes every call through to
``object.__new__``: CPython cannot give a class back its original constructor slot once
``__new__`` was assigned (``del DataLoader.__new__`` leaves ``DataLoader(dataset)`` raising
``TypeError: object.__new__() takes exactly one argument``). Behaviour after ``unpatch()`` is
torch's; the cost is one Python call per DataLoader built.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import dataloader as _torch_dataloader

from threadloader._device import check_device_args
from threadloader._isolation import check_isolation
from threadloader.loader import ThreadDataLoader

__all__ = ["is_patched", "patch", "patched", "unpatch"]

_DataLoader: Any = _torch_dataloader.DataLoader  # the real class, never replaced
_SIGNATURE = inspect.signature(ThreadDataLoader.__init__)
#: ThreadDataLoader's keyword-only options a patch may set as defaults for diverted builds.
OPTION_NAMES = ("isolation", "device", "device_prefetch", "log_every_s", "save_worker_rng")
_STATEFUL_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"

_lock = threading.RLock()
_layers: list[tuple[object, dict[str, Any]]] = []  # (token, options) of each active patch
_local = threading.local()  # .templates: options of loaders Accelerate is rebuilding (this thread)
_hook_installed = False
#: Called with every ThreadDataLoader built while a patch or template is active (``--report``).
_build_listeners: list[Callable[[ThreadDataLoader[Any], str], None]] = []


def _check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate patch options once, at ``patch()``, rather than at every diverted build."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"patch() got unexpected option(s) {', '.join(unknown)}")
    check_isolation(options.get("isolation"))
    check_device_args(options.get("device"), options.get("device_prefetch"))
    log_every_s = options.get("log_every_s")
    if log_every_s is not None and not log_every_s > 0:
        raise ValueError(f"log_every_s must be a positive number of seconds, got {log_every_s}")
    if not isinstance(options.get("save_worker_rng", False), bool):
        raise TypeError("save_worker_rng must be a bool")
    return {k: v for k, v in options.items() if v is not None and v is not False}


def _current_options() -> dict[str, Any] | None:
    """The options diverted builds get in this thread now; None when nothing is diverted."""
    templates = getattr(_local, "templates", None)
    if templates:
        return templates[-1]
    layers = _layers  # read without the lock: a list's last item is read atomically
    return layers[-1][1] if layers else None


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
    if _build_listeners:
        where = _caller()
        for listener in tuple(_build_listeners):  # another thread may add one
            listener(loader, where)


def _dataloader_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``DataLoader.__new__`` while the hook is installed: divert, else ``object.__new__``."""
    if args or kwargs:  # a call with no arguments is copy/pickle re-creating an instance
        options = _current_options()
        if options is not None:
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
        options = dict(self.__dict__.pop("_threadloader_divert"))
        try:
            bound = _SIGNATURE.bind_partial(self, *args, **kwargs).arguments
        except TypeError:  # ThreadDataLoader.__init__ below raises it, as torch's would
            bound = {}
        workers = bound.get("num_workers", 0)
        if not workers:  # our worker options need workers: a num_workers=0 loader stays valid
            options.pop("isolation", None)
            options.pop("save_worker_rng", None)
        if "isolation" in options:
            try:
                check_isolation(options["isolation"], bound.get("multiprocessing_context"))
            except ValueError as e:
                warnings.warn(
                    f"threadloader.patch: this loader runs without isolation: {e}", stacklevel=3
                )
                options.pop("isolation")
        for name, value in options.items():
            kwargs.setdefault(name, value)
        ThreadDataLoader.__init__(self, *args, **kwargs)
        self.__class__ = ThreadDataLoader  # type: ignore[assignment]


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


def _install_hook() -> None:
    global _hook_installed
    with _lock:
        if not _hook_installed:
            _DataLoader.__new__ = _NewHook()
            _hook_installed = True


def patch(
    *,
    isolation: str | None = None,
    device: str | int | torch.device | None = None,
    device_prefetch: int | None = None,
    log_every_s: float | None = None,
    save_worker_rng: bool = False,
) -> None:
    """Make every ``torch.utils.data.DataLoader(...)`` call build a ``ThreadDataLoader``.

    Whatever name the code calls it by, imported before or after this call; torchdata's
    ``StatefulDataLoader(...)`` too. Subclasses of DataLoader are built as themselves (see the
    module docstring). Patches nest: each ``patch()`` is undone by one ``unpatch()``, and the
    innermost one's options apply. Process-wide and thread-safe.

    Args:
        isolation: ``isolation=`` for diverted loaders with workers (``"process"``: one helper
            process runs the worker threads). Loaders with ``num_workers=0`` get None.
        device: ``device=`` for diverted loaders: batches arrive on this device.
        device_prefetch: ``device_prefetch=`` for diverted loaders; needs ``device``.
        log_every_s: ``log_every_s=`` for diverted loaders: a throughput line at most this often.
        save_worker_rng: ``save_worker_rng=`` for diverted loaders with workers.

    Raises:
        ValueError: an option ``ThreadDataLoader`` would reject (unknown isolation mode,
            ``log_every_s`` <= 0, ``device_prefetch`` without ``device`` or < 1, bad device).
        RuntimeError: ``device`` names a CUDA device and CUDA is not available.
        TypeError: ``save_worker_rng`` is not a bool.
    """
    options = _check_options(
        {
            "isolation": isolation,
            "device": device,
            "device_prefetch": device_prefetch,
            "log_every_s": log_every_s,
            "save_worker_rng": save_worker_rng,
        }
    )
    _push(options)


def _push(options: dict[str, Any]) -> object:
    _install_hook()
    token = object()
    with _lock:
        _layers.append((token, options))
    _install_integrations()
    return token


def _pop(token: object) -> None:
    with _lock:
        for i in range(len(_layers) - 1, -1, -1):
            if _layers[i][0] is token:
                del _layers[i]
                return


def unpatch() -> None:
    """Undo the latest ``patch()``: with none left active, DataLoader builds DataLoader again.

    A no-op when no patch is active. Loaders already built keep their class.
    """
    with _lock:
        if _layers:
            _layers.pop()


def is_patched() -> bool:
    """Whether a ``patch()`` is active now.

    Returns:
        True while at least one ``patch()`` or ``patched()`` block is in effect.
    """
    return bool(_layers)


@contextlib.contextmanager
def patched(
    *,
    isolation: str | None = None,
    device: str | int | torch.device | None = None,
    device_prefetch: int | None = None,
    log_every_s: float | None = None,
    save_worker_rng: bool = False,
) -> Iterator[None]:
    """``patch()`` for the duration of a ``with`` block, undone on exit (also on an exception).

    Args:
        isolation: as ``patch``.
        device: as ``patch``.
        device_prefetch: as ``patch``.
        log_every_s: as ``patch``.
        save_worker_rng: as ``patch``.

    Yields:
        None.

    Raises:
        ValueError, RuntimeError, TypeError: as ``patch``, before the block runs.
    """
    options = _check_options(
        {
            "isolation": isolation,
            "device": device,
            "device_prefetch": device_prefetch,
            "log_every_s": log_every_s,
            "save_worker_rng": save_worker_rng,
        }
    )
    token = _push(options)
    try:
        yield
    finally:
        _pop(token)  # this block's own layer, even if an inner patch() was left active


@contextlib.contextmanager
def building_like(loader: ThreadDataLoader[Any]) -> Iterator[None]:
    """In this thread, divert DataLoader builds to ThreadDataLoaders with ``loader``'s options.

    For integrations that rebuild a loader from its parts (Accelerate's ``prepare``): the
    rebuilt loader keeps the worker threads and every option of the one it was given.
    """
    _install_hook()
    options = {name: getattr(loader, name) for name in OPTION_NAMES}
    options = {k: v for k, v in options.items() if v is not None and v is not False}
    templates = getattr(_local, "templates", None)
    if templates is None:
        templates = _local.templates = []
    templates.append(options)
    try:
        yield
    finally:
        templates.pop()


def _install_integrations() -> None:
    """Hook libraries already imported that rebuild loaders (Accelerate)."""
    if "accelerate.accelerator" in sys.modules:
        from threadloader.integrations import accelerate

        accelerate.install()
