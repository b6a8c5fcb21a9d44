"""Memory of the current process tree: what a loader's workers really cost.

RSS counts a page shared by a parent and its forked workers once in every process, so summing
RSS over a tree overstates process workers. PSS (proportional set size) splits each shared page
between the processes that map it, so the sum over the tree is what the tree costs the machine.
Linux reports it in ``/proc/<pid>/smaps_rollup``; elsewhere we fall back to RSS.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["PeakSampler", "tree_pss_bytes"]


def _pss_or_rss(proc: psutil.Process) -> int:
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass  # no /proc (macOS, Windows), a kernel before 4.14, or the process just exited
    try:
        return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0


def tree_pss_bytes(pid: int | None = None) -> int:
    """Return the summed PSS of a process and all its descendants, in bytes.

    A process that exits while being measured counts as 0. Where ``smaps_rollup`` is not
    available the process's RSS is used instead, which overstates memory shared by processes.

    Args:
        pid: The root process; the current process when ``None``.

    Returns:
        Sum of PSS (or RSS fallback) over the tree, in bytes.

    Raises:
        psutil.NoSuchProcess: If the root process does not exist.
    """
    root = psutil.Process(pid)
    try:
        children = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        children = []
    return sum(_pss_or_rss(p) for p in [root, *children])


class PeakSampler:
    """Samples :func:`tree_pss_bytes` in a background thread and keeps the peak.

    The sampling thread exists only inside the ``with`` block: ``__exit__`` stops and joins it.
    Only the peak, the first and last values and a count are kept, so memory stays bounded
    however long the block runs. A sampler can be entered once.

    Example::

        baseline = tree_pss_bytes()
        with PeakSampler() as peak:
            for batch in loader:
                ...
        added = peak.peak_bytes - baseline

    Args:
        interval_s: Time between samples; longer when one sample takes more than a quarter
            of it, so that sampling never costs more than ~20% of one core.
        pid: Root of the process tree; the current process when ``None``.

    Raises:
        ValueError: If ``interval_s`` is not positive.
    """

    def __init__(self, interval_s: float = 0.02, pid: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.pid = pid
        self.first_bytes = 0
        """The sample taken on entry."""
        self.last_bytes = 0
        """The sample taken on exit."""
        self.peak_bytes = 0
        """The largest sample, including those taken on entry and exit."""
        self.samples = 0
        """How many samples were taken."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._entered = False

    def __repr__(self) -> str:
        state = "running" if self._thread is not None else ("done" if self._entered else "new")
        return (
            f"PeakSampler({state}, peak={self.peak_bytes / 2**20:.1f} MiB, "
            f"samples={self.samples}, interval_s={self.interval_s})"
        )

    def _sample(self) -> int:
        value = tree_pss_bytes(self.pid)
        self.peak_bytes = max(self.peak_bytes, value)
        self.samples += 1
        return value

    def _run(self) -> None:
        wait = self.interval_s
        try:
            while not self._stop.wait(wait):
                start = time.perf_counter()
                self._sample()
                # Reading smaps_rollup walks the page tables: ~5 ms for a 700 MB process. Keep
                # the sampler under ~20% of one core so it does not slow what it measures.
                wait = max(self.interval_s, 4 * (time.perf_counter() - start))
        except Exception as e:  # noqa: BLE001 - re-raised by __exit__, never lost in a thread
            self._error = e

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a PeakSampler can be entered only once")
        self._entered = True
        # A peak exists even if the block is shorter than one tick.
        self.first_bytes = self._sample()
        self._thread = threading.Thread(
            target=self._run, name=f"threadloader-peak-sampler-{id(self):x}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None and exc is None:
            raise RuntimeError("the peak sampler thread failed") from error
        self.last_bytes = self._sample()
