"""The patch of ``python -m threadloader run`` in the Python processes a script starts itself.

``run`` puts this folder first on ``PYTHONPATH`` and its options in ``THREADLOADER_RUN_PATCH``,
so every Python process started below it (``subprocess``, ``multiprocessing``'s spawn and
forkserver, Lightning's launcher of the other ranks) imports this module at its start, as
``sitecustomize``. Where the variable is set, the process applies the same patch at its first
``DataLoader`` construction (a process that builds none imports nothing of threadloader's, and
none is imported in the middle of another module's import, torch's included); then this module
hands over to the ``sitecustomize`` the process would have imported without it, and leaves its
folder off ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence
    from types import ModuleType

#: The environment variable that carries ``run``'s patch options (JSON) to child processes.
ENV = "THREADLOADER_RUN_PATCH"
FOLDER = os.path.dirname(os.path.abspath(__file__))


def _apply(options: dict[str, Any]) -> None:
    """``patch(**options)``, right after torch's import; a failure warns, never stops the
    process (it runs unpatched, as without ``run``)."""
    try:
        from threadloader.integrations import patch as _patch

        log_every_s = options.get("log_every_s")
        _patch.patch(**options)
        if log_every_s is not None:
            from threadloader.integrations.log_lines import log_to_stderr

            log_to_stderr()
    except Exception as error:  # noqa: BLE001  # named, and the process goes on unpatched
        import warnings

        warnings.warn(
            f"python -m threadloader run could not patch this child process "
            f"({type(error).__name__}: {error}); its DataLoaders are torch's",
            RuntimeWarning,
            stacklevel=1,
        )


class _FirstBuild:
    """``DataLoader.__new__`` until the first construction, which applies the patch (that gives
    ``DataLoader`` its own hook) and is then built through it. A descriptor, as the patch's
    hook is, so that ``inspect.signature(DataLoader)`` stays its ``__init__``'s meanwhile."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = options

    def __get__(self, instance: object, owner: type) -> Any:
        first = self

        class Bound:
            @property
            def __signature__(self) -> Any:
                import inspect

                return inspect.signature(owner.__init__)  # type: ignore[misc]

            def __call__(self, cls: type, *args: Any, **kwargs: Any) -> Any:
                return first.build(cls, *args, **kwargs)

        return Bound()

    def build(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        base = self._cls
        if base.__dict__.get("__new__") is self:
            _apply(self._options)
            if base.__dict__.get("__new__") is self:  # not patched: build torch's as before
                base.__new__ = _plain_new  # type: ignore[assignment]
        return base.__new__(cls, *args, **kwargs)


def _plain_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    return object.__new__(cls)


class _PatchAfterTorch:
    """A ``sys.meta_path`` finder that finds nothing itself: on the first import of ``torch`` it
    wraps the loader that the other finders give, so that once torch's ``__init__`` has run,
    ``DataLoader`` gets a ``_FirstBuild``. (Not an ``importlib.abc`` subclass: every child pays
    this module's imports, and that one imports ``typing``.)"""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once; the finders after it find torch
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        options = self._options

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            _hook_first_build(options)

        loader.exec_module = exec_then_hook
        return spec


def _hook_first_build(options: dict[str, Any]) -> None:
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    cls = getattr(dataloader, "DataLoader", None)
    if isinstance(cls, type) and "__new__" not in cls.__dict__:  # else patched already
        cls.__new__ = _FirstBuild(cls, options)  # type: ignore[assignment]


def _install() -> None:
    raw = os.environ.get(ENV)
    if not raw:
        return
    import json

    try:
        options = json.loads(raw)
    except ValueError:
        return
    if not isinstance(options, dict):
        return
    if "torch" in sys.modules:
        _hook_first_build(options)
    else:
        sys.meta_path.insert(0, _PatchAfterTorch(options))


def _hand_over() -> None:
    """Import the ``sitecustomize`` this folder hides, if any, and drop the folder from
    ``sys.path`` (``PYTHONPATH`` keeps it for the processes this one starts)."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != FOLDER]
    this = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # noqa: F401  # the next one on sys.path
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
    finally:
        # The import that runs this module takes its result from sys.modules: the next one,
        # else this one.
        sys.modules.setdefault("sitecustomize", this)


if __name__ == "sitecustomize":
    _install()
    _hand_over()
