"""What code written for torch's DataLoader and StatefulDataLoader does to a loader, done to ours.

Copies (``copy.deepcopy``, ``pickle``: ``mp.spawn`` arguments, config snapshots), subclasses
whose ``_get_iterator()`` wraps or replaces the iterator, ``StatefulDataLoader``'s empty state
and ``next_iter_state``, and torch's iterator's ``_shutdown_workers()``.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_epochs_equal, collect_epochs
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
from torchdata.stateful_dataloader import StatefulDataLoader

from threadloader import ThreadDataLoader


class Draws(Dataset[tuple[int, float]]):
    """Item i: (i, a draw from the worker's global torch RNG)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(()))


def _epochs(loader: Any, epochs: int) -> list[list[Any]]:
    """``collect_epochs`` from one global RNG state: with no workers, items draw from it."""
    torch.manual_seed(0)
    return collect_epochs(loader, epochs)


def _pickled(loader: Any) -> Any:
    return pickle.loads(pickle.dumps(loader))


def _loader(cls: type, workers: int, shuffle: bool = True, **kwargs: Any) -> Any:
    return cls(
        Draws(),
        batch_size=4,
        shuffle=shuffle,
        num_workers=workers,
        generator=torch.Generator().manual_seed(3),
        **kwargs,
    )


@pytest.mark.parametrize("how", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ran", ["fresh", "one epoch"])
def test_a_copy_gives_the_epochs_a_copy_of_torchs_loader_gives(
    how: Callable[[Any], Any], workers: int, ran: str
) -> None:
    ours, theirs = _loader(ThreadDataLoader, workers), _loader(DataLoader, workers)
    if ran == "one epoch":
        assert_epochs_equal(_epochs(ours, 1)[0], _epochs(theirs, 1)[0])
    our_copy, their_copy = how(ours), how(theirs)
    assert_epochs_equal(_epochs(our_copy, 2)[1], _epochs(their_copy, 2)[1])
    assert our_copy.dataset is not ours.dataset
    # The original goes on as it would have: the copy shares no generator or epoch with it.
    assert_epochs_equal(_epochs(ours, 1)[0], _epochs(theirs, 1)[0])


def test_a_copy_taken_mid_epoch_saves_the_state_of_the_original() -> None:
    loader = _loader(ThreadDataLoader, 2)
    it = iter(loader)
    next(it)
    clone = copy.deepcopy(loader)
    assert clone.state_dict() == loader.state_dict()
    with pytest.raises(RuntimeError, match="needs an epoch"):
        clone.stats()  # what ran, ran in the original
    del it


def test_a_loader_holding_persistent_workers_cannot_be_copied_as_with_torch() -> None:
    for cls in (DataLoader, ThreadDataLoader):
        loader = _loader(cls, 2, persistent_workers=True)
        next(iter(loader))
        with pytest.raises((TypeError, NotImplementedError)):
            copy.deepcopy(loader)
        loader._iterator._shutdown_workers()


class _Counting:
    """A subclass's wrapper around the loader's iterator."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self.inner, self.seen = inner, 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.seen += 1
        return batch

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        """What torch's __iter__ calls on a persistent loader's kept iterator."""
        self.inner._reset(loader, first_iter)  # type: ignore[attr-defined]
        self.seen = 0


def _wrapping(base: type) -> type:
    class Wrapping(base):  # type: ignore[misc, valid-type]
        def _get_iterator(self) -> Any:
            return _Counting(super()._get_iterator())

    return Wrapping


def _replacing(base: type) -> type:
    class Replacing(base):  # type: ignore[misc, valid-type]
        def _get_iterator(self) -> Any:
            return _SingleProcessDataLoaderIter(self)

    return Replacing


@pytest.mark.parametrize(
    ("make", "workers"),
    [(_wrapping, 0), (_wrapping, 2), (_replacing, 0)],  # torch's own iterator needs 0 workers
    ids=["wraps-0", "wraps-2", "replaces-0"],
)
def test_a_subclass_whose_get_iterator_wraps_or_replaces_ours_gets_torchs_batches(
    make: Callable[[type], type], workers: int
) -> None:
    ours = _loader(make(ThreadDataLoader), workers)
    theirs = _loader(make(DataLoader), workers)
    assert_epochs_equal(_epochs(ours, 2)[1], _epochs(theirs, 2)[1])


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_wrapped_iterator_still_saves_and_resumes_the_epoch(
    workers: int, persistent: bool
) -> None:
    """Also in a persistent loader's second epoch, where _get_iterator() is not called again."""
    cls = _wrapping(ThreadDataLoader)
    kwargs: dict[str, Any] = {"persistent_workers": True} if persistent else {}
    whole_loader = _loader(cls, workers, **kwargs)
    list(whole_loader)
    whole = [b[0] for b in whole_loader]  # indices: the draws need save_worker_rng
    loader = _loader(cls, workers, **kwargs)
    list(loader)
    it = iter(loader)
    head = [next(it)[0], next(it)[0]]
    assert it.seen == 2
    state = loader.state_dict()
    assert state["batches_yielded"] == 2 and state["epoch"] == 2
    assert loader.stats().batches == 2
    del it
    resumed = _loader(cls, workers, **kwargs)
    resumed.load_state_dict(state)
    assert_epochs_equal(head + [b[0] for b in resumed], whole)


def test_device_with_a_subclass_iterator_of_its_own_says_it_cannot_move_its_batches() -> None:
    loader = _wrapping(ThreadDataLoader)(Draws(), batch_size=4, num_workers=2, device="cpu")
    with pytest.raises(RuntimeError, match="device= moves the batches of the loader's own"):
        iter(loader)


@pytest.mark.parametrize("persistent", [False, True])
def test_an_empty_state_is_no_state_as_in_stateful_dataloader(persistent: bool) -> None:
    def epochs(cls: type) -> list[list[Any]]:
        # StatefulDataLoader shuffles with a sampler of its own: compare the workers' draws.
        loader = _loader(cls, 2, shuffle=False, persistent_workers=persistent)
        out = _epochs(loader, 1)
        loader.load_state_dict({})
        assert loader.next_iter_state is None
        return out + collect_epochs(loader, 2)

    ours, theirs = epochs(ThreadDataLoader), epochs(StatefulDataLoader)
    for our_epoch, their_epoch in zip(ours, theirs, strict=True):
        assert_epochs_equal(our_epoch, their_epoch)


def test_next_iter_state_is_the_loaded_state_until_an_iter_starts_from_it() -> None:
    loader = _loader(ThreadDataLoader, 2)
    assert loader.next_iter_state is None
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    resumed = _loader(ThreadDataLoader, 2)
    resumed.load_state_dict(state)
    pending = resumed.next_iter_state
    assert pending is not None and pending["batches_yielded"] == state["batches_yielded"] == 1
    pending["batches_yielded"] = 0  # a copy: changing it changes nothing
    assert resumed.next_iter_state["batches_yielded"] == 1
    next(iter(resumed))
    assert resumed.next_iter_state is None


def test_shutdown_workers_ends_the_worker_threads_as_torchs_ends_its_processes() -> None:
    loader = ThreadDataLoader(Draws(), batch_size=4, num_workers=2, persistent_workers=True)
    list(loader)
    it = loader._iterator
    workers = list(it._workers)
    assert all(w.is_alive() for w in workers)
    it._shutdown_workers()
    for w in workers:
        w.join(10)
    assert not any(w.is_alive() for w in workers)


def _moving_subclass(base: type, before: bool) -> type:
    """A subclass with a ``device`` of its own, set before or after ``super().__init__()``,
    that moves each batch there itself; and an ``isolation`` meaning something else."""

    class Moving(base):  # type: ignore[misc, valid-type]
        def __init__(self, dataset: Any, device: str, **kwargs: Any) -> None:
            if before:
                self.device = torch.device(device)
                self.isolation = "its own meaning"
            super().__init__(dataset, **kwargs)
            if not before:
                self.device = torch.device(device)
                self.isolation = "its own meaning"

        def __iter__(self) -> Iterator[Any]:
            for batch in super().__iter__():
                yield batch.to(self.device)

    return Moving


@pytest.mark.parametrize("before", [True, False], ids=["set-before-init", "set-after-init"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_subclass_may_use_the_names_of_our_options_for_its_own(
    before: bool, workers: int
) -> None:
    def run(base: type) -> tuple[Any, list[Any]]:
        loader = _moving_subclass(base, before)(
            list(range(8)), "meta", batch_size=4, num_workers=workers
        )
        return loader, list(loader)

    (ours, our_batches), (_, their_batches) = run(ThreadDataLoader), run(DataLoader)
    assert [b.device.type for b in our_batches] == [b.device.type for b in their_batches]
    assert [b.device.type for b in our_batches] == ["meta", "meta"]
    assert ours.device == torch.device("meta") and ours.isolation == "its own meaning"
    assert ours.stats().mode == "threads"  # our isolation option is still the default's
