"""ThreadDataLoader: torch's DataLoader, with worker threads instead of worker processes."""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, _DatasetKind
from torch.utils.data.dataloader import _BaseDataLoaderIter

from threadloader._engine import global_rng, worker_info
from threadloader._engine.dataset_state import settle_dataset
from threadloader._engine.device_epoch import (
    DeviceEpochIterator,
    check_device_args,
    refuse_prefetch_without_device,
    staging_pool,
)
from threadloader._engine.device_epoch import retire as retire_device_epoch
from threadloader._engine.inline import InlineDataLoaderIter
from threadloader._engine.options import Options, check_helpers_type, check_log_every
from threadloader._engine.state import (
    EndRanEarly,
    Progress,
    Resume,
    SamplerSnapshot,
    build_state,
    epoch_complete,
    epoch_left_for_the_next,
    loaded_epoch_left,
    ran_out_and_delivered,
    resumes_a_finished_epoch,
    stream_ended,
)
from threadloader._engine.state_check import parse_state
from threadloader._engine.state_codec import RNG_KEYS, decode_state, encode_rng
from threadloader._engine.stats import EpochStats, LoaderStats
from threadloader._engine.threaded import ThreadedDataLoaderIter
from threadloader._primitives import finalizers
from threadloader._primitives.concurrency import usable_cpus
from threadloader._primitives.warn import warn_user
from threadloader.device.pinned import BufferPool
from threadloader.device.recycle import RecyclingAllocator
from threadloader.isolation.auto import PROCESS, THREADS, AutoIsolation, Choice, one_line
from threadloader.isolation.helper_source import (
    check_isolation,
    refresh_zygote,
    start_helper_server,
)
from threadloader.isolation.main_state import code_of
from threadloader.isolation.mid_epoch import mover_for
from threadloader.isolation.parent import GlobalsLeftOut, IsolatedDataLoaderIter
from threadloader.isolation.zygote import StaleScriptCode
from threadloader.isolation.zygote import running as zygote_running

T_co = TypeVar("T_co", covariant=True)


#: Above this many worker threads per core we warn, as torch warns above one process per core.
#: Threads that mostly wait (object storage, HTTP) are cheap: dozens per core are legitimate.
THREADS_PER_CORE_WARNING = 32
#: Unused batch buffers kept for reuse: one is freed by the loop for each one a worker needs,
#: so two cover the steady state, and at most two batches' memory is held beyond torch's.
RECYCLED_BUFFERS = 2
#: Called with every ThreadDataLoader at the end of its ``__init__``: how integrations (a higher
#: layer) learn of a loader, e.g. to hook a framework that will rebuild it (Accelerate).
BUILT_HOOKS: list[Callable[[Any], None]] = []

worker_info.install()


#: Attributes a copy of a loader starts without (``ThreadDataLoader.__getstate__``).
_PROCESS_LOCAL = (
    "_recycler",
    "_staging",
    "_host_epoch",
    "_device_facade",
    "_transfer_thread",
    "_stats",
    "_made",
)


def _left_epoch_seeds(resume: Resume) -> tuple[torch.Tensor | None, int]:
    """Where a loaded state's epoch, left by ``set_epoch``, leaves the next ``iter()``: the
    loader's generator state (None when the loader draws from the global RNG) and the base seed
    persistent workers keep."""
    by_generator = resume.rng_source == "generator"
    return (resume.rng_state if by_generator else None), resume.base_seed


def _rng_restorer(generator: torch.Generator | None) -> Callable[[], None]:
    """What puts torch's global RNG, and ``generator`` if given, back as they are now."""
    rng = torch.get_rng_state()
    state = generator.get_state() if generator is not None else None

    def restore() -> None:
        torch.set_rng_state(rng)
        if generator is not None and state is not None:
            generator.set_state(state)

    return restore


class ThreadDataLoader(DataLoader[T_co]):
    """A ``torch.utils.data.DataLoader`` whose workers are threads in the training process.

    Every argument keeps DataLoader's name, position, default, validation and error message
    (``__init__`` is torch's); batches, their order, seeds and ``get_worker_info()`` are what
    DataLoader gives for the same inputs. What changes is where workers run:

    - ``num_workers=0`` is torch's single-process loading, unchanged.
    - ``num_workers=N`` starts N threads, not N processes. Each worker fetches from its own
      shallow copy of the dataset object (``copy.copy``: the data it references is in memory
      once, with no copy-on-read growth), and fetches and collates whole batches, as torch's
      do: no pickling of batches, no shared-memory files.
    - ``multiprocessing_context`` is validated as torch does, then unused: there are no
      worker processes to start.
    - Inside a worker thread, torch's default generator (every random op called without a
      generator, ``torch.manual_seed`` and friends), ``random`` and ``numpy.random`` are the
      worker's own, seeded as torch seeds a worker process (``get_worker_info().rng`` holds the
      torch and ``random`` ones; ``torch.random.thread_safe_generator()`` returns the torch
      one); the training thread's RNGs are never moved by a worker.

    Args:
        dataset: as DataLoader. Each worker thread sees its own shallow copy.
        batch_size: as DataLoader.
        shuffle: as DataLoader.
        sampler: as DataLoader.
        batch_sampler: as DataLoader.
        num_workers: number of worker *threads*; 0 loads in the calling thread.
        collate_fn: as DataLoader; runs in the worker thread.
        pin_memory: as DataLoader; pinning happens in the worker thread.
        drop_last: as DataLoader.
        timeout: as DataLoader: seconds to wait for a batch before ``RuntimeError``.
        worker_init_fn: as DataLoader; called once in each worker thread with its id.
        multiprocessing_context: validated as DataLoader does; unused.
        generator: as DataLoader: drives the sampler and each epoch's ``base_seed``.
        prefetch_factor: batches in flight per worker (default 2 with workers).
        persistent_workers: keep the worker threads across epochs.
        pin_memory_device: as DataLoader (deprecated there).
        in_order: as DataLoader: deliver in sampler order, or as batches complete.
        snapshot_every_n_steps: as torchdata's ``StatefulDataLoader``, accepted so that code
            written for it runs unchanged; kept as an attribute. There it sets how often worker
            processes send their dataset state to the main process, trading a cheaper step for
            a resume that replays up to that many batches. Worker threads hand their state over
            with every batch at no IPC cost, so a state is always exact and this value changes
            nothing.
        device: (ours, keyword-only) deliver batches on this device (``"cuda"``, ``"cuda:1"``,
            a ``torch.device``): a transfer thread copies them on its own CUDA stream while
            the loop computes; workers collate straight into pinned staging buffers. ``None``
            (default): batches stay on the host, as with DataLoader.
        device_prefetch: (ours, keyword-only) batches kept on the device ahead of the loop;
            ``None`` (default): 2 with ``device``. Needs ``device``.
        isolation: (ours, keyword-only) where the worker threads run. ``"auto"`` (default):
            in this process for the first epoch, which measures; each later epoch moves them
            into helper processes when the last one's items held the GIL or the training step
            ran slower while they worked, and back when helpers ran the loop slower (never
            with ``persistent_workers``, an epoch too short to win back starting helpers, or a
            dataset that cannot be pickled; ``stats().mode`` says what ran and why). A long
            first epoch moves mid-epoch: into helpers forked from this process when nothing
            but the training thread and the workers runs then, else from the zygote or a
            ready forkserver, each worker's dataset copy and generators pickled.
            ``"threads"`` (or ``None``): always in this process. ``"process"``: always in
            helper processes (``helpers``), so they never compete with the training thread for
            the GIL. Batches, their order and ``state_dict()`` are the same in every mode.
        helpers: (ours, keyword-only) when the worker threads run in helper processes, how
            many helpers share them: worker ``w`` runs in helper ``w % helpers``. Each helper
            holds one copy of the dataset and runs its workers' threads on its own GIL, so
            Python-bound item code scales over helpers as over torch's worker processes.
            ``None`` (default): one helper with ``"process"``, one per worker up to the usable
            CPUs with ``"auto"``. At most ``num_workers``.
        log_every_s: (ours, keyword-only) log a one-line throughput / data-wait summary through
            the ``threadloader`` logger at INFO level at most this often; off by default.
        save_worker_rng: (ours, keyword-only) make ``state_dict()`` hold each worker's own
            generators as of its last delivered batch, so that after ``load_state_dict()``
            random draws from them (``thread_safe_generator()``, ``get_worker_info().rng``)
            continue exactly as without the interruption, on the same number of workers.
            Costs a snapshot of three generators a batch (measured: 250 -> 266 us a batch of
            token windows); off by default, when a resume reseeds them.

    Raises:
        ValueError: for every argument combination DataLoader rejects, with its message; an
            unknown ``isolation`` mode, or ``isolation="process"`` with a ``fork``
            context; ``device_prefetch`` < 1; an unknown device string; a
            ``threadloader.Mixture`` sampled by anything but its own ``MixtureSampler`` (the
            weights would be ignored); with ``num_workers=0``, ``isolation="process"`` or
            ``save_worker_rng=True``; ``helpers`` not a positive number, above ``num_workers``
            or with ``isolation="threads"``; ``device_prefetch`` without ``device`` (each would
            be accepted and do nothing, as torch refuses ``persistent_workers`` without
            workers); ``log_every_s`` not a positive number.
        RuntimeError: ``device`` names a CUDA device and CUDA is not available.
        TypeError: ``save_worker_rng`` is not a bool, or ``helpers`` is not an int.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        device: str | int | torch.device | None = None,
        device_prefetch: int | None = None,
        isolation: str | None = "auto",
        helpers: int | None = None,
        log_every_s: float | None = None,
        save_worker_rng: bool = False,
    ) -> None:
        finalizers.install_hook()  # before any fork of ours (the zygote's, here)
        self._options = Options(
            device=device,
            device_prefetch=device_prefetch,
            isolation=isolation,
            helpers=helpers,
            log_every_s=log_every_s,
            save_worker_rng=save_worker_rng,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        self._options.mirror_on(self)  # for reading; the library reads self._options
        self._auto = AutoIsolation()
        self._epoch_choice: Choice | None = None  # where the latest epoch's workers ran
        self._staging: BufferPool | None = None
        # Large default-collated batches reuse memory the user has dropped (see _recycle).
        self._recycler = RecyclingAllocator(max_free=RECYCLED_BUFFERS)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        # After torch's own checks, so that arguments torch refuses raise torch's error first.
        check_log_every(log_every_s)
        if not isinstance(save_worker_rng, bool):
            raise TypeError(f"save_worker_rng must be a bool, got {type(save_worker_rng).__name__}")
        check_isolation(isolation, multiprocessing_context)
        check_device_args(device, device_prefetch)
        self._epochs_started = 0
        # Digest of the global RNG at the first iter(), and a loaded state's (digest, RNG) for
        # the next iter() to restore where nothing else did (``_engine.global_rng``).
        self._global_rng_mark: str | None = None
        self._global_rng_restore: tuple[str, torch.Tensor] | None = None
        self._resume: Resume | None = None
        # A loaded state that ended an epoch of torch's DistributedSampler: that epoch, until
        # the next iter() (``_engine.state.resumes_a_finished_epoch``), and that iter()'s flag.
        self._ended_sampler_epoch: int | None = None
        self._empty_pass = False
        self._pending_state: dict[str, Any] | None = None  # loaded, and no iter() since
        # (generator state, base seed) a new persistent iterator continues from (load_state_dict)
        self._undo_seed_draw: tuple[Any, int] | None = None
        self._first_sampler_iter_resumes = False  # set while a new iterator is made
        self._end_ran_early: EndRanEarly | None = None  # stream_ended: an end run by state_dict
        self._progress: Progress | None = None  # the latest epoch's, kept past its iterator
        # A sampler with its own state: its state after its last pass's last draw (_state 11).
        self._sampler_pass_end: SamplerSnapshot | None = None
        self._host_epoch: weakref.ref[Any] | None = None
        # device=: the latest epoch's facade; with persistent workers, its transfer thread
        self._device_facade: weakref.ref[DeviceEpochIterator] | None = None
        self._transfer_thread: threading.Thread | None = None
        self._stats: EpochStats | None = None  # likewise
        self._made: weakref.ref[Any] | None = None  # the iterator _get_iterator() just made
        _check_mixture_sampler(self)
        _refuse_ignored_options(self)
        if self._options.isolation == "process":
            start_helper_server(multiprocessing_context, code_of(self))
        elif self._options.isolation == "auto" and zygote_running():
            refresh_zygote(multiprocessing_context, code_of(self))
        for hook in BUILT_HOOKS:  # integrations: e.g. accelerator.prepare(self) keeps threads
            hook(self)

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``copy.deepcopy`` copy: the loader without what lives only in
        this process (locks, weak references to its epochs, a transfer thread).

        A copy is a loader that has run no epoch here (``stats()`` needs one of its own); its
        ``state_dict()`` is the original's. As with torch, a loader holding persistent workers
        (``_iterator``) cannot be copied.
        """
        state = self.__dict__.copy()
        for name in _PROCESS_LOCAL:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._recycler = RecyclingAllocator(max_free=RECYCLED_BUFFERS)

    def __iter__(self) -> Any:
        global_rng.at_iter(self)  # before anything of this iter() draws from it
        early, self._end_ran_early = self._end_ran_early, None
        if early is not None:  # a state_dict() ran the last epoch's end; did the loop get there?
            early.undo()
        if loaded_epoch_left(self, self._pending_state):
            self._start_after_the_loaded_epoch()
        # A persistent epoch is reset or replaced below: the last epoch's transfer thread must
        # be done pulling from it (and a timeout it hits meanwhile is seen by the check below).
        if self._transfer_thread is not None:
            retire_device_epoch(self._device_facade, self._transfer_thread)
        self._transfer_thread = None
        if self._iterator is not None and (
            self._resume is not None or getattr(self._iterator, "closed", False)
        ):
            # Persistent workers were seeded for another epoch: resume on fresh ones. Or they
            # were stopped (a timeout, Ctrl-C, close()): torch's workers would still be there.
            self._iterator.close()  # type: ignore[attr-defined]
            self._iterator = None
        self._epochs_started += 1
        self._pending_state = None  # this epoch starts from it: its own progress says the rest
        if self._iterator is not None:
            self._undo_seed_draw = None  # reused: it draws no new base seed
        if self._options.device is not None and self._staging is None:
            self._staging = staging_pool(self)  # before the workers start: they collate into it
        self._made = None
        it: Any = super().__iter__()
        made_ref, self._made = self._made, None
        if not hasattr(it, "_progress"):
            # A subclass's _get_iterator() wrapped ours, or returned an iterator of its own
            # (torch's DataLoader returns whatever it gives): state and stats follow ours if any
            # (with persistent workers, the one made for the first epoch and reset since).
            made = made_ref() if made_ref is not None else None
            if made is None and self._iterator is it and self._host_epoch is not None:
                made = self._host_epoch()
            if self._options.device is not None:
                if made is not None:
                    made.close()
                raise RuntimeError(
                    f"device= moves the batches of the loader's own iterator, and this "
                    f"loader's _get_iterator() returned a {type(it).__name__}: move the batches "
                    "in the subclass instead, or leave _get_iterator() to the loader"
                )
            self._host_epoch = None if made is None else weakref.ref(made)
            self._progress = getattr(made, "_progress", None)
            self._stats = getattr(made, "_stats", None)
            return it
        self._host_epoch = weakref.ref(it)
        if self._options.device is not None:
            persistent = self._iterator is not None
            it = DeviceEpochIterator(self, it, persistent)
            self._device_facade = weakref.ref(it)
            if persistent:
                self._transfer_thread = it.transfer_thread
        self._progress = it._progress
        self._stats = it._stats
        return it

    def stats(self) -> LoaderStats:
        """A snapshot of where the time went in the current (or last) epoch.

        Returns:
            A frozen ``LoaderStats``: batches, the training loop's data wait, per-stage timings,
            worker busy time, advice when the dataset holds the GIL, and the dataset's own
            ``stats()`` when it has them (``RemoteFiles``: retries, skips, cache hits and
            misses). ``str()`` of it is a one-screen report.

        Raises:
            RuntimeError: no epoch has started yet.
        """
        if self._stats is None:
            raise RuntimeError("stats() needs an epoch: iterate over the loader first")
        snapshot = self._stats.snapshot()
        choice = self._epoch_choice
        if choice is not None and choice.mode == PROCESS:
            dataset_stats = self._stats.dataset  # the helpers' copies do the reading
        else:
            own = getattr(self.dataset, "stats", None)
            dataset_stats = own() if callable(own) else None
        mode = choice.mode if choice is not None else THREADS
        reason = choice.reason if choice is not None else None
        return dataclasses.replace(snapshot, dataset=dataset_stats, mode=mode, mode_reason=reason)

    def _get_iterator(self) -> _BaseDataLoaderIter:
        resume, self._resume = self._resume, None
        # A resumed epoch's base seed comes from the state, but torch's iterator draws one from
        # the global RNG all the same: the iterator gives that draw back (``undo_seed_draw``),
        # so that a global RNG restored with the checkpoint (Accelerate's load_state does) seeds
        # the next epochs as it would have without the interruption (torchdata's
        # StatefulDataLoader draws nothing either).
        if resume is not None and resume.rng_source == "global" and self._undo_seed_draw is None:
            self._undo_seed_draw = (None, resume.base_seed)
        undo = self._undo_seed_draw
        if undo is not None and undo[0] is None:  # the global RNG, as the new iterator finds it
            self._undo_seed_draw = (torch.get_rng_state(), undo[1])
        # The empty rest of a loaded finished epoch, which set_epoch named again (a loop that
        # restarts at the checkpoint's epoch): the uninterrupted run made no such iterator, so
        # this one gives its base-seed draw back, and the next epoch's workers are seeded as
        # that run's were. A persistent one is reset for the next epoch, which draws nothing.
        finished_rest = resumes_a_finished_epoch(self)
        self._empty_pass = finished_rest and self._ended_sampler_epoch is not None
        self._ended_sampler_epoch = None  # for this iter() only
        empty_rest = not self.persistent_workers and finished_rest
        give_back = _rng_restorer(self.generator) if empty_rest else None
        # That rest is the pass the iterator's first iter() of the sampler begins: a worker
        # iterator must not make the second one torch's makes, which would start the epoch over.
        self._first_sampler_iter_resumes = finished_rest
        try:
            it = self._new_iterator(resume)
            self._made = weakref.ref(it)  # __iter__ finds it behind a subclass's wrapper
            return it
        finally:
            self._undo_seed_draw = None  # used, or the iterator failed: never for a later one
            self._first_sampler_iter_resumes = False
            if give_back is not None:
                give_back()

    def _new_iterator(self, resume: Resume | None) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            self._epoch_choice = None
            return InlineDataLoaderIter(self, resume)
        self.check_worker_number_rationality()
        if self.num_workers < 0:  # set after construction, which refuses it: torch's check
            raise AssertionError(
                "num_workers must be greater than 0 for MultiProcessingDataLoaderIter"
            )
        first = self._options.isolation == "auto" and self._stats is None
        self._epoch_choice = choice = self._choose_mode()
        if choice.mode == PROCESS and self._options.isolation != "auto":
            return IsolatedDataLoaderIter(self, resume, helpers=choice.helpers)
        if choice.mode == PROCESS:
            undo_draw = self._seed_draw_undoer()
            try:
                return IsolatedDataLoaderIter(
                    self, resume, helpers=choice.helpers, confirm_start=True
                )
            except StaleScriptCode as exc:  # the zygote lacks the script's code: for now
                undo_draw()
                self._epoch_choice = Choice(THREADS, f"{exc}: the epoch runs in worker threads")
            except Exception as exc:  # noqa: BLE001  # "auto" runs the epoch in threads instead
                undo_draw()  # the threads' iterator makes the failed one's base-seed draw
                self._epoch_choice = self._auto.helpers_failed(exc)
                if isinstance(exc, GlobalsLeftOut):  # the script's state: nothing failed
                    return self._threaded_epoch(resume, first)
                warn_user(
                    f"threadloader: isolation='auto' could not start helper processes "
                    f"({one_line(exc)}); this loader's epochs run in worker threads",
                    RuntimeWarning,
                )
        return self._threaded_epoch(resume, first)

    def _threaded_epoch(self, resume: Resume | None, first: bool) -> ThreadedDataLoaderIter:
        """The epoch in worker threads; ``"auto"``'s first may move mid-epoch."""
        epoch = ThreadedDataLoaderIter(self, resume, log_every_s=self._options.log_every_s)
        if first:  # "auto" moves its first epoch into helpers once it has measured enough
            epoch.mover = mover_for(self, epoch, _AutoPolicy(self))
        return epoch

    def _seed_draw_undoer(self) -> Callable[[], None]:
        """What puts the RNGs a new iterator draws its base seed from back as they are now."""
        undo, restore = self._undo_seed_draw, _rng_restorer(self.generator)

        def undo_draw() -> None:
            restore()
            self._undo_seed_draw = undo

        return undo_draw

    def _choose_mode(self) -> Choice:
        """Where this epoch's workers run: the ``isolation`` option, or ``"auto"``'s choice."""
        if self._options.isolation == "auto":
            last = self._stats.snapshot() if self._stats is not None else None
            return self._auto.next_epoch(self, last)
        if self._options.isolation == "process":
            return Choice(PROCESS, "isolation='process'", helpers=self._options.helpers)
        return Choice(THREADS, f"isolation={self._options.isolation!r}")

    def set_mixture_weights(self, weights: Mapping[str, float]) -> int:
        """Change a ``threadloader.Mixture``'s weights from the next batch the loop requests.

        The batches workers prefetched under the old weights are dropped and fetched again
        (map-style: only indices are recomputed, the data is read once). The change is recorded
        in the sampler's state with its position, so a resume reproduces the stream.

        Args:
            weights: source name -> weight (see ``Mixture.set_weights``).

        Returns:
            The global stream position the new weights take effect from.

        Raises:
            TypeError: the loader's sampler is not a ``MixtureSampler``.
            ValueError: the weights are invalid (see ``Mixture.set_weights``), or an epoch with
                workers and ``in_order=False`` is running (nothing changed).
            RuntimeError: this is called from one of this loader's workers (the dataset's
                code), which draw from the stream the change rewinds; with ``device=``, the
                running epoch was closed (``close()``, Ctrl-C), or this is called from the
                transfer thread (the dataset's code, with ``num_workers=0``), which the change
                would wait for.
        """
        from threadloader.streams import MixtureSampler
        from threadloader.streams.mixing import check_weights

        sampler = self.sampler
        if not isinstance(sampler, MixtureSampler):
            raise TypeError(
                f"set_mixture_weights needs a MixtureSampler, this loader samples with "
                f"{type(sampler).__name__}"
            )
        mixture: Any = self.dataset
        check_weights(weights, mixture.names)  # before anything stops: nothing changes then
        epoch = self._host_epoch() if self._host_epoch is not None else None
        in_its_worker = getattr(epoch, "in_its_worker", None)
        if in_its_worker is not None and in_its_worker():
            raise RuntimeError(
                "set_mixture_weights was called from one of this loader's workers (the "
                "dataset's code): the change rewinds the stream its batches come from. Call it "
                "from the thread that iterates the loader"
            )
        progress = self._progress  # the loop's: with device=, behind the host epoch's
        if epoch is None and progress is not None and not progress.exhausted:
            # The loop left the epoch (break): the next batch it asks for is the first of the
            # pass the next iter() makes, not where the pass it left had drawn to.
            sampler.leave_earlier_pass(sampler.passes_begun)
            return int(mixture.set_weights(weights))
        if epoch is None or progress is None or progress.exhausted:
            position = int(mixture.set_weights(weights))
            loaded = self._pending_state  # waiting for iter(): the change is part of it now
            saved = loaded.get("sampler") if loaded is not None else None
            if loaded is not None and saved is not None and saved.get("epoch") == sampler.epoch:
                loaded["sampler"] = sampler.state_dict()
            return position
        if epoch_left_for_the_next(self, progress):
            # set_epoch moved the sampler on since this epoch began (after its last batch, or
            # after a break): the next batch the loop asks for is the start of the epoch it set.
            return int(mixture.set_weights(weights))
        if epoch_complete(self, progress):
            # The loop has every batch of the epoch: the next it asks for is the next epoch's,
            # which starts at this pass's end, past what drop_last left out (as a state then
            # says); nothing in flight is drawn from there.
            end = sampler.pass_end(since=progress.sampler_passes)
            return int(mixture.set_weights(weights, at_position=end))
        if not self.in_order and self.num_workers > 0:
            raise ValueError("a live change of the index stream needs in_order=True")
        if progress.ahead:
            raise ValueError(
                "set_mixture_weights cannot rewind this epoch: batches after the current one "
                "were already delivered out of order (in_order=False, now or in the state it "
                "resumed from)"
            )
        consumed = progress.pass_positions() * (self.batch_size or 1)

        def change() -> int:
            if progress.sampler_passes is not None:  # the sampler's pass may be an earlier one
                sampler.leave_earlier_pass(progress.sampler_passes)
            ended = sampler.pass_ended
            position = mixture.set_weights(weights, at_position=sampler.position_after(consumed))
            # A pass that had handed out its last index restarts at the position: a new one.
            epoch.redispatch(new_pass=ended and not sampler.pass_ended)
            return int(position)

        facade = self._device_facade() if self._device_facade is not None else None
        if facade is None or facade._progress is not progress:
            return change()
        # The transfer thread draws from the sampler: stop it, and take back from the host
        # epoch the batches it holds, before the sampler is rewound.
        position = int(facade.rewound(change))
        if self._transfer_thread is not None:
            self._transfer_thread = facade.transfer_thread  # what the next iter() waits for
        return position

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop stands: enough for ``load_state_dict`` to resume exactly.

        Consumer-aligned: it counts the batches ``__next__`` returned, not those prefetched. A
        plain dict of Python scalars, lists and tensors (``torch.save``-able); each rank saves
        its own, with no collective. See ``threadloader._engine.state`` for what resumes how.

        Returns:
            The state of the current (or last) epoch; a state taken after an epoch ended makes
            the next ``iter()`` start the following epoch, and so does one taken after the
            epoch's last batch was delivered, before ``next()`` raised ``StopIteration``
            (Lightning checkpoints at the last step of an epoch so), or after ``set_epoch``
            moved the sampler on (a loop that left its epoch with ``break`` and set the next
            one). While a loaded state is waiting for ``iter()``, that state, unless
            ``set_epoch`` moved the sampler to another epoch than the one it was taken in.
        """
        if loaded_epoch_left(self, self._pending_state):
            # set_epoch left the loaded epoch: the state the next iter() starts from
            state = build_state(self, None)
            if self._resume is not None:
                rng_state, state["base_seed"] = _left_epoch_seeds(self._resume)
                if rng_state is not None:
                    state["rng_state"] = encode_rng(rng_state)
            return state
        if self._pending_state is not None:
            return copy.deepcopy(self._pending_state)  # nothing ran since it was loaded
        progress = self._progress
        if progress is not None and epoch_left_for_the_next(self, progress):
            # As after the epoch's end; persistent workers carry into the next epoch what the
            # left epoch's batches in flight do to their dataset copies and generators.
            epoch = self._host_epoch() if self._host_epoch is not None else None
            # With device=, the transfer thread reads the epoch.
            if (
                self.persistent_workers
                and self._options.device is None
                and epoch is not None
                and epoch._progress is progress
                and hasattr(epoch, "progress_after_in_flight")
            ):
                progress = epoch.progress_after_in_flight()
            return build_state(self, progress, complete=True)
        complete = progress is not None and epoch_complete(self, progress)
        # With device=, the transfer thread reads the epoch: it is left alone.
        epoch = self._host_epoch() if self._host_epoch is not None else None
        ours = epoch is not None and epoch._progress is progress
        if ours and progress is not None and self._options.device is None:
            if complete:
                # Counted complete: let the sampler's iterator end now, as the next next() would
                # (torch's RandomSampler draws once more from the loader's generator then; a
                # loop that leaves the epoch instead gets it undone at its next iter()). A batch
                # drawn and not delivered yet says the sampler's len() fell short.
                complete = not getattr(epoch, "_task_info", None) and stream_ended(epoch, self)
            else:  # a sampler without len(), which the workers drew to its end
                complete = ran_out_and_delivered(epoch, self, progress)
        return build_state(self, progress, complete=complete)

    def _start_after_the_loaded_epoch(self) -> None:
        """``set_epoch`` left the loaded epoch: this ``iter()`` starts the epoch set, as the
        saving loop's next ``iter()`` did after it left that epoch: with the loader's generator
        where that epoch's iterator left it, and with persistent workers on the base seed they
        kept (their iterator is reused, drawing none)."""
        resume, self._resume = self._resume, None
        if resume is None:
            return
        rng_state, base_seed = _left_epoch_seeds(resume)
        if rng_state is not None:
            self.generator.set_state(rng_state)
        if self.persistent_workers and self.num_workers > 0:
            self._undo_seed_draw = (rng_state, base_seed)

    @property
    def next_iter_state(self) -> dict[str, Any] | None:
        """The state the next ``iter()`` resumes from (``StatefulDataLoader``'s name): the one
        ``load_state_dict()`` was given, until an ``iter()`` starts from it; else None."""
        return None if self._pending_state is None else copy.deepcopy(self._pending_state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` resume where ``state`` was taken (Lightning calls it so).

        Map-style datasets resume without re-reading data, on any number of workers; with
        ``threadloader.samplers`` also on any world size. IterableDatasets with
        ``state_dict``/``load_state_dict`` resume per worker on the same number of workers;
        others are replayed with a warning.

        Args:
            state: a dict returned by ``state_dict()``. An empty dict loads nothing, as with
                ``StatefulDataLoader``: the next ``iter()`` starts on new workers, from a
                state loaded before if one is waiting.

        Raises:
            ValueError: the state is malformed, of another format version, or for another
                dataset kind, dataset length, RNG source, world size or worker count than this
                loader can resume it on.
        """
        if isinstance(state, Mapping) and not state:
            # StatefulDataLoader's "no state": the next iter() starts as it would have, on
            # workers started afresh.
            self._iterator = None
            return
        state = decode_state(state)  # RNG states are text in a state (JSON-able)
        resume = parse_state(self, state)
        global_rng.loaded(self, state.get("global_rng_mark"), state.get("global_rng_at_save"))
        self._epochs_started = int(state["epoch"]) - (1 if state["in_progress"] else 0)
        self._resume = resume if state["in_progress"] else None
        self._ended_sampler_epoch = (
            None if state["in_progress"] else state.get("ended_sampler_epoch")
        )
        self._progress = None  # what ran before the load does not carry into the resumed run
        self._sampler_pass_end = None if state["in_progress"] else resume.own_sampler_state
        if not state["in_progress"] and self.num_workers == 0 and resume.worker_states:
            # The dataset as the finished epoch left it (``_engine.dataset_state`` point 4).
            iterable = self._dataset_kind == _DatasetKind.Iterable
            settle_dataset(
                self.dataset, resume.worker_states[0], resume.worker_state_form, iterable, 0
            )
        self._pending_state = copy.deepcopy(dict(state))
        for key in RNG_KEYS:
            if isinstance(self._pending_state.get(key), torch.Tensor):
                self._pending_state[key] = encode_rng(self._pending_state[key])
        self._undo_seed_draw = None
        self._end_ran_early = None  # the loaded state sets the generators
        by_generator = state["rng_source"] == "generator"
        if not state["in_progress"] and by_generator:
            self.generator.set_state(state["rng_state"])
        if (
            not state["in_progress"]
            and self.persistent_workers
            and self.num_workers > 0
            and int(state["epoch"]) >= 1
        ):
            # The saving loader would have reused its persistent iterator for the next epoch,
            # drawing no base seed; a new iterator here draws one (see __iter__). Its workers
            # would have kept their dataset copies and generators (``_engine.state`` point 8).
            rng_state = state["rng_state"] if by_generator else None  # None: as iter() finds it
            self._undo_seed_draw = (rng_state, int(state["base_seed"]))
            if resume.worker_states is not None or resume.rng_states is not None:
                self._resume = dataclasses.replace(resume, next_epoch=True)

    def check_worker_number_rationality(self) -> None:
        """Warn when the number of worker threads is far beyond what the machine can use.

        torch warns above one worker *process* per CPU. Threads are cheap and, for
        latency-bound data, are mostly waiting, so we warn only above
        ``THREADS_PER_CORE_WARNING`` threads per CPU the process may use. The message keeps
        torch's sentence ("excessive worker creation might get DataLoader running slow or even
        freeze"), so filters and tests written for torch's warning still match it.
        """
        if not self.num_workers:
            return
        cpus = usable_cpus()
        limit = THREADS_PER_CORE_WARNING * cpus
        if self.num_workers > limit:
            warnings.warn(
                f"This ThreadDataLoader will create {self.num_workers} worker threads, more than "
                f"{THREADS_PER_CORE_WARNING} per usable CPU ({cpus} CPUs). Please be aware that "
                "excessive worker creation might get DataLoader running slow or even freeze, "
                "lower the worker number to avoid potential slowness/freeze if necessary. "
                "Threads beyond what the data source can keep busy only add switching overhead.",
                stacklevel=2,
            )


class _AutoPolicy:
    """The loader's ``"auto"`` policy as a mid-epoch move asks it (``mid_epoch.MovePolicy``),
    holding the loader weakly: the epoch may outlive it."""

    def __init__(self, loader: ThreadDataLoader[Any]) -> None:
        self._loader = weakref.ref(loader)

    def moved(self, choice: Choice, before: LoaderStats, since: LoaderStats) -> None:
        """Record that the first epoch moved into helpers, for ``stats()``."""
        loader = self._loader()
        if loader is not None:
            loader._auto.moved(choice, before, since)
            loader._epoch_choice = choice

    def pickling_problem(self) -> str | None:
        """What a helper could not receive pickled (``AutoIsolation.pickling_problem``)."""
        loader = self._loader()
        return "the loader is gone" if loader is None else loader._auto.pickling_problem(loader)

    def warm_up(self) -> None:
        """Start the forkserver later epochs' helpers would come from
        (``AutoIsolation.warm_up``)."""
        loader = self._loader()
        if loader is not None:
            loader._auto.warm_up(loader)

    def unforked_start_s(self) -> float | None:
        """``AutoIsolation.unforked_start_s``; None once the loader is gone."""
        loader = self._loader()
        return None if loader is None else loader._auto.unforked_start_s(loader)

    def declined(self, reason: str) -> None:
        """Say in ``stats().mode_reason`` why the epoch did not move when it was due."""
        loader = self._loader()
        if loader is not None:
            loader._epoch_choice = Choice(THREADS, reason)


def _check_mixture_sampler(loader: ThreadDataLoader[Any]) -> None:
    """Refuse a ``Mixture`` that no ``MixtureSampler`` of its own samples.

    As a dataset a ``Mixture`` is the concatenation of its sources; only its ``MixtureSampler``
    applies the weights. With any other sampler (torch's default ones, ``shuffle=True``, a
    ``DistributedSampler``) the weights would be silently ignored. Mixing by default instead
    would decide the ranks' sharding and the shuffling behind the user's back.

    Raises:
        ValueError: naming ``MixtureSampler``.
    """
    from threadloader.streams import Mixture, MixtureSampler

    mixture = loader.dataset
    if not isinstance(mixture, Mixture):
        return
    sampler = loader.sampler if loader.batch_sampler is None else loader.batch_sampler
    sampler = getattr(sampler, "sampler", sampler)  # torch's BatchSampler wraps it
    if isinstance(sampler, MixtureSampler) and sampler.mixture is mixture:
        return
    what = (
        "a MixtureSampler of another Mixture"
        if isinstance(sampler, MixtureSampler)
        else type(sampler).__name__
    )
    raise ValueError(
        f"a threadloader.Mixture is mixed by its MixtureSampler, but this loader samples it "
        f"with {what}, which would read the sources one after another and ignore the weights: "
        f"pass sampler=MixtureSampler(mixture) (num_replicas= and rank= under DDP; with "
        f"Lightning, Trainer(use_distributed_sampler=False)). For the plain concatenation, use "
        f"torch.utils.data.ConcatDataset."
    )


def _refuse_ignored_options(loader: ThreadDataLoader[Any]) -> None:
    """Refuse our options that would be accepted and then do nothing, as torch refuses
    ``persistent_workers`` and ``prefetch_factor`` without workers.

    Raises:
        ValueError: naming the option and what it needs.
        TypeError: ``helpers`` is not an int.
    """
    options = loader._options
    helpers = options.helpers
    if loader.num_workers == 0 and options.isolation == "process":
        raise ValueError(
            "isolation='process' runs the worker threads in a helper process, so it needs "
            "num_workers > 0 (with num_workers=0 every batch is made in the training thread); "
            "set num_workers > 0, or isolation='auto'"
        )
    if helpers is not None:
        check_helpers_type(helpers)
        if options.isolation not in ("process", "auto"):
            raise ValueError(
                f"helpers={helpers} sets how many helper processes run the worker "
                f"threads, so it needs isolation='process' or 'auto' (with "
                f"isolation={options.isolation!r} the threads always run in this process)"
            )
        if not 1 <= helpers <= loader.num_workers:
            raise ValueError(
                f"helpers must be between 1 and num_workers={loader.num_workers} (each helper "
                f"runs at least one worker), got {helpers}"
            )
    if loader.num_workers == 0 and options.save_worker_rng:
        raise ValueError(
            "save_worker_rng=True saves each worker's own generators, so it needs "
            "num_workers > 0 (with num_workers=0 batches draw from the training thread's "
            "global RNGs, which are the training script's to save); set num_workers > 0, or "
            "save_worker_rng=False"
        )
    refuse_prefetch_without_device(options.device, options.device_prefetch)
