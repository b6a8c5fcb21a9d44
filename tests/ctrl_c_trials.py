"""A training loop pressed Ctrl-C at random moments: the child side of ``test_ctrl_c.py``.

Run as ``python ctrl_c_trials.py CONFIG TRIALS SEED``. Each trial builds a loader of large
batches (16 x 3x224x224 float32, 9.6 MB: recycled memory, shared-memory slots), trains on it
epoch after epoch (some epochs end with a ``break``, as validation loops do), and a timer thread
sends SIGINT to the process at a random moment, from the loader's construction to a few epochs
in. One line per trial on stdout: ``ok SECONDS`` when ``KeyboardInterrupt`` reached the loop
within ``LIMIT_S`` of the signal and, once the loop let go of the loader, no threadloader thread
or helper process was left; else a word naming what went wrong. The last trial lets its
``KeyboardInterrupt`` end the interpreter (``exit SENT_AT CAUGHT_AT PIDS...`` printed first, on
the monotonic clock), so the parent checks the exit status, stderr, how long the interrupt took
to reach the loop, how long the exit handlers took (the parent's wrapper prints
``atexit-done TIME`` after the last one) and how long the interpreter then took to end.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader

#: The longest a Ctrl-C may take to stop the loop.
LIMIT_S = 2.0
#: Where in a trial the signal may land: seconds after the loader starts being built.
LATEST_S = 0.8

CONFIGS: dict[str, dict[str, Any]] = {
    "threads": {"device": None, "pin_memory": False},
    "pinned": {"device": None, "pin_memory": True},
    "process": {"device": None, "isolation": "process"},
    "device": {"device": "cpu"},  # batches through the transfer thread
}


class Images(Dataset[tuple[torch.Tensor, int]]):
    """64 images of 3x224x224: four batches of 16 an epoch, so epochs end often."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 224, 224), float(i)), i


class Lost(Exception):
    """The Ctrl-C did not reach the loop within ``LIMIT_S``."""


def _train(
    loader: ThreadDataLoader[Any], rng: random.Random, sent: list[float], pids: list[int]
) -> None:
    while True:  # epochs
        it = iter(loader)
        pid = getattr(it, "helper_pid", None)
        if pid is not None:
            pids.append(pid)
        stop_after = rng.choice([2, 3, 99])  # 99: the whole epoch
        for step, (x, _y) in enumerate(it):
            x.mul(0.5).sum()  # the step
            if sent and time.monotonic() - sent[0] > LIMIT_S:
                raise Lost
            if step + 1 == stop_after:
                break
        del it


def _leftovers(pids: list[int]) -> str | None:
    """What of the trial's loaders is still running 2 s after the loop let go of them."""
    deadline = time.monotonic() + 2.0
    while True:
        gc.collect()
        threads = [t.name for t in threading.enumerate() if t.name.startswith("threadloader-")]
        helpers = [p for p in pids if _running(p)]
        if not threads and not helpers:
            return None
        if time.monotonic() > deadline:
            return f"left threads={threads} helpers={helpers}"
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _press(sent: list[float]) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (helpers included).

    The parent starts this script in a session of its own, so the group is this script's."""
    sent.append(time.monotonic())
    os.killpg(os.getpgrp(), signal.SIGINT)


def trial(config: str, rng: random.Random, last: bool) -> str:
    sent: list[float] = []
    pids: list[int] = []
    timer = threading.Timer(rng.uniform(0.0, LATEST_S), _press, (sent,))
    try:
        timer.start()
        loader = ThreadDataLoader(Images(), batch_size=16, num_workers=2, **CONFIGS[config])
        _train(loader, rng, sent, pids)
    except KeyboardInterrupt:
        caught = time.monotonic()
        if last:
            print("exit", sent[0], caught, *pids, flush=True)
            raise
        took = caught - sent[0] if sent else float("nan")
        outcome = f"ok {took:.3f}" if took <= LIMIT_S else f"late {took:.3f}"
    except Lost:
        outcome = "lost"
    finally:
        timer.join()
    loader = None  # the loop lets go of its loader
    try:
        time.sleep(0.2)  # an interrupt sent twice would land here
    except KeyboardInterrupt:
        return "twice"
    return _leftovers(pids) or outcome


def main() -> None:
    config, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    if config == "process":
        # One epoch first, while this process runs one thread (its helpers fork from it), so
        # that first-use costs stay out of the trials. A trial's timer thread runs as its
        # loader is built, so trials' helpers come from the forkserver; a press that kills
        # the forkserver while it imports torch leaves it dying for the next trial's iter().
        list(ThreadDataLoader(Images(), batch_size=16, num_workers=2, **CONFIGS[config]))
    for i in range(trials):
        print(trial(config, rng, last=i == trials - 1), flush=True)


if __name__ == "__main__":
    main()
