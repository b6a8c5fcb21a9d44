"""``python -m threadloader compare``: ThreadDataLoader against other loaders, on one dataset.

This module runs the loaders. :mod:`threadloader.compare.inputs` holds the options, the dataset
and :class:`CompareError`; :mod:`threadloader.compare.report` turns the result into a table,
JSON or a plot. Every public name of the three is importable from here.

How a comparison runs; where the code disagrees with this, the code is wrong. What every loader
reads, and in which order, is point 1 of ``inputs``.

1. Each round runs every available loader once, back to back, starting one loader later each
   round, so drift in machine load hits every loader alike. Ratios are taken within a round;
   the table quotes medians over rounds.
2. One run: start the loader and take the first batch (that time is "time to first batch"),
   then ``2 * num_workers`` warm-up batches untimed (what the workers made ahead while the loop
   waited for the first: counting them would credit the timed window with work done before its
   clock started; 1 batch of a 10 ms-an-item dataset "ran" at 100x its ceiling; a loader
   without workers, ``DataLoader(num_workers=0)``, makes nothing ahead and has none), then time
   ``--batches`` more batches, or as many as ``--seconds`` allows. samples/s counts the timed
   batches only. The loop measures the time it spends blocked in ``next()``: data wait is
   that time over the timed wall time. ``--step-ms`` sleeps after each batch, standing in for a
   training step that releases the GIL (as waiting on a GPU does); without it the loop does
   nothing but fetch, so data wait is close to 100% for every loader.
3. Peak memory is the largest PSS of the whole process tree (worker processes included) seen
   by :class:`threadloader.compare.memory_probe.PeakSampler` while the loader runs.
4. A loader whose package is not installed, or that cannot read this kind of dataset, is not
   run and is listed with the reason. A loader that fails on the dataset raises
   :class:`CompareError` naming it (``--traceback`` lets the loader's own exception through).

None of these modules prints: they return text and data; ``threadloader/__main__.py`` prints them.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, default_collate

from threadloader.compare.inputs import (
    BASELINE,
    LOADERS,
    WORKLOADS,
    CompareConfig,
    CompareError,
    Source,
    _one_line,
    _WrapAroundSampler,
    load_source,
)
from threadloader.compare.report import (
    _label,
    check_plot_available,
    format_table,
    plot_path_problem,
    to_json,
    write_plot,
)
from threadloader.compare.results import CompareResult, LoaderResult, RunResult

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

_PSS_INTERVAL_S = 0.05  # each sample reads /proc of every process in the tree: keep it cheap


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
            preprocessor=_Catching(ds.__getitem__),
            batch_size=bs,
            aggregator=_Catching(_collate_unless_failed),
            num_threads=num_workers,
            output_order="input",
        )
        gen = iter(loader)  # spdl annotates __iter__ as returning an Iterable
        return _raising(gen), getattr(gen, "close", lambda: None)
    raise ValueError(f"unknown loader {key!r}")


class _Failed:
    """An exception carried as a value through SPDL's pipeline (see :class:`_Catching`)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _Catching:
    """``fn``, with an exception returned as a :class:`_Failed` instead of raised.

    SPDL's DataLoader logs and drops a task that raises, with no failure limit it lets us set:
    a dataset failing on every item would hang the run printing tracebacks, and one failing on
    some items would be timed on the rest. torch and torchdata raise; this makes SPDL do so too.
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, arg: Any) -> Any:
        try:
            return self.fn(arg)
        except Exception as e:  # noqa: BLE001  (raised again by _raising)
            return _Failed(e)


def _collate_unless_failed(samples: list[Any]) -> Any:
    failed = next((s for s in samples if isinstance(s, _Failed)), None)
    return failed if failed is not None else default_collate(samples)


def _raising(batches: Iterator[Any]) -> Iterator[Any]:
    """SPDL's batches, raising the first item's or collate's exception where it arrives."""
    for batch in batches:
        if isinstance(batch, _Failed):
            raise batch.error
        yield batch


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

_END = object()


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
        from threadloader.compare.memory_probe import PeakSampler
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
    warmup = 0 if key == "dataloader0" else 2 * config.num_workers  # point 2
    count = (
        (config.batches + 1 + warmup) * source.batch_size if config.batches is not None else None
    )
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
            for _ in range(warmup):
                if next(it, _END) is _END:
                    break
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
        start_up = (
            f"the first {1 + warmup} start the loader up (the first batch, and {warmup} made "
            "ahead while it was awaited)"
            if warmup
            else "the first starts the loader up"
        )
        raise CompareError(
            f"the dataset gave too few batches to time: {start_up}, and at least one more is timed"
        )
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
    """A plain progress line on stderr: which run is measuring, and about how long is left.

    On a terminal the line is rewritten in place and erased at the end; elsewhere (a pipe, a
    CI log) each run gets a line of its own. Nothing at all when not ``enabled``.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self._stream = sys.stderr if enabled else None
        self._tty = self._stream is not None and self._stream.isatty()
        self._total = total
        self._done = 0
        self._width = 0  # of the line on the terminal, to erase it
        self._started = time.perf_counter()

    def start(self, text: str) -> None:
        if self._stream is None:
            return
        line = f"[{self._done + 1}/{self._total}] {text}"
        if self._done:
            each = (time.perf_counter() - self._started) / self._done
            line += f", about {each * (self._total - self._done):.0f} s left"
        if self._tty:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def done(self) -> None:
        self._done += 1

    def close(self) -> None:
        if self._stream is not None and self._tty and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()


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
    if not keys:
        reasons = "; ".join(f"{_label(k, config.num_workers)}: {r}" for k, r in skipped.items())
        raise CompareError(f"none of the chosen loaders can run on {source.name}: {reasons}")
    make_sampler, memory_note = _memory_probe()
    runs: dict[str, list[RunResult]] = {k: [] for k in keys}
    progress = _Progress(config.rounds * len(keys), config.progress)
    try:
        for round_no in range(config.rounds):
            shift = round_no % len(keys)
            for key in keys[shift:] + keys[:shift]:
                label = _label(key, config.num_workers)
                progress.start(f"measuring {label}, round {round_no + 1} of {config.rounds}")
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
