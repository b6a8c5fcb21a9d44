"""Helpers that are not forked and the main module: a script runs once, a notebook never fails.

torch forks its workers on Linux, so scripts without ``if __name__ == "__main__":`` and datasets
defined in a notebook cell work with ``DataLoader``. Helpers that are not forked (another
Python thread runs: a progress bar's monitor, a Jupyter kernel's threads) come from a
forkserver, which imports the main script again, or, for a notebook or ``python -c``, imports
nothing, so a class defined there cannot be unpickled. The default ``"auto"`` must then stay in
threads, and an explicit ``isolation="process"`` must say why it cannot start rather than train a
second time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from threadloader.isolation import main_script
from threadloader.isolation.main_script import unguarded_main_script

_REPO = str(Path(__file__).resolve().parents[1])

#: The top of every script: a GIL-bound verdict decided, not measured (as in
#: test_isolation_auto.py), and a thread like tqdm's monitor running before iter().
_PRELUDE = """
import threading, torch
from torch.utils.data import Dataset
from threadloader import ThreadDataLoader
from threadloader.isolation import auto
auto.held_the_gil = lambda stats: True
auto.slowed_the_training = lambda stats: False
auto.MIN_EPOCH_S = auto.MIN_EPOCH_S_SERVER = 0.0
auto.loop_pace = lambda stats: 100.0
print("SCRIPT RAN", flush=True)

class Items(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.tensor(i)

stop = threading.Event()
monitor = threading.Thread(target=stop.wait, daemon=True)
"""

_AUTO_BODY = """
monitor.start()
loader = ThreadDataLoader(Items(), batch_size=4, num_workers=2)
epochs = [[b.tolist() for b in loader] for _ in range(2)]
assert epochs[1] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]], epochs
print("MODE", loader.stats().mode, "|", loader.stats().mode_reason, flush=True)
stop.set()
"""

_PROCESS_BODY = """
monitor.start()
loader = ThreadDataLoader(Items(), batch_size=4, num_workers=2, isolation="process")
print("BATCHES", [b.tolist() for b in loader], flush=True)
stop.set()
"""


def _run(
    tmp_path: Path, body: str, guarded: bool, how: str = "script", prelude: str = _PRELUDE
) -> subprocess.CompletedProcess[str]:
    """Run ``prelude + body`` as a script file, or with ``python -c`` (``how="-c"``)."""
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    script = tmp_path / "train.py"
    script.write_text(prelude + body)
    env = {**os.environ, "PYTHONPATH": f"{_REPO}{os.pathsep}{tmp_path}", "THREADLOADER_ZYGOTE": "0"}
    return subprocess.run(
        [sys.executable, str(script)]
        if how == "script"
        else [sys.executable, "-c", prelude + body],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
        cwd=tmp_path,
    )


def test_auto_leaves_an_unguarded_script_in_threads_and_says_why(tmp_path: Path) -> None:
    proc = _run(tmp_path, _AUTO_BODY, guarded=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("SCRIPT RAN") == 1, proc.stdout
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    assert mode.startswith("MODE threads"), mode
    assert 'has no `if __name__ == "__main__":` block' in mode, mode
    assert "train.py" in mode


def test_auto_moves_a_guarded_script_to_forkserver_helpers(tmp_path: Path) -> None:
    """The check refuses only scripts that would run again: a guarded one still moves (its
    prelude runs again in the forkserver, as with torch's forkserver workers)."""
    proc = _run(tmp_path, _AUTO_BODY, guarded=True)
    assert proc.returncode == 0, proc.stderr
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    assert mode.startswith("MODE process"), mode


def test_auto_leaves_a_dataset_defined_in_an_interactive_main_in_threads(tmp_path: Path) -> None:
    """``python -c`` stands for a notebook: its ``__main__`` has no file to import."""
    proc = _run(tmp_path, _AUTO_BODY, guarded=False, how="-c")
    assert proc.returncode == 0, proc.stderr
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    assert mode.startswith("MODE threads"), mode
    assert "its dataset needs Items, defined in __main__, which helper processes" in mode, mode


def test_auto_moves_an_interactive_main_whose_dataset_is_importable(tmp_path: Path) -> None:
    (tmp_path / "items_module.py").write_text(
        "import torch\nfrom torch.utils.data import Dataset\n"
        "class Items(Dataset):\n"
        "    def __len__(self):\n        return 16\n"
        "    def __getitem__(self, i):\n        return torch.tensor(i)\n"
    )
    prelude = _PRELUDE.replace("class Items(Dataset):", "class Unused(Dataset):")
    prelude += "from items_module import Items\n"
    proc = _run(tmp_path, _AUTO_BODY, guarded=False, how="-c", prelude=prelude)
    assert proc.returncode == 0, proc.stderr
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    assert mode.startswith("MODE process"), mode


def test_process_isolation_refuses_to_run_an_unguarded_script_again(tmp_path: Path) -> None:
    proc = _run(tmp_path, _PROCESS_BODY, guarded=False)
    assert proc.returncode != 0
    assert proc.stdout.count("SCRIPT RAN") == 1, proc.stdout
    assert "BATCHES" not in proc.stdout
    assert "RuntimeError: threadloader: the main script" in proc.stderr, proc.stderr
    assert "would run it again" in proc.stderr and 'isolation="threads"' in proc.stderr


def test_process_isolation_refuses_a_dataset_defined_in_an_interactive_main(
    tmp_path: Path,
) -> None:
    """``python -c`` (a notebook) while another thread runs: the helpers would come from the
    forkserver, which has no main script to import ``Items`` from. Refused before any helper
    starts, naming the class, instead of an ``AttributeError`` from each helper."""
    proc = _run(tmp_path, _PROCESS_BODY, guarded=False, how="-c")
    assert proc.returncode != 0
    assert "BATCHES" not in proc.stdout
    assert "cannot import Items, defined in __main__" in proc.stderr, proc.stderr
    assert 'isolation="threads"' in proc.stderr and "AttributeError" not in proc.stderr


def test_process_isolation_runs_a_guarded_script(tmp_path: Path) -> None:
    proc = _run(tmp_path, _PROCESS_BODY, guarded=True)
    assert proc.returncode == 0, proc.stderr
    assert "BATCHES [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]" in proc.stdout


#: Items that read what the script's main part set at run time: a global, and the default dtype.
_RUN_TIME_STATE = """
import threading, torch
from torch.utils.data import Dataset
from threadloader import ThreadDataLoader
from threadloader.isolation import auto
auto.held_the_gil = lambda stats: True
auto.slowed_the_training = lambda stats: False
auto.MIN_EPOCH_S = auto.MIN_EPOCH_S_SERVER = 0.0
auto.loop_pace = lambda stats: 100.0
SCALE = 1
LOCK = None

class Items(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if LOCK is not None:
            with LOCK:
                pass
        return torch.tensor(float(i * SCALE))

"""

_RUN_TIME_BODY = """
SCALE = 3
torch.set_default_dtype(torch.float64)
LOCK = threading.Lock() if "{lock}" == "lock" else None
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
loader = ThreadDataLoader(
    Items(), batch_size=4, num_workers=2, isolation="{isolation}", multiprocessing_context={context}
)
for epoch in range(2):
    print("EPOCH", [(b.tolist(), str(b.dtype)) for b in loader], flush=True)
print("MODE", loader.stats().mode, "|", loader.stats().mode_reason, flush=True)
stop.set()
"""

_SCALED = "[([0.0, 3.0, 6.0, 9.0], 'torch.float64'), ([12.0, 15.0, 18.0, 21.0], 'torch.float64')]"


def _run_time_state(
    tmp_path: Path, lock: str, isolation: str, context: str | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run the run-time-state script: both epochs give torch's scaled float64 batches; its
    ``MODE`` line."""
    body = _RUN_TIME_BODY.format(lock=lock, isolation=isolation, context=repr(context))
    proc = _run(tmp_path, body, guarded=True, prelude=_RUN_TIME_STATE)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("EPOCH")] == [f"EPOCH {_SCALED}"] * 2, lines
    return proc, next(line for line in lines if line.startswith("MODE"))


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_helpers_see_what_the_script_set_at_run_time_as_forked_workers_do(
    tmp_path: Path, isolation: str
) -> None:
    """A global the guarded part set (from the command line, say) and torch's default dtype:
    torch's forked workers see them; so do helpers from the forkserver, which import the
    script afresh and run only its top level."""
    _, mode = _run_time_state(tmp_path, lock="", isolation=isolation)
    assert mode.startswith("MODE process"), mode


def test_auto_helpers_from_a_named_forkserver_see_what_its_threads_saw(tmp_path: Path) -> None:
    """With ``multiprocessing_context="forkserver"``, ``isolation="auto"`` runs its first epoch
    in threads, which see the global and dtype the guarded part set, then moves: its helpers
    see them too (torch's forkserver workers would not), so the batches do not change with the
    move."""
    _, mode = _run_time_state(tmp_path, lock="", isolation="auto", context="forkserver")
    assert mode.startswith("MODE process"), mode


def test_auto_stays_in_threads_when_a_global_items_read_cannot_reach_helpers(
    tmp_path: Path,
) -> None:
    """A lock in a global the items use cannot be pickled: helpers that are not forked would
    not see it, so the workers stay threads, and stats() names the global."""
    proc, mode = _run_time_state(tmp_path, lock="lock", isolation="auto")
    assert mode.startswith("MODE threads"), mode
    assert "global LOCK, which the dataset's code reads, cannot be sent" in mode, mode
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


def test_process_isolation_warns_of_a_global_items_read_that_cannot_reach_helpers(
    tmp_path: Path,
) -> None:
    """isolation="process" cannot stay in threads: its helpers run without the lock, and a
    RuntimeWarning names it."""
    proc, mode = _run_time_state(tmp_path, lock="lock", isolation="process")
    assert mode.startswith("MODE process"), mode
    assert "RuntimeWarning: threadloader: the main script's global LOCK" in proc.stderr
    assert "train.py" in proc.stderr.split("RuntimeWarning")[0].splitlines()[-1]


def _main_module(
    monkeypatch: pytest.MonkeyPatch, file: str | None = None, spec_name: str | None = None
) -> None:
    main = types.ModuleType("__main__")
    if file is not None:
        main.__file__ = file
    main.__spec__ = (  # type: ignore[assignment]
        None if spec_name is None else types.SimpleNamespace(name=spec_name, origin=file)
    )
    monkeypatch.setitem(sys.modules, "__main__", main)
    main_script._has_main_guard.cache_clear()


@pytest.mark.parametrize(
    ("source", "reruns"),
    [
        ("print('train')\n", True),
        ("def main():\n    pass\nmain()\n", True),
        ("if __name__ == '__main__':\n    print('train')\n", False),
        ("if '__main__' == __name__:\n    print('train')\n", False),
        ("import sys\nif __name__ == '__main__' and sys.argv:\n    print('train')\n", False),
        ("if __name__ in ('__main__',):\n    print('train')\n", False),
        (
            "try:\n    if __name__ == '__main__':\n        print('train')\nfinally:\n    pass\n",
            False,
        ),
        ("class C:\n    if __name__ == '__main__':\n        pass\nprint('train')\n", True),
        ("def f():\n    if __name__ == '__main__':\n        pass\nf()\n", True),  # not top level
        ("if __name__ != '__main__':\n    pass\nprint('train')\n", True),
        ("def broken(:\n", False),  # multiprocessing fails on it itself, and says so
    ],
)
def test_a_script_reruns_without_a_top_level_guard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str, reruns: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    _main_module(monkeypatch, file=str(script))
    assert unguarded_main_script() == (str(script) if reruns else None)


def test_what_multiprocessing_does_not_import_again_never_reruns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unguarded = tmp_path / "train.py"
    unguarded.write_text("print('train')\n")
    _main_module(monkeypatch)  # python -c, an interactive session
    assert unguarded_main_script() is None
    _main_module(monkeypatch, file=str(tmp_path / "pkg" / "__main__.py"), spec_name="pkg.__main__")
    assert unguarded_main_script() is None  # python -m pkg
    ipython = tmp_path / "ipython.py"
    ipython.write_text("print('shell')\n")
    _main_module(monkeypatch, file=str(ipython))
    assert unguarded_main_script() is None
    _main_module(monkeypatch, file=str(unguarded), spec_name="train")  # python -m train
    assert unguarded_main_script() == str(unguarded)


def test_auto_stays_in_threads_when_helpers_cannot_import_the_datasets_module(
    tmp_path: Path,
) -> None:
    """The dataset's class comes from a module the script loaded from a file path (not on
    ``sys.path``): a helper from the forkserver cannot unpickle it. Every epoch still runs,
    in threads, with a warning naming the module."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "items_from_a_path.py").write_text(
        "import torch\nfrom torch.utils.data import Dataset\n"
        "class Items(Dataset):\n"
        "    def __len__(self):\n        return 16\n"
        "    def __getitem__(self, i):\n        return torch.tensor(i)\n"
    )
    body = (
        f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("items_from_a_path", {str(hidden / "items_from_a_path.py")!r})
module = importlib.util.module_from_spec(spec)
sys.modules["items_from_a_path"] = module
spec.loader.exec_module(module)
Items = module.Items
"""
        + _AUTO_BODY
    )
    proc = _run(tmp_path, body, guarded=True)
    assert proc.returncode == 0, proc.stderr
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    assert mode.startswith("MODE threads"), mode
    assert "No module named 'items_from_a_path'" in mode, mode
    assert "could not start helper processes (ModuleNotFoundError" in proc.stderr, proc.stderr


#: A dataset whose code the guarded part changes: a method swapped, a base's attribute set, a
#: global rebound to another function of the script and one to another module's.
_CHANGED_CODE = """
import enum, math

class Base(Dataset):
    scale = 1

class Split(enum.Enum):
    TRAIN = 1

Split.weight = 1  # an attribute, not a member

class Missing:
    pass

class Scaled(Base):
    split = Split.TRAIN
    MISSING = Missing()
    cache = MISSING
    def __len__(self):
        return 4
    def value(self, i):
        return i
    def __getitem__(self, i):
        unset = 100 * self.split.value * Split.weight if Scaled.cache is Scaled.MISSING else 0
        return torch.tensor([self.value(i) * self.scale, TRANSFORM(i), ACT(-2.5), unset])

def tenfold(self, i):
    return i * 10

def double(x):
    return 2 * x

def triple(x):
    return 3 * x

TRANSFORM = double
ACT = math.floor
"""

_CHANGED_BODY = """
monitor.start()
Scaled.value = tenfold
Base.scale = 2
TRANSFORM = triple
ACT = math.ceil
Split.weight = 2
loader = ThreadDataLoader(Scaled(), batch_size=2, num_workers=2, isolation="{isolation}")
print("EPOCHS", [[b.tolist() for b in loader] for _ in range(2)], flush=True)
print("MODE", loader.stats().mode, flush=True)
stop.set()
"""


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_forkserver_helpers_run_the_methods_attributes_and_functions_the_script_set(
    tmp_path: Path, isolation: str
) -> None:
    """The guarded part swapped a method, set a base class's attribute and rebound globals the
    items call: torch's forked workers run them so; helpers from the forkserver, which imports
    the script afresh (its top level defines the old ones), run them so too, in every epoch.
    What the script left alone stays the helper's own object: an Enum member, and a sentinel
    the items compare with ``is``; an attribute set on the Enum class arrives."""
    proc = _run(
        tmp_path,
        _CHANGED_BODY.format(isolation=isolation),
        guarded=True,
        prelude=_PRELUDE + _CHANGED_CODE,
    )
    assert proc.returncode == 0, proc.stderr
    items = [[i * 20, i * 3, -2, 200] for i in range(4)]
    epoch = [items[:2], items[2:]]
    assert f"EPOCHS {[epoch, epoch]}" in proc.stdout.splitlines(), proc.stdout
    assert "MODE process" in proc.stdout, proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


_POSTED = """
class Posted(Dataset):
    post = staticmethod(lambda x: x)
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.tensor(Posted.post(i))
"""

_POSTED_BODY = """
monitor.start()
Posted.post = staticmethod(lambda x: x * 2)
loader = ThreadDataLoader(Posted(), batch_size=2, num_workers=2, isolation="{isolation}")
print("EPOCHS", [[b.tolist() for b in loader] for _ in range(2)], flush=True)
print("MODE", loader.stats().mode, "|", loader.stats().mode_reason, flush=True)
stop.set()
"""


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_a_lambda_the_script_set_on_a_class_is_named_where_helpers_cannot_receive_it(
    tmp_path: Path, isolation: str
) -> None:
    """The guarded part set a lambda on the dataset's class: pickle cannot send it by name, and
    helpers from the forkserver hold the top level's. ``"auto"`` stays in threads, where the
    batches are the script's, saying why; ``"process"`` warns, naming it."""
    proc = _run(
        tmp_path, _POSTED_BODY.format(isolation=isolation), guarded=True, prelude=_PRELUDE + _POSTED
    )
    assert proc.returncode == 0, proc.stderr
    mode = next(line for line in proc.stdout.splitlines() if line.startswith("MODE"))
    if isolation == "auto":
        assert "EPOCHS [[[0, 2], [4, 6]], [[0, 2], [4, 6]]]" in proc.stdout, proc.stdout
        assert mode.startswith("MODE threads") and "Posted.post" in mode, mode
    else:
        warning = "RuntimeWarning: threadloader: the main script's class attribute Posted.post"
        assert warning in proc.stderr, proc.stderr


_VALUED = """
class Valued(Dataset):
    def __len__(self):
        return 4
    def value(self, i):
        return i
    def __getitem__(self, i):
        return torch.tensor(self.value(i))
"""

_MAIN_BLOCK_DEF_BODY = """
monitor.start()
def tenfold(self, i):
    return i * 10
Valued.value = tenfold
loader = ThreadDataLoader(Valued(), batch_size=2, num_workers=2, isolation="{isolation}")
try:
    print("EPOCHS", [[b.tolist() for b in loader] for _ in range(2)], flush=True)
    print("MODE", loader.stats().mode, flush=True)
except AttributeError as exc:
    import traceback
    print("RAISED", " | ".join(traceback.format_exception_only(exc)).replace("\\n", " "), flush=True)
stop.set()
"""


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_a_method_defined_in_the_main_block_is_not_in_forkserver_helpers_and_says_so(
    tmp_path: Path, isolation: str
) -> None:
    """The guarded part defines a function and sets it as a method: a helper that imports the
    script cannot find it by name. ``"auto"`` stays in threads, with the script's batches;
    ``"process"`` raises pickle's error, whose note says why and what to do."""
    body = _MAIN_BLOCK_DEF_BODY.format(isolation=isolation)
    proc = _run(tmp_path, body, guarded=True, prelude=_PRELUDE + _VALUED)
    assert proc.returncode == 0, proc.stderr
    if isolation == "auto":
        assert "EPOCHS [[[0, 10], [20, 30]], [[0, 10], [20, 30]]]" in proc.stdout, proc.stdout
        assert "MODE threads" in proc.stdout, proc.stdout
    else:
        raised = next(line for line in proc.stdout.splitlines() if line.startswith("RAISED"))
        assert "loading Valued.value of the main script in a helper process" in raised, raised
        assert 'what the `if __name__ == "__main__":` block defines is not there' in raised


_DELETED = """
class Numbered(Dataset):
    num = 10

class Renumbered(Numbered):
    num = 1
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return torch.tensor(self.num)
"""

_DELETED_BODY = """
monitor.start()
del Renumbered.num  # the base's is read
loader = ThreadDataLoader(Renumbered(), batch_size=2, num_workers=2, isolation="process")
print("BATCHES", [b.tolist() for b in loader], flush=True)
stop.set()
"""


def test_a_class_attribute_the_script_deleted_is_deleted_in_forkserver_helpers(
    tmp_path: Path,
) -> None:
    """The guarded part deleted a class attribute, so the base class's is read: helpers that
    import the script (whose top level sets it) delete it too, as torch's forked workers see."""
    proc = _run(tmp_path, _DELETED_BODY, guarded=True, prelude=_PRELUDE + _DELETED)
    assert proc.returncode == 0, proc.stderr
    assert "BATCHES [[10, 10]]" in proc.stdout, proc.stdout
