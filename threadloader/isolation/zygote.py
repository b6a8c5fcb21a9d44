"""Helper processes forked from a copy of the training process taken while it ran one thread.

A helper started by the forkserver is a fresh interpreter that imports torch on its own: its
memory is not shared with the training process, and a server still importing delays the first
batch. Forking the training process itself shares everything, but a process that runs Python
threads can be forked while another thread holds a lock. The zygote takes the safe moment: when
a loader with isolation is built and the main thread is the only Python thread, it forks once;
the copy (the zygote) runs no threads and forks every helper from then on.

How the zygote behaves; where the code disagrees with this, the code is wrong.

1. It starts only on Linux, only when ``threading`` knows no thread but the main one, and never
   in a process importing ``__main__`` for multiprocessing. Native thread pools (OpenBLAS,
   OpenMP) may exist: they sit idle between calls and their libraries prepare for ``fork``
   themselves, as for torch's own fork-started workers; CUDA is not used by a helper. It is
   used only when ``iter()`` cannot fork the training process itself (another Python thread
   runs by then; ``parent`` point 2); without it helpers come from the forkserver. What it
   costs: pages the training process changes after the fork stay in the zygote as they were
   (the dataset's among them, once it is pickled for a helper).
2. Right after the fork, every descriptor the zygote inherited except stdio and its socket is
   pointed at ``/dev/null``: a pipe or socket the training process holds must see its EOF when
   that process closes it, and a file object the copy still references closes ``/dev/null``,
   never a descriptor opened later. It ignores SIGINT (a terminal's Ctrl-C is the training
   process's), freezes the garbage collector's view of what it inherited (so a helper's
   collections do not write to, and so copy, the shared pages), and exits when its socket
   reaches EOF: the training process exited or died. Every other process forked from the
   training process (a helper forked from it, torch's DataLoader workers, a user's fork)
   closes its copy of the training process's end at once, and forgets the zygote: holding it,
   they kept the zygote alive, and the training process's exit waited for it.
3. A helper is a ``multiprocessing.Process`` started with ``fork`` inside the zygote. Its target
   and arguments are pickled in the training process by ``ForkingPickler`` (descriptors such as
   pipe ends and shared tensors travel beside the bytes on the socket, as with the forkserver)
   and unpickled in the helper, so the dataset is the one ``iter()`` sees, not the copy of the
   training process at the zygote's fork. So are ``sys.path`` and the working directory, as
   multiprocessing's spawn and forkserver pass them: a module on a path the script added
   since, or a relative path after ``os.chdir``, resolve as in the training process. The
   zygote and the helper both drop those bytes once the helper has them: kept, they would hold
   a second copy of the dataset for as long as the helper runs.
4. The training process's handle (``ZygoteProcess``) gets the helper's pid and, when the helper
   has been reaped, its exit code through a status pipe whose write end the helper also holds:
   the pipe ends, and the handle reports the helper gone, even if the zygote died first.
5. Classes, functions and wrappers (``functools.lru_cache``) of the main script are pickled by
   name, and a helper finds them in the zygote's ``__main__``: as they were at its fork. The
   training process keeps them as they were then, with each class's attributes that are code
   (``_Script``). A loader whose code (``main_state.script_code``: what its dataset,
   ``collate_fn`` and ``worker_init_fn`` hold and call) uses one that the script defined,
   replaced or changed since (a class defined after the first loader, a notebook cell run
   again, a method replaced on a class) never uses that zygote (``missing``): a helper would
   fail to find it, or run its old code. A loader built while this process runs one Python
   thread forks a new zygote where the running one's copy differs from the script in anything
   (``ensure_running``; ``isolation="auto"`` only replaces one, starting none); the old one is
   retired: it forks nothing more and exits once the helpers it forked have ended, reporting
   their exit codes until then. Where no new zygote can fork, helpers come from the
   forkserver, which imports the script afresh (``helper_source``). What that bounded walk
   misses (an object nested deeper than it looks), the start's pickle catches: while anything
   changed, the pickler refuses code of the script that changed (``StaleScriptCode``), and the
   helpers start elsewhere. A class's data attributes are not code: those changed since the
   fork, and those that can change in place (a dict, a tensor), travel with the start
   (``changed_data``, ``main_state`` point 5). Other modules' classes, changed in place after
   the fork, are not checked.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import gc
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable
from multiprocessing.context import set_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from threadloader.isolation.main_state import (
    ClassAttribute,
    by_name_in,
    nested_classes,
    script_classes,
)

#: Environment variable that, set to ``0``, makes helpers come from the forkserver always.
ENV_SWITCH = "THREADLOADER_ZYGOTE"
#: Descriptors one helper's start may carry (Linux allows 253 per message).
MAX_FDS = 253
#: Seconds the training process waits for the zygote to fork a helper.
START_WAIT_S = 30.0

_HEADER = struct.Struct("=QQ")  # name length, payload length
_CODE = struct.Struct("=q")

_lock = threading.Lock()
_server: _Server | None = None
#: Zygotes replaced by a newer one, still serving the helpers they forked (point 5).
_retired: list[_Server] = []
_atexit_registered = False
#: In a helper: the descriptors that came with its start, indexed by ``_DupFd``.
_received: list[int] = []


def only_the_main_thread(besides: int = 0) -> bool:
    """Whether the calling thread is the main one and ``threading`` knows no other, apart
    from ``besides`` threads the caller is about to join."""
    return (
        threading.current_thread() is threading.main_thread()
        and threading.active_count() == 1 + besides
    )


def may_fork(besides: int = 0) -> bool:
    """Whether this process may fork now: Linux, only the main thread, not switched off (point 1).

    Args:
        besides: threads the caller joins before it forks (a threaded epoch's workers).

    Returns:
        True where a fork copies no lock another Python thread could hold.
    """
    _reap_retired_if_free()
    if os.environ.get(ENV_SWITCH, "1") == "0" or sys.platform != "linux":
        return False
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return False
    return only_the_main_thread(besides)


def ensure_running(code: Iterable[Any] = (), start: bool = True) -> bool:
    """Start the zygote if none runs, or a new one if the running one's copy of the main script
    is not the script as it is now, where this process may fork now (points 1 and 5).

    Args:
        code: the main script's classes and functions a loader's helpers run
            (``main_state.script_code``).
        start: False: only replace a running zygote, start none (``isolation="auto"``).

    Returns:
        Whether a zygote that has ``code`` is running for this process.
    """
    global _server, _atexit_registered
    code = list(code)
    with _lock:
        _reap_retired()
        if _server is not None and _server.alive():
            now = _Script()
            lacking = _server.missing(code, now)
            # Also for code this loader does not run: a start would check the pickle of
            # anything that changed (``helper._WatchingPickler``), costing a call per object.
            if not lacking and not _server.script.changed(now):
                return True
            if not may_fork():
                return not lacking
            _server.retire()
            _retired.append(_server)
            _server = None
        elif not start:
            return False
        if not may_fork():
            return False
        _server = _Server.fork()
        if not _atexit_registered:
            atexit.register(_close_at_exit)
            _atexit_registered = True
        return True


def running(code: Iterable[Any] = ()) -> bool:
    """Whether this process has a live zygote (``ensure_running`` started one) that has ``code``,
    the main script's classes and functions a loader's helpers run, as they are now (point 5)."""
    with _lock:
        _reap_retired()
        return _server is not None and _server.alive() and not _server.missing(code)


def missing(code: Iterable[Any]) -> list[str]:
    """The names of those of ``code`` that the running zygote's ``__main__`` lacks (point 5):
    classes and functions of the main script defined or replaced since its fork. Empty where no
    zygote runs."""
    with _lock:
        return _server.missing(code) if _server is not None and _server.alive() else []


def changed_data(code: Iterable[Any]) -> list[ClassAttribute]:
    """The data attributes of the script's classes among ``code``, of their bases and of the
    classes nested in them (a subclass reads what its base holds), that the running zygote
    holds other than this process does (``main_state`` point 5), each with whether it is still
    there (False: deleted since): its helpers receive them pickled. Empty where no zygote
    runs."""
    with _lock:
        server = _server if _server is not None and _server.alive() else None
    if server is None:
        return []
    script = server.script
    return [
        ClassAttribute(klass, *change)
        for klass in script_classes(code, script.module)
        if script.class_named(klass)
        for change in script.changed_data(klass)
    ]


def server_pid() -> int | None:
    """The zygote's pid, or None when there is none."""
    with _lock:
        return _server.pid if _server is not None and _server.alive() else None


def retired_pids() -> list[int]:
    """Pids of retired zygotes (point 5) that have not exited yet."""
    with _lock:
        _reap_retired()
        return [server.pid for server in _retired]


def _reap_retired() -> None:
    # Called with ``_lock`` held: forget the retired zygotes that have exited.
    _retired[:] = [server for server in _retired if server.alive()]


def _reap_retired_if_free() -> None:
    # From a helper's handle, which a finalizer may call while this thread holds ``_lock``
    # (a collection inside ``ensure_running``): never waits for it.
    if _retired and _lock.acquire(blocking=False):
        try:
            _reap_retired()
        finally:
            _lock.release()


def shutdown() -> None:
    """Close the zygote's socket and wait for it to exit; helpers it forked keep running."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.close()


def _after_fork_in_child() -> None:
    # Point 2: this process's end of the zygote's socket is the parent's (the zygote, forked
    # with ``_lock`` held, resets its own state in ``_serve``). Retired zygotes are the parent's
    # children, their sockets closed already.
    global _server, _lock
    _lock = threading.Lock()
    _retired.clear()
    server, _server = _server, None
    if server is not None:
        server.sock.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_at_exit() -> None:
    # The zygote would exit on its own once this process's socket closes; closing it here
    # also reaps it, and leaves no socket for the interpreter to warn about.
    with _lock:
        server = _server
        _reap_retired()  # a retired one exits once its helpers have ended: not waited for
    if server is not None:
        server.close(wait_s=1.0)


class _Server:
    """The training process's end of the zygote: its pid and socket.

    Args:
        pid: the zygote's pid.
        sock: this process's end of its socket.
        script: the main script's code as at the fork (point 5).
    """

    def __init__(self, pid: int, sock: socket.socket, script: _Script) -> None:
        self.pid = pid
        self.sock = sock
        self.script = script
        self.send_lock = threading.Lock()
        self._gone = False
        self._broken = False  # a request was cut short: the zygote's stream is out of step
        self._retiring = False  # a newer zygote serves: this one exits after its helpers

    @classmethod
    def fork(cls) -> _Server:
        script = _Script(checksums=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 1
            try:
                ours.close()
                _serve(theirs)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours, script)

    def missing(self, code: Iterable[Any], now: _Script | None = None) -> list[str]:
        """Names of those of ``code`` that ``__main__`` holds other than at the fork (point 5);
        ``now``: the script as it stands, where the caller has it."""
        code = list(code)
        if not code:
            return []
        now = _Script() if now is None else now
        names = []
        for obj in code:
            name = getattr(obj, "__qualname__", None)
            if not isinstance(name, str) or "<locals>" in name:
                continue  # not found by name in any process: pickling it fails here
            if not self.script.holds(name.partition(".")[0], now):
                names.append(name)
        return names

    def retire(self) -> None:
        """Ask the zygote to fork nothing more and exit once its helpers have (point 5), and
        close this end."""
        with self.send_lock, contextlib.suppress(OSError):
            if not self._broken:
                self.sock.sendall(_HEADER.pack(0, 0))
        self.sock.close()  # a zygote that missed the request exits on the EOF
        self._broken = self._retiring = True  # never asked to start a helper again

    def alive(self) -> bool:
        if self._gone:
            return False
        if self._broken and not self._retiring:
            return False  # out of step (``start``): given up
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            done = self.pid
        if done:
            self._gone = True
            self.sock.close()
        return not self._gone

    def close(self, wait_s: float | None = None) -> None:
        """Close the socket (the zygote exits on its EOF) and reap it, waiting up to ``wait_s``
        seconds (None: until it exits)."""
        self.sock.close()
        if self._gone:
            return
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                done, _ = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            except ChildProcessError:
                done = self.pid
            if done or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(0.005)
        self._gone = bool(done)

    def start(self, name: str, payload: bytes | memoryview, fds: list[int]) -> None:
        if len(fds) > MAX_FDS:
            raise ValueError(
                f"starting an isolation helper needs {len(fds)} file descriptors (pipes and "
                f"tensors shared through file descriptors); at most {MAX_FDS} fit in one start. "
                "Call torch.multiprocessing.set_sharing_strategy('file_system') or hold fewer "
                "separate tensors in the dataset"
            )
        raw = (name or "threadloader-helper").encode()  # an empty name retires (point 5)
        with self.send_lock:
            if self._broken:
                raise OSError("threadloader's zygote process is not running")
            try:
                socket.send_fds(self.sock, [_HEADER.pack(len(raw), len(payload))], fds)
                self.sock.sendall(raw)
                self.sock.sendall(payload)
            except BaseException:
                # Cut short (a Ctrl-C between two chunks): the zygote would read the next
                # request from the middle of this one. Give it up: it exits on the socket's
                # EOF, and later helpers start another way (``helper_source.helper_context``).
                self._broken = True
                self.sock.close()
                raise


class StaleScriptCode(RuntimeError):
    """A helper's start pickles, by name, code of the main script that the zygote holds other
    than the training process does (point 5): the helper must come from elsewhere."""

    @classmethod
    def of(cls, names: Iterable[str]) -> StaleScriptCode:
        """The error naming the script's classes and functions the zygote lacks."""
        return cls(
            f"{', '.join(names)}, defined in __main__, changed since threadloader's zygote forked"
        )


class _DupFd:
    """A descriptor sent beside a helper's start, found again by its index in the helper."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return _received[self.index]


class ZygoteProcess:
    """A helper process forked by the zygote; the subset of ``multiprocessing.Process`` links use.

    Args:
        target: the function the helper runs.
        args: its arguments, pickled with ``ForkingPickler`` when the helper starts.
        name: the helper's process name.
        daemon: accepted for ``multiprocessing.Process``'s signature; helpers always are.
    """

    def __init__(
        self,
        target: Callable[..., object],
        args: tuple[Any, ...] = (),
        name: str = "threadloader-helper",
        daemon: bool = True,
    ) -> None:
        self._target = target
        self._args = args
        self.name = name
        self.daemon = daemon
        self.pid: int | None = None
        self.sentinel: int | None = None
        self._code: int | None = None
        self._fds: list[int] = []
        #: While the helper starts: the main script's globals of code that the zygote holds
        #: other than this process does (point 5), which its pickle must not name.
        self.stale_script_code: frozenset[str] = frozenset()
        self.script_module = "__main__"

    # The two methods multiprocessing.reduction.DupFd calls on the process being started.
    def duplicate_for_child(self, fd: int) -> int:
        """Send ``fd`` with the start; returns its index among the helper's received fds."""
        self._fds.append(fd)
        return len(self._fds) - 1

    DupFd = _DupFd

    def start(self) -> None:
        """Fork the helper from the zygote and wait for its pid.

        Raises:
            OSError: the zygote is gone.
            ValueError: the start would carry more descriptors than one message can.
            StaleScriptCode: the arguments' pickle names code of the main script that the
                zygote holds other than this process does (``PickledOnce`` checks; point 5).
            Exception: whatever pickling the arguments raises.
        """
        with _lock:
            server = _server
        if server is None or not server.alive():
            raise OSError("threadloader's zygote process is not running")
        now = _Script()
        self.stale_script_code, self.script_module = server.script.changed(now), now.module
        status_r, status_w = os.pipe()
        try:
            self._fds = [status_w]
            set_spawning_popen(self)  # type: ignore[arg-type]
            try:
                where = (list(sys.path), os.getcwd())  # as iter() finds them (point 3)
                payload = ForkingPickler.dumps((self._target, self._args, where))  # no copy
            finally:
                set_spawning_popen(None)
            server.start(self.name, payload, self._fds)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
            self._fds = []
        self.sentinel = status_r
        pid = _read_code(status_r) if _readable([status_r], START_WAIT_S) else None
        if pid is None:
            os.close(status_r)
            self.sentinel = None
            raise OSError("threadloader's zygote process did not start the helper")
        self.pid = pid

    @property
    def exitcode(self) -> int | None:
        """None while the helper runs; then its exit code (negative: the signal that ended it)."""
        self._poll(0)
        return self._code

    def _poll(self, timeout: float | None) -> None:
        if self._code is not None or self.sentinel is None:
            return
        if _readable([self.sentinel], timeout):
            code = _read_code(self.sentinel)
            # No code: the zygote died before reaping the helper, which has ended too (it held
            # the pipe's other write end).
            self._code = 255 if code is None else code
            _reap_retired_if_free()  # a retired zygote exits once its last helper has

    def is_alive(self) -> bool:
        """Whether the helper still runs."""
        return self.pid is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for the helper to end."""
        self._poll(timeout)

    def kill(self) -> None:
        """SIGKILL the helper, if it still runs."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the helper, if it still runs."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        if self.pid is not None and self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def close(self) -> None:
        """Release the status pipe (the exit code is then unknown if not read yet)."""
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # Bound at definition: at interpreter exit module globals may already be None.
        fd, self.sentinel = self.sentinel, None
        if fd is not None:
            try:
                _close(fd)
            except OSError:
                pass


class ZygoteContext:
    """What ``link`` asks of a multiprocessing context, with helpers forked by the zygote."""

    Process = ZygoteProcess

    @staticmethod
    def Pipe(duplex: bool = True) -> Any:  # multiprocessing's name
        """``multiprocessing.Pipe``: the ends travel to the helper as descriptors."""
        return multiprocessing.connection.Pipe(duplex)

    @staticmethod
    def get_start_method() -> str:
        """``"zygote"``: not one of multiprocessing's methods."""
        return "zygote"


def _read_code(fd: int) -> int | None:
    data = b""
    while len(data) < _CODE.size:
        chunk = os.read(fd, _CODE.size - len(data))
        if not chunk:
            return None
        data += chunk
    return int(_CODE.unpack(data)[0])


def _write_code(fd: int, code: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, _CODE.pack(code))


# --- the zygote's side ----------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """The zygote's loop: fork a helper per request, report each one's end (points 2-5)."""
    global _server, _lock
    _server, _lock = None, threading.Lock()  # the fork copied the training process's, held
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_this_process(b"threadloader-zy")
    _point_inherited_fds_at_devnull(keep={0, 1, 2, sock.fileno()})
    gc.freeze()
    fork = multiprocessing.get_context("fork")
    children: dict[int, tuple[Any, int]] = {}  # sentinel -> (process, status fd)
    listening = True
    while listening or children:
        for fd in _readable([sock.fileno(), *children] if listening else [*children], None):
            if fd in children:
                proc, status = children.pop(fd)
                proc.join()
                _write_code(status, proc.exitcode if proc.exitcode is not None else 255)
                os.close(status)
                proc.close()
                continue
            request = _receive(sock)
            if request is None:
                return  # the training process closed its end, or died
            name, payload, fds = request
            request = None
            if not name:  # retired (point 5): serve the helpers forked so far, then exit
                listening = False
                sock.close()
                continue
            held = [sock.fileno(), *(status for _, status in children.values())]
            box = [payload]
            del payload
            proc = fork.Process(target=_helper_entry, args=(box, fds, held), name=name, daemon=True)
            try:
                proc.start()
            except OSError:
                for received in fds:
                    os.close(received)
                continue  # the status pipe ends: the training process sees the start fail
            finally:
                box.clear()
            _write_code(fds[0], proc.pid or 0)
            for received in fds[1:]:
                os.close(received)
            children[proc.sentinel] = (proc, fds[0])


def _readable(fds: list[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` with data or at their end within ``timeout`` seconds (None: no limit).

    ``poll``, not ``select``: a process with more than 1,024 open files has descriptors
    ``select`` refuses.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(wait_ms)]


def _receive(sock: socket.socket) -> tuple[str, bytes, list[int]] | None:
    try:
        data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        if not data:
            return None
        data += _recv_exactly(sock, _HEADER.size - len(data))
        name_len, payload_len = _HEADER.unpack(data)
        if not name_len:
            return "", b"", list(fds)  # retired: no name, nothing to start (point 5)
        name = _recv_exactly(sock, name_len).decode()
        payload = _recv_exactly(sock, payload_len)
    except (OSError, EOFError):
        return None
    return name, payload, list(fds)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def _helper_entry(box: list[bytes], fds: list[int], held: list[int]) -> None:
    """A helper's first code: drop the zygote's descriptors, then run the target (point 3)."""
    for fd in held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _received[:] = fds
    target, args, (path, cwd) = pickle.loads(box.pop())
    sys.path[:] = path
    with contextlib.suppress(OSError):  # gone since: the helper stays where the zygote is
        os.chdir(cwd)
    target(*args)


def _point_inherited_fds_at_devnull(keep: set[int]) -> None:
    try:
        inherited = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in inherited:
        if fd in keep or fd == devnull:
            continue
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd, inheritable=False)
    os.close(devnull)


def _name_this_process(name: bytes) -> None:
    # The name ps and psutil show (15 bytes at most): the zygote is not the training script.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)


def _held(value: Any) -> Callable[[], Any]:
    """What gives ``value`` back: a weak reference where it takes one, else ``value`` kept."""
    try:
        return weakref.ref(value)
    except TypeError:  # ints, strings, tuples: kept
        return lambda: value


#: Types whose values never change in place (a tuple or frozenset only when what it holds
#: does not either).
_CONSTANTS = (
    int, float, complex, str, bytes, type(None), range, torch.dtype, torch.device, enum.Enum,
)  # fmt: skip


def _constant(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` cannot have changed since it was recorded: a number, string, bytes,
    None, or a tuple or frozenset of such, ``depth`` levels deep at most."""
    if isinstance(value, _CONSTANTS):
        return True
    if isinstance(value, (tuple, frozenset)) and depth > 0 and len(value) <= 64:
        return all(_constant(item, depth - 1) for item in value)
    return False


class _Crc:
    """A file that keeps only the CRC-32 of what is written to it."""

    def __init__(self) -> None:
        self.crc = 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return len(data)


def _checksum(value: Any) -> int | None:
    """A CRC-32 of what ``value`` holds, to tell whether it changed in place since (point 5):
    of its bytes, for a CPU tensor or an array; of its pickle otherwise. None where it cannot
    be taken (a tensor off the CPU, an object pickle refuses)."""
    try:
        raw: np.ndarray | None = None
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                return None
            raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        elif isinstance(value, np.ndarray) and value.dtype != object:
            raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        if raw is not None:
            return zlib.crc32(raw.data) ^ hash((str(value.dtype), tuple(value.shape)))
        sink = _Crc()
        pickle.Pickler(sink, pickle.HIGHEST_PROTOCOL).dump(value)
        return sink.crc
    except Exception:  # noqa: BLE001  # then it counts as changed: it is sent
        return None


def _gone() -> object:
    """What a record of no attribute gives: an object no attribute holds."""
    return _gone


def _split(cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """A class's own attributes: those that are code (functions, descriptors such as
    ``property``, ``staticmethod``, ``classmethod``, classes), and those that are data (a
    counter ``__getitem__`` bumps, a scale the script sets, a callable object such as a
    tokenizer or a transform instance, which pickle sends by value), but for the dunder names
    Python and ``copyreg`` keep there."""
    code, data = {}, {}
    for name, value in list(vars(cls).items()):
        if isinstance(value, type) or hasattr(type(value), "__get__"):
            code[name] = value
        elif not (name.startswith("__") and name.endswith("__")):
            data[name] = value
    return code, data


class _Script:
    """The main script's code that pickle finds by name, as it stands (point 5): each global
    that is a class, function or wrapper of the script's, and what each class holds."""

    def __init__(self, checksums: bool = False) -> None:
        """Args:
        checksums: take each data attribute's checksum where it can change in place (the
            record of a zygote's fork, which ``changed_data`` compares with).
        """
        main = sys.modules.get("__main__")
        self.module = main.__name__ if main is not None else "__main__"
        space = list(vars(main).items()) if main is not None else []
        self.code = {name: value for name, value in space if by_name_in(value, self.module)}
        # Each class of the script, nested ones too, by qualified name: the class, its code
        # attributes, and its data attributes held weakly where they can be (a class-level
        # cache rebound since is not kept alive by this record), each with its checksum.
        self.classes: dict[
            str, tuple[type, dict[str, Any], dict[str, tuple[Callable[[], Any], int | None]]]
        ] = {}
        pending = [value for value in self.code.values() if isinstance(value, type)]
        while pending:
            cls = pending.pop()
            if cls.__qualname__ in self.classes:
                continue
            code, data = _split(cls)
            held = {
                n: (_held(v), _checksum(v) if checksums and not _constant(v) else None)
                for n, v in data.items()
            }
            self.classes[cls.__qualname__] = (cls, code, held)
            pending.extend(nested_classes(cls))

    def holds(self, top: str, now: _Script) -> bool:
        """Whether ``now`` has the global ``top`` as this one had it: the same object, and for a
        class, the same code attributes (a method replaced on it changes what a helper runs)."""
        value = self.code.get(top)
        if value is None or value is not now.code.get(top):
            return False
        if not isinstance(value, type):
            return True
        if not self.class_named(value):
            return False  # another class of the same qualified name was recorded: not this
        held = self.classes[value.__qualname__][1]
        code = _split(value)[0]
        return len(code) == len(held) and all(code.get(n, held) is item for n, item in held.items())

    def class_named(self, cls: Any) -> bool:
        """Whether ``cls`` is a class of the script this one had, under its qualified name."""
        name = getattr(cls, "__qualname__", None)
        entry = self.classes.get(name) if isinstance(name, str) else None
        return entry is not None and entry[0] is cls

    def changed_data(self, cls: type) -> list[tuple[str, bool]]:
        """The data attributes of ``cls`` (``class_named``) that it holds now other than this
        one had them: rebound, or changed in place (a dict, a list, a tensor: its checksum
        differs, or none was taken), each with whether it is still there (False: deleted
        since)."""
        held = self.classes[cls.__qualname__][2]
        now = _split(cls)[1]
        changed = []
        for name, value in now.items():
            then, checksum = held.get(name, (_gone, None))
            if then() is not value or (
                not _constant(value) and (checksum is None or _checksum(value) != checksum)
            ):
                changed.append((name, True))
        return changed + [(name, False) for name in held.keys() - now.keys()]

    def changed(self, now: _Script) -> frozenset[str]:
        """Globals of code that ``now`` has other than this one had: new, gone or changed."""
        return frozenset(
            top for top in self.code.keys() | now.code.keys() if not self.holds(top, now)
        )
