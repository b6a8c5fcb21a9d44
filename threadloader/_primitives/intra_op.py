"""One intra-op thread for torch's CPU ops on a worker thread, as in a torch worker process.

torch runs a CPU op on a team of threads (its intra-op pool; OpenMP on Linux builds), and how
many is a per-thread setting: a thread takes the process's number the first time it runs an op,
and keeps its own after. On a thread other than the one that imported torch, each op that runs
in parallel pays for its own team: cloning a 3x224x224 uint8 image took 46-54 us on a new
thread against 6 us with one intra-op thread (2 cores), and N workers each using every core's
threads oversubscribe the machine. torch's worker processes and its pin-memory thread call
``torch.set_num_threads(1)``, and so does each of our worker and transfer threads.

``torch.set_num_threads`` also sets the number that threads take when they first run an op, so
``single_intra_op_thread`` puts the process's number back afterwards, from a short-lived thread
of its own: threads the training code starts later still use every core, and the training
thread's own setting never changes.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()


def single_intra_op_thread() -> None:
    """Make torch run the calling thread's CPU ops on that thread alone.

    Leaves the training thread's number and the one later threads take as they were.
    """
    with _lock:  # two threads doing this at once must not put back each other's 1
        process_setting = torch.get_num_threads()  # a new thread reads the process's number
        torch.set_num_threads(1)
        if process_setting != 1:
            restore = threading.Thread(
                target=torch.set_num_threads,
                args=(process_setting,),
                name="threadloader-intra-op-setting",
            )
            restore.start()
            restore.join()
