"""What one comparison measured: per run, per loader, and for the whole comparison.

``runner`` fills these in; ``report`` turns them into the table, JSON and plot.
"""

from __future__ import annotations

import dataclasses
import statistics

from threadloader.compare.inputs import CompareConfig, Source


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
# the loaders
