"""``python -m threadloader``: command-line tools.

``compare`` runs ThreadDataLoader against torch's DataLoader (and torchdata.nodes and SPDL when
installed) on a built-in workload or on your own dataset, and prints a table::

    python -m threadloader compare                                   # tensors, 2 workers
    python -m threadloader compare --workload python                 # a GIL-bound dataset
    python -m threadloader compare --workload images --seconds 5 --num-workers 4
    python -m threadloader compare --dataset mypkg.data:make_dataset --batch-size 64 --json

``run`` runs a training script as ``python`` would, with every torch DataLoader it (or a library
it calls: Hugging Face Trainer, Accelerate) builds made a ThreadDataLoader::

    python -m threadloader run train.py --lr 0.1                     # the script's own arguments
    python -m threadloader run --report --isolation process -m mypkg.train

This module only parses arguments and prints; the work is in ``threadloader/compare/`` and
``threadloader/integrations/run.py``. Every input error ends with one line on stderr and exit
status 2; ``run`` exits with the script's status.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from threadloader.compare import runner

__all__ = ["main"]

EXIT_USAGE = 2
"""Exit status for bad input, as argparse uses."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C, as shells report SIGINT."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: error: message (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


_N = TypeVar("_N", int, float)


def _number(
    parse: Callable[[str], _N], accept: Callable[[_N], bool], expected: str
) -> Callable[[str], _N]:
    """An argparse ``type=``: ``parse(text)``, kept when ``accept`` it, else a one-line error."""

    def convert(text: str) -> _N:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return convert


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_positive_float = _number(float, lambda v: 0 < v < math.inf, "a positive number")
_non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a number >= 0")


def _loader_list(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in runner.LOADERS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown loader {unknown[0] if unknown else text!r}; "
            f"choose from {','.join(runner.LOADERS)}"
        )
    return keys


def build_parser() -> argparse.ArgumentParser:
    """Build the ``python -m threadloader`` argument parser.

    Returns:
        The parser, with one subcommand per tool.
    """
    parser = _Parser(prog="python -m threadloader", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    cmp = sub.add_parser(
        "compare",
        help="ThreadDataLoader against DataLoader and other loaders on one dataset",
        description="Run ThreadDataLoader, torch's DataLoader with worker processes and with "
        "num_workers=0, and torchdata.nodes and SPDL when installed, on the same dataset; "
        "rounds interleave the loaders and the table quotes medians.",
    )
    what = cmp.add_mutually_exclusive_group()
    what.add_argument(
        "--workload",
        choices=runner.WORKLOADS,
        default="tensors",
        help="built-in synthetic workload (default: tensors, numpy work that releases the GIL; "
        "python holds it throughout)",
    )
    what.add_argument(
        "--dataset",
        metavar="MODULE:FACTORY",
        help="your dataset: FACTORY() in MODULE returns a map-style or iterable dataset",
    )
    cmp.add_argument(
        "--batch-size",
        type=_positive_int,
        help="batch size (default: the workload's, or 32 for --dataset)",
    )
    amount = cmp.add_mutually_exclusive_group()
    amount.add_argument(
        "--batches",
        type=_positive_int,
        help="batches timed per run, after the first and 2 x num-workers warm-up batches "
        "(at least 10 x num-workers)",
    )
    amount.add_argument(
        "--seconds",
        type=_positive_float,
        help="seconds timed per run, after the first batch (default: 1, long enough for "
        "every loader's start-up to be over: the first batch has its own column)",
    )
    cmp.add_argument(
        "--num-workers",
        type=_positive_int,
        default=2,
        help="worker threads/processes of each parallel loader (default: 2)",
    )
    cmp.add_argument(
        "--rounds",
        type=_positive_int,
        default=3,
        help="times each loader runs, interleaved; the table quotes medians (default: 3)",
    )
    cmp.add_argument(
        "--step-ms",
        type=_non_negative_float,
        default=0.0,
        help="sleep this long after each batch, like a training step waiting on a GPU (default: 0)",
    )
    cmp.add_argument(
        "--loaders",
        type=_loader_list,
        default=runner.LOADERS,
        help=f"comma-separated subset of {','.join(runner.LOADERS)} (default: all)",
    )
    cmp.add_argument(
        "--size",
        choices=("small", "bench"),
        default="small",
        help="built-in workload size: small builds in a second, bench is what bench/ measures",
    )
    cmp.add_argument("--json", action="store_true", help="print JSON instead of the table")
    cmp.add_argument("--plot", metavar="OUT.png", help="also write a bar chart (needs matplotlib)")
    cmp.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    sub.add_parser(
        "run",
        help="run a training script with every torch DataLoader made a ThreadDataLoader",
        add_help=False,  # main() hands everything after "run" to threadloader.integrations.run
    )
    cmp.add_argument(
        "--traceback",
        action="store_true",
        help="show the full traceback when a loader fails on the dataset",
    )
    return parser


def _fail(message: str) -> int:
    sys.stderr.write(f"python -m threadloader compare: error: {message}\n")
    return EXIT_USAGE


def _compare_command(args: argparse.Namespace) -> int:
    config = runner.CompareConfig(
        workload=args.workload,
        dataset=args.dataset,
        batch_size=args.batch_size,
        batches=args.batches,
        seconds=None if args.batches is not None else (args.seconds or 1.0),
        num_workers=args.num_workers,
        rounds=args.rounds,
        step_ms=args.step_ms,
        loaders=args.loaders,
        size=args.size,
        progress=not args.no_progress,
        traceback=args.traceback,
    )
    try:
        if args.plot is not None:  # fail before minutes of measuring, not after
            problem = runner.plot_path_problem(args.plot)
            if problem:
                return _fail(problem)
        result = runner.run_compare(config)
    except runner.CompareError as e:
        return _fail(str(e))
    except KeyboardInterrupt:  # every loader is closed by then; a traceback would be noise
        sys.stderr.write("python -m threadloader compare: interrupted\n")
        return EXIT_INTERRUPTED
    # The results first: a plot that cannot be written must not lose minutes of measuring.
    if args.json:
        print(json.dumps(runner.to_json(result), indent=2))
    else:
        print(runner.format_table(result))
    if args.plot is not None:
        try:
            written = runner.write_plot(result, args.plot)
        except runner.CompareError as e:
            return _fail(str(e))
        if not args.json:
            print(f"plot written to {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m threadloader`` with ``argv``.

    Args:
        argv: Arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success, 2 on bad input, 130 after Ctrl-C; for ``run``, the
        script's.

    Raises:
        SystemExit: From argparse, for ``--help`` (status 0) and unparsable arguments (2); for
            ``run``, the script's own ``sys.exit()``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the script's arguments are not ours to parse
        from threadloader.integrations import run

        return run.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        return _compare_command(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse requires one


if __name__ == "__main__":
    sys.exit(main())
