"""What the main script set at run time, for helpers that are not forked from it (main_state).

A script's dataset reads globals its ``main()`` set; helpers from a forkserver import the
script afresh and would see their top-level values. ``capture`` finds the globals that the
dataset's, ``collate_fn``'s and ``worker_init_fn``'s code reads, and only those.
"""

from __future__ import annotations

import functools
import math
import operator
import pickle
import sys
import threading
import types
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, Subset

from threadloader.isolation import main_state
from threadloader.isolation.main_state import MainState, capture

SOURCE = """
import math
import torch
from torch.utils.data import Dataset

SCALE = 1
OFFSET = 0
UNUSED = 1
VOCAB = {}
LOCK = None
BIG = b""
WRITER = None
HANDLE = None
MISSING = object()

def shift(i):
    return i + OFFSET

class Items(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        self.check()
        return shift(i) * SCALE + len(VOCAB) + int(math.sqrt(4))
    def check(self):
        return self.locked
    @property
    def locked(self):
        return LOCK
    def report(self):
        return WRITER

class Opened(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i, default=MISSING):
        return HANDLE.read(i) if default is MISSING else default

def open_handle(worker_id):
    global HANDLE
    HANDLE = open_somewhere()

def open_somewhere():
    return None

def collate(batch):
    return [b for b in batch if b is not BIG]

def init(worker_id, tag):
    return tag
"""


def _script() -> types.ModuleType:
    """A main module as a script defines it, then its main part sets the globals."""
    main = types.ModuleType("__main__")
    exec(compile(SOURCE, "train.py", "exec"), vars(main))  # noqa: S102  # the test's own script
    main.SCALE, main.OFFSET, main.UNUSED = 3, 10, 5
    main.VOCAB = {"a": 1}
    return main


def _values(state: MainState) -> dict[str, Any]:
    return {name: pickle.loads(data) for name, data in state.values}


def test_the_globals_the_datasets_code_reads_are_captured_and_no_others() -> None:
    """Read by any method of the script's class (a worker may call any, through a property, a
    constructor, a name built at run time), and by a helper function of the script; not
    modules, functions or classes (the import makes those), nor globals nobody reads."""
    main = _script()
    state = capture([Subset(main.Items(), [0, 1])], main)
    expected = {"SCALE": 3, "OFFSET": 10, "VOCAB": {"a": 1}, "LOCK": None, "WRITER": None}
    assert _values(state) == expected
    assert state.left_out == ()


def test_a_global_worker_init_fn_writes_is_left_to_it() -> None:
    """It opens a handle into a global in each worker: each helper runs it too, so the
    training process's handle (which cannot be pickled) is not needed there."""
    main = _script()
    main.HANDLE = threading.Lock()  # what worker_init_fn opened in the threads
    state = capture([main.Opened()], main, init=main.open_handle)
    assert "HANDLE" not in _values(state) and state.left_out == ()
    assert "HANDLE" in capture([main.Opened()], main).left_out  # without it: needed


def test_code_that_cannot_be_walked_or_scanned_finds_nothing_rather_than_raising() -> None:
    class Lazy:
        """A handle whose attributes raise until it is opened."""

        def __getattribute__(self, name: str) -> Any:
            raise RuntimeError(f"not opened yet: {name}")

    main = _script()
    main.Items.first = property(operator.itemgetter(0))  # a getter that is no function
    state = capture([main.Items(), Lazy()], main)
    assert state.values


def test_a_large_tensor_is_refused_before_it_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    main = _script()
    monkeypatch.setattr(main_state, "LIMIT_BYTES", 2**20)
    main.VOCAB = torch.zeros(2**20)  # 4 MB
    assert capture([main.Items()], main).left_out == ("VOCAB",)


def test_collate_fn_and_worker_init_fn_reach_their_globals_through_a_partial() -> None:
    main = _script()
    state = capture([[1, 2], main.collate, functools.partial(main.init, tag="x")], main)
    assert _values(state) == {"BIG": b""}


def test_what_cannot_be_pickled_or_is_too_large_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    main = _script()
    main.LOCK = threading.Lock()
    state = capture([main.Items()], main)
    assert state.left_out == ("LOCK",)
    assert "LOCK" not in _values(state)
    monkeypatch.setattr(main_state, "LIMIT_BYTES", 40)
    main.LOCK, main.VOCAB = None, {str(k): k for k in range(100)}
    assert capture([main.Items()], main).left_out == ("VOCAB",)


def test_a_dataset_of_another_module_needs_nothing() -> None:
    class Elsewhere(Dataset[int]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            return int(math.sqrt(i))

    state = capture([Elsewhere()], _script())
    assert state.values == () and state.left_out == ()


def test_applying_sets_the_globals_where_the_scripts_functions_read_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper imports the script with runpy, which runs it in a namespace of its own and
    copies the result into the module: the functions read that namespace."""
    fresh = types.ModuleType("__mp_main__")
    namespace: dict[str, Any] = {"__name__": "__mp_main__"}
    exec(compile(SOURCE, "train.py", "exec"), namespace)  # noqa: S102  # the test's own script
    vars(fresh).update(namespace)
    monkeypatch.setitem(sys.modules, "__main__", fresh)
    script = _script()
    values = capture([script.Items()], script).values
    dtype = torch.get_default_dtype()
    try:
        MainState(values, torch.float64).apply()
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(dtype)
    assert fresh.Items()[1] == (1 + 10) * 3 + 1 + 2
    assert namespace["SCALE"] == 3 and fresh.SCALE == 3


def test_applying_keeps_a_global_that_is_as_imported_the_same_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sentinel made at import, compared with ``is`` (a default argument holds it): set
    again from its pickle it would be another object, and every comparison would fail."""
    fresh = _script()
    sentinel = fresh.MISSING
    monkeypatch.setitem(sys.modules, "__main__", fresh)
    script = _script()
    script.HANDLE = types.SimpleNamespace(read=abs)
    MainState(capture([script.Opened()], script).values, torch.get_default_dtype()).apply()
    assert fresh.MISSING is sentinel and fresh.Opened()[2] == 2


def test_an_instance_of_a_script_class_is_left_out() -> None:
    """Set again in a helper it would be another object than its import made (a sentinel a
    default argument holds, compared with ``is``): "auto" keeps such workers in threads."""
    main = _script()
    main.VOCAB = main.Opened()
    assert capture([main.Items()], main).left_out == ("VOCAB",)


def test_worker_init_fn_as_a_bound_method_leaves_only_its_own_writes() -> None:
    """Its instance (the dataset) is not its code: a global the dataset's code writes (a cache
    filled on first use) is still sent."""
    main = _script()
    code = compile("def fill(self):\n    global SCALE\n    SCALE = 5\n", "train.py", "exec")
    exec(code, vars(main))  # noqa: S102  # the test's own script
    main.Items.fill = main.fill
    main.Items.noop = lambda self, worker_id: None
    main.Items.noop.__module__ = "__main__"
    dataset = main.Items()
    state = capture([dataset], main, init=dataset.noop)
    assert _values(state)["SCALE"] == 3
    assert "SCALE" not in _values(capture([dataset], main, init=main.fill))


def test_the_script_code_helpers_run_is_found_through_the_functions_it_calls() -> None:
    """The dataset's class, the script's function its method calls, ``collate_fn`` and
    ``worker_init_fn`` with what it calls: what a zygote must hold as the script has it now;
    not the script's other functions and classes."""
    main = _script()
    code = main_state.script_code(
        [Subset(main.Items(), [0, 1]), main.collate], main, init=main.open_handle
    )
    names = sorted(obj.__qualname__ for obj in code)
    assert names == ["Items", "collate", "open_handle", "open_somewhere", "shift"]
    assert main_state.script_code([Subset(main.Opened(), [0])], main) == [main.Opened]


def test_changed_class_attributes_are_sent_and_set_and_an_unpicklable_one_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data attributes of the script's classes the zygote names travel pickled and are set on
    the helper's class where they differ, or deleted where deleted; one that cannot be pickled
    (a lock opened on first use) is not sent, nor named: the helper keeps its own."""
    main = _script()
    main.Items.limit = 7
    main.Items.lock = threading.Lock()
    changed = [
        main_state.ClassAttribute(main.Items, "limit"),
        main_state.ClassAttribute(main.Items, "lock"),
        main_state.ClassAttribute(main.Items, "gone", there=False),
    ]
    state = capture([main.Items()], main, attributes=changed)
    assert [(owner, name) for owner, name, _ in state.attributes] == [
        ("Items", "limit"),
        ("Items", "gone"),
    ]
    assert state.left_out == ()
    helper_main = _script()  # the helper's copy of the script, as its fork left it
    helper_main.Items.gone = 1
    monkeypatch.setitem(sys.modules, "__main__", helper_main)
    state.apply()
    assert helper_main.Items.limit == 7 and not hasattr(helper_main.Items, "gone")
