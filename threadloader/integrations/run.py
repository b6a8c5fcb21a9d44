"""``python -m threadloader run SCRIPT [ARGS...]``: run a training script with the patch applied.

The script runs as ``python SCRIPT ARGS...`` would run it: ``__name__ == "__main__"``, the same
``sys.argv`` (``sys.argv[0]`` the path as given), ``sys.path[0]`` the script's directory, its
exit status (``sys.exit(n)``, 1 after an uncaught exception, whose traceback starts at the
script's own frame, as Python prints it). ``-m MODULE`` runs a module as ``python -m MODULE``.
Every ``torch.utils.data.DataLoader`` the script or its libraries build is a ThreadDataLoader
(see ``threadloader.integrations.patch``); threadloader's options come before the script, every
argument after it is the script's::

    python -m threadloader run train.py --lr 0.1
    python -m threadloader run --isolation process --report -m mypkg.train --epochs 3
    torchrun --nproc_per_node=2 -m threadloader run train.py

Nothing is printed unless asked: ``--report`` prints the ``stats()`` of every loader built to
stderr when the script ends, ``--log-every S`` logs each loader's throughput line at most every
S seconds (to stderr, unless the script configured the ``threadloader`` logger itself).

What it does not reach: processes the script starts itself (``multiprocessing``, ``mp.spawn``)
are the script's; those started by ``spawn`` or ``forkserver`` run unpatched (their loaders have
worker processes), those forked inherit the patch.
"""

from __future__ import annotations

import argparse
import builtins
import importlib.machinery
import io
import logging
import os
import runpy
import sys
import threading
import types
import weakref
import zipfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from threadloader._engine.stats import LoaderStats
from threadloader._primitives.finalizers import Finalizer
from threadloader.integrations import _divert
from threadloader.integrations import patch as _patch
from threadloader.loader import ThreadDataLoader

__all__ = ["main"]

EXIT_USAGE = 2
PROG = "python -m threadloader run"
USAGE = f"{PROG} [OPTIONS] (SCRIPT | -m MODULE) [ARGS...]"
#: Options that take a value, to find where the script's path starts.
_VALUE_OPTIONS = ("--isolation", "--helpers", "--device", "--log-every")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of the options before the script (``--help`` prints it).

    Returns:
        The parser.
    """
    parser = _Parser(
        prog=PROG,
        usage=USAGE,
        description="Run a Python script (or -m MODULE) as python would, with every torch "
        "DataLoader it builds, directly or inside a library (Hugging Face Trainer, Accelerate), "
        "built as a threadloader.ThreadDataLoader. Options go before the script; everything "
        "after the script is the script's.",
    )
    parser.add_argument(
        "--isolation",
        choices=("auto", "process", "threads"),
        help="where each loader's worker threads run (isolation=): 'auto' (the default) moves "
        "them into helper processes when measurements say it pays, 'process' always, "
        "'threads' never",
    )
    parser.add_argument(
        "--helpers",
        type=_positive_int,
        metavar="P",
        help="with --isolation: how many helper processes share a loader's workers (helpers=)",
    )
    parser.add_argument(
        "--device", help="deliver batches on this device, e.g. cuda (device=); default: host"
    )
    parser.add_argument(
        "--log-every",
        type=_positive_seconds,
        metavar="S",
        help="log each loader's throughput and data wait at most every S seconds (stderr)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="print the stats() of every loader to stderr when the script ends",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m")
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(threadloader's options, [SCRIPT, ARGS...] or [-m, MODULE, ARGS...]): the first argument
    that is neither an option nor an option's value starts the script's part."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            return list(argv[:i]), list(argv[i:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in _VALUE_OPTIONS else 1
    return list(argv), []


class _Report:
    """Every ThreadDataLoader built during the run, by weak reference, and what its stats need.

    A loader often dies long before the script ends: built inside ``main()``, or only held by
    its epoch's iterator (``for batch in DataLoader(...)``: the iterator does not keep the loader,
    and the epoch runs on after the loader is gone). So when a loader dies its finalizer keeps
    the parts ``stats()`` reads (the epoch's stats recorder, still updated by a running
    iterator, and the dataset's ``stats`` method when it has one), not the loader.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaders: list[tuple[str, weakref.ref[Any], dict[str, Any]]] = []

    def __call__(self, loader: ThreadDataLoader[Any], where: str) -> None:
        kept: dict[str, Any] = {}  # filled when the loader dies; a Ctrl-C meanwhile is kept
        Finalizer(loader, _keep_stats_parts, loader.__dict__, kept)
        with self.lock:
            self.loaders.append((where, weakref.ref(loader), kept))

    def format(self) -> str:
        with self.lock:
            loaders = list(self.loaders)
        entries: list[tuple[str, LoaderStats | None, int]] = []
        for where, ref, kept in loaders:
            loader = ref()
            parts = loader.__dict__ if loader is not None else kept
            entries.append((where, _stats_of(parts), parts.get("num_workers", 0)))
        iterated = [e for e in entries if e[1] is not None]
        lines = [
            f"threadloader run: {len(entries)} loader(s) built, {len(iterated)} iterated; "
            + "stats of each one's last epoch:"
        ]
        for n, (where, stats, workers) in enumerate(iterated, 1):
            lines.append(f"[loader {n}] built at {where}, num_workers={workers}")
            lines.append(str(stats))
        return "\n".join(lines)


class _DatasetStats:
    """Stands in for a dead loader's dataset: only its ``stats`` method is kept."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats


def _keep_stats_parts(state: dict[str, Any], kept: dict[str, Any]) -> None:
    own = getattr(state.get("dataset"), "stats", None)
    kept.update(
        _stats=state.get("_stats"),
        isolation=state.get("isolation"),
        _epoch_choice=state.get("_epoch_choice"),
        num_workers=state.get("num_workers", 0),
        dataset=_DatasetStats(own) if callable(own) else None,
    )


def _stats_of(parts: dict[str, Any]) -> LoaderStats | None:
    """``ThreadDataLoader.stats()`` from a loader's instance dict (or the parts a dead one left);
    None if it never started an epoch (or never finished ``__init__``)."""
    if parts.get("_stats") is None:
        return None
    try:
        return ThreadDataLoader.stats(types.SimpleNamespace(**parts))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001  # a report must never fail a finished run
        return None


def _fail_like_python(message: str, status: int, program: str) -> int:
    """Print ``program: message`` as the interpreter does for a script it cannot run."""
    sys.stderr.write(f"{program}: {message}\n" if program else f"{message}\n")
    return status


def _script_traceback(error: BaseException) -> types.TracebackType | None:
    """The traceback from the script's first frame on: ours and runpy's frames dropped."""
    tb = error.__traceback__
    while tb is not None and (
        tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy")
        or tb.tb_frame.f_code.co_filename == __file__
    ):
        tb = tb.tb_next
    return tb


def _exec_script(path: str) -> None:
    """Run a source file as ``python PATH`` does: a new ``__main__`` module whose ``__file__`` is
    the absolute path (tracebacks name it so), ``sys.argv[0]`` left as given."""
    absolute = os.path.abspath(path)
    with io.open_code(absolute) as f:
        source = f.read()
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=absolute,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", absolute),
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
        __annotations__={},  # the interpreter's own __main__ starts with one
    )
    code = compile(source, absolute, "exec", dont_inherit=True)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module  # pickle and multiprocessing find the script's names there
    try:
        exec(code, module.__dict__)  # noqa: S102  # what python SCRIPT does
    finally:
        sys.modules["__main__"] = saved


def _run_target(target: list[str]) -> int:
    """Run ``[SCRIPT, ARGS...]`` or ``[-m, MODULE, ARGS...]`` as ``__main__``; its exit status."""
    run: Callable[[], object]
    if target[0].startswith("-m"):
        module = target[0][2:] or (target[1] if len(target) > 1 else "")
        args = target[1:] if target[0] != "-m" else target[2:]
        if not module:
            return _fail_like_python("Argument expected for the -m option", EXIT_USAGE, "")
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m

        def run() -> object:
            return runpy.run_module(module, run_name="__main__", alter_sys=True)

    else:
        path, args = target[0], target[1:]
        if not os.path.exists(path):
            absolute = os.path.abspath(path)
            return _fail_like_python(
                f"can't open file {absolute!r}: [Errno 2] No such file or directory",
                EXIT_USAGE,
                sys.orig_argv[0] if sys.orig_argv else sys.executable,
            )
        sys.argv = [path, *args]
        if os.path.isdir(path) or zipfile.is_zipfile(path):
            del sys.path[0]  # run_path puts the directory or archive there, as python does

            def run() -> object:
                return runpy.run_path(path, run_name="__main__")

        else:
            sys.path[0:1] = [os.path.dirname(os.path.realpath(path))]

            def run() -> object:
                if path.endswith((".pyc", ".pyo")):
                    return runpy.run_path(path, run_name="__main__")
                _exec_script(path)
                return None

    try:
        run()
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001  # printed as python prints it
        tb = _script_traceback(error)
        if tb is None and isinstance(error, ImportError):  # runpy could not find it
            return _fail_like_python(str(error), 1, sys.executable)
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        return 130 if isinstance(error, KeyboardInterrupt) else 1
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``python -m threadloader run ARGV...``.

    Args:
        argv: the arguments after ``run``.

    Returns:
        The script's exit status: 0 when it returns, 1 after an uncaught exception (130 after
        Ctrl-C), 2 when the script does not exist or the options are bad.

    Raises:
        SystemExit: the script's own ``sys.exit()`` (its status and message, unchanged), and
            argparse's for ``--help``.
    """
    options, target = _split(argv)
    parser = build_parser()
    args = parser.parse_args(options)  # "-m" is in target, never in options: listed for --help
    if not target:
        parser.error("missing SCRIPT or -m MODULE")
    try:
        _patch.patch(
            isolation=args.isolation,
            helpers=args.helpers,
            device=args.device,
            log_every_s=args.log_every,
        )
    except (ValueError, RuntimeError, TypeError) as e:
        parser.error(str(e))
    if args.log_every is not None:
        _log_to_stderr()
    report = _Report() if args.report else None
    if report is not None:
        _divert.build_listeners.append(report)
    try:
        return _run_target(target)
    finally:
        if report is not None:
            import gc

            gc.collect()  # loaders in reference cycles: finalized now, not at exit
            sys.stderr.write(report.format() + "\n")
            sys.stderr.flush()


def _log_to_stderr() -> None:
    """Show the ``threadloader`` logger's INFO lines (``log_every_s``) unless the script set it up."""
    logger = logging.getLogger("threadloader")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
