"""What the training script set at run time that helpers not forked from it would not see.

torch's workers are forked from the training process when it iterates: they see every global
the script's ``main()`` set (``SCALE = args.scale``, a tokenizer loaded into a global) and
torch's default dtype as they are then. Helpers from a forkserver or ``spawn`` import the main
script afresh, under another name than ``__main__``, so only its top level runs there; the
zygote is a copy taken when the loader was built. Where the code disagrees with these rules,
the code is wrong.

1. ``capture`` finds the code of the main script that the helpers run: the classes of the
   dataset and what it holds (a ``Subset``'s dataset, a list of datasets, a transform), of
   ``collate_fn`` and of ``worker_init_fn``, where defined in ``__main__``: their methods a
   worker calls by itself (``__getitem__``, ``__iter__``, ``__call__``, ...), those the code
   scanned names (``self.decode``), and the functions and classes of ``__main__`` it names,
   transitively. The globals of ``__main__`` that code reads (``LOAD_GLOBAL``), other than
   modules, functions and classes (the import makes those) and those ``worker_init_fn``
   writes (it runs in each helper too), are pickled by value, with torch's default dtype: a
   ``MainState``. What cannot be scanned counts as nothing found.
2. A value that cannot be pickled, one that takes the total past ``LIMIT_BYTES``, or a tensor
   that is not on the CPU, is left out and named in ``MainState.left_out``, unless the
   script's top level binds it outside its ``__main__`` block and nothing rebinds it (a
   helper's import makes it as this process's did: ``DB = sqlite3.connect(...)``): ``"auto"`` then keeps the workers in threads, where
   they see it; ``"process"`` runs them without it, as torch's forkserver workers would.
3. ``MainState.apply`` runs in the helper after it loaded its spec and before any worker
   starts (``worker_init_fn`` sees the globals too): each global whose value differs from the
   helper's own (by its pickle: one as imported stays the same object) is set in the helper's
   ``__main__`` module and in the namespace its functions read (``runpy`` imports a script in
   a namespace of its own), and torch's default dtype is set.
4. Only for helpers that are not forked from the training process, where the user named no
   ``multiprocessing_context`` (one that names ``forkserver`` or ``spawn`` gets what torch's
   workers get then: the script's top level).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import dis
import functools
import itertools
import pathlib
import pickle
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from threadloader.isolation.capped import Capped, PayloadTooLarge

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
                if _pickles_to(spaces[-1].get(name, _ABSENT), data):
                    continue  # as imported: the same object stays (an `is` check still holds)
                value = pickle.loads(data)
                for space in spaces:
                    space[name] = value
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)


_ABSENT = object()


def _pickles_to(value: Any, data: bytes) -> bool:
    """Whether ``value`` pickles to ``data``."""
    if value is _ABSENT:
        return False
    try:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL) == data
    except Exception:  # noqa: BLE001  # then it differs
        return False


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


def capture(
    roots: Iterable[Any], main: types.ModuleType | None = None, init: Any = None
) -> MainState:
    """The ``MainState`` of ``main`` (this process's ``__main__``) that ``roots`` need (point 1).

    Never raises: what cannot be read or scanned counts as nothing found.

    Args:
        roots: the dataset and ``collate_fn``.
        main: the main module; by default ``sys.modules["__main__"]``.
        init: ``worker_init_fn``: its code is scanned too, and the globals it writes are left
            to it (it runs in each helper, and sets them there as it did here).

    Returns:
        The globals their code reads, pickled, with what could not be.
    """
    main = sys.modules.get(_MAIN) if main is None else main
    dtype = torch.get_default_dtype()
    if main is None:
        return MainState((), dtype)
    space, module = vars(main), main.__name__
    try:
        read, _ = _scan(_main_code([*roots, init], module), space, module)
        _, written = _scan(_main_code([init], module), space, module)
    except Exception:  # noqa: BLE001  # code that cannot be scanned: nothing found
        read, written = set(), set()
    values: list[tuple[str, bytes]] = []
    left_out: list[str] = []
    total = 0
    imported: frozenset[str] | None = None
    for name in sorted(read - written):
        buffer = Capped(LIMIT_BYTES - total)  # stops a large value before it is copied
        try:
            _Pickler(buffer, LIMIT_BYTES - total).dump(space[name])
        except Exception:  # noqa: BLE001  # named in left_out: "auto" stays in threads
            if imported is None:
                imported = _made_by_import(main)
            if name not in imported:
                left_out.append(name)
            continue
        data = buffer.getvalue()
        total += len(data)
        values.append((name, data))
    return MainState(tuple(values), dtype, tuple(left_out))


def _made_by_import(main: types.ModuleType) -> frozenset[str]:
    """The globals the script's top level binds, outside its ``if __name__ == "__main__":``
    block, and nothing rebinds (the block, or a function's ``global``): a helper's import of
    the script makes them as the training process's did (``DB = sqlite3.connect(...)``)."""
    try:
        tree = ast.parse(pathlib.Path(main.__file__ or "").read_text())
    except Exception:  # noqa: BLE001  # no source to read (a notebook, python -c): none
        return frozenset()
    top: set[str] = set()
    rebound: set[str] = set()
    for node in tree.body:
        (rebound if _is_main_guard(node) else top).update(_bound(node))
    for child in ast.walk(tree):
        if isinstance(child, ast.Global):
            rebound.update(child.names)
    return frozenset(top - rebound)


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    constants = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and constants == {"__main__"}


def _bound(node: ast.AST) -> set[str]:
    """The names ``node`` binds at its own level (not inside functions and classes)."""
    names: set[str] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if isinstance(current, ast.Name) and isinstance(current.ctx, ast.Store):
            names.add(current.id)
        elif isinstance(current, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in current.names)
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(current.name)
            continue
        if not isinstance(current, ast.Lambda):
            pending.extend(ast.iter_child_nodes(current))
    return names


class _Pickler(pickle.Pickler):
    """Refuses a tensor beyond ``limit`` bytes, or off the CPU, before torch copies it whole
    into a buffer of its own (which ``Capped`` would see only afterwards)."""

    def __init__(self, file: Any, limit: int) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._limit = limit

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise PayloadTooLarge(f"a global holds a tensor on {obj.device}")
            if obj.untyped_storage().nbytes() > self._limit:
                raise PayloadTooLarge(f"a global's tensor exceeds {self._limit / 1e6:.3g} MB")
        return NotImplemented


def _defined_in(obj: Any, module: str) -> bool:
    try:
        return getattr(obj, "__module__", None) == module
    except Exception:  # noqa: BLE001  # an object whose attributes raise: not the script's
        return False


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
        with contextlib.suppress(Exception):  # an object whose attributes raise: skipped
            if isinstance(obj, (types.FunctionType, type)):
                if _defined_in(obj, module):
                    found.append(obj)
                continue
            if isinstance(obj, types.ModuleType):
                continue
            if _defined_in(type(obj), module):
                found.append(type(obj))
            if depth < _MAX_DEPTH:
                queue.extend((child, depth + 1) for child in _children(obj))
    return found


def _children(obj: Any) -> list[Any]:
    """What the walk looks at inside ``obj``."""
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args[:_MAX_ELEMENTS], *_first(obj.keywords.values())]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, (list, tuple)):
        return list(obj[:_MAX_ELEMENTS])
    if isinstance(obj, dict):
        return _first(obj.values())
    if isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)) or obj is None:
        return []
    attributes = getattr(obj, "__dict__", None)
    return _first(attributes.values(), _MAX_ELEMENTS * 4) if isinstance(attributes, dict) else []


def _first(values: Iterable[Any], count: int = _MAX_ELEMENTS) -> list[Any]:
    return list(itertools.islice(values, count))


#: What a worker calls on a dataset, or on a transform or sampler it holds, by itself; other
#: methods count once the code scanned names them (``self.decode(...)``).
_ENTRY_METHODS = frozenset(
    {
        "__getitem__",
        "__getitems__",
        "__iter__",
        "__next__",
        "__call__",
        "__len__",
        "__setstate__",
        "__copy__",
        "state_dict",
        "load_state_dict",
    }
)
_READS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_WRITES = frozenset({"STORE_GLOBAL"})
_ATTRIBUTES = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR"})


def _members(cls: type, module: str, names: Iterable[str]) -> Iterator[types.CodeType]:
    """The code of ``cls``'s members named ``names``, defined in ``module``'s classes."""
    for klass in cls.__mro__:
        if not _defined_in(klass, module):
            continue
        for name in names:
            member = vars(klass).get(name)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            functions = [member]
            if isinstance(member, property):
                functions = [member.fget, member.fset]
            for function in functions:
                if isinstance(function, types.FunctionType):
                    yield function.__code__


def _scan(owners: list[Any], space: dict[str, Any], module: str) -> tuple[set[str], set[str]]:
    """The globals of ``space`` (the main module's) that the code of ``owners`` reads, and
    those it writes, following the functions and classes of ``module`` it names and the
    methods of those classes it names; not modules, functions, classes."""
    read: set[str] = set()
    written: set[str] = set()
    classes: list[type] = []
    attributes: set[str] = set(_ENTRY_METHODS)
    done: set[tuple[int, str]] = set()
    codes: list[types.CodeType] = []

    def reach(owner: Any) -> None:
        if isinstance(owner, types.FunctionType):
            if (id(owner), "") not in done:
                done.add((id(owner), ""))
                codes.append(owner.__code__)
        elif isinstance(owner, type) and owner not in classes:
            classes.append(owner)

    for owner in owners:
        reach(owner)
    while True:
        for cls in classes:  # members named since the class was reached
            fresh = [n for n in attributes if (id(cls), n) not in done]
            done.update((id(cls), n) for n in fresh)
            codes.extend(_members(cls, module, fresh))
        if not codes:
            return read, written
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for instruction in dis.get_instructions(code):
            name = instruction.argval
            if instruction.opname in _ATTRIBUTES and isinstance(name, str):
                attributes.add(name)
            elif instruction.opname in _WRITES:
                written.add(name)
            elif instruction.opname in _READS and name in space and not name.startswith("__"):
                value = space[name]
                if isinstance(value, (types.FunctionType, type)):
                    if _defined_in(value, module):
                        reach(value)
                elif not isinstance(value, (types.ModuleType, types.BuiltinFunctionType)):
                    read.add(name)
