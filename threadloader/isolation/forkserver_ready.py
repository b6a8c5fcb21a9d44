"""The forkserver's mark that it is ready: its imports are done, a helper would start at once.

multiprocessing's forkserver imports its preload modules (the main script, threadloader's
helper, torch: 1.5 s and more) before it answers a request; a helper asked for meanwhile waits
for those imports. ``helper_source`` preloads this module after every other one. Imported in the
forkserver, it creates an empty file named for the server's user and pid (``mark_path``), which
the training process can look for without asking the server (``helper_source.forkserver_ready``),
and removes it when the server exits. Imported in any other process, it does nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile

from threadloader.isolation.forkserver_exit import in_forkserver


def mark_path(pid: int) -> str:
    """The file the forkserver with this pid creates once its imports are done."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"threadloader-{uid}-forkserver-{pid}.ready")


def _unmark(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _mark() -> None:
    path = mark_path(os.getpid())
    try:
        with open(path, "wb"):
            pass
    except OSError:  # the training process then waits for a helper's start, as without a mark
        return
    atexit.register(_unmark, path)


if in_forkserver():
    _mark()
