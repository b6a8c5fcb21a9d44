"""One intra-op thread for torch's CPU ops on a worker thread, as in a torch worker process.

torch runs a CPU op on a team of threads (its intra-op pool; OpenMP on Linux builds), and how
many is a per-thread setting: a thread takes the process's number the first time it runs an op,
and keeps its own after. On a thread other than the one that imported torch, each op that runs
in parallel pays for its own team: cloning a 3x224x224 uint8 image took 46-54 us on a new
thread against 6 us with one intra-op thread (2 cores), and N workers each using every core's
threads oversubscribe the machine. torch's worker processes run on one intra-op thread
(``torch.set_num_threads(1)``), and so does each of our worker and transfer threads.

Only the calling thread's number changes. ``torch.set_num_threads`` would also change the
number that threads take when they first run an op, the OpenMP threads of the training
thread's own team included, and through them how some of the training step's kernels split
their work: a loss then differs from torch's in its last digits, depending on when a worker
thread started. So the calling thread's OpenMP setting is changed directly, through the OpenMP
runtime that torch loaded. Where it cannot be found, ``torch.set_num_threads`` is used: a worker
thread then puts the process's number back at once for the threads that start later, and the
training thread when its task is done.

The training thread runs a worker's task itself at times (a batch no worker had started, or
every batch while the training thread alone is fastest). It does so with one intra-op thread
too (``as_worker``), and gets its own number back after: a batch must not depend on which
thread made it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable

import torch

_lock = threading.Lock()
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _openmp_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded; None if none is found."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".1"))}
    except OSError:  # no /proc (macOS): torch.set_num_threads instead
        return None
    found = [p for p in paths if os.path.basename(p).startswith(_RUNTIMES)]
    found.sort(key=lambda p: (os.sep + "torch" + os.sep not in p, p))  # torch's own first
    for path in found:
        try:
            setter = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        setter.argtypes = [ctypes.c_int]
        setter.restype = None
        return setter
    return None


def _set_own(count: int) -> bool:
    """Set the calling thread's OpenMP number alone, if the runtime was found.

    The thread must have asked torch for its number before (``torch.get_num_threads``): torch
    sets a thread's number when it first asks, and would overwrite this one.

    Returns:
        Whether it was set (else the caller falls back to ``torch.set_num_threads``).
    """
    setter = _openmp_setter()
    if setter is None:
        return False
    setter(count)
    return True


def _new_thread_setting() -> int:
    """The number a thread starting now would take."""
    seen: list[int] = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    return seen[0]


def single_intra_op_thread() -> None:
    """Make torch run the calling thread's CPU ops on that thread alone, for its whole life.

    Leaves the training thread's number and the one later threads take as they were.
    """
    torch.get_num_threads()  # torch's first setting of this thread's number comes before ours
    if _set_own(1):
        return
    with _lock:  # two threads doing this at once must not put back each other's number
        process_setting = _new_thread_setting()
        torch.set_num_threads(1)
        if process_setting != 1:
            restore_later = threading.Thread(
                target=torch.set_num_threads,
                args=(process_setting,),
                name="threadloader-intra-op-setting",
            )
            restore_later.start()
            restore_later.join()


def as_worker() -> int:
    """Make the calling thread run torch's CPU ops on itself alone, for one worker's task.

    Without the OpenMP runtime, ``torch.set_num_threads(1)`` also sets the number a thread
    starting during the task takes; ``restore`` sets the process's number back with the
    calling thread's. No thread is started for that: the training thread may do this for
    every batch.

    Returns:
        The thread's number before, for ``restore``.
    """
    before = torch.get_num_threads()
    if before != 1 and not _set_own(1):
        with _lock:
            torch.set_num_threads(1)
    return before


def restore(before: int) -> None:
    """Give the calling thread back the number ``as_worker`` returned."""
    if before != 1 and not _set_own(before):
        with _lock:
            torch.set_num_threads(before)
