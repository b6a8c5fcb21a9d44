"""Per-thread stage timers: cheap to write from the hot path, merged when stats are read.

Each thread that fetches (a worker, or the training thread when it runs a batch itself) writes
only its own ``StageRecorder``; ``stats()`` reads them all. A recorder's lock is uncontended on
the write path (one writer), and makes reads consistent without relying on the GIL.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

#: Recent durations kept per stage for percentiles: enough for p99, bounded memory.
RESERVOIR = 1024

STAGES = ("sampler", "fetch", "collate", "pin", "transfer")


@dataclass
class _Stage:
    count: int = 0
    total: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RESERVOIR))


class StageRecorder:
    """Durations of the stages one thread ran, and how long it was busy in all."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._stages: dict[str, _Stage] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._add_locked(stage, seconds)

    def add_pair(self, stage: str, seconds: float, stage2: str, seconds2: float) -> None:
        """Two ``add`` calls under one lock (fetch and collate: once per batch, hot path)."""
        with self._lock:
            self._add_locked(stage, seconds)
            self._add_locked(stage2, seconds2)

    def _add_locked(self, stage: str, seconds: float) -> None:
        s = self._stages.get(stage)
        if s is None:
            s = self._stages[stage] = _Stage()
        s.count += 1
        s.total += seconds
        s.recent.append(seconds)

    def read(self) -> dict[str, tuple[int, float, list[float]]]:
        """``{stage: (count, total seconds, recent durations)}``, copied under the lock."""
        with self._lock:
            return {k: (s.count, s.total, list(s.recent)) for k, s in self._stages.items()}

    def busy(self) -> float:
        with self._lock:
            return sum(s.total for s in self._stages.values())
