"""The training process's end of a helper's task pipe: writes that never block.

The training thread writes tasks (``task_board``'s messages) and reads results, both on the one
thread. A blocking write could wait forever: the helper reads the task pipe only when its
runners have nothing to claim, and a runner whose result is larger than the result socket's
buffer (a batch of strings is pickled into the message) waits, holding the helper's one sender,
until the training process reads it. With enough tasks in flight to fill the pipe (large index
lists: a big ``batch_size``, many workers, a high ``prefetch_factor``), each process would wait
for the other. So the pipe is non-blocking: what it cannot take now waits here, in order, and
goes out as the helper reads, from the training thread's waits for results (``link``), which
watch the pipe for room while anything is pending.

Messages are framed as ``multiprocessing.connection.Connection.send`` frames them (a 4-byte
big-endian length, then the pickle), so the helper reads them with ``Connection.recv``.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!iQ")  # -1, then the length, for a message of 2 GiB or more


def frame(msg: Any) -> bytes:
    """``msg`` pickled and framed as ``Connection.send`` writes it."""
    payload = ForkingPickler.dumps(msg)
    n = len(payload)
    if n > 0x7FFFFFFF:
        return _LONG.pack(-1, n) + payload
    return _SHORT.pack(n) + payload


class TaskPipe:
    """Write end of a pipe whose ``send`` never blocks; what does not fit waits in order.

    Args:
        conn: the pipe's write end; made non-blocking. Closed by ``close``.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.fileno = conn.fileno()
        os.set_blocking(self.fileno, False)
        self._pending: deque[memoryview] = deque()

    @property
    def pending(self) -> bool:
        """Whether some message, or its end, is still waiting to be written."""
        return bool(self._pending)

    def send(self, msg: Any) -> None:
        """Write ``msg`` now as far as the pipe takes it; the rest waits for ``flush``.

        Raises:
            OSError: the reader is gone (``BrokenPipeError``) or the pipe was closed.
        """
        data = memoryview(frame(msg))
        if self._pending:
            self._pending.append(data)
            self.flush()
            return
        rest = data[self._write(data) :]
        if rest:
            self._pending.append(rest)

    def flush(self) -> bool:
        """Write what is waiting, as far as the pipe takes it now.

        Returns:
            True when nothing is left waiting.

        Raises:
            OSError: the reader is gone (``BrokenPipeError``) or the pipe was closed.
        """
        pending = self._pending
        while pending:
            head = pending[0]
            written = self._write(head)
            if written < len(head):
                pending[0] = head[written:]
                return False
            pending.popleft()
        return True

    def _write(self, data: memoryview) -> int:
        """Bytes of ``data`` the pipe took now (0 when it is full)."""
        try:
            return os.write(self.fileno, data)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        """Close the pipe (the helper sees its end); what was waiting is dropped."""
        self._pending.clear()
        self._conn.close()
