"""``num_workers=0``: torch's single-process loading, plus the loader's state tracking."""

from __future__ import annotations

import copy
from typing import Any

from torch.utils.data import _DatasetKind
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from threadloader._state import (
    Progress,
    ProgressMixin,
    Resume,
    begin_pass,
    dataset_is_stateful,
    warn_replay,
)


class InlineDataLoaderIter(ProgressMixin, _SingleProcessDataLoaderIter):
    """torch's ``_SingleProcessDataLoaderIter``, resumable and describing its own position.

    Batches come from torch's own fetcher in the calling thread, exactly as with DataLoader.
    """

    def __init__(self, loader: Any, resume: Resume | None = None) -> None:
        dataset: Any = loader.dataset
        self._track_dataset = loader._dataset_kind == _DatasetKind.Iterable and (
            dataset_is_stateful(dataset)
        )
        if resume is not None and resume.worker_states and resume.worker_states[0] is not None:
            dataset.load_state_dict(resume.worker_states[0])  # before torch's fetcher calls iter()
        self._progress = Progress()
        super().__init__(loader)
        self._sampler_iter = begin_pass(self, loader, resume)
        if self._progress.dataset_states is None:
            self._progress.dataset_states = [None]
        self._progress.workers_alive = [True]
        self._discard = resume.batches if resume is not None and resume.replay_data else 0
        if self._discard:
            warn_replay(dataset, self._discard)

    def _next_data(self) -> Any:
        try:
            while self._discard:
                super()._next_data()
                self._discard -= 1
            data = super()._next_data()
        except StopIteration:
            self._progress.exhausted = True
            raise
        if self._track_dataset:
            state = copy.deepcopy(self._dataset.state_dict())  # type: ignore[attr-defined]
            self._progress.dataset_states = [state]
        return data
