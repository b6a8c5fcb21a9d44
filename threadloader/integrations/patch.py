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
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from threadloader import loader as _loader
from threadloader._engine.device_epoch import check_device_args, refuse_prefetch_without_device
from threadloader._engine.options import check_helpers_type, check_log_every
from threadloader.integrations import _divert
from threadloader.isolation.helper_source import check_isolation

__all__ = ["is_patched", "patch", "patched", "unpatch"]

OPTION_NAMES = _divert.OPTION_NAMES


def _check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate patch options once, at ``patch()``, rather than at every diverted build."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"patch() got unexpected option(s) {', '.join(unknown)}")
    check_isolation(options.get("isolation"))
    helpers = options.get("helpers")
    if helpers is not None:
        check_helpers_type(helpers)
        if helpers < 1:
            raise ValueError(f"helpers must be a positive int, got {helpers!r}")
        if options.get("isolation") in ("threads",):
            raise ValueError("helpers needs isolation='process' or 'auto' (the default)")
    check_device_args(options.get("device"), options.get("device_prefetch"))
    refuse_prefetch_without_device(options.get("device"), options.get("device_prefetch"))
    check_log_every(options.get("log_every_s"))
    if not isinstance(options.get("save_worker_rng", False), bool):
        raise TypeError("save_worker_rng must be a bool")
    return {k: v for k, v in options.items() if v is not None and v is not False}


def patch(
    *,
    isolation: str | None = None,
    helpers: int | None = None,
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
        isolation: ``isolation=`` for diverted loaders with workers (``"process"``: helper
            processes run the worker threads; ``"threads"``: never; None: the loader's
            default, ``"auto"``). Loaders with ``num_workers=0`` get the default.
        helpers: ``helpers=`` for diverted loaders with workers whose isolation is
            ``"process"`` or ``"auto"``, at most their ``num_workers``.
        device: ``device=`` for diverted loaders: batches arrive on this device.
        device_prefetch: ``device_prefetch=`` for diverted loaders; needs ``device``.
        log_every_s: ``log_every_s=`` for diverted loaders: a throughput line at most this often.
        save_worker_rng: ``save_worker_rng=`` for diverted loaders with workers.

    Raises:
        ValueError: an option ``ThreadDataLoader`` would reject (unknown isolation mode,
            ``helpers`` below 1 or with ``isolation="threads"``, ``log_every_s`` not a
            positive number, ``device_prefetch`` without ``device`` or < 1, bad device).
        RuntimeError: ``device`` names a CUDA device and CUDA is not available.
        TypeError: ``save_worker_rng`` is not a bool, or ``helpers`` is not an int.
    """
    options = _check_options(
        {
            "isolation": isolation,
            "helpers": helpers,
            "device": device,
            "device_prefetch": device_prefetch,
            "log_every_s": log_every_s,
            "save_worker_rng": save_worker_rng,
        }
    )
    _push(options)


def _push(options: dict[str, Any]) -> object:
    _divert.install_hook()
    token = object()
    with _divert.lock:
        _divert.layers.append((token, options))
    _install_integrations()
    return token


def _pop(token: object) -> None:
    with _divert.lock:
        for i in range(len(_divert.layers) - 1, -1, -1):
            if _divert.layers[i][0] is token:
                del _divert.layers[i]
                return


def unpatch() -> None:
    """Undo the latest ``patch()``: with none left active, DataLoader builds DataLoader again.

    A no-op when no patch is active. Loaders already built keep their class.
    """
    with _divert.lock:
        if _divert.layers:
            _divert.layers.pop()


def is_patched() -> bool:
    """Whether a ``patch()`` is active now.

    Returns:
        True while at least one ``patch()`` or ``patched()`` block is in effect.
    """
    return bool(_divert.layers)


@contextlib.contextmanager
def patched(
    *,
    isolation: str | None = None,
    helpers: int | None = None,
    device: str | int | torch.device | None = None,
    device_prefetch: int | None = None,
    log_every_s: float | None = None,
    save_worker_rng: bool = False,
) -> Iterator[None]:
    """``patch()`` for the duration of a ``with`` block, undone on exit (also on an exception).

    Args:
        isolation: as ``patch``.
        helpers: as ``patch``.
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
            "helpers": helpers,
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


def _install_integrations(loader: object = None) -> None:
    """Hook libraries already imported that rebuild loaders (Accelerate).

    Also run by every ThreadDataLoader's ``__init__`` (``loader.BUILT_HOOKS``), so that
    ``accelerator.prepare(ThreadDataLoader(...))`` keeps the threads with no patch and no import
    of ours: a script imports Accelerate before it builds the loader it prepares.
    """
    if "accelerate.accelerator" in sys.modules:
        from threadloader.integrations import accelerate

        accelerate.install()


_loader.BUILT_HOOKS.append(_install_integrations)
