"""The output of ``python -m threadloader compare``: a plain-text table, JSON, a bar chart.

Everything here reads what :func:`threadloader.compare.runner.run_compare` returned and returns text
or data, or writes the plot file; it never prints. The loaders' labels are here too: they are
what the table calls each loader.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from threadloader.compare.inputs import BASELINE, WORKLOADS, CompareError, _one_line

if TYPE_CHECKING:
    from threadloader.compare.results import CompareResult


def _label(key: str, num_workers: int) -> str:
    return {
        "thread": f"ThreadDataLoader(num_workers={num_workers})",
        "dataloader": f"DataLoader(num_workers={num_workers})",
        "dataloader0": "DataLoader(num_workers=0)",
        "torchdata": f"torchdata.nodes ({num_workers} threads)",
        "spdl": f"SPDL DataLoader ({num_workers} threads)",
    }[key]


def _fmt_seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.0f} MiB"


def format_table(result: CompareResult) -> str:
    """Render the comparison as a plain-text table with a header and notes.

    Args:
        result: What :func:`run_compare` returned.

    Returns:
        Lines separated by newlines, without a trailing newline.
    """
    cfg, src = result.config, result.source
    amount = f"{cfg.batches} batches" if cfg.batches is not None else f"{cfg.seconds:g} s"
    lines = [
        f"{src.name}: {src.description}",
        f"batch size {src.batch_size}, {cfg.num_workers} workers, {amount} per run after the "
        f"first batch, {cfg.rounds} round{'s' if cfg.rounds != 1 else ''} (medians)"
        + (f", {cfg.step_ms:g} ms step" if cfg.step_ms else ""),
        "",
    ]
    header = ["loader", "samples/s", "1st batch", "peak PSS", "data wait"]
    header.append(f"vs DataLoader({cfg.num_workers})")
    rows = [header]
    for r in result.loaders:
        ratio = "" if r.ratio_vs_baseline is None else f"{r.ratio_vs_baseline:.2f}x"
        rows.append(
            [
                r.label,
                f"{r.samples_per_s:,.0f}",
                _fmt_seconds(r.first_batch_s),
                _fmt_mib(r.peak_pss_bytes),
                f"{r.data_wait_fraction:.0%}",
                ratio,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    for key, reason in result.skipped.items():
        lines.append(f"not run: {_label(key, cfg.num_workers)}: {reason}")
    ran_out = [r.label for r in result.loaders if any(run.ran_out for run in r.runs)]
    if ran_out:
        lines.append(f"the dataset ran out before the end of the run for: {', '.join(ran_out)}")
    if result.memory_note:
        lines.append(result.memory_note)
    lines.append("peak PSS: of the whole process tree, worker processes included.")
    lines.append(
        f"vs DataLoader({cfg.num_workers}): the median of each round's ratio (loaders of a round "
        "run back to back), not the ratio of the medians."
    )
    lines.append(
        "data wait: share of the loop's time spent blocked in next()"
        + ("." if cfg.step_ms else "; the loop does no other work, try --step-ms 5.")
    )
    if cfg.dataset is None:
        others = "|".join(w for w in WORKLOADS if w != src.name)
        lines.append(
            f"other workloads: --workload {others} (python holds the GIL throughout); "
            "your own dataset: --dataset module:factory."
        )
    return "\n".join(lines)


def to_json(result: CompareResult) -> dict[str, Any]:
    """Return the comparison as JSON-serialisable data.

    Args:
        result: What :func:`run_compare` returned.

    Returns:
        ``{"config": ..., "dataset": ..., "baseline": key, "results": [...], "skipped": {...}}``;
        each result has the medians (``samples_per_s``, ``first_batch_s``, ``peak_pss_bytes``,
        ``data_wait_fraction``, ``ratio_vs_baseline``) and every run under ``runs``.
    """
    cfg, src = result.config, result.source
    config = dataclasses.asdict(cfg)
    config["loaders"] = list(cfg.loaders)
    config.pop("progress")
    config.pop("traceback")
    return {
        "config": config,
        "dataset": {
            "name": src.name,
            "description": src.description,
            "batch_size": src.batch_size,
            "map_style": src.map_style,
        },
        "baseline": BASELINE,
        "results": [
            {
                "loader": r.key,
                "label": r.label,
                "samples_per_s": r.samples_per_s,
                "first_batch_s": r.first_batch_s,
                "peak_pss_bytes": r.peak_pss_bytes,
                "data_wait_fraction": r.data_wait_fraction,
                "ratio_vs_baseline": r.ratio_vs_baseline,
                "runs": [dataclasses.asdict(run) for run in r.runs],
            }
            for r in result.loaders
        ],
        "skipped": dict(result.skipped),
        "memory_note": result.memory_note,
    }


PLOT_NEEDS_MATPLOTLIB = "--plot needs matplotlib: pip install threadloader[compare]"
"""What ``--plot`` says when matplotlib is not installed."""


def check_plot_available() -> None:
    """Fail before any measuring when ``--plot`` cannot work.

    Raises:
        CompareError: If matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise CompareError(PLOT_NEEDS_MATPLOTLIB) from e


def plot_file(path: str) -> str:
    """The file ``--plot path`` writes: ``path``, or, when it has no extension, ``path`` without
    trailing dots plus ``.png``, as matplotlib names it (so the message names the real file)."""
    return path if _extension(path) else path.rstrip(".") + ".png"


def _extension(path: str) -> str:
    return os.path.splitext(path)[1][1:]


def _plot_formats() -> dict[str, str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return FigureCanvasAgg(Figure()).get_supported_filetypes()


def write_plot(result: CompareResult, path: str) -> str:
    """Write a bar chart of samples/s and peak memory per loader to ``path``.

    Args:
        result: What :func:`run_compare` returned.
        path: Output file; the format follows its extension (``.png``, ``.svg``, ...); a name
            without one gets ``.png``.

    Returns:
        The file written (``plot_file(path)``).

    Raises:
        CompareError: If matplotlib is not installed or the file cannot be written.
    """
    path = plot_file(path)
    check_plot_available()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [
        r.label.replace(" (", "\n(").replace("(num_workers", "\n(num_workers")
        for r in result.loaders
    ]
    fig = Figure(figsize=(max(6.0, 1.9 * len(labels)), 6.5), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: no global state, no GUI backend
    speed, memory = fig.subplots(2, 1, sharex=True)
    xs = range(len(labels))
    colors = ["tab:orange" if r.key == "thread" else "tab:blue" for r in result.loaders]
    medians = [r.samples_per_s for r in result.loaders]
    lows = [
        m - min(run.samples_per_s for run in r.runs)
        for m, r in zip(medians, result.loaders, strict=True)
    ]
    highs = [
        max(run.samples_per_s for run in r.runs) - m
        for m, r in zip(medians, result.loaders, strict=True)
    ]
    speed.bar(xs, medians, color=colors, yerr=[lows, highs], capsize=4)
    speed.set_ylabel("samples/s (median, min-max)")
    speed.margins(y=0.15)  # room for the ratio labels above the bars
    for x, r in zip(xs, result.loaders, strict=True):
        if r.ratio_vs_baseline is not None:
            speed.annotate(
                f"{r.ratio_vs_baseline:.2f}x",
                (x, r.samples_per_s),
                ha="center",
                va="bottom",
                xytext=(0, 3),
                textcoords="offset points",
            )
    speed.set_title(
        f"{result.source.name}: batch {result.source.batch_size}, "
        f"{result.config.num_workers} workers"
    )
    peaks = [(r.peak_pss_bytes or 0) / 2**20 for r in result.loaders]
    memory.bar(xs, peaks, color=colors)
    memory.set_ylabel("peak PSS of process tree (MiB)")
    memory.set_xticks(list(xs), labels, fontsize=8)
    try:
        fig.savefig(path, format=_extension(path))
    except (OSError, ValueError) as e:
        raise CompareError(f"cannot write plot {path!r}: {_one_line(e)}") from e
    return path


def plot_path_problem(path: str) -> str | None:
    """Say why ``--plot path`` cannot work, before an expensive run; None when it looks fine.

    The path is checked first, without matplotlib: a folder that does not exist is the same
    mistake whether or not matplotlib is installed. Then matplotlib must be importable, and
    able to write the file's format.

    Args:
        path: Where ``--plot`` would write.

    Returns:
        A one-line reason, or None.
    """
    if not os.path.basename(path.rstrip(".")):
        return f"cannot write plot {path!r}: give a file name such as out.png"
    target = plot_file(path)
    if os.path.isdir(path) or os.path.isdir(target):
        return f"cannot write plot {path!r}: it is a directory; give a file name such as out.png"
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        return f"cannot write plot {path!r}: folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"cannot write plot {path!r}: folder {folder!r} is not writable"
    try:
        check_plot_available()
    except CompareError as e:
        return str(e)
    formats = _plot_formats()
    if _extension(target).lower() not in formats:
        return (
            f"cannot write plot {path!r}: matplotlib cannot write .{_extension(target)} files; "
            f"use one of {', '.join('.' + f for f in sorted(formats))}"
        )
    return None
