"""``device=``: an epoch whose batches arrive on the device, copied on a side stream.

``iter(loader)`` with ``device`` set returns a ``DeviceEpochIterator``: a facade over the usual
epoch iterator (threaded or inline), which a ``DevicePrefetcher``'s transfer thread drains, so
that each batch's host-to-device copy is issued off the training thread and overlaps its compute.

Consumer-aligned state: the transfer thread runs ``device_prefetch`` batches ahead of the loop,
and the epoch iterator's ``Progress`` advances with it. Each host batch therefore travels with a
snapshot of that progress (a ``Tagged`` leaf, which the copy leaves alone), and the facade's own
``Progress`` -- the one the loader saves -- takes the snapshot of the batch it hands over. A
worker's error travels the same way, in its batch's place, and is raised when its turn comes.
A live change of the index stream (``set_mixture_weights``) stops the transfer thread, drops
what it holds, takes the host epoch back to the loop's position (``rewound``) and starts a new
transfer thread.

Memory path: with a CUDA device, workers collate straight into pinned staging buffers from a
``BufferPool`` shared with the prefetcher, which returns each buffer to the pool once the copy
that reads it has completed (its CUDA event). Without ``device``, ``pin_memory=True`` collates
straight into torch's pinned host allocator: one copy instead of collate-then-pin.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate

from threadloader._engine.options import options_of
from threadloader._engine.state import Progress
from threadloader._primitives.finalizers import Finalizer
from threadloader.device.handoff import failure
from threadloader.device.pinned import BufferPool, pinned_allocator, pinning_collate
from threadloader.device.recycle import RecyclingCollate
from threadloader.device.transfer import DevicePrefetcher, Tagged, device_from_arg

#: ``device_prefetch`` when the loader leaves it None.
DEVICE_PREFETCH = 2
#: Staging buffers per batch in flight: a batch may hold several tensors (inputs, targets...).
BUFFERS_PER_BATCH = 4


def device_prefetch(loader: Any) -> int:
    """Batches kept on the device ahead of the loop: ``DEVICE_PREFETCH`` unless the loader says."""
    given = options_of(loader).device_prefetch
    return DEVICE_PREFETCH if given is None else int(given)


def staging_pool(loader: Any) -> BufferPool | None:
    """The pinned staging pool for ``loader.device``; None when the device is not CUDA."""
    device = options_of(loader).device
    if device is None or device_from_arg(device).type != "cuda":
        return None
    in_flight = (loader.prefetch_factor or 1) * max(loader.num_workers, 1) + device_prefetch(loader)
    return BufferPool(max_buffers=BUFFERS_PER_BATCH * (in_flight + 2))


def host_collate(loader: Any, collate_fn: Callable[[Any], Any], pin: bool) -> Callable[[Any], Any]:
    """The collate function workers run: straight into pinned memory when that is wanted.

    Args:
        loader: the ThreadDataLoader (its ``_staging`` pool, when ``device`` is CUDA).
        collate_fn: the loader's collate function.
        pin: torch's own decision to pin (``pin_memory=True`` and an accelerator present).
    """
    staging = getattr(loader, "_staging", None)
    as_worker = loader.num_workers > 0  # torch collates in a worker process: out= semantics
    if staging is not None:
        return pinning_collate(collate_fn, staging, as_worker=as_worker)
    if pin:
        return pinning_collate(collate_fn, pinned_allocator, as_worker=as_worker)
    recycler = getattr(loader, "_recycler", None)
    if recycler is not None and collate_fn is default_collate:
        return RecyclingCollate(recycler, as_worker=as_worker)
    return collate_fn


def copy_progress(progress: Progress) -> Progress:
    """A copy of ``progress`` that shares none of the lists an epoch changes in place."""
    return dataclasses.replace(
        progress,
        dataset_states=list(progress.dataset_states or []) or None,
        rng_states=list(progress.rng_states or []) or None,
        workers_alive=list(progress.workers_alive),
        worker_batches=list(progress.worker_batches),
        sampler_snapshots={},  # the transfer thread's own: nothing reads them from here
    )


@dataclasses.dataclass(frozen=True)
class _Raised:
    """A host batch whose making raised: the error rides the transfer stage in its batch's
    place, tagged like a batch, so that the loop's progress counts it when it is raised."""

    exc: BaseException


@dataclasses.dataclass(frozen=True)
class _HostTag:
    """What rides with a host batch: the epoch's progress after it, and how many batches
    (errors included) the epoch had handed out with it."""

    progress: Progress
    handed_out: int


class _HostBatches:
    """What the transfer thread pulls: host batches, or the errors raised in their place, each
    tagged with the progress after it.

    Holds the epoch iterator strongly: the transfer thread is its only consumer.
    """

    def __init__(self, epoch: Any) -> None:
        self._epoch = epoch
        self.handed_out = 0  # batches next() returned or raised for (not StopIteration)

    def __iter__(self) -> _HostBatches:
        return self

    def __next__(self) -> Tagged[Any]:
        try:
            batch = next(self._epoch)
        except StopIteration:
            raise
        except Exception as exc:  # noqa: BLE001  # a worker's error takes its batch's place
            # Its frames' locals cleared, as a Failure's; and never a local of this frame, which
            # its traceback holds: the cycle would keep the loop's iterator alive.
            return self._tagged(_Raised(failure(exc).exc))
        return self._tagged(batch)

    def _tagged(self, batch: Any) -> Tagged[Any]:
        self.handed_out += 1
        return Tagged(batch, _HostTag(copy_progress(self._epoch._progress), self.handed_out))


def _close(prefetcher: DevicePrefetcher[Any]) -> None:
    prefetcher.close()


def retire(last: weakref.ref[DeviceEpochIterator] | None, thread: threading.Thread | None) -> None:
    """Stop the last epoch's transfer thread and wait for it, however long its last pull takes.

    With persistent workers the next ``iter()`` resets the same host epoch iterator, which the
    last epoch's transfer thread may still be pulling from (a batch it will drop). Two threads
    must never drive one epoch iterator: the old thread took the new epoch's first batches and
    corrupted its reorder table. torch's own reset likewise waits for the batches in flight.

    Args:
        last: the last epoch's facade, if the loop still holds it (closing it drops its batches).
        thread: its transfer thread, kept apart: a dropped facade's finalizer joins it for
            ``transfer.JOIN_TIMEOUT_S`` only.
    """
    epoch = last() if last is not None else None
    if epoch is not None:
        epoch.close()
    if thread is not None and thread is not threading.current_thread():
        thread.join()


class DeviceEpochIterator:
    """One epoch, batches on ``loader.device``; what ``iter(loader)`` returns with ``device=``.

    Args:
        loader: the ThreadDataLoader.
        epoch: the host-side epoch iterator, which only the transfer thread will drain.
        persistent: the epoch iterator outlives this epoch (persistent workers): closing this
            must not close it.
    """

    def __init__(self, loader: Any, epoch: Any, persistent: bool) -> None:
        self._progress = copy_progress(epoch._progress)  # what the loop has received
        self._stats = epoch._stats
        self._stats.attach_consumer()  # before the transfer thread starts draining the epoch
        self._epoch_ref = weakref.ref(epoch)
        self._workers: list[Any] = epoch._workers  # the host epoch's workers
        self._host = _HostBatches(epoch)
        # The loop, not the transfer thread, reaches the end: until then batches may be taken
        # back (``rewound``) and made again by the same workers. Closing this closes the epoch.
        epoch.closed_by_consumer = True
        self._received = 0  # of the host epoch's batches (and errors), by the loop
        self._prefetcher: DevicePrefetcher[Any] = DevicePrefetcher(
            self._host,
            options_of(loader).device,
            device_prefetch(loader),
            pool=getattr(loader, "_staging", None),
            on_close=None if persistent else epoch.close,
            name=f"threadloader-{id(self):x}-transfer",
        )
        self._finalizer = Finalizer(
            self, _close, self._prefetcher, on_interrupt=self._prefetcher._transfer.abandon
        )
        self._issued = 0.0

    def __iter__(self) -> DeviceEpochIterator:
        return self

    def __len__(self) -> int:
        epoch = self._epoch_ref()
        return len(epoch) if epoch is not None else 0

    def __next__(self) -> Any:
        start = time.perf_counter()
        delivered = ended = False
        try:
            tagged = next(self._prefetcher)
            delivered = not isinstance(tagged.batch, _Raised)
        except StopIteration:
            self._progress.exhausted = ended = True
            raise
        except KeyboardInterrupt:
            self.close()
            raise
        except Exception:
            self._received += 1  # a failed copy: its host batch was handed out
            raise
        finally:
            self._stats.on_consumer_wait(time.perf_counter() - start, delivered, ended)
        tag: _HostTag = tagged.tag
        self._progress.__dict__.update(tag.progress.__dict__)
        self._received = tag.handed_out
        if not delivered:
            exc = tagged.batch.exc
            del tagged
            try:
                raise exc
            finally:
                del exc  # the traceback holds this frame: no cycle through the exception
        issued = self._prefetcher.stats().issue_s
        self._stats.caller.add("transfer", issued - self._issued)
        self._issued = issued
        return tagged.batch

    @property
    def transfer_thread(self) -> threading.Thread:
        """The thread that drains the host epoch (``retire`` waits for it)."""
        return self._prefetcher.thread

    def close(self) -> None:
        """Stop the transfer thread (and, unless persistent, the workers). Idempotent."""
        self._finalizer()

    def rewound(self, change: Callable[[], Any]) -> Any:
        """Run ``change`` with the host epoch back at the loop's position, then go on from it.

        For a live change of the index stream (``ThreadDataLoader.set_mixture_weights``): the
        transfer thread stops pulling; the batches it holds are dropped and the host epoch
        takes back those it had handed out past the loop (``take_back``), so that ``change``
        sees the sampler, the progress and the workers as the loop does; a new transfer thread
        then pulls what ``change`` dispatched. Call it from the thread that iterates.

        Args:
            change: rewinds the sampler to the loop's position and redispatches the host epoch.

        Returns:
            What ``change`` returned.

        Raises:
            RuntimeError: this epoch was closed.
        """
        epoch = self._epoch_ref()
        if epoch is None:
            raise RuntimeError("this epoch was closed")
        outcome: list[Any] = []

        def rewind() -> None:
            epoch.take_back(copy_progress(self._progress), self._received)
            self._host.handed_out = self._received
            outcome.append(change())
            # The loop stands where the host epoch now does: ``change`` may have begun a new
            # pass of the sampler there, which the next change or state must count from.
            self._progress.__dict__.update(copy_progress(epoch._progress).__dict__)

        self._prefetcher.restart(rewind)
        return outcome[0]

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        raise RuntimeError("a device epoch is not reset; iter(loader) makes a new one")


def check_device_args(device: Any, device_prefetch: Any) -> None:
    """Validate ``device=`` and ``device_prefetch=`` at construction, naming the bad value.

    Raises:
        ValueError, RuntimeError, TypeError: see ``transfer.device_from_arg``.
        ValueError: ``device_prefetch`` is neither None nor an int >= 1.
    """
    if device_prefetch is not None:
        is_int = isinstance(device_prefetch, int) and not isinstance(device_prefetch, bool)
        if not is_int or device_prefetch < 1:
            raise ValueError(f"device_prefetch must be an int >= 1, got {device_prefetch!r}")
    if device is not None:
        device_from_arg(device)


def refuse_prefetch_without_device(device: Any, device_prefetch: Any) -> None:
    """Refuse ``device_prefetch=`` without ``device=``, where it would be ignored.

    Raises:
        ValueError: ``device_prefetch`` is set and ``device`` is None.
    """
    if device is None and device_prefetch is not None:
        raise ValueError(
            f"device_prefetch={device_prefetch!r} sets how many batches wait on the device, so "
            "it needs device= (without it batches stay on the host)"
        )
