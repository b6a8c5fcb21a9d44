"""Move batches to the GPU on a side CUDA stream while the training loop computes.

``DevicePrefetcher`` owns one thread and one CUDA stream. The thread pulls host batches from a
source iterator, issues ``copy(non_blocking=True)`` of every tensor on its stream, records an
event, and hands the device batch over; ``__next__`` makes the consumer's current stream wait on
that event (a GPU-side wait: the host never synchronizes) and marks every delivered tensor with
``record_stream(current_stream)``.

Why ``record_stream``: the device tensors are allocated on the side stream, and torch's caching
allocator only orders reuse of a freed block after work on the stream that allocated it. When
the training loop drops a batch its kernels may still be queued on *its* stream; without the
mark the transfer thread's next allocation could get the same block and overwrite it before
those kernels read it (the race SPDL fixed in its PR #1082 by holding on to old batches).
``record_stream`` makes the allocator wait for the consumer stream's work queued at free time.

How a prefetcher behaves; where the code disagrees with this, the code is wrong.

1. Order: batches arrive in the order the source produced them; at most ``depth`` batches have
   been pulled from the source and not yet delivered (they occupy device memory).
2. Errors: an exception from the source (or from a copy) is raised by ``__next__`` at its
   position; the batches before it are delivered first, and the prefetcher keeps pulling after
   it, as calling ``next(source)`` directly would. A non-``Exception`` (``SystemExit``) ends it.
3. Drained: the source's ``StopIteration`` is delivered last; the thread has then exited and is
   joined, and every later ``next()`` raises ``StopIteration``.
4. Abandoned (``close()``, ``break``, ``del``, garbage collection, interpreter exit): nothing new
   is pulled, batches not delivered are dropped, the thread is joined. The thread never
   references the prefetcher, so dropping it is enough for its finalizer to run; ``next()``
   after ``close()`` raises ``RuntimeError``.
5. Host staging buffers that came from ``pool`` go back to it with the copy's event, so they are
   reused only once the copy has read them. ``device="cpu"`` passes batches through unchanged,
   with the same thread, ordering and shutdown (what CI without a GPU exercises).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from threadloader._primitives import exit_hook
from threadloader._primitives.finalizers import Finalizer
from threadloader._primitives.intra_op import single_intra_op_thread
from threadloader.device.copier import CudaCopier, Moved, PassThrough
from threadloader.device.handoff import END, Failure, Handoff, HandoffClosed, HandoffState, failure
from threadloader.device.pinned import BufferPool, PoolStats

__all__ = ["DevicePrefetcher", "Tagged", "TransferStats", "device_from_arg"]

T = TypeVar("T")

#: Seconds ``close()`` waits for the transfer thread, which may be inside ``next(source)``. A
#: source stuck longer than that is left to return on its own; the thread then exits at once.
JOIN_TIMEOUT_S = 10.0

DeviceLike = str | int | torch.device


def device_from_arg(device: DeviceLike) -> torch.device:
    """Validate a ``device=`` argument and resolve it to the device batches will land on.

    ``"cuda"`` resolves to the *current* CUDA device of the calling thread, now: the transfer
    thread has a current device of its own (0), so an unresolved ``"cuda"`` would silently copy
    to device 0 on a rank that called ``torch.cuda.set_device(3)``.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int N (CUDA device N) or a
            ``torch.device`` of those types.

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", index)`` with the index filled in.

    Raises:
        TypeError: ``device`` is not a str, int or ``torch.device``.
        ValueError: an unknown device string, a device type other than cpu and cuda, or a CUDA
            index that does not exist; the message names the device.
        RuntimeError: a CUDA device was asked for and CUDA is not available.
    """
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a str, int or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device!r}: a CUDA device index must be >= 0")
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"device={device!r} is not a device torch knows: {err}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"device={device!r}: batches can be moved to 'cpu' or 'cuda' devices, not {dev.type!r}"
        )
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        raise RuntimeError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with {build}); use device=None or 'cpu'"
        )
    count = torch.cuda.device_count()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ValueError(
            f"device={device!r}: there is no CUDA device {index}; {count} visible "
            "(see CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", index)


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """A snapshot of a ``DevicePrefetcher``; a new one per ``stats()`` call."""

    batches: int  # delivered to the consumer
    wait_s: float  # time __next__ spent blocked waiting for a batch: the loop's starvation
    issue_s: float  # transfer-thread time spent issuing copies (not their GPU duration)
    bytes: int  # bytes of tensors copied to the device
    pool: PoolStats | None  # the staging pool's counters, if there is one


@dataclasses.dataclass(frozen=True)
class Tagged(Generic[T]):
    """A batch with metadata that rides along untouched: only ``batch`` goes to the device.

    A source may yield ``Tagged(batch, tag)``; the prefetcher then delivers
    ``Tagged(batch_on_device, tag)``, the very same ``tag`` object, never walked or moved. The
    loader uses it to carry each batch's resume state (which may hold tensors, e.g. generator
    states, that must stay on the host) so that its state stays aligned with what the training
    loop received, not with what was prefetched.
    """

    batch: T
    tag: Any


class _Transfer:
    """Everything the transfer thread uses; the ``DevicePrefetcher`` facade is never reachable
    from here, so dropping the facade runs its finalizer, which closes this."""

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device,
        depth: int,
        pool: BufferPool | None,
        on_close: Callable[[], None] | None,
        name: str,
    ) -> None:
        self.source: Iterator[Any] | None = source
        self.device = device
        self.pool = pool
        self.copier: CudaCopier | PassThrough = (
            CudaCopier(device, pool) if device.type == "cuda" else PassThrough()
        )
        self.handoff = Handoff(depth)
        self.on_close = on_close
        self.name = name
        self.state = HandoffState.RUNNING
        self.batches = 0
        self.wait_s = 0.0
        self._lock = threading.Lock()
        self._closing = False
        self.finished = threading.Event()  # set as the thread's function returns
        self.thread = threading.Thread(
            target=_transfer_loop,
            args=(self, source),
            name=name,
            daemon=True,  # never block exit; the exit hook joins it first
        )

    def next(self) -> Any:
        if self.state is HandoffState.DRAINED:
            raise StopIteration
        if self.state is HandoffState.CLOSED:
            raise RuntimeError(
                f"{self.name} was closed; its batches not yet delivered were dropped"
            )
        start = time.perf_counter()
        try:
            item = self.handoff.get()
        except HandoffClosed:
            raise RuntimeError(f"{self.name} was closed while waiting for a batch") from None
        except KeyboardInterrupt:
            self.close()  # Ctrl-C while waiting: the epoch is over, the thread must not linger
            raise
        finally:
            self.wait_s += time.perf_counter() - start
        if item is END:
            self.state = HandoffState.DRAINED
            self.close()
            raise StopIteration
        if isinstance(item, Failure):
            exc = item.exc
            del item
            try:
                raise exc
            finally:
                del exc  # the traceback holds this frame: no cycle through the exception
        self.batches += 1
        return self.copier.deliver(item)

    def restart(self, rewind: Callable[[], None]) -> None:
        """Drop the batches pulled and not delivered, run ``rewind``, then pull again.

        The thread finishes the pull it is in (``on_close`` is not run: the source stays open),
        and ``rewind`` runs here once no thread pulls, so it may move the source back; a new
        thread then pulls on from where the source is. A Ctrl-C, or ``rewind`` raising, ends
        the stream instead: the consumer's next ``next()`` raises.

        Raises:
            RuntimeError: the prefetcher was closed (also while it restarted, from another
                thread), or this is its own thread (it would wait for itself).
        """
        if self.state is not HandoffState.RUNNING:
            raise RuntimeError(f"{self.name} was closed; it cannot start pulling again")
        if threading.current_thread() is self.thread:
            raise RuntimeError(
                f"{self.name} was asked to restart (a live mixture-weight change) from its own "
                "thread, by code it runs as it pulls a batch (the dataset, with num_workers=0): "
                "it would wait for itself; make the change from the thread that iterates"
            )
        try:
            dropped = self.handoff.close()  # wakes the thread if it waits for a slot
            del dropped
            self.finished.wait()  # as long as its pull takes: the source is not ours until then
            self.thread.join()
            rewind()
            with self._lock:  # a close() from another thread meanwhile: no new thread
                if self._closing:
                    raise RuntimeError(f"{self.name} was closed while it restarted")
                self.handoff = Handoff(self.handoff.depth)
                self.finished = threading.Event()
                self.thread = threading.Thread(
                    target=_transfer_loop, args=(self, self.source), name=self.name, daemon=True
                )
                self.thread.start()
        except BaseException:
            self.abandon()  # a new thread, if it started, sees its hand-off closed and exits
            raise

    def abandon(self) -> None:
        """Stop the thread without waiting for it; the exit hook joins it. Idempotent.

        What a Ctrl-C that stopped ``close`` anywhere leaves to do (``_primitives.finalizers`` point 2).
        """
        if self.state is HandoffState.RUNNING:
            self.state = HandoffState.CLOSED
        self.handoff.close()  # wakes the thread; a second close does nothing more

    def close(self) -> None:
        """Stop the thread and join it. Safe from a finalizer and from that thread.

        Idempotent, and complete when called again after a Ctrl-C stopped it: every call wakes
        the thread and waits for it (the exit hook's too); ``on_close`` runs once.
        """
        with self._lock:
            first, self._closing = not self._closing, True
        if self.state is HandoffState.RUNNING:
            self.state = HandoffState.CLOSED
        dropped = self.handoff.close()
        del dropped  # device batches never delivered: freed here, only the side stream used them
        error: BaseException | None = None
        if first and self.on_close is not None:
            try:
                self.on_close()  # e.g. close the loader's epoch, so a pending next() returns
            except BaseException as exc:  # noqa: BLE001  # re-raised once the thread is joined
                error = exc
        if self.thread.ident is not None and self.thread is not threading.current_thread():
            # Waiting for ``finished`` first: CPython 3.11 marks a thread whose join a Ctrl-C
            # interrupted as stopped, and a later join of it returns at once.
            self.finished.wait(JOIN_TIMEOUT_S)
            self.thread.join(JOIN_TIMEOUT_S)
        self.source = None  # the source (an epoch and its workers) may now be collected
        exit_hook.untrack(self)
        if error is not None:
            try:
                raise error
            finally:
                del error


def _transfer_loop(transfer: _Transfer, source: Iterator[Any]) -> None:
    """What the transfer thread runs (``_transfer_batches``), then says it has finished."""
    try:
        _transfer_batches(transfer, source)
    finally:
        transfer.finished.set()


def _transfer_batches(transfer: _Transfer, source: Iterator[Any]) -> None:
    """Take a slot, pull a batch, copy it, hand it over; until the end or the close."""
    handoff, copier = transfer.handoff, transfer.copier
    try:
        single_intra_op_thread()  # as torch's pin-memory thread: staging copies stay on this one
        copier.enter_thread()
    except BaseException as exc:  # noqa: BLE001  # delivered to the consumer, not lost
        _finish(handoff, failure(exc))
        return
    while handoff.take_slot():
        try:
            host = next(source)
        except StopIteration:
            handoff.put(END)
            return
        except BaseException as exc:  # noqa: BLE001  # raised by the consumer's next()
            handoff.put(failure(exc))
            if not isinstance(exc, Exception):  # SystemExit and the like end the stream
                _finish(handoff, None)
                return
            del exc
            continue
        item: Moved | Failure
        try:
            if isinstance(host, Tagged):
                moved = copier.move(host.batch)
                item = dataclasses.replace(moved, batch=Tagged(moved.batch, host.tag))
                del moved  # a blocked take_slot() must not pin it either
            else:
                item = copier.move(host)
        except BaseException as exc:  # noqa: BLE001  # e.g. CUDA out of memory: the consumer's
            item = failure(exc)
        del host  # a blocked take_slot() must not pin the last host batch
        handoff.put(item)
        del item


def _finish(handoff: Handoff, failure: Failure | None) -> None:
    """End the stream early: ``failure`` (if any), then the end, each in a slot of its own."""
    if failure is not None and handoff.take_slot():
        handoff.put(failure)
    if handoff.take_slot():
        handoff.put(END)


class DevicePrefetcher(Generic[T]):
    """Iterate ``source`` with its batches already on ``device``, ``depth`` batches ahead.

    One thread owned by the prefetcher pulls batches from ``source`` and copies every tensor in
    them (through dicts, lists, tuples and namedtuples, as ``pin_memory`` walks them; other
    objects pass through unchanged) to ``device`` with ``non_blocking=True`` on the
    prefetcher's own CUDA stream, then records an event. ``__next__`` makes the calling thread's
    current stream wait on that event and calls ``record_stream`` on every tensor it delivers,
    so the batch is complete for any kernel launched after ``next()`` returns, the host never
    synchronizes, and the caching allocator cannot reuse a batch's memory while the consumer's
    kernels may still read it. Copies are asynchronous when the host tensors are pinned; with a
    ``pool``, pageable ones are first staged into pooled pinned buffers, and pooled buffers
    (e.g. collated into by ``pinned_collate(batch, pool)``) return to the pool once their copy
    completed.

    ``source`` runs on the prefetcher's thread, which holds it until ``close()``: it must not
    reference the object whose finalizer closes the prefetcher, or that object is never
    collected. Non-tensor leaves pass through unchanged, so a source may yield
    ``(batch, metadata)`` pairs to carry per-batch state, aligned with what the consumer got.

    Args:
        source: the host batches.
        device: where batches go (see ``device_from_arg``); ``"cpu"`` passes them through.
        depth: batches pulled from ``source`` and not yet delivered, at most (device memory
            holds this many batches besides those the consumer keeps).
        pool: pinned staging buffers; None: tensors are copied from where they are. Needs a
            CUDA ``device`` (nothing is staged for any other).
        on_close: called by ``close()`` before joining the thread, to wake it if it waits
            inside ``next(source)`` (e.g. the loader epoch's own ``close``). Thread-safe, and
            must not reference the prefetcher.
        name: the thread's name, for stack dumps.

    Raises:
        TypeError, ValueError, RuntimeError: an invalid ``device`` (see ``device_from_arg``).
        ValueError: ``depth`` below 1; a ``pool`` with a device other than CUDA (it would
            be ignored).
    """

    def __init__(
        self,
        source: Iterator[T],
        device: DeviceLike,
        depth: int = 2,
        pool: BufferPool | None = None,
        *,
        on_close: Callable[[], None] | None = None,
        name: str | None = None,
    ) -> None:
        dev = device_from_arg(device)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if pool is not None and dev.type != "cuda":
            raise ValueError(
                f"pool= stages host-to-CUDA copies, but device is {dev}: nothing would be staged"
            )
        self._transfer = _Transfer(
            iter(source),
            dev,
            depth,
            pool,
            on_close,
            name or f"threadloader-{id(self):x}-transfer",
        )
        # The finalizer holds the _Transfer, never self: break, del and GC all end the thread.
        self._finalizer = Finalizer(self, self._transfer.close, on_interrupt=self._transfer.abandon)
        exit_hook.track(self._transfer)
        try:
            self._transfer.thread.start()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        t = self._transfer
        alive = t.thread.is_alive()
        return (
            f"<DevicePrefetcher {t.name} device={t.device} state={t.state.name} "
            f"delivered={t.batches} thread_alive={alive}>"
        )

    def __iter__(self) -> DevicePrefetcher[T]:
        return self

    def __next__(self) -> T:
        """Return the next batch, on the device and ready for the current stream.

        Raises:
            StopIteration: the source is exhausted.
            RuntimeError: the prefetcher was closed.
            BaseException: whatever the source (or a copy) raised for this position.
        """
        result: T = self._transfer.next()
        return result

    @property
    def device(self) -> torch.device:
        """The resolved device batches land on."""
        return self._transfer.device

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream the copies run on; None for ``device="cpu"``."""
        return self._transfer.copier.stream

    @property
    def thread(self) -> threading.Thread:
        """The transfer thread (for tests and stack dumps)."""
        return self._transfer.thread

    def close(self) -> None:
        """Stop pulling, drop batches not delivered, join the thread. Idempotent."""
        self._finalizer()

    def restart(self, rewind: Callable[[], None]) -> None:
        """Drop the batches not delivered and pull again, after ``rewind`` moved the source.

        For a source whose later batches changed (a live mixture-weight change): the transfer
        thread finishes the pull it is in, then ``rewind`` runs in the calling thread while no
        thread pulls from ``source``, and a new transfer thread pulls on from there. Call it
        from the thread that iterates.

        Args:
            rewind: moves the source back to the first batch the consumer has not received.

        Raises:
            RuntimeError: the prefetcher was closed, or this is called from its transfer
                thread (the dataset's code, with ``num_workers=0``), which it would wait for.
            BaseException: what ``rewind`` raised; the prefetcher is then closed.
        """
        self._transfer.restart(rewind)

    def stats(self) -> TransferStats:
        """Return a snapshot of this prefetcher's counters."""
        t = self._transfer
        return TransferStats(
            batches=t.batches,
            wait_s=t.wait_s,
            issue_s=t.copier.issue_s,
            bytes=t.copier.bytes,
            pool=t.pool.stats() if t.pool is not None else None,
        )
