"""Where helper processes come from: this process forked, the zygote, a forkserver, or spawn.

Where the code disagrees with these rules, the code is wrong.

1. When the loader names no ``multiprocessing_context`` (``helper_context``): this process is
   forked when ``iter()`` finds it running one Python thread (``threading`` knows no other):
   the helpers share its pages and get the dataset, ``collate_fn`` and ``worker_init_fn`` as
   they are, nothing pickled, as torch's fork-started workers do. Otherwise the zygote forks
   them (``zygote``: a copy of this process taken when a loader with ``isolation="process"``
   was built, if it ran one thread then, and if the script's classes and functions the helpers
   run are as they were then: ``zygote`` point 5), else a forkserver that preloads the main
   script, threadloader and torch, else ``spawn`` where there is no forkserver or ``TMPDIR`` is
   too long a path for its socket; then the dataset, ``collate_fn`` and ``worker_init_fn`` are
   pickled (``PickledOnce``; once for all the helpers an ``iter()`` starts, unless the pickle
   carries tensors' descriptors, which serve one process each): one copy of the dataset per
   helper. A process running other Python threads is never forked: one of them could hold a
   lock the copy would keep.
2. A ``multiprocessing_context`` the user names is used as given (``fork`` only while this
   process runs one Python thread: ``"process"`` refuses it, ``"auto"`` then stays in threads).
3. Helpers are never started with ``forkserver`` or ``spawn`` for a main script without an
   ``if __name__ == "__main__":`` block: those processes import it again, and it would run
   again in each (``main_script``).
4. A loader with ``isolation="process"`` starts what its helpers will come from when it is
   built (``start_helper_server``): the zygote, else the forkserver, which imports torch while
   the script goes on.
5. ``isolation="auto"`` starts a forkserver only once its measurements say the workers should
   move and this process may not be forked (``warm_forkserver``), and moves an epoch shorter
   than a forkserver's start only once the server is ready (``forkserver_is_ready``): the
   forkserver marks that itself, after its imports (``forkserver_ready``), with a file named
   for its pid in a folder this process passes every forkserver it starts (its own, removed at
   its exit; ``_pass_main_path``). One it started that exited before its mark is not started
   again that way (``forkserver_lost``).
6. A forkserver started here imports the main script before it is ready, with the training
   process's ``sys.path``, as each helper would (``forkserver_main``, preloaded in place of
   ``"__main__"``; ``_pass_main_path``), so its helpers do not each run the script's imports.
   Where that import fails, each helper imports the script itself.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import multiprocessing.util
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterable
from typing import Any

from threadloader.isolation import zygote
from threadloader.isolation.forkserver_process import ready_mark
from threadloader.isolation.main_script import unguarded_main_script

#: Values the loader's ``isolation=`` option accepts.
ISOLATION_MODES = ("auto", "process", "threads", None)
#: The module that marks a forkserver ready once its imports are done (``forkserver_ready``).
_READY_MARK = "threadloader.isolation.forkserver_ready"
#: Modules the forkserver imports after the user's: the helper, its quick exit, its ready mark.
_PRELOAD = ("threadloader.isolation.helper", "threadloader.isolation.forkserver_exit", _READY_MARK)
#: What the forkserver preloads in place of ``"__main__"`` (point 6).
_MAIN_IMPORT = "threadloader.isolation.forkserver_main"


def check_isolation(isolation: object, multiprocessing_context: object = None) -> None:
    """Validate ``ThreadDataLoader(isolation=..., multiprocessing_context=...)``.

    Args:
        isolation: the option's value.
        multiprocessing_context: the loader's context (a name or a context object), if any.

    Raises:
        ValueError: ``isolation`` is not "auto", "process", "threads" or None, or
            ``isolation="process"`` would start helpers with ``fork`` (``"auto"`` forks only
            while this process runs one Python thread, and otherwise stays in threads).
    """
    if isolation not in ISOLATION_MODES:
        raise ValueError(
            f"isolation must be 'auto', 'process', 'threads' or None, got {isolation!r}"
        )
    if isolation == "process" and start_method(multiprocessing_context) == "fork":
        raise ValueError(
            "isolation='process' does not take multiprocessing_context='fork': it forks "
            "helpers from the training process only while that runs no other Python thread "
            "(else from its zygote), as forking a process that runs threads can copy a lock "
            "another thread holds. Pass multiprocessing_context='forkserver' or 'spawn', or "
            "none."
        )


def start_method(multiprocessing_context: object) -> str | None:
    """The start method a loader's ``multiprocessing_context`` (a name or a context) names."""
    if multiprocessing_context is None or isinstance(multiprocessing_context, str):
        return multiprocessing_context
    method = getattr(multiprocessing_context, "get_start_method", lambda: None)()
    return method if isinstance(method, str) else None


def helper_context(
    multiprocessing_context: Any = None, code: Iterable[Any] = (), use_zygote: bool = True
) -> Any:
    """What starts helpers: ``fork``, the zygote, the forkserver, or spawn where there is none.

    Where the user named no context: ``fork`` when this process runs one Python thread (the
    helpers share its pages and see the dataset as it is now, as torch's fork-started workers
    do), else the zygote (``zygote``: a copy of this process taken when a loader was built and
    it ran one Python thread) if one runs that has ``code`` as it is now, else the forkserver,
    which preloads torch and threadloader, or ``spawn`` where the forkserver's socket cannot be
    bound (a long ``TMPDIR``).

    Args:
        multiprocessing_context: the loader's context object or name, if the user gave one.
        code: the main script's classes and functions the helpers run
            (``main_state.script_code``; ``zygote`` point 5).
        use_zygote: False: never the zygote (its copy of the main script lacks what the
            helpers run, ``zygote.StaleScriptCode``): the forkserver or spawn instead.

    Returns:
        A ``fork``, ``forkserver`` or ``spawn`` context, or ``zygote.ZygoteContext()``.

    Raises:
        ValueError: the given context starts processes with ``fork`` and this process runs
            other Python threads.
        RuntimeError: the helpers would be started with ``forkserver`` or ``spawn``, which
            import the main script again, and it has no ``if __name__ == "__main__":`` block
            (``main_script``): it would run again in every helper.
        zygote.StaleScriptCode: with ``use_zygote``, the helpers would come from the zygote,
            which lacks ``code`` as it is now (``zygote`` point 5).
    """
    if start_method(multiprocessing_context) == "fork" and not zygote.may_fork():
        check_isolation("process", multiprocessing_context)
    if multiprocessing_context is None:
        if zygote.may_fork():  # one Python thread: fork this process, as torch's workers are
            return multiprocessing.get_context("fork")
        if use_zygote:
            lacking = zygote.missing(code)
            if lacking:
                raise zygote.StaleScriptCode.of(lacking)
            if zygote.running():
                return zygote.ZygoteContext()
        multiprocessing_context = "forkserver" if _forkserver_can_listen() else "spawn"
    ctx = (
        multiprocessing.get_context(multiprocessing_context)
        if isinstance(multiprocessing_context, str)
        else multiprocessing_context
    )
    method = ctx.get_start_method()
    script = unguarded_main_script() if method in ("forkserver", "spawn") else None
    if script is not None:
        raise RuntimeError(
            f"threadloader: {rerun_reason(script, method)}. Put the script's work under "
            '`if __name__ == "__main__":`, build the loader while the script runs no other '
            'Python thread (helpers are then forked), or pass isolation="threads"'
        )
    if method == "forkserver":
        _preload_in_forkserver(ctx)
    return ctx


def rerun_reason(script: str, method: str) -> str:
    """Why helpers started with ``method`` may not start: they would run ``script`` again."""
    return (
        f'the main script {script} has no `if __name__ == "__main__":` block, and helper '
        f"processes started with {method} would run it again"
    )


def start_helper_server(multiprocessing_context: Any = None, code: Iterable[Any] = ()) -> None:
    """Start what helpers are forked from, without waiting for it to be ready.

    Called when a loader with ``isolation="process"`` is built: the zygote forks now, while the
    script is likely to have one thread still; a forkserver imports torch and threadloader while
    the script goes on (building its model), so the first ``iter()`` forks a helper from a
    server that is ready instead of waiting for those imports. ``isolation="auto"`` starts
    nothing here: it may never need a helper, and a zygote's copy of this process costs memory
    from the moment the training process writes to pages they share.

    Args:
        multiprocessing_context: the loader's context object or name, if the user gave one.
        code: the main script's classes and functions the helpers run: a zygote that lacks
            them is replaced (``zygote`` point 5).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # this process is importing __main__ for multiprocessing: start nothing here
    if multiprocessing_context is None and zygote.ensure_running(code):
        return
    start_forkserver(helper_context(multiprocessing_context, code, use_zygote=False))


def refresh_zygote(multiprocessing_context: Any = None, code: Iterable[Any] = ()) -> None:
    """Replace a running zygote whose copy of the main script is not the script as it is now,
    where this process may fork (``zygote`` point 5), so that ``isolation="auto"``'s helpers can
    come from it. Starts none: ``"auto"`` may never need helpers (``start_helper_server``).

    Args:
        multiprocessing_context: the loader's context object or name, if the user gave one.
        code: the main script's classes and functions the helpers would run.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # this process is importing __main__ for multiprocessing
    if multiprocessing_context is None:
        zygote.ensure_running(code, start=False)


def warm_forkserver(multiprocessing_context: Any = None, code: Iterable[Any] = ()) -> bool:
    """Start the forkserver that helpers would come from now, without waiting for its imports.

    For ``isolation="auto"`` (point 5): called once measurements say the workers should move and
    this process may not be forked, so that the epoch which moves them forks its helpers from a
    server that is ready, instead of waiting while an interpreter imports torch. Nothing starts
    where helpers would be forked from this process or the zygote, or come from spawn.

    Args:
        multiprocessing_context: the loader's context object or name, if the user gave one.
        code: the main script's classes and functions the helpers run (``helper_context``).

    Returns:
        Whether helpers would come from a forkserver, now running or starting.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return False  # this process is importing __main__ for multiprocessing
    try:
        ctx = helper_context(multiprocessing_context, code)
    except (RuntimeError, ValueError):  # no helper may start: nothing to warm
        return False
    if ctx.get_start_method() != "forkserver":
        return False
    if forkserver_is_ready():
        return True
    if forkserver_lost():
        return False  # started again, it would be lost again: helpers wait for their start
    before = _server_pid()
    started = start_forkserver(ctx)
    if started is not None and started != before:
        _warmed.add(started)
    return started is not None


def forkserver_is_ready() -> bool:
    """Whether a forkserver runs with its imports done: a helper asked for now starts at once.

    Known from the mark ``forkserver_ready`` leaves (point 5). A forkserver started without that
    module among its preloads but with threadloader's helper (the user's preload list, kept) is
    taken as ready; one without the helper (started by the user or another library for its own
    processes) is not: each helper would import torch.
    """
    pid = _server_pid()
    if pid is None:
        return False
    if _READY_MARK not in _server_preloads():
        return not forkserver_foreign()
    return _marked(pid)


def forkserver_foreign() -> bool:
    """Whether the forkserver that runs was started without threadloader's helper among its
    preloads (by the user or another library): it never gets ready for helpers."""
    return _server_pid() is not None and _PRELOAD[0] not in _server_preloads()


def forkserver_lost() -> bool:
    """Whether a forkserver ``warm_forkserver`` started exited before it was ready (a preload
    module raised, the out-of-memory killer): it is not started that way again."""
    return any(_exited(pid) and not _marked(pid) for pid in _warmed)


def mark_path(pid: int) -> str | None:
    """The file the forkserver with this pid creates once its imports are done
    (``forkserver_ready``), in this process's folder for such marks; None where there is none
    (no forkserver was started with one)."""
    return ready_mark(_mark_folder[0], pid) if _mark_folder else None


def _marked(pid: int) -> bool:
    path = mark_path(pid)
    return path is not None and os.path.exists(path)


_mark_folder: list[str] = []  # this process's folder for ready marks, made on first use


def _new_mark_folder() -> str | None:
    """This process's folder for forkservers' ready marks: only this process's user can read
    it, and it is removed when this process exits. None if none can be made (a server is then
    never taken as ready: epochs move by the longer rule)."""
    if not _mark_folder:
        try:
            folder = tempfile.mkdtemp(prefix="threadloader-forkserver-")
        except OSError:
            return None
        _mark_folder.append(folder)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return _mark_folder[0]


def start_forkserver(ctx: Any) -> int | None:
    """Start the forkserver if ``ctx`` uses one and none runs, without waiting for its imports.

    It imports the main script as helpers would (``__mp_main__``) before it is ready, so that
    its helpers do not each import it again (``_pass_main_path``).

    Returns:
        The forkserver's pid, or None where ``ctx`` uses none or it could not start.
    """
    if ctx.get_start_method() != "forkserver":
        return None
    _pass_main_path()
    before = _server_pid()
    try:
        multiprocessing.forkserver.ensure_running()
    except OSError:  # iter() tries again, and raises what starting a helper raises
        return None
    pid = _server_pid()
    stale = mark_path(pid) if pid is not None and pid != before else None
    if stale is not None:  # a mark left by a killed server with this pid
        with contextlib.suppress(OSError):
            os.unlink(stale)
    return pid


def _server_pid() -> int | None:
    """The pid of the forkserver multiprocessing started from this process, if it did."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def _server_preloads() -> list[str]:
    """The modules the forkserver preloads (or will, once started): multiprocessing's default
    is ``["__main__"]``."""
    return list(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", ["__main__"]))


#: Forkservers ``warm_forkserver`` started (their pids).
_warmed: set[int] = set()


def _exited(pid: int) -> bool:
    """Whether this process's child ``pid`` has ended (without reaping it: multiprocessing
    reaps its forkserver itself)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True
    except (AttributeError, OSError):  # no waitid here: take it as running
        return False


def _pass_main_path() -> None:
    """Let every forkserver this process starts from now on import the main script before it
    is ready (point 6) and mark itself ready in this process's folder (point 5), however it
    starts: from ``start_forkserver``, or from multiprocessing itself when a helper starts and
    no server runs (again, if one died).

    The server receives only the preparation data's ``main_path`` and ``sys_path``; Python 3.11
    to 3.13 have the path under ``init_main_from_path``, so the server never gets it. For the
    server's start (the data multiprocessing asks for under the name ``"ignore"``), ``main_path``
    carries the path (or, for ``python -m``, the module's name) and ``sys.argv`` for
    ``forkserver_main`` (preloaded in place of ``"__main__"``, whose own import would miss the
    training process's ``sys.path`` and arguments, and a module run with ``-m``), and the
    marks' folder for ``forkserver_ready``. multiprocessing reads ``main_path`` only where
    ``"__main__"`` is preloaded: nothing is added there.
    """
    with _passing_main_path:
        if _main_path_passing:
            return
        original = multiprocessing.spawn.get_preparation_data

        def with_main_path(name: str) -> dict[str, Any]:
            data = original(name)
            if name != "ignore" or "main_path" in data or "__main__" in _server_preloads():
                return data
            given: dict[str, Any] = {
                "ready": _new_mark_folder(),
                "argv": list(data.get("sys_argv", sys.argv)),
            }
            path, module = data.get("init_main_from_path"), data.get("init_main_from_name")
            if path is not None:
                given["path"] = path
            elif module is not None:  # python -m pkg.train
                given["name"] = module
            data["main_path"] = given
            return data

        multiprocessing.spawn.get_preparation_data = with_main_path
        _main_path_passing.append(original)


_main_path_passing: list[Any] = []  # what _pass_main_path replaced, once it did
_passing_main_path = threading.Lock()


def _forkserver_can_listen() -> bool:
    """Whether this platform has a forkserver and it can bind its socket (``AF_UNIX``).

    multiprocessing puts the forkserver's socket in a folder under ``TMPDIR``; a socket path is
    limited to ~100 bytes, so a long ``TMPDIR`` stops the forkserver from starting at all. Where
    the user named no start method, helpers then come from ``spawn``, which needs no socket.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    if _server_pid() is not None:
        return True
    return _socket_path_fits(multiprocessing.util.get_temp_dir())


@functools.cache
def _socket_path_fits(folder: str) -> bool:
    # Bind a socket at a path as long as the forkserver's (``listener-`` and 8 characters).
    path = os.path.join(folder, f"tl-probe-{os.getpid() % 10**8:08d}")
    try:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.bind(path)
    except OSError:
        return False
    os.unlink(path)
    return True


def _preload_in_forkserver(ctx: Any) -> None:
    # The preload list only counts when the forkserver starts; keep what the user asked for.
    if _server_pid() is not None:
        return
    _pass_main_path()
    asked = _server_preloads()
    modules = [_MAIN_IMPORT if name == "__main__" else name for name in asked]
    missing = [name for name in _PRELOAD if name not in modules]
    if missing or modules != asked:
        ctx.set_forkserver_preload([*modules, *missing])
