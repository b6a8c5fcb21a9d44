"""What the training script set at run time that helpers not forked from it would not see.

torch's workers are forked from the training process when it iterates: they see every global
the script's ``main()`` set (``SCALE = args.scale``, a tokenizer loaded into a global) and
torch's default dtype as they are then. Helpers from a forkserver or ``spawn`` import the main
script afresh, under another name than ``__main__``, so only its top level runs there; the
zygote is a copy taken when the loader was built. Where the code disagrees with these rules,
the code is wrong.

1. ``capture`` finds the code of the main script that the helpers run: the classes of the
   dataset and what it holds (a ``Subset``'s dataset, a list of datasets), ``collate_fn`` and
   ``worker_init_fn``, where defined in ``__main__``, and the functions and classes of
   ``__main__`` that code names, transitively. The globals of ``__main__`` that code reads
   (``LOAD_GLOBAL``), other than modules, functions and classes (the import makes those), are
   pickled by value, with torch's default dtype: a ``MainState``.
2. A value that cannot be pickled, or one that takes the total past ``LIMIT_BYTES``, is left
   out and named in ``MainState.left_out``: ``"auto"`` then keeps the workers in threads, where
   they see it; ``"process"`` runs them without it, as torch's forkserver workers would.
3. ``MainState.apply`` runs in the helper after it loaded its spec and before any worker
   starts (``worker_init_fn`` sees the globals too): each global is set in the helper's
   ``__main__`` module and in the namespace its functions read (``runpy`` imports a script in
   a namespace of its own), and torch's default dtype is set.
4. Only for helpers that are not forked from the training process, where the user named no
   ``multiprocessing_context`` (one that names ``forkserver`` or ``spawn`` gets what torch's
   workers get then: the script's top level).
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import pickle
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from threadloader.isolation.capped import Capped

__all__ = ["LIMIT_BYTES", "MainState", "capture"]

#: The most bytes of globals a helper receives; beyond, the rest is left out (point 2).
LIMIT_BYTES = 64 * 2**20
#: How many objects the walk from the dataset visits at most, and how deep.
_MAX_OBJECTS = 2000
_MAX_DEPTH = 3
#: Elements of a container the walk looks at (a list of datasets, not a list of samples).
_MAX_ELEMENTS = 16

_MAIN = "__main__"


@dataclasses.dataclass(frozen=True)
class MainState:
    """Globals of the main script its helpers' code reads, pickled, and torch's default dtype.

    Attributes:
        values: each global's name and its pickled value.
        default_dtype: ``torch.get_default_dtype()`` in the training process.
        left_out: globals that code reads which could not be sent (point 2).
    """

    values: tuple[tuple[str, bytes], ...]
    default_dtype: torch.dtype
    left_out: tuple[str, ...] = ()

    def apply(self) -> None:
        """Set the globals on this process's ``__main__`` and torch's default dtype (point 3).

        Raises:
            Exception: what unpickling a value raises (a class this process cannot import).
        """
        main = sys.modules.get(_MAIN)
        if main is not None and self.values:
            spaces = _namespaces(main)
            for name, data in self.values:
                value = pickle.loads(data)
                for space in spaces:
                    space[name] = value
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)


def _namespaces(main: types.ModuleType) -> list[dict[str, Any]]:
    """Where the main script's code reads its globals: the module's namespace, and the one its
    functions were made in (``runpy.run_path``, which imports a script as ``__mp_main__``, runs
    it in a namespace of its own and copies the result into the module)."""
    spaces = [vars(main)]
    for value in list(vars(main).values()):
        if not _defined_in(value, main.__name__):
            continue
        functions = [value] if isinstance(value, types.FunctionType) else []
        if isinstance(value, type):
            functions = [f for f in vars(value).values() if isinstance(f, types.FunctionType)]
        for function in functions:
            if all(function.__globals__ is not space for space in spaces):
                spaces.append(function.__globals__)
    return spaces


def capture(roots: Iterable[Any], main: types.ModuleType | None = None) -> MainState:
    """The ``MainState`` of ``main`` (this process's ``__main__``) that ``roots`` need (point 1).

    Args:
        roots: the dataset, ``collate_fn`` and ``worker_init_fn``.
        main: the main module; by default ``sys.modules["__main__"]``.

    Returns:
        The globals their code reads, pickled, with what could not be.
    """
    main = sys.modules.get(_MAIN) if main is None else main
    dtype = torch.get_default_dtype()
    if main is None:
        return MainState((), dtype)
    space = vars(main)
    values: list[tuple[str, bytes]] = []
    left_out: list[str] = []
    total = 0
    for name in sorted(_globals_read(_main_code(roots, main.__name__), space, main.__name__)):
        buffer = Capped(LIMIT_BYTES - total)  # stops a large value before it is copied
        try:
            pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(space[name])
        except Exception:  # noqa: BLE001  # named in left_out: "auto" stays in threads
            left_out.append(name)
            continue
        data = buffer.getvalue()
        total += len(data)
        values.append((name, data))
    return MainState(tuple(values), dtype, tuple(left_out))


def _defined_in(obj: Any, module: str) -> bool:
    return getattr(obj, "__module__", None) == module


def _main_code(roots: Iterable[Any], module: str) -> list[Any]:
    """The classes and functions of ``module`` that ``roots`` are or hold, found by a bounded
    walk through their attributes and the first elements of their containers."""
    found: list[Any] = []
    seen: set[int] = set()
    queue: list[tuple[Any, int]] = [(root, 0) for root in roots if root is not None]
    while queue and len(seen) < _MAX_OBJECTS:
        obj, depth = queue.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (types.FunctionType, type)):
            if _defined_in(obj, module):
                found.append(obj)
            continue
        if isinstance(obj, types.ModuleType):
            continue
        if _defined_in(type(obj), module):
            found.append(type(obj))
        if depth >= _MAX_DEPTH:
            continue
        queue.extend((child, depth + 1) for child in _children(obj))
    return found


def _children(obj: Any) -> Iterator[Any]:
    """What the walk looks at inside ``obj``."""
    if isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args[:_MAX_ELEMENTS]
        yield from list(obj.keywords.values())[:_MAX_ELEMENTS]
    elif isinstance(obj, types.MethodType):
        yield obj.__func__
        yield obj.__self__
    elif isinstance(obj, (list, tuple)):
        yield from obj[:_MAX_ELEMENTS]
    elif isinstance(obj, dict):
        yield from list(obj.values())[:_MAX_ELEMENTS]
    elif isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)) or obj is None:
        return
    else:
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            yield from list(attributes.values())[: _MAX_ELEMENTS * 4]


def _codes_of(obj: Any) -> Iterator[types.CodeType]:
    """The code objects of a function, or of every method of a class's ``module`` bases."""
    if isinstance(obj, types.FunctionType):
        yield obj.__code__
        return
    module = obj.__module__
    for klass in obj.__mro__:
        if klass.__module__ != module:
            continue
        for member in vars(klass).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                yield from (f.__code__ for f in (member.fget, member.fset) if f is not None)
            elif isinstance(member, types.FunctionType):
                yield member.__code__


def _globals_read(code_owners: list[Any], space: dict[str, Any], module: str) -> set[str]:
    """The globals of ``space`` (the main module's) the code of ``code_owners`` reads,
    following functions and classes of ``module`` it names; not modules, functions, classes."""
    names: set[str] = set()
    done: set[int] = set()
    pending = list(code_owners)
    codes: list[types.CodeType] = []
    while pending or codes:
        while pending:
            owner = pending.pop()
            if id(owner) not in done:
                done.add(id(owner))
                codes.extend(_codes_of(owner))
        if not codes:
            break
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for instruction in dis.get_instructions(code):
            if instruction.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
                continue
            name = instruction.argval
            if name not in space or name.startswith("__"):
                continue
            value = space[name]
            if isinstance(value, (types.FunctionType, type)):
                if _defined_in(value, module):
                    pending.append(value)
                continue
            if isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
                continue
            names.add(name)
    return names
