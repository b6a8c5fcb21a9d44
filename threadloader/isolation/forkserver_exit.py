"""The forkserver's exit: at once, as a helper's.

multiprocessing's forkserver ends when the last process using it is gone (the EOF of its alive
pipe raises ``SystemExit``), then runs the interpreter's teardown with torch imported: ~0.7 s on
2 cores. All that time it holds the training process's stdout and stderr, so whatever reads them
to their end (``python train.py | tee log``, ``subprocess.run(..., capture_output=True)``) waits
for it after the training process has exited.

``helper_source`` preloads this module into the forkserver it uses. There it registers an exit handler
that flushes stdio and ends the process with ``os._exit(0)``: preloaded after the user's modules
and the helper, its handler runs before theirs (only ``forkserver_ready``'s, which removes its
mark, runs earlier). Nothing in the forkserver needs cleaning up: the processes it forked are
independent (and end with ``os._exit`` themselves, never running its exit handlers). Imported in
any other process, it does nothing.
"""

from __future__ import annotations

import atexit
import os
import sys

from threadloader.isolation.forkserver_process import in_forkserver


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can reach it
            pass
    os._exit(0)


if in_forkserver():
    atexit.register(_exit_now)
