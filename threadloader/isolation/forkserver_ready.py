"""The forkserver's mark that it is ready: its imports are done, a helper would start at once.

multiprocessing's forkserver imports its preload modules (the main script, threadloader's
helper, torch: 1.5 s and more) before it answers a request; a helper asked for meanwhile waits
for those imports. ``helper_source`` preloads this module after every other one. Imported in the
forkserver, it creates an empty file named for its pid in the folder the training process
passed in the server's arguments (``helper_source.mark_path``), which the training process can
look for without asking the server (``helper_source.forkserver_is_ready``), and removes it when
the server exits, with the folder where the training process is gone (it removes the folder at
its own exit, which a SIGTERM skips). Imported in any other process, or in a server given no
folder, it does nothing.

Nothing else in threadloader imports this module or ``forkserver_exit``: the forkserver imports
the main script first, and the script's ``import threadloader`` must not mark the server ready
before the preloads after it, nor register ``forkserver_exit``'s handler before theirs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

from threadloader.isolation.forkserver_process import in_forkserver, ready_mark, server_arguments


def _unmark(path: str, pid: int, parent: int) -> None:
    if os.getpid() != pid:  # a process forked from the server, exiting: the server still runs
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    if os.getppid() != parent:  # the training process died without its exit handlers (a
        with contextlib.suppress(OSError):  # SIGTERM, a kill): its folder goes, once empty
            os.rmdir(os.path.dirname(path))


def _mark() -> None:
    given = server_arguments(list(getattr(sys, "orig_argv", ()))).get("main_path")
    folder = given.get("ready") if isinstance(given, dict) else None
    if not isinstance(folder, str):
        return  # given no folder: no mark (the training process moves by the longer rule)
    pid = os.getpid()
    path = ready_mark(folder, pid)
    try:
        with open(path, "wb"):
            pass
    except OSError:  # the training process then waits for a helper's start, as without a mark
        return
    atexit.register(_unmark, path, pid, os.getppid())


if in_forkserver():
    _mark()
