"""``python -m threadloader compare``: ThreadDataLoader against other loaders, on one dataset.

How a comparison runs; where the code disagrees with this, the code is wrong.

1. The dataset is a built-in workload (:mod:`threadloader.workloads`) or whatever a user's
   ``module:factory`` returns: a map-style dataset (``__getitem__`` and ``__len__``) or a
   ``torch.utils.data.IterableDataset``. Every loader reads it with the same batch size, and a
   map-style dataset through the same index order: ``0, 1, 2, ...`` wrapping around at the end,
   so a small dataset still feeds as many batches as were asked for.
2. Each round runs every available loader once, back to back, starting one loader later each
   round, so drift in machine load hits every loader alike. Ratios are taken within a round;
   the table quotes medians over rounds.
3. One run: start the loader and take the first batch (that time is "time to first batch"),
   then time ``--batches`` more batches, or as many as ``--seconds`` allows. samples/s counts the
   timed batches only. The loop measures the time it spends blocked in ``next()``: data wait is
   that time over the timed wall time. ``--step-ms`` sleeps after each batch, standing in for a
   training step that releases the GIL (as waiting on a GPU does); without it the loop does
   nothing but fetch, so data wait is close to 100% for every loader.
4. Peak memory is the largest PSS of the whole process tree (worker processes included) seen
   by :class:`threadloader._memory_probe.PeakSampler` while the loader runs.
5. A loader whose package is not installed, or that cannot read this kind of dataset, is not
   run and is listed with the reason. Everything the user got wrong (a module that does not
   import, a factory that raises, a dataset that fails to load) raises :class:`CompareError`,
   whose message is one line.

This module never prints: it returns text and data; ``threadloader/__main__.py`` prints them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler, default_collate

__all__ = [
    "BASELINE",
    "LOADERS",
    "WORKLOADS",
    "CompareConfig",
    "CompareError",
    "CompareResult",
    "LoaderResult",
    "RunResult",
    "check_plot_available",
    "format_table",
    "load_source",
    "plot_path_problem",
    "run_compare",
    "to_json",
    "write_plot",
]

LOADERS: tuple[str, ...] = ("thread", "dataloader", "dataloader0", "torchdata", "spdl")
"""Loader keys, in the order the table lists them."""

BASELINE = "dataloader"
"""The loader every ratio is taken against: torch's DataLoader with the same num_workers."""

WORKLOADS: tuple[str, ...] = ("tokens", "images", "tensors", "python")
"""Built-in workloads the command accepts (see :mod:`threadloader.workloads`)."""

_DEFAULT_DATASET_BATCH_SIZE = 32
_PSS_INTERVAL_S = 0.05  # each sample reads /proc of every process in the tree: keep it cheap


class CompareError(Exception):
    """A problem with the user's input or dataset; its message is one line, shown as is."""


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What to compare and for how long.

    Attributes:
        workload: A name from :data:`WORKLOADS`; ignored when ``dataset`` is set.
        dataset: ``"module:factory"``; the factory is called with no arguments.
        batch_size: Batch size; ``None`` uses the workload's, or 32 for ``dataset``.
        batches: Timed batches per run (after the first); ``None`` when ``seconds`` is set.
        seconds: Timed seconds per run; ``None`` when ``batches`` is set.
        num_workers: Workers (threads or processes) of every parallel loader.
        rounds: How many times every loader runs.
        step_ms: Milliseconds the loop sleeps after each batch (a stand-in training step).
        loaders: Keys from :data:`LOADERS` to run.
        size: Workload size, ``"small"`` or ``"bench"`` (see :func:`make_workload`).
        progress: Show a tqdm progress bar on stderr (when tqdm is installed).
        traceback: Let exceptions from loading propagate instead of raising CompareError.
    """

    workload: str = "tokens"
    dataset: str | None = None
    batch_size: int | None = None
    batches: int | None = 200
    seconds: float | None = None
    num_workers: int = 2
    rounds: int = 3
    step_ms: float = 0.0
    loaders: tuple[str, ...] = LOADERS
    size: str = "small"
    progress: bool = False
    traceback: bool = False

    def validate(self) -> None:
        """Check every field.

        Raises:
            CompareError: On the first field that is out of range or unknown.
        """
        if self.dataset is None and self.workload not in WORKLOADS:
            raise CompareError(
                f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}"
            )
        if (self.batches is None) == (self.seconds is None):
            raise CompareError("give exactly one of batches and seconds")
        positive: dict[str, float | None] = {
            "batch size": self.batch_size,
            "batches": self.batches,
            "seconds": self.seconds,
            "num_workers": self.num_workers,
            "rounds": self.rounds,
        }
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise CompareError(f"{name} must be positive, got {value}")
        if not self.step_ms >= 0:
            raise CompareError(f"step_ms must be zero or positive, got {self.step_ms}")
        unknown = [k for k in self.loaders if k not in LOADERS]
        if unknown or not self.loaders:
            raise CompareError(
                f"unknown loader {unknown[0] if unknown else '(none)'!r}; "
                f"choose from {', '.join(LOADERS)}"
            )


@dataclasses.dataclass(frozen=True)
class Source:
    """The dataset every loader reads.

    Attributes:
        name: The workload name or the ``module:factory`` string.
        dataset: The dataset.
        batch_size: The batch size every loader uses.
        description: One line saying what an item is.
        map_style: False for an ``IterableDataset``.
        samples_per_item: Samples one item counts for.
    """

    name: str
    dataset: Any
    batch_size: int
    description: str
    map_style: bool
    samples_per_item: int = 1


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run of one loader.

    Attributes:
        round: Round number, from 0.
        batches: Timed batches taken (fewer than asked when the dataset ran out).
        samples: Samples in the timed batches.
        elapsed_s: Wall time of the timed batches.
        samples_per_s: ``samples / elapsed_s``.
        first_batch_s: From creating the loader to holding its first batch.
        wait_s: Time the loop spent blocked in ``next()`` during the timed batches.
        data_wait_fraction: ``wait_s / elapsed_s``.
        peak_pss_bytes: Peak PSS of the process tree during the run; None without psutil.
        start_pss_bytes: PSS of the process tree just before the loader was created.
        ran_out: The dataset ended before the batches or seconds asked for.
    """

    round: int
    batches: int
    samples: int
    elapsed_s: float
    samples_per_s: float
    first_batch_s: float
    wait_s: float
    data_wait_fraction: float
    peak_pss_bytes: int | None
    start_pss_bytes: int | None
    ran_out: bool


@dataclasses.dataclass(frozen=True)
class LoaderResult:
    """Every run of one loader, and their medians.

    Attributes:
        key: A key from :data:`LOADERS`.
        label: What the table calls it.
        runs: One entry per round.
        ratio_vs_baseline: Median over rounds of samples/s over the baseline's in the same
            round; None when the baseline did not run.
    """

    key: str
    label: str
    runs: tuple[RunResult, ...]
    ratio_vs_baseline: float | None

    @property
    def samples_per_s(self) -> float:
        """Median samples/s over rounds."""
        return statistics.median(r.samples_per_s for r in self.runs)

    @property
    def first_batch_s(self) -> float:
        """Median time to first batch over rounds."""
        return statistics.median(r.first_batch_s for r in self.runs)

    @property
    def data_wait_fraction(self) -> float:
        """Median data-wait fraction over rounds."""
        return statistics.median(r.data_wait_fraction for r in self.runs)

    @property
    def peak_pss_bytes(self) -> int | None:
        """Median peak PSS over rounds; None when memory was not measured."""
        peaks = [r.peak_pss_bytes for r in self.runs if r.peak_pss_bytes is not None]
        return int(statistics.median(peaks)) if peaks else None


@dataclasses.dataclass(frozen=True)
class CompareResult:
    """The whole comparison.

    Attributes:
        config: What was asked for.
        source: The dataset that was read.
        loaders: One entry per loader that ran, in :data:`LOADERS` order.
        skipped: Loader key -> why it did not run.
        memory_note: Why memory was not measured, or None when it was.
    """

    config: CompareConfig
    source: Source
    loaders: tuple[LoaderResult, ...]
    skipped: dict[str, str]
    memory_note: str | None


# --------------------------------------------------------------------------------------------
# the dataset


def load_source(config: CompareConfig) -> Source:
    """Build the built-in workload or call the user's factory.

    Args:
        config: A validated config.

    Returns:
        The dataset, its batch size and a description.

    Raises:
        CompareError: If the module does not import, the attribute is missing, the factory
            raises, or what it returns is not a dataset a DataLoader can read.
    """
    if config.dataset is None:
        from threadloader.workloads import make_workload

        try:
            spec = make_workload(config.workload, size=config.size)
        except (ImportError, ValueError, OSError) as e:
            raise CompareError(f"cannot build workload {config.workload!r}: {_one_line(e)}") from e
        return Source(
            name=spec.name,
            dataset=spec.dataset,
            batch_size=config.batch_size or spec.batch_size,
            description=spec.description,
            map_style=True,
            samples_per_item=spec.samples_per_item,
        )
    dataset = _call_factory(config.dataset)
    map_style = _check_dataset(dataset, config.dataset)
    kind = "map-style" if map_style else "iterable"
    size = f", {len(dataset):,} items" if map_style else ""
    return Source(
        name=config.dataset,
        dataset=dataset,
        batch_size=config.batch_size or _DEFAULT_DATASET_BATCH_SIZE,
        description=f"{type(dataset).__name__} from {config.dataset} ({kind}{size})",
        map_style=map_style,
    )


def _call_factory(spec: str) -> Any:
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise CompareError(f"--dataset expects module:factory (e.g. mypkg.data:make), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:
        raise CompareError(f"cannot import module {module_name!r}: {_one_line(e)}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise CompareError(f"{module_name!r} has no attribute {attr_path!r}") from e
    if _is_dataset(obj) and not isinstance(obj, type):
        return obj  # `module:ds` naming a dataset object rather than a factory
    if not callable(obj):
        raise CompareError(f"{spec} is a {type(obj).__name__}, not a factory or a dataset")
    try:
        return obj()
    except (Exception, SystemExit) as e:
        raise CompareError(f"{spec}() raised {_one_line(e)}") from e


def _is_dataset(obj: Any) -> bool:
    if isinstance(obj, IterableDataset):
        return True
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _check_dataset(dataset: Any, spec: str) -> bool:
    """Return True for a map-style dataset, False for an IterableDataset."""
    if isinstance(dataset, IterableDataset):
        return False
    if not _is_dataset(dataset) or isinstance(dataset, str | bytes):
        hint = (
            "; wrap an iterator in a torch.utils.data.IterableDataset"
            if hasattr(dataset, "__iter__")
            else ""
        )
        raise CompareError(
            f"{spec}() returned a {type(dataset).__name__}, not a dataset: need __getitem__ "
            f"and __len__ (map-style) or a torch.utils.data.IterableDataset{hint}"
        )
    try:
        length = len(dataset)
    except Exception as e:
        raise CompareError(f"len() of the dataset from {spec} raised {_one_line(e)}") from e
    if length <= 0:
        raise CompareError(f"the dataset from {spec} is empty")
    return True


class _WrapAroundSampler(Sampler[int]):
    """``0, 1, ..., n-1, 0, 1, ...``: ``count`` indices, or endless when ``count`` is None."""

    def __init__(self, n: int, count: int | None) -> None:
        self.n = n
        self.count = count

    def __iter__(self) -> Iterator[int]:
        indices = itertools.cycle(range(self.n))
        return indices if self.count is None else itertools.islice(indices, self.count)


# --------------------------------------------------------------------------------------------
# the loaders


def _label(key: str, num_workers: int) -> str:
    return {
        "thread": f"ThreadDataLoader(num_workers={num_workers})",
        "dataloader": f"DataLoader(num_workers={num_workers})",
        "dataloader0": "DataLoader(num_workers=0)",
        "torchdata": f"torchdata.nodes ({num_workers} threads)",
        "spdl": f"SPDL DataLoader ({num_workers} threads)",
    }[key]


def _unavailable(key: str, source: Source) -> str | None:
    """Why ``key`` cannot run on ``source``, or None. Imports the package (outside any timing)."""
    if key == "torchdata":
        try:
            import torchdata.nodes  # noqa: F401
        except ImportError:
            return "not installed (pip install torchdata)"
    if key == "spdl":
        try:
            import spdl.dataloader  # noqa: F401
        except ImportError:
            return "not installed (pip install spdl)"
    if key in ("torchdata", "spdl") and not source.map_style:
        return "compared on map-style datasets only (this one is an IterableDataset)"
    return None


class _MapAndCollate:
    """torchdata.nodes' recipe for replacing DataLoader: one task fetches and collates a batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        return default_collate([self.dataset[i] for i in indices])


def _open(
    key: str, source: Source, num_workers: int, count: int | None
) -> tuple[Iterator[Any], Callable[[], None]]:
    """Start loader ``key`` and return its iterator and a function that stops it."""
    ds, bs = source.dataset, source.batch_size
    sampler = _WrapAroundSampler(len(ds), count) if source.map_style else None
    if key in ("thread", "dataloader", "dataloader0"):
        from threadloader.loader import ThreadDataLoader

        cls = ThreadDataLoader if key == "thread" else DataLoader
        workers = 0 if key == "dataloader0" else num_workers
        it = iter(cls(ds, batch_size=bs, sampler=sampler, num_workers=workers))
        # torch's process iterator stops its workers in _shutdown_workers; ours in close()
        close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
        return it, close or (lambda: None)
    if key == "torchdata":
        import torchdata.nodes as tn
        from torch.utils.data import BatchSampler

        assert sampler is not None  # _unavailable() keeps IterableDatasets away
        node: Any = tn.SamplerWrapper(BatchSampler(sampler, bs, drop_last=False))
        node = tn.ParallelMapper(
            node, map_fn=_MapAndCollate(ds), num_workers=num_workers, method="thread"
        )
        node = tn.Prefetcher(node, prefetch_factor=2 * num_workers)  # DataLoader's depth
        return iter(tn.Loader(node)), lambda: _shutdown_nodes(node)
    if key == "spdl":
        import spdl.dataloader

        assert sampler is not None
        loader: Any = spdl.dataloader.DataLoader(
            sampler,
            preprocessor=ds.__getitem__,
            batch_size=bs,
            aggregator=default_collate,
            num_threads=num_workers,
            output_order="input",
        )
        gen = iter(loader)  # spdl annotates __iter__ as returning an Iterable
        return gen, getattr(gen, "close", lambda: None)
    raise ValueError(f"unknown loader {key!r}")


def _shutdown_nodes(node: Any, depth: int = 0) -> None:
    """Stop torchdata's threads now rather than whenever the nodes are collected.

    torchdata.nodes stops its threads in ``__del__`` via a private ``_shutdown()``; a run that
    stops early (``--seconds``, or a wrap-around sampler) would otherwise leave them fetching
    during the next loader's run. Walks the chain of nodes through ``_it`` and ``source``.
    """
    if node is None or depth > 16:
        return
    shutdown = getattr(node, "_shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(Exception):
            shutdown()
    for attr in ("_it", "source"):
        child = getattr(node, attr, None)
        if child is not None and child is not node:
            _shutdown_nodes(child, depth + 1)


# --------------------------------------------------------------------------------------------
# one run


def _batch_len(batch: Any, default: int) -> int:
    """Samples in a (possibly nested) batch: the first dimension of its first tensor."""
    for _ in range(8):
        if hasattr(batch, "shape") and len(batch.shape) > 0:
            return int(batch.shape[0])
        if isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, Sequence) and not isinstance(batch, str | bytes) and batch:
            first = batch[0]
            if not hasattr(first, "shape") and not isinstance(first, Mapping | Sequence):
                return len(batch)  # a list of plain values
            batch = first
        else:
            break
    return default


def _memory_probe() -> tuple[Callable[[], Any] | None, str | None]:
    try:
        from threadloader._memory_probe import PeakSampler
    except ImportError:
        return None, "peak memory not measured: pip install psutil"
    return (lambda: PeakSampler(interval_s=_PSS_INTERVAL_S)), None


def _run_once(
    key: str,
    source: Source,
    config: CompareConfig,
    round_no: int,
    make_sampler: Callable[[], Any] | None,
) -> RunResult:
    batches_wanted = config.batches if config.batches is not None else sys.maxsize
    duration = config.seconds if config.seconds is not None else math.inf
    count = (config.batches + 1) * source.batch_size if config.batches is not None else None
    step_s = config.step_ms / 1000.0
    clock = time.perf_counter
    gc.collect()
    memory = make_sampler() if make_sampler is not None else contextlib.nullcontext()
    with memory:
        start_pss = getattr(memory, "first_bytes", None)
        t0 = clock()
        it, close = _open(key, source, config.num_workers, count)
        try:
            try:
                next(it)
            except StopIteration:
                raise CompareError("the dataset gave no batch") from None
            first_batch_s = clock() - t0
            n = samples = 0
            wait = 0.0
            ran_out = False
            start = now = clock()
            deadline = start + duration
            while n < batches_wanted and now < deadline:
                before = clock()
                try:
                    batch = next(it)
                except StopIteration:
                    ran_out = True
                    break
                now = clock()
                wait += now - before
                samples += _batch_len(batch, source.batch_size)
                n += 1
                del batch
                if step_s:
                    time.sleep(step_s)
                    now = clock()
            elapsed = clock() - start
        finally:
            close()
            del it, close
    gc.collect()
    if n == 0:
        raise CompareError("the dataset gave only one batch; need at least two to time")
    samples *= source.samples_per_item
    return RunResult(
        round=round_no,
        batches=n,
        samples=samples,
        elapsed_s=elapsed,
        samples_per_s=samples / elapsed,
        first_batch_s=first_batch_s,
        wait_s=wait,
        data_wait_fraction=wait / elapsed,
        peak_pss_bytes=getattr(memory, "peak_bytes", None),
        start_pss_bytes=start_pss,
        ran_out=ran_out,
    )


# --------------------------------------------------------------------------------------------
# the comparison


class _Progress:
    """A tqdm bar over runs on stderr, or nothing when tqdm is missing or stderr is no TTY."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if not (enabled and sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="run", file=sys.stderr, leave=False)

    def start(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_compare(config: CompareConfig) -> CompareResult:
    """Run every loader ``config.rounds`` times on the configured dataset.

    Args:
        config: What to compare; validated here.

    Returns:
        Every run of every loader that could run, and why the others did not.

    Raises:
        CompareError: On bad input, or when a loader fails to read the dataset (unless
            ``config.traceback``, which lets that exception through).
    """
    config.validate()
    source = load_source(config)
    skipped: dict[str, str] = {}
    keys: list[str] = []
    for key in (k for k in LOADERS if k in config.loaders):
        reason = _unavailable(key, source)
        if reason is None:
            keys.append(key)
        else:
            skipped[key] = reason
    make_sampler, memory_note = _memory_probe()
    runs: dict[str, list[RunResult]] = {k: [] for k in keys}
    progress = _Progress(config.rounds * len(keys), config.progress)
    try:
        for round_no in range(config.rounds):
            shift = round_no % len(keys)
            for key in keys[shift:] + keys[:shift]:
                label = _label(key, config.num_workers)
                progress.start(f"round {round_no + 1}/{config.rounds}: {label}")
                try:
                    runs[key].append(_run_once(key, source, config, round_no, make_sampler))
                except CompareError as e:
                    raise CompareError(f"{label}: {e}") from e
                except Exception as e:
                    if config.traceback:
                        raise
                    raise CompareError(
                        f"{label} failed: {_one_line(e)} (--traceback shows where)"
                    ) from e
                progress.done()
    finally:
        progress.close()
    results = []
    for key in keys:
        ratio = None
        if BASELINE in runs:
            base = {r.round: r.samples_per_s for r in runs[BASELINE]}
            ratio = statistics.median(r.samples_per_s / base[r.round] for r in runs[key])
        results.append(LoaderResult(key, _label(key, config.num_workers), tuple(runs[key]), ratio))
    return CompareResult(config, source, tuple(results), skipped, memory_note)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# --------------------------------------------------------------------------------------------
# output


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
        "data wait: share of the loop's time spent blocked in next()"
        + ("." if cfg.step_ms else "; the loop does no other work, try --step-ms 5.")
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


def check_plot_available() -> None:
    """Fail before any measuring when ``--plot`` cannot work.

    Raises:
        CompareError: If matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise CompareError(
            "--plot needs matplotlib: pip install matplotlib (or threadloader[compare])"
        ) from e


def write_plot(result: CompareResult, path: str) -> None:
    """Write a bar chart of samples/s and peak memory per loader to ``path``.

    Args:
        result: What :func:`run_compare` returned.
        path: Output file; the format follows its extension (``.png``, ``.svg``, ...).

    Raises:
        CompareError: If matplotlib is not installed or the file cannot be written.
    """
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
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise CompareError(f"cannot write plot {path!r}: {_one_line(e)}") from e


def plot_path_problem(path: str) -> str | None:
    """Say why ``path`` cannot be written, before an expensive run; None when it looks fine.

    Args:
        path: Where ``--plot`` would write.

    Returns:
        A one-line reason, or None.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write plot {path!r}: folder {folder!r} does not exist"
    return None
