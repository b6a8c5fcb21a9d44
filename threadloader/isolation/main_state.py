"""What the training script set at run time that helpers not forked from it would not see.

torch's workers are forked from the training process when it iterates: they see every global
the script's ``main()`` set (``SCALE = args.scale``, a tokenizer loaded into a global) and
torch's default dtype as they are then. Helpers from a forkserver or ``spawn`` import the main
script afresh, under another name than ``__main__``, so only its top level runs there; the
zygote is a copy taken when the loader was built. Where the code disagrees with these rules,
the code is wrong.

1. ``capture`` finds the code of the main script that the helpers run: the classes of the
   dataset and what it holds (a ``Subset``'s dataset, a list of datasets, a transform), of
   ``collate_fn`` and of ``worker_init_fn``, where defined in ``__main__``, with all their
   methods, and the functions and classes of ``__main__`` that code names, transitively. The
   globals of ``__main__`` that code reads (``LOAD_GLOBAL``), other than modules, functions and
   classes (the import makes those) and those ``worker_init_fn``'s own code writes (it runs in
   each helper too and sets them there), are pickled by value, with torch's default dtype: a
   ``MainState``. A global holding a function or class under another name than its own
   (``TRANSFORM = flip``, ``ACT = math.ceil``: the script may have bound it at run time) is
   pickled by name where pickle can (not a lambda), and never left out. Code that cannot be
   scanned counts as needing what cannot be sent (``UNSCANNED``).
2. A value that cannot be pickled, one that takes the total past ``LIMIT_BYTES``, a tensor that
   is not on the CPU, or an instance of a class of the script (set again in a helper, it would
   be another object than the one its import made, which a default argument may hold and code
   compare with ``is``), is left out and named in ``MainState.left_out``: ``"auto"`` then keeps
   the workers in threads, where they see it; ``"process"`` runs them without it, as torch's
   forkserver workers would, and warns (``parent._main_state``).
3. ``MainState.apply`` runs in the helper after it loaded its spec and before any worker
   starts (``worker_init_fn`` sees the globals too): each global whose value differs from the
   helper's own (by its pickle, and by the pickle the helper makes of the value unpickled,
   since a helper that imported the script names its classes ``__mp_main__``: one as
   imported stays the same object) is set in the helper's
   ``__main__`` module and in the namespace its functions read (``runpy`` imports a script in
   a namespace of its own), and torch's default dtype is set.
4. Only for helpers that are not forked from the training process, where the user named no
   ``multiprocessing_context`` (with ``isolation="process"``, one that names ``forkserver``
   or ``spawn`` gets what torch's workers get then: the script's top level; ``"auto"``'s
   helpers get the state whatever the context, as its threads see it).
5. Helpers that import the script afresh receive every attribute of the script's classes
   (``script_classes``: nested ones and bases too) but Python's own (``class_attributes``):
   the script may have set one (``Dataset.scale = args.scale``) or swapped a method since its
   top level ran, and a function pickles by name (an ``Enum``'s members and ``_sunder_``
   names excepted: constants its import made), with the names of them all: one of its own
   the script deleted since (``del Dataset.scale``) it deletes (``MainState.whole``).
   Helpers from the zygote receive the data attributes of those classes that changed since
   its fork (``Dataset.scale = 10``, a counter ``__getitem__`` bumps; the zygote names them,
   ``zygote.changed_data``): rebound, deleted, or, for a value that can change in place (a
   class-level dict, list or tensor: anything but a number, string, bytes or a tuple of
   those), whose checksum differs from the one taken at the fork (of its bytes, for an array
   or a tensor; of its pickle otherwise) or could not be taken; a large table nobody changed
   costs a start its checksum, not its pickle. They are pickled under the same rules but
   that an instance of a script class is sent too (a config set on the class; a sentinel
   left as it was pickles as the helper's own and stays that object), and set on the class
   in the helper where they differ, or deleted there where deleted here. One that cannot be
   pickled stays as the helper has it, unnamed (a file or lock a dataset opens on first use
   into a class attribute: the helper opens its own); one beyond the limit is named in
   ``left_out`` (``Dataset.table``). Code attributes are the zygote's concern.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import enum
import functools
import itertools
import pickle
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from threadloader.isolation.capped import Capped, PayloadTooLarge

__all__ = [
    "LIMIT_BYTES",
    "ClassAttribute",
    "MainState",
    "by_name_in",
    "capture",
    "class_attributes",
    "code_of",
    "main_classes",
    "nested_classes",
    "script_classes",
    "script_code",
]

#: What ``MainState.left_out`` names when the script's code could not be scanned (point 1).
UNSCANNED = "(code that could not be scanned)"
#: The most bytes of globals a helper receives; beyond, the rest is left out (point 2).
LIMIT_BYTES = 64 * 2**20
#: How many objects the walk from the dataset visits at most, and how deep.
_MAX_OBJECTS = 2000
_MAX_DEPTH = 3
#: Elements of a container the walk looks at (a list of datasets, not a list of samples).
_MAX_ELEMENTS = 16

_MAIN = "__main__"


class ClassAttribute(NamedTuple):
    """An attribute of a class of the script to send as it is now (point 5)."""

    owner: type
    name: str
    #: False: deleted since the zygote's fork.
    there: bool = True


@dataclasses.dataclass(frozen=True)
class MainState:
    """Globals of the main script its helpers' code reads, pickled, and torch's default dtype.

    Attributes:
        values: each global's name and its pickled value.
        default_dtype: ``torch.get_default_dtype()`` in the training process.
        left_out: globals that code reads which could not be sent (point 2).
        attributes: attributes of the script's classes (point 5): each class's qualified
            name, the attribute's name, its pickled value (None: deleted since).
        whole: for a helper that imports the script, each class whose attributes it receives
            and the names they are under: one of the helper's own not among them was deleted
            by the script since its top level ran.
    """

    values: tuple[tuple[str, bytes], ...]
    default_dtype: torch.dtype
    left_out: tuple[str, ...] = ()
    attributes: tuple[tuple[str, str, bytes | None], ...] = ()
    whole: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def apply(self) -> None:
        """Set the globals on this process's ``__main__`` and torch's default dtype (point 3).

        Raises:
            Exception: what unpickling a value raises (a class this process cannot import).
        """
        main = sys.modules.get(_MAIN)
        if main is not None and self.values:
            spaces = _namespaces(main)
            for name, data in self.values:
                try:
                    value = _other(spaces[-1].get(name, _ABSENT), data)
                except Exception as exc:
                    _add_note(exc, name)
                    raise
                if value is not _ABSENT:
                    for space in spaces:
                        space[name] = value
        for owner, names in self.whole:
            cls: Any = functools.reduce(getattr, owner.split("."), main)
            for name, value in list(vars(cls).items()):
                if name not in names and _received(cls, name, value):
                    delattr(cls, name)  # deleted since the top level ran (``del DS.scale``)
        for owner, attribute, pickled in self.attributes:
            cls = functools.reduce(getattr, owner.split("."), main)
            if pickled is None:
                if attribute in vars(cls):
                    delattr(cls, attribute)
                continue
            try:
                value = _other(vars(cls).get(attribute, _ABSENT), pickled)
                if value is not _ABSENT:
                    setattr(cls, attribute, value)
            except Exception as exc:
                _add_note(exc, f"{owner}.{attribute}")
                raise
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)


_ABSENT = object()


def _add_note(exc: BaseException, name: str) -> None:
    """Say on ``exc``, raised loading ``name`` in a helper, what it was doing and why it may fail
    there: a class or function the script's main part defined is not in the helper's copy."""
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(
            f"threadloader: loading {name} of the main script in a helper process: one that "
            "imports the script runs only its top level, so what the `if __name__ == "
            '"__main__":` block defines is not there; define it at the top level, build the '
            "loader while the script runs one Python thread (helpers are then forked), or pass "
            'isolation="threads"'
        )


def _other(current: Any, data: bytes) -> Any:
    """``data`` unpickled where it is not ``current`` as this process has it, else ``_ABSENT``:
    what is the same stays the same object (an ``is`` check, a sentinel, an ``Enum`` member
    still holds). Compared as pickled here too: a helper that imported the script holds its
    classes and functions under ``__mp_main__``, which the training process's pickle names
    ``__main__``."""
    if _pickles_to(current, data):
        return _ABSENT  # as imported, or as the zygote has it
    value = pickle.loads(data)
    if value is current:
        return _ABSENT
    main = sys.modules.get(_MAIN)
    renamed = main is not None and main.__name__ != _MAIN  # an import's: ``__mp_main__``
    if renamed and current is not _ABSENT and _same_pickle(value, current):
        return _ABSENT
    return value


def _same_pickle(one: Any, other: Any) -> bool:
    """Whether two objects pickle alike in this process."""
    try:
        return pickle.dumps(one, pickle.HIGHEST_PROTOCOL) == pickle.dumps(
            other, pickle.HIGHEST_PROTOCOL
        )
    except Exception:  # noqa: BLE001  # then they differ
        return False


def _pickles_to(value: Any, data: bytes) -> bool:
    """Whether ``value`` pickles to ``data``."""
    if value is _ABSENT:
        return False
    buffer = Capped(len(data))  # a larger pickle differs: never copied whole (a memmap)
    try:
        pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001  # then it differs
        return False
    return buffer.getvalue() == data


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
    roots: Iterable[Any],
    main: types.ModuleType | None = None,
    init: Any = None,
    attributes: Iterable[ClassAttribute] = (),
    whole: Iterable[type] = (),
) -> MainState:
    """The ``MainState`` of ``main`` (this process's ``__main__``) that ``roots`` need (point 1).

    Never raises: an object the walk cannot read is skipped, and code that cannot be scanned
    makes ``left_out`` name ``UNSCANNED``.

    Args:
        roots: the dataset and ``collate_fn``.
        main: the main module; by default ``sys.modules["__main__"]``.
        init: ``worker_init_fn``: its code is scanned too, and the globals it writes are left
            to it (it runs in each helper, and sets them there as it did here).
        attributes: attributes of the script's classes to send as they are now (point 5).
            One that cannot be pickled is not sent (a file or lock a dataset opens on first
            use: the helper opens its own), and not named in ``left_out``, unless it is a
            function made outside the class's body (a lambda set at run time); one beyond
            the limit is named there too, as ``Class.name``.
        whole: classes whose ``attributes`` are all a helper that imports the script receives
            of them (``class_attributes``): it deletes those of its own not named there.

    Returns:
        The globals their code reads, pickled, with what could not be.
    """
    main = sys.modules.get(_MAIN) if main is None else main
    dtype = torch.get_default_dtype()
    if main is None:
        return MainState((), dtype)
    space, module = vars(main), main.__name__
    try:
        scanned = _scan(_main_code([*roots, init], module), space, module)
        written = _scan(_own_code(init), space, module).written
    except Exception:  # noqa: BLE001  # code that cannot be scanned: assume it needs anything
        return MainState((), dtype, (UNSCANNED,))
    total = 0

    def pickled(value: Any, instances: bool = False) -> bytes | Exception:
        nonlocal total
        buffer = Capped(LIMIT_BYTES - total)  # stops a large value before it is copied
        try:
            _Pickler(buffer, LIMIT_BYTES - total, module, instances).dump(value)
        except Exception as exc:  # noqa: BLE001  # named in left_out: "auto" stays in threads
            return exc
        data = buffer.getvalue()
        total += len(data)
        return data

    values: list[tuple[str, bytes]] = []
    left_out: list[str] = []
    for name in sorted(scanned.read - written):
        data = pickled(space[name])
        if isinstance(data, bytes):
            values.append((name, data))
        else:
            left_out.append(name)
    for name in sorted(scanned.aliases - written):
        data = pickled(space[name])
        if isinstance(data, bytes):  # else a lambda, say: left as the helper's copy has it
            values.append((name, data))
    sent: list[tuple[str, str, bytes | None]] = []
    attributes = list(attributes)
    for owner, name, there in attributes:
        sending = pickled(vars(owner)[name], instances=True) if there else None
        if sending is None or isinstance(sending, bytes):
            sent.append((owner.__qualname__, name, sending))
        elif isinstance(sending, PayloadTooLarge) or _set_from_outside(owner, vars(owner)[name]):
            left_out.append(f"{owner.__qualname__}.{name}")  # the helper's copy may lack it
    names = tuple(
        (cls.__qualname__, tuple(a.name for a in attributes if a.owner is cls)) for cls in whole
    )
    return MainState(tuple(values), dtype, tuple(left_out), tuple(sent), names)


def _set_from_outside(owner: type, value: Any) -> bool:
    """Whether ``value``, an attribute of ``owner`` that pickle refused, is a function made
    outside the class's body (a lambda the script set on it at run time): the helper's copy of
    the class holds another one, or none."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return isinstance(value, types.FunctionType) and not value.__qualname__.startswith(
        owner.__qualname__ + "."
    )


def script_code(
    roots: Iterable[Any], main: types.ModuleType | None = None, init: Any = None
) -> list[Any]:
    """The classes and functions of the main script that helpers running ``roots`` and ``init``
    run: those the walk of point 1 finds, and those their code names, transitively.

    Helpers not forked from this process find them by name in their own ``__main__``
    (``zygote`` point 5). Never raises: code that cannot be scanned adds nothing.

    Args:
        roots: the dataset and ``collate_fn``.
        main: the main module; by default ``sys.modules["__main__"]``.
        init: ``worker_init_fn``.

    Returns:
        The classes and functions, each once.
    """
    main = sys.modules.get(_MAIN) if main is None else main
    if main is None:
        return []
    module = main.__name__
    found = _main_code([*roots, init], module)
    try:
        return _scan(found, vars(main), module).code
    except Exception:  # noqa: BLE001  # code that cannot be scanned: what the walk found
        return found


def script_classes(code: Iterable[Any], module: str) -> list[type]:
    """The classes of the script ``module`` among ``code``, their bases of the script (a
    subclass reads what its base holds) and the classes nested in those (their code reaches
    them through them), transitively, each once."""
    found: dict[type, None] = {}
    pending = [k for obj in code if isinstance(obj, type) for k in obj.__mro__]
    while pending:
        cls = pending.pop()
        if cls in found or not _defined_in(cls, module):
            continue
        found[cls] = None
        pending.extend(nested_classes(cls))
    return list(found)


def nested_classes(cls: type) -> list[type]:
    """The classes defined in ``cls``'s body (by qualified name: not classes it only holds)."""
    prefix = cls.__qualname__ + "."
    return [
        value
        for value in list(vars(cls).values())
        if isinstance(value, type) and value.__qualname__.startswith(prefix)
    ]


def class_attributes(classes: Iterable[type]) -> list[ClassAttribute]:
    """What helpers that import the script afresh receive of its ``classes`` (point 5:
    ``main_classes``), as ``capture``'s ``attributes``: every attribute but for Python's own
    (``__dict__``, ``__module__``...) and nested classes; their import makes the class as the
    script's top level defines it, where the script may have set or replaced some since
    (``Dataset.scale = args.scale``, a method swapped: sent by name)."""
    return [
        ClassAttribute(cls, name)
        for cls in classes
        for name, value in list(vars(cls).items())
        if _received(cls, name, value)
    ]


def main_classes(code: Iterable[Any], main: types.ModuleType | None = None) -> list[type]:
    """``script_classes`` of ``main`` (this process's ``__main__`` by default)."""
    main = sys.modules.get(_MAIN) if main is None else main
    return [] if main is None else script_classes(code, main.__name__)


def _received(cls: type, name: str, value: Any) -> bool:
    """Whether helpers that import the script receive ``cls``'s attribute ``name``: not a
    nested class, nor Python's own dunder names (a ``__getitem__`` the script replaced is
    one), nor what an ``Enum`` keeps for itself."""
    dunder = name.startswith("__") and name.endswith("__")
    return (
        not isinstance(value, type)
        and (not dunder or isinstance(value, types.FunctionType))
        and not _enum_own(cls, name)
    )


def _enum_own(cls: type, name: str) -> bool:
    """Whether ``name`` is what an ``Enum`` class keeps for itself: a member (a constant its
    import made, which refuses to be set again) or an ``_sunder_`` name."""
    if not issubclass(cls, enum.Enum):
        return False
    return name in cls.__members__ or (name.startswith("_") and name.endswith("_"))


def code_of(runs: Any) -> list[Any]:
    """``script_code`` of what a loader's helpers run: ``runs``' ``dataset``, ``collate_fn``
    and ``worker_init_fn`` (a ``ThreadDataLoader``, or the ``WorkerSpec`` its epoch made)."""
    return script_code((runs.dataset, runs.collate_fn), init=runs.worker_init_fn)


class _Pickler(pickle.Pickler):
    """Refuses a tensor beyond ``limit`` bytes, or off the CPU, before torch copies it whole
    into a buffer of its own (which ``Capped`` would see only afterwards), and, without
    ``instances``, an instance of a class of the script ``module``: set again in a helper it
    would be another object than the one its import made, which a default argument or a class
    attribute may hold and code may compare with ``is`` (a sentinel). A class attribute may
    hold one (point 5: a config the script set on the dataset's class): ``apply`` sets it only
    where it pickles otherwise than the helper's own, so a sentinel stays the same object."""

    def __init__(self, file: Any, limit: int, module: str, instances: bool) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._limit = limit
        self._module = module
        self._instances = instances

    def reducer_override(self, obj: Any) -> Any:
        if (
            not self._instances
            and not isinstance(obj, type)
            and _defined_in(type(obj), self._module)
        ):
            raise TypeError(f"a global holds a {type(obj).__name__}, a class of the script")
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


def by_name_in(obj: Any, module: str) -> str | None:
    """The qualified name ``obj`` is pickled by, where it is code of ``module`` that pickle
    finds by name (a class, a function, a ``functools.lru_cache`` wrapper); else None.

    Instances of such a class are not: they have no ``__qualname__`` of their own.
    """
    try:
        name = getattr(obj, "__qualname__", None)
        if not isinstance(name, str) or getattr(obj, "__module__", None) != module:
            return None
    except Exception:  # noqa: BLE001  # an object whose attributes raise: not the script's
        return None
    return name if callable(obj) else None


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
            if isinstance(obj, (types.FunctionType, type)) or by_name_in(obj, module):
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


_READS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_WRITES = frozenset({"STORE_GLOBAL"})


def _own_code(function: Any) -> list[Any]:
    """``worker_init_fn``'s own function (of a partial, or a bound method), for its writes:
    not what its instance holds."""
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, types.MethodType):
        function = function.__func__
    return [function] if isinstance(function, types.FunctionType) else []


def _functions_of(obj: Any, module: str) -> Iterator[types.FunctionType]:
    """A function (and the one a wrapper such as ``functools.lru_cache`` wraps), or every
    method of a class and of its ``module`` bases."""
    if not isinstance(obj, type):
        for function in (obj, getattr(obj, "__wrapped__", None)):
            if isinstance(function, types.FunctionType):
                yield function
        return
    for klass in obj.__mro__:
        if not _defined_in(klass, module):
            continue
        for member in vars(klass).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            functions = [member.fget, member.fset] if isinstance(member, property) else [member]
            for function in functions:
                if isinstance(function, types.FunctionType):
                    yield function


class _Scanned(NamedTuple):
    """What ``_scan`` finds."""

    #: Globals the code reads, but for modules, functions and classes.
    read: set[str]
    #: Globals the code writes.
    written: set[str]
    #: The owners, and the functions and classes of the script the scan followed.
    code: list[Any]
    #: Globals the code reads that hold a function or class under another name than its own
    #: (``TRANSFORM = flip``, ``ACT = math.ceil``): pickled by name where pickle can.
    aliases: set[str]


def _scan(owners: list[Any], space: dict[str, Any], module: str) -> _Scanned:
    """The globals of ``space`` (the main module's) that the code of ``owners`` reads, and
    those it writes, following the functions and classes of ``module`` it names."""
    read: set[str] = set()
    written: set[str] = set()
    aliases: set[str] = set()
    done: dict[int, Any] = {}
    pending = list(owners)
    codes: list[types.CodeType] = []
    while pending or codes:
        while pending:
            owner = pending.pop()
            if id(owner) not in done:
                done[id(owner)] = owner
                for function in _functions_of(owner, module):
                    codes.append(function.__code__)
                    defaults = [
                        *(function.__defaults__ or ()),
                        *(function.__kwdefaults__ or {}).values(),
                    ]
                    pending.extend(  # def f(x, table=Table): code the script reaches so
                        value
                        for value in defaults
                        if isinstance(value, (types.FunctionType, type))
                        and _defined_in(value, module)
                    )
        if not codes:
            break
        code = codes.pop()
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for instruction in dis.get_instructions(code):
            name = instruction.argval
            if instruction.opname in _WRITES:
                written.add(name)
            elif instruction.opname in _READS and name in space and not name.startswith("__"):
                value = space[name]
                if isinstance(value, (types.FunctionType, type, types.BuiltinFunctionType)):
                    if _defined_in(value, module):
                        pending.append(value)
                    if by_name_in(value, module) != name:
                        aliases.add(name)  # the import binds it otherwise, or not at all
                elif by_name_in(value, module) is not None:
                    pending.append(value)  # a wrapper of the script's: pickled by name too
                elif not isinstance(value, types.ModuleType):
                    read.add(name)
    return _Scanned(read, written, list(done.values()), aliases)
