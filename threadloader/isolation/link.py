"""The training process's handle on one helper process: its pipes, its slot ring, its tasks, and how
it ends, whether the epoch finished, was abandoned, or the helper died.
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from threadloader._engine.dispatch import reraise as _reraise
from threadloader._primitives.concurrency import usable_cpus
from threadloader.isolation.helper import (
    FATAL,
    RESULT,
    RETIRE,
    SEGMENT,
    STARTED,
    TRAINING_ENDS,
    HelperSpec,
    PickledOnce,
    SharedField,
    helper_main,
)
from threadloader.isolation.ring_reader import RingReader
from threadloader.isolation.task_pipe import TaskPipe

#: Seconds ``close()`` waits for the helper to exit before killing it.
CLOSE_WAIT_S = 5.0


#: How long a helper that died of a failure waits for a Ctrl-C that may have killed it to reach
#: this process too (``_Link._died``).
INTERRUPT_GRACE_S = 0.2


#: Longest time the training thread polls for the helper's next result before it sleeps
#: (point 6). Waits longer than this make the wake-up's cost small by comparison.
SPIN_S = 0.001


#: Lets another runnable thread or process have the CPU between two polls (POSIX only). On
#: 2 cores, with the helper on one and the polling on the other, a third busy thread (the
#: benches' memory sampler) otherwise waited for a CPU: 8 runs with it, 31.9k -> 32.9k samples/s.
yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def let_a_ctrl_c_arrive() -> None:
    """Wait ``INTERRUPT_GRACE_S`` for a Ctrl-C that may have killed another process of ours.

    Raises:
        KeyboardInterrupt: it arrived (it reaches this process a little after, or before, the
            other one's death; an exception unwinding runs no signal handler, so without a wait
            the loop would see the death first, or only).
    """
    time.sleep(INTERRUPT_GRACE_S)
    run_signal_handlers()


def run_signal_handlers() -> None:
    """Nothing: entering a Python function runs the handlers of signals flagged meanwhile."""


def _poll_ms(deadline: float | None) -> int | None:
    """``select.poll``'s timeout until ``deadline`` (monotonic): None waits for good."""
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _start_process(ctx: Any, **kwargs: Any) -> Any:
    """Start a helper process, with a new forkserver if the one there was died under the start.

    A terminal's Ctrl-C reaches the whole process group and kills a forkserver still importing
    torch (it ignores SIGINT only once it runs); the loop that Ctrl-C stopped has ended, and a
    later ``iter()`` finds the forkserver dying. multiprocessing starts a new one only once it
    sees the old one dead, so the start is tried once more after the grace.

    Args:
        ctx: a multiprocessing context or ``zygote.ZygoteContext``.
        **kwargs: ``ctx.Process``'s arguments.

    Returns:
        The started process.

    Raises:
        KeyboardInterrupt: a Ctrl-C killed the forkserver under this start: it is the loop's.
        EOFError, OSError: starting failed, twice for a forkserver.
    """
    retries = 1 if ctx.get_start_method() == "forkserver" else 0
    while True:
        process = ctx.Process(**kwargs)
        try:
            process.start()
            return process
        except (EOFError, OSError):
            let_a_ctrl_c_arrive()
            if not retries:
                raise
            retries -= 1


class HelperDied(RuntimeError):
    """The helper process ended while the training process was waiting for it."""


class _Link:
    """This process's handle on one helper: its process, its pipes, its ring, and its end.

    Pipes: a control pipe (the helper exits on its EOF), the ring's release mailbox, the task
    pipe (every worker's tasks, ``task_board``), and one result socket back (a socket:
    descriptors travel on it).

    Args:
        ctx: what starts the helper: a multiprocessing context or ``zygote.ZygoteContext``.
        spec: what the helper runs.
        name: the helper's process name, e.g. ``threadloader-helper-7f3a``.
        limit: the most bytes ``spec`` may pickle to (``PickledOnce``), if any.
        shared: pickles ``spec.worker`` once for the helpers started with it, if given.

    Raises:
        PayloadTooLarge: ``spec`` pickles to more than ``limit`` bytes.
        Exception: whatever pickling the dataset, collate_fn or worker_init_fn raises.
    """

    def __init__(
        self,
        ctx: Any,
        spec: HelperSpec,
        name: str,
        limit: int | None = None,
        shared: SharedField | None = None,
    ) -> None:
        control_r, control_w = ctx.Pipe(duplex=False)
        mailbox_r, mailbox_w = ctx.Pipe(duplex=False)  # raw records, never Connection.send
        tasks_r, tasks_w = ctx.Pipe(duplex=False)  # every worker's tasks (``task_board``)
        result_here, result_there = ctx.Pipe(duplex=True)
        self.control: Connection = control_w
        self.mailbox: Connection = mailbox_w
        os.set_blocking(mailbox_w.fileno(), False)
        self.tasks = TaskPipe(tasks_w)  # never blocks: ``task_pipe``
        self.results: Connection = result_here
        TRAINING_ENDS.update([control_w, mailbox_w, tasks_w, result_here])
        self.reader = RingReader(mailbox_w.fileno())
        self.closed = False
        self.started = False  # the helper said it loaded its spec (``wait_started``)
        self._cpus = usable_cpus()
        self.spin = False  # poll before sleeping on the next wait (point 6)
        self.polled = self.spun = 0  # waits that polled; of them, ended without sleeping
        theirs = [control_r, mailbox_r, tasks_r, result_there]
        payload = PickledOnce(spec, limit, shared)
        try:
            self.process = _start_process(
                ctx,
                target=helper_main,
                args=(payload, control_r, mailbox_r, tasks_r, result_there),
                name=name,
                daemon=True,  # multiprocessing ends it at interpreter exit too
            )
        except BaseException:
            for conn in [*theirs, *self._ours()]:
                conn.close()
            self.closed = True
            raise
        finally:
            payload.release()  # a zygote's process keeps its arguments
        for conn in theirs:
            conn.close()
        self._waiting = select.poll()
        self._waiting.register(self.results.fileno(), select.POLLIN)
        self._waiting_or_room = select.poll()  # while tasks wait for room in their pipe
        self._waiting_or_room.register(self.results.fileno(), select.POLLIN)
        self._waiting_or_room.register(self.tasks.fileno, select.POLLOUT)

    def _ours(self) -> list[Connection | TaskPipe]:
        return [self.control, self.mailbox, self.tasks, self.results]

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<helper pid={self.process.pid} {state} {self.reader!r}>"

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send ``msg`` (``task_board``'s TASK or EPOCH) to the helper, without blocking: what
        the task pipe cannot take now goes out during the next waits for results.

        Raises:
            HelperDied: the helper is gone.
            RuntimeError: this link was closed.
        """
        self._check_open()
        try:
            self.tasks.send(msg)
        except OSError:
            raise self._gone() from None

    def flush(self) -> bool:
        """Write the tasks waiting for room in the pipe, as far as it takes them now.

        Returns:
            True when none is left waiting.

        Raises:
            HelperDied: the helper is gone.
        """
        try:
            return self.tasks.flush()
        except OSError:
            raise self._gone() from None

    def ready(self) -> bool:
        """Whether a message is waiting (a snapshot)."""
        # Connection.poll(0) builds a selector per call: ten times the cost of this.
        return not self.closed and bool(self._waiting.poll(0))

    def receive(self, timeout: float | None) -> tuple[Any, ...]:
        """The next result message, mapping or unmapping segments announced before it.

        Args:
            timeout: seconds to wait at most; None waits until a message or the helper's end.

        Raises:
            TimeoutError: nothing arrived within ``timeout``.
            HelperDied: the helper process ended.
            RuntimeError: this link was closed, or the helper could not start (the original
                exception's type, from its ``ExceptionWrapper``).
        """
        self._check_open()
        started = time.perf_counter()
        if self.spin and not self.tasks.pending and (timeout is None or timeout > SPIN_S):
            self.polled += 1
            self.spun += self._poll_for(SPIN_S)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.flush():
                try:
                    arrived = deadline is None or self.results.poll(
                        max(0.0, deadline - time.monotonic())
                    )
                except (EOFError, OSError):
                    raise self._died() from None
            else:  # tasks wait for room: write them as the helper reads (``task_pipe``)
                arrived = self._result_or_room(deadline)
                if not arrived and (deadline is None or time.monotonic() < deadline):
                    continue
            if not arrived:
                raise TimeoutError
            msg = self.take_message()
            if msg is not None:
                # Poll next time while waits are short and the helper leaves a CPU (msg[8]:
                # its fetching threads) to the polling.
                waited = time.perf_counter() - started
                self.spin = waited <= SPIN_S and msg[8] < self._cpus
                return msg

    def wait_started(self, deadline: float | None) -> None:
        """Wait until the helper has loaded its spec (unpickled the dataset, ``collate_fn`` and
        ``worker_init_fn``) and started its workers' threads. Call before any task is sent.

        Args:
            deadline: ``time.monotonic()`` to wait until at most; None waits for good.

        Raises:
            TimeoutError: the helper had not started by ``deadline``.
            HelperDied: the helper process ended.
            RuntimeError: this link was closed, or the helper could not start (the original
                exception's type, from its ``ExceptionWrapper``).
        """
        while not self.started:
            self._check_open()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                arrived = self.results.poll(left)
            except (EOFError, OSError):
                raise self._died() from None
            if not arrived:
                raise TimeoutError
            if self.take_message() is not None:  # no task was sent: nothing to deliver
                raise RuntimeError("threadloader: a helper sent a result before it started")

    def take_message(self) -> tuple[Any, ...] | None:
        """Read one message (waiting for it); a result is returned, a segment's news is applied.

        Returns:
            The ``RESULT`` message, or None when the message was about a segment.

        Raises:
            HelperDied: the helper process ended.
            RuntimeError: the helper could not start (the original exception's type).
        """
        conn = self.results
        try:
            msg = conn.recv()
            tag = msg[0]
            if tag == RESULT:
                return msg
            if tag == SEGMENT:
                _, seg_id, slot_bytes, count = msg
                self.reader.add_segment(seg_id, slot_bytes, count, recv_handle(conn))
            elif tag == RETIRE:
                self.reader.retire(msg[1])
            elif tag == STARTED:
                self.started = True
        except (EOFError, OSError):
            raise self._died() from None
        if tag == FATAL:
            self.close()
            _reraise(msg[1])
        return None

    def _result_or_room(self, deadline: float | None) -> bool:
        """Wait until a result is ready, the task pipe has room, or ``deadline`` passes.

        Returns:
            Whether a result (or the helper's end) is ready to read.
        """
        results = self.results.fileno()
        return any(fd == results for fd, _ in self._waiting_or_room.poll(_poll_ms(deadline)))

    def _poll_for(self, seconds: float) -> bool:
        """Poll the result socket for up to ``seconds``; whether a message arrived."""
        poll = self._waiting.poll  # releases the GIL on each call
        end = time.perf_counter() + seconds
        while not poll(0):
            if time.perf_counter() >= end:
                return False
            yield_cpu()  # to any thread or process waiting for this CPU
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "this threadloader iterator was closed (KeyboardInterrupt, timeout or close()); "
                "start a new epoch with iter(loader)"
            )

    def _gone(self) -> BaseException:
        """Why the helper is gone, found writing to it: the error it sent before it exited (it
        could not load what it runs, and a task was sent before its news was read), else
        ``HelperDied``. What else it sent is dropped: the epoch ends with this error."""
        try:
            while not self.closed and self.results.poll(0):
                self.take_message()
        except Exception as exc:  # noqa: BLE001  # its FATAL's error, or HelperDied at the end
            return exc
        return self._died()

    def _died(self) -> HelperDied:
        self.process.join(CLOSE_WAIT_S)
        code = self.process.exitcode
        self.close()
        if code in (1, -signal.SIGINT):
            # A terminal's Ctrl-C reaches the whole process group, and a helper still starting
            # (before it ignores SIGINT) dies of it: the Ctrl-C, not this error, is the loop's.
            let_a_ctrl_c_arrive()
        return HelperDied(
            f"DataLoader worker (pid(s) {self.process.pid}) exited unexpectedly: "
            f"threadloader's isolation helper process ended with exit code {code}"
        )

    def close(self) -> None:
        """Tell the helper to exit, close the pipes, join it (kill it if it lingers).

        Idempotent; safe from a finalizer and from any thread.

        Raises:
            KeyboardInterrupt: Ctrl-C while waiting (the helper is killed first).
        """
        if self.closed:
            return
        self._close_pipes()
        process = self.process
        if process.pid is None:
            return
        try:
            process.join(CLOSE_WAIT_S)
        except KeyboardInterrupt:  # Ctrl-C while waiting: stop it now, and keep the Ctrl-C
            process.kill()
            raise
        if process.exitcode is None:
            process.kill()
            process.join(CLOSE_WAIT_S)

    def kill(self) -> None:
        """Close the pipes and kill the helper, waiting for nothing. Idempotent.

        What a Ctrl-C that stopped ``close`` anywhere leaves to do (``_primitives.finalizers`` point 2).
        """
        self._close_pipes()
        if self.process.pid is not None and self.process.exitcode is None:
            self.process.kill()

    def reap(self) -> None:
        """Kill the helper and wait for its end, so that no zombie is left. Idempotent."""
        self.kill()
        if self.process.pid is not None:
            self.process.join(CLOSE_WAIT_S)  # SIGKILL cannot be ignored: a moment at most

    def _close_pipes(self) -> None:
        self.closed = True
        for conn in self._ours():  # the control pipe's EOF tells the helper to exit
            try:
                conn.close()  # a second close does nothing
            except OSError:
                pass


class Links:
    """The training process's handles on its helpers: worker ``w`` runs in helper ``w % P``.

    Results are read from whichever helper has one, starting after the helper read last, so
    that no helper's results wait behind another's. The group, never an iterator, is what a
    finalizer holds.

    Args:
        links: one ``_Link`` per helper, started.
    """

    def __init__(self, links: list[_Link]) -> None:
        self.links = links
        self._waiting = select.poll()
        for link in links:
            self._waiting.register(link.results.fileno(), select.POLLIN)
        self._next = 0

    def __repr__(self) -> str:
        return " ".join(repr(link) for link in self.links)

    def for_worker(self, worker_id: int) -> _Link:
        """The link to the helper that runs worker ``worker_id``."""
        return self.links[worker_id % len(self.links)]

    def ready(self) -> bool:
        """Whether any helper's message is waiting (a snapshot)."""
        return any(link.ready() for link in self.links)

    def wait_started(self, timeout: float | None) -> None:
        """Wait until every helper has loaded its spec and started (``_Link.wait_started``).

        Args:
            timeout: seconds to wait at most, for all of them; None waits for good.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for link in self.links:
            link.wait_started(deadline)

    def receive(self, timeout: float | None) -> tuple[Any, ...]:
        """The next result message from any helper.

        Args:
            timeout: seconds to wait at most; None waits until a message or a helper's end.

        Raises:
            TimeoutError: nothing arrived within ``timeout``.
            HelperDied: a helper process ended.
            RuntimeError: a link was closed, or a helper could not start.
        """
        if len(self.links) == 1:
            return self.links[0].receive(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        count = len(self.links)
        while True:
            for step in range(count):
                i = (self._next + step) % count
                link = self.links[i]
                link._check_open()
                if link.ready():
                    msg = link.take_message()
                    if msg is not None:
                        self._next = (i + 1) % count
                        return msg
            wait_ms = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                wait_ms = max(1, int(left * 1000))
            waiting = self._waiting
            writing = [link for link in self.links if not link.flush()]
            if writing:  # tasks wait for room: write them as the helpers read (``task_pipe``)
                waiting = select.poll()
                for link in self.links:
                    waiting.register(link.results.fileno(), select.POLLIN)
                for link in writing:
                    waiting.register(link.tasks.fileno, select.POLLOUT)
            waiting.poll(wait_ms)  # a helper's end shows as ready: read, it raises

    def close(self) -> None:
        """Close every link (``_Link.close``); a Ctrl-C meanwhile kills the rest, then is raised."""
        try:
            for link in self.links:
                link.close()
        except KeyboardInterrupt:
            self.kill()
            raise

    def kill(self) -> None:
        """Kill every helper, waiting for nothing (``_Link.kill``)."""
        for link in self.links:
            link.kill()

    def reap(self) -> None:
        """Kill every helper, then wait for their ends (``_Link.reap``)."""
        self.kill()
        for link in self.links:
            link.reap()
