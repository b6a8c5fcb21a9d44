"""``num_workers=0``: torch's single-process loading, plus the loader's state tracking."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import _DatasetKind
from torch.utils.data.dataloader import _BaseDataLoaderIter, _SingleProcessDataLoaderIter

from threadloader._engine import dataset_state
from threadloader._engine.datapipes import graph_walks, shard_here
from threadloader._engine.device_epoch import host_collate
from threadloader._engine.fetch import Fetcher
from threadloader._engine.options import options_of
from threadloader._engine.profiled_next import ProfiledNext
from threadloader._engine.state import (
    Progress,
    ProgressMixin,
    Resume,
    before_sampler_iter,
    begin_pass,
    start_new_pass,
    undo_seed_draw,
    warn_replay,
    without_predrawn,
)
from threadloader._engine.stats import EpochStats
from threadloader._primitives.timing import StageRecorder


class _RecordingFetcher:
    """torch's fetcher interface (``fetch(index)``) over ours, recording into one recorder."""

    def __init__(self, fetcher: Fetcher, recorder: StageRecorder) -> None:
        self.fetcher, self._recorder = fetcher, recorder

    def fetch(self, index: Any) -> Any:
        return self.fetcher.fetch(index, self._recorder)


class InlineDataLoaderIter(ProfiledNext, ProgressMixin, _SingleProcessDataLoaderIter):
    """torch's ``_SingleProcessDataLoaderIter``, resumable and describing its own position.

    Batches come from torch's own fetcher in the calling thread, exactly as with DataLoader.
    """

    def __init__(self, loader: Any, resume: Resume | None = None) -> None:
        dataset: Any = loader.dataset
        self._track_dataset = dataset_state.tracked(
            dataset, loader._dataset_kind == _DatasetKind.Iterable
        )
        state = resume.worker_states[0] if resume is not None and resume.worker_states else None
        form = resume.worker_state_form if resume is not None else 1
        dataset_state.restore_dataset(dataset, state, form)  # before iter(), as StatefulDataLoader
        self._progress = Progress()
        before_sampler_iter(self, loader)
        # torch's _SingleProcessDataLoaderIter.__init__ would build its own fetcher, calling an
        # IterableDataset's __iter__ once more than torch does: skip to the base class.
        with graph_walks(loader.dataset):  # torch seeds a DataPipe here (_datapipes point 5)
            _BaseDataLoaderIter.__init__(self, loader)
        undo_seed_draw(self, loader)
        if self._timeout != 0:
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        shard_here(self._dataset, self._world_size, self._rank)  # as torch's, before any iter()
        self._stats = EpochStats(0, options_of(loader).log_every_s)
        self._workers: list[Any] = []  # as for torch's worker list: no worker runs
        self._dataset_fetcher = _RecordingFetcher(
            Fetcher(
                self._dataset_kind,
                self._dataset,
                self._auto_collation,
                host_collate(loader, self._collate_fn, self._pin_memory),
                self._drop_last,
            ),
            self._stats.caller,
        )
        self._dataset_fetcher.fetcher.restore(state, form)
        self._pin_memory = False  # pinned by the collate above, not again after it
        self._sampler_iter = begin_pass(self, loader, resume)
        self._map_style = self._dataset_kind == _DatasetKind.Map
        self._drawn = self._behind = 0  # map-style: batches drawn, and behind the loop
        self._snapshot_dataset()  # a state taken before the first batch: the epoch's start
        if self._progress.dataset_states is None:
            self._progress.dataset_states = [None]
        self._progress.workers_alive = [True]
        self._discard = resume.batches if resume is not None and resume.replay_data else 0
        if self._discard:
            warn_replay(dataset, self._discard)

    def close(self) -> None:
        """Nothing to stop: batches are made in the calling thread."""

    def take_back(self, progress: Progress, handed_out: int) -> None:
        """Forget the batches returned after the first ``handed_out``, which a consumer dropped
        (``device_epoch``'s transfer stage), and go back to ``progress``, as it was after the
        last one kept. ``redispatch`` must follow."""
        self._progress.__dict__.update(progress.__dict__)
        self._drawn = self._behind = handed_out

    def redispatch(self, new_pass: bool = False) -> None:
        """The sampler was rewound to the delivered position (a live mixture-weight change):
        drop what was drawn from it and not delivered, the resume's early draw (``Predrawn``);
        with ``new_pass``, draw from a new pass of the sampler (``DispatchingIter.redispatch``)."""
        self._sampler_iter = without_predrawn(self._sampler_iter)
        if new_pass:
            start_new_pass(self)

    def _next_index(self) -> Any:
        start = time.perf_counter()
        try:
            index = super()._next_index()
        finally:
            self._stats.caller.add("sampler", time.perf_counter() - start)
        self._drawn += 1
        self._progress.indices_drawn = True
        self._progress.note_draw()
        return index

    def _next_data(self) -> Any:
        start = time.perf_counter()
        delivered = ended = False
        try:
            while self._discard:
                super()._next_data()
                self._discard -= 1
            data = super()._next_data()
            delivered = True
        except StopIteration:
            self._progress.exhausted = ended = True
            self._snapshot_dataset()  # as the finished epoch left it (_dataset_state point 4)
            raise
        finally:
            if self._map_style and self._drawn > self._behind:
                # Returned or raised: either way its indices are used (_state point 7).
                self._progress.behind(self._behind)
                self._behind += 1
            self._stats.on_next(time.perf_counter() - start, False, delivered, delivered, ended)
        self._snapshot_dataset()
        return data

    def _snapshot_dataset(self) -> None:
        if self._track_dataset:
            fetcher = self._dataset_fetcher.fetcher
            state = dataset_state.snapshot(self._dataset, fetcher.iterator, fetcher.ended)
            if state is not None:
                self._progress.dataset_states = [state]
