"""ThreadDataLoader yields exactly the batches torch's DataLoader yields for the same inputs.

The reference for map-style datasets is torch's DataLoader with num_workers=0 (its batches and
their order do not depend on num_workers); where torch's behaviour does depend on its workers
(persistent workers draw one base seed, IterableDataset length warnings) the reference is torch's
own process loader with the same arguments.
"""

from __future__ import annotations

import threading
import warnings
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    assert_epochs_equal,
    assert_same_multiset,
    collect,
    collect_epochs,
    torch_epochs,
    torch_loader,
)
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    TensorDataset,
    get_worker_info,
)

from threadloader import ThreadDataLoader

NUM_WORKERS = [0, 1, 2, 3]

Pair = namedtuple("Pair", ["x", "y"])


class Numbers:
    """Map-style dataset of n ints (a plain class: DataLoader only needs __getitem__/__len__)."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index * 3 + 1


class Arrays(Numbers):
    """Items are numpy arrays and numpy scalars of several dtypes."""

    def __getitem__(self, index: int) -> Any:
        base = super().__getitem__(index)
        return (
            np.arange(base, base + 6, dtype=np.float32).reshape(2, 3),
            np.array([base, -base], dtype=np.int16),
            np.float64(base) / 7,
            np.bool_(index % 2),
        )


class Dicts(Numbers):
    """Items are dicts of a tensor, an int, a float, a string and a nested dict."""

    def __getitem__(self, index: int) -> Any:
        base = super().__getitem__(index)
        return {
            "x": torch.full((2, 2), base, dtype=torch.float64),
            "label": base % 5,
            "weight": base / 3,
            "name": f"item-{index}",
            "meta": {"index": torch.tensor(index), "even": index % 2 == 0},
        }


class Pairs(Numbers):
    """Items are namedtuples of a tensor and a list of ints."""

    def __getitem__(self, index: int) -> Any:
        base = super().__getitem__(index)
        return Pair(x=torch.arange(base, base + 4), y=[base, base + 1])


class Strings(Numbers):
    """Items are strings and bytes."""

    def __getitem__(self, index: int) -> Any:
        return (f"sample {super().__getitem__(index)}", b"raw-%d" % index)


class WithGetitems(Numbers):
    """Has __getitems__, which torch uses for batches; items it returns are marked as such."""

    def __getitem__(self, index: int) -> Any:
        return ("one", super().__getitem__(index))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [("many", super(WithGetitems, self).__getitem__(i)) for i in indices]


class EveryThirdBackwards(Sampler[int]):
    """A custom sampler: every third index, last first."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -3))

    def __len__(self) -> int:
        return len(range(self.n - 1, -1, -3))


UNEVEN_BATCHES = [[4, 1], [0], [2, 3, 5, 9], [22, 21, 20], [7], [8, 6, 10, 11, 12]]


def sum_and_count(items: list[Any]) -> dict[str, Any]:
    """A custom collate_fn."""
    return {"sum": sum(items), "count": len(items), "items": tuple(items)}


def _tensors() -> TensorDataset:
    return TensorDataset(torch.arange(46, dtype=torch.float32).reshape(23, 2), torch.arange(23))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# name -> (dataset factory, kwargs factory); factories so each loader gets fresh generators.
Scenario = tuple[Callable[[], Any], Callable[[], dict[str, Any]]]
SCENARIOS: dict[str, Scenario] = {
    "sequential": (Numbers, lambda: {"batch_size": 4}),
    "sequential batch_size 1": (Numbers, dict),
    "shuffle with generator": (Numbers, lambda: {"batch_size": 4, "shuffle": True, "generator": _seeded(7)}),
    "shuffle with another generator seed": (Numbers, lambda: {"batch_size": 5, "shuffle": True, "generator": _seeded(12345)}),
    "batch_size None": (Numbers, lambda: {"batch_size": None}),
    "batch_size None shuffled": (Numbers, lambda: {"batch_size": None, "shuffle": True, "generator": _seeded(3)}),
    "custom sampler": (Numbers, lambda: {"batch_size": 3, "sampler": EveryThirdBackwards(23)}),
    "random sampler with replacement": (Numbers, lambda: {"batch_size": 3, "sampler": RandomSampler(range(23), replacement=True, num_samples=17, generator=_seeded(5))}),
    "custom batch_sampler list": (Numbers, lambda: {"batch_sampler": UNEVEN_BATCHES}),
    "custom batch_sampler object": (Numbers, lambda: {"batch_sampler": BatchSampler(RandomSampler(range(23), generator=_seeded(9)), 4, drop_last=False)}),
    "drop_last True": (Numbers, lambda: {"batch_size": 5, "drop_last": True}),
    "drop_last False": (Numbers, lambda: {"batch_size": 5, "drop_last": False}),
    "drop_last shuffled": (Numbers, lambda: {"batch_size": 6, "drop_last": True, "shuffle": True, "generator": _seeded(1)}),
    "custom collate_fn": (Numbers, lambda: {"batch_size": 4, "collate_fn": sum_and_count}),
    "custom collate_fn without batching": (Numbers, lambda: {"batch_size": None, "collate_fn": str}),
    "tensors": (_tensors, lambda: {"batch_size": 4}),
    "tensors shuffled": (_tensors, lambda: {"batch_size": 4, "shuffle": True, "generator": _seeded(2)}),
    "numpy arrays": (Arrays, lambda: {"batch_size": 4}),
    "numpy arrays without batching": (Arrays, lambda: {"batch_size": None}),
    "dicts": (Dicts, lambda: {"batch_size": 4}),
    "namedtuples": (Pairs, lambda: {"batch_size": 4}),
    "strings": (Strings, lambda: {"batch_size": 4}),
    "__getitems__": (WithGetitems, lambda: {"batch_size": 4}),
    "__getitems__ without batching": (WithGetitems, lambda: {"batch_size": None}),
    "__getitems__ with batch_sampler": (WithGetitems, lambda: {"batch_sampler": UNEVEN_BATCHES}),
}  # fmt: skip


def _worker_kwargs(num_workers: int) -> dict[str, Any]:
    """``num_workers`` for a torch reference run, left out (torch's default) when it is 0."""
    return {"num_workers": num_workers} if num_workers else {}


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=list(SCENARIOS))
def test_same_batches_in_same_order_as_dataloader(scenario: str, num_workers: int) -> None:
    """For each sampling/collation scenario, every batch equals torch's, in the same order."""
    make_dataset, make_kwargs = SCENARIOS[scenario]
    dataset = make_dataset()
    theirs = torch_epochs(dataset, **make_kwargs())[0]
    ours = collect(ThreadDataLoader(dataset, num_workers=num_workers, **make_kwargs()))
    assert_epochs_equal(ours, theirs)


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_two_shuffled_epochs_from_one_loader_match_dataloader(num_workers: int) -> None:
    """Two epochs of one shuffled loader give torch's two epochs (the generator advances alike)."""
    kwargs = {"batch_size": 4, "shuffle": True}
    theirs = torch_epochs(Numbers(), epochs=2, generator=_seeded(11), **kwargs)
    loader = ThreadDataLoader(Numbers(), generator=_seeded(11), num_workers=num_workers, **kwargs)
    ours = collect_epochs(loader, 2)
    for epoch in range(2):
        assert_epochs_equal(ours[epoch], theirs[epoch])
    assert not torch.equal(torch.cat(ours[0]), torch.cat(ours[1]))  # a new order each epoch


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_shuffle_without_generator_follows_global_seed_like_dataloader(num_workers: int) -> None:
    """With no generator, after the same torch.manual_seed, shuffled batches equal torch's."""
    torch.manual_seed(2024)
    theirs = torch_epochs(Numbers(), epochs=2, batch_size=4, shuffle=True)
    torch.manual_seed(2024)
    loader = ThreadDataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=num_workers)
    ours = collect_epochs(loader, 2)
    for epoch in range(2):
        assert_epochs_equal(ours[epoch], theirs[epoch])


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("prefetch_factor", [1, 2, 5])
def test_prefetch_factor_does_not_change_batches(num_workers: int, prefetch_factor: int) -> None:
    """Any prefetch_factor gives the same shuffled batches as torch's DataLoader."""
    kwargs = {"batch_size": 3, "shuffle": True}
    theirs = torch_epochs(_tensors(), generator=_seeded(4), **kwargs)[0]
    loader = ThreadDataLoader(
        _tensors(), generator=_seeded(4), num_workers=num_workers,
        prefetch_factor=prefetch_factor, **kwargs,
    )  # fmt: skip
    assert_epochs_equal(collect(loader), theirs)


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
@pytest.mark.parametrize("in_order", [True, False])
def test_in_order_false_yields_the_same_multiset_of_batches(
    in_order: bool, num_workers: int
) -> None:
    """in_order=False yields torch's batches, each exactly once, in some order; True in order."""
    kwargs = {"batch_size": 3, "shuffle": True}
    theirs = torch_epochs(Dicts(), generator=_seeded(8), **kwargs)[0]
    loader = ThreadDataLoader(
        Dicts(), generator=_seeded(8), in_order=in_order, num_workers=num_workers, **kwargs
    )
    ours = collect(loader)
    if in_order:
        assert_epochs_equal(ours, theirs)
    else:
        assert_same_multiset(ours, theirs)


class IdentRecorder(Numbers):
    """Records the thread ident of every __getitem__ call."""

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.idents: list[int] = []

    def __getitem__(self, index: int) -> int:
        self.idents.append(threading.get_ident())
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_persistent_workers_give_dataloaders_batches_over_three_epochs(num_workers: int) -> None:
    """With persistent_workers, three shuffled epochs equal torch's persistent process loader's."""
    kwargs = {"batch_size": 4, "shuffle": True, "persistent_workers": True}
    theirs = torch_epochs(
        Numbers(), epochs=3, generator=_seeded(21), num_workers=num_workers, **kwargs
    )
    loader = ThreadDataLoader(Numbers(), generator=_seeded(21), num_workers=num_workers, **kwargs)
    ours = collect_epochs(loader, 3)
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], theirs[epoch])


class GlobalDraws(torch.utils.data.Dataset[float]):
    """Item i: a draw from the worker's global torch RNG (its own in a worker)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> float:
        return float(torch.rand(()))


@pytest.mark.parametrize("isolation", ["threads", "process"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_persistent_workers_finish_an_abandoned_epochs_batches_like_dataloader(
    num_workers: int, isolation: str
) -> None:
    """Leaving an epoch early: torch's persistent workers make every batch already given to
    them before the next epoch starts, so what those batches drew is drawn in every run. The
    next epoch's draws equal torch's (they depended on how many batches a worker had started
    by the break)."""

    def epochs(make: Callable[..., Any], **extra: Any) -> list[list[list[float]]]:
        torch.manual_seed(0)
        loader = make(
            GlobalDraws(), batch_size=2, num_workers=num_workers, persistent_workers=True,
            **extra,
        )  # fmt: skip
        first = []
        for batch in loader:
            first.append(batch.tolist())
            break
        return [first, [b.tolist() for b in loader], [b.tolist() for b in loader]]

    theirs = epochs(torch_loader, multiprocessing_context="fork")
    assert epochs(ThreadDataLoader, isolation=isolation) == theirs


class Sixteen(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("iterable", [True, False], ids=["iterable", "map-style"])
def test_persistent_workers_survive_epochs_left_before_their_first_batch(iterable: bool) -> None:
    """Epochs left right after iter(), again and again: each waits for what was given to the
    workers, as torch's does, so nothing piles up (a worker's task queue overflowed with a
    RuntimeError, or a result queue did, killing a worker thread and hanging the loop)."""

    def epochs(make: Callable[..., Any], **extra: Any) -> list[Any]:
        dataset = Sixteen() if iterable else list(range(16))
        order = {} if iterable else {"in_order": False}
        loader = make(
            dataset, batch_size=3, num_workers=2, prefetch_factor=2, persistent_workers=True,
            **order, **extra,
        )  # fmt: skip
        out = [[b.tolist() for b in loader]]
        for _ in range(3):
            it = iter(loader)
            del it
        out.append([b.tolist() for b in loader])
        return out

    theirs = epochs(torch_loader, multiprocessing_context="fork")
    ours = epochs(ThreadDataLoader, isolation="threads")
    if iterable:
        assert ours == theirs
    else:
        assert [sorted(map(tuple, e)) for e in ours] == [sorted(map(tuple, e)) for e in theirs]


def _threads_beyond(baseline: set[threading.Thread]) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t not in baseline}


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_persistent_workers_reuse_the_same_threads_across_epochs(num_workers: int) -> None:
    """Later epochs of a persistent loader fetch in the first epoch's threads; no new ones start."""
    baseline = set(threading.enumerate())
    dataset = IdentRecorder()
    loader = ThreadDataLoader(
        dataset, batch_size=2, num_workers=num_workers, persistent_workers=True
    )
    main = threading.get_ident()
    collect(loader)
    threads_after_first = _threads_beyond(baseline)
    first_idents = set(dataset.idents)
    workers_used = first_idents - {main}
    assert len(workers_used) <= num_workers
    assert workers_used <= {t.ident for t in threads_after_first}
    for _ in range(2):
        dataset.idents.clear()
        collect(loader)
        assert set(dataset.idents) <= {t.ident for t in threads_after_first} | {main}
        assert _threads_beyond(baseline) == threads_after_first


def _len_scenarios() -> dict[str, tuple[Any, dict[str, Any]]]:
    return {
        "batch 4": (Numbers(), {"batch_size": 4}),
        "batch 4 drop_last": (Numbers(), {"batch_size": 4, "drop_last": True}),
        "batch None": (Numbers(), {"batch_size": None}),
        "sampler": (Numbers(), {"batch_size": 2, "sampler": EveryThirdBackwards(23)}),
        "batch_sampler": (Numbers(), {"batch_sampler": UNEVEN_BATCHES}),
        "iterable batch 4": (SizedStream(), {"batch_size": 4}),
        "iterable batch 4 drop_last": (SizedStream(), {"batch_size": 4, "drop_last": True}),
        "iterable batch None": (SizedStream(), {"batch_size": None}),
    }


class SizedStream(IterableDataset[int]):
    """Iterable dataset reporting __len__ = 10, sharded across workers by get_worker_info()."""

    def __init__(self, reported: int = 10, actual: int = 10) -> None:
        self.reported = reported
        self.actual = actual

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.actual, step))

    def __repr__(self) -> str:
        return "SizedStream()"


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
@pytest.mark.parametrize("scenario", list(_len_scenarios()))
def test_len_equals_dataloaders_len(scenario: str, num_workers: int) -> None:
    """len(loader) equals len(DataLoader(...)) for map-style and sized iterable datasets."""
    dataset, kwargs = _len_scenarios()[scenario]
    assert len(ThreadDataLoader(dataset, num_workers=num_workers, **kwargs)) == len(
        torch_loader(dataset, **kwargs)
    )


def _length_warnings(loader: Any) -> tuple[list[Any], list[warnings.WarningMessage]]:
    len(loader)  # torch warns only once __len__ of the loader has been asked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = collect(loader)
    return batches, [w for w in caught if "Length of IterableDataset" in str(w.message)]


LENGTH_CASES = {"yields more than len": (4, 9), "yields exactly len": (9, 9)}


@pytest.mark.parametrize("num_workers", NUM_WORKERS)
@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("case", LENGTH_CASES)
def test_iterable_length_warnings_match_dataloaders(
    case: str, batch_size: int | None, num_workers: int
) -> None:
    """An IterableDataset yielding more than its __len__ gets torch's UserWarning per extra batch."""
    reported, actual = LENGTH_CASES[case]
    dataset = SizedStream(reported=reported, actual=actual)
    reference = torch_loader(dataset, batch_size=batch_size, **_worker_kwargs(num_workers))
    ref_batches, theirs = _length_warnings(reference)
    batches, ours = _length_warnings(
        ThreadDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    )
    assert_epochs_equal(batches, ref_batches)
    assert [w.category for w in ours] == [w.category for w in theirs]
    for mine, ref in zip(ours, theirs, strict=True):
        # torch adds a hint about worker processes after this sentence; threads may word it anew
        prefix = str(ref.message).split("samples have been fetched.")[0]
        assert str(mine.message).startswith(prefix)


class CountingBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batches depend on how often __iter__ was called."""

    def __init__(self) -> None:
        self.calls = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.calls += 1
        return iter([[self.calls * 10 + i] for i in range(2)])

    def __len__(self) -> int:
        return 2


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("num_workers", NUM_WORKERS)
def test_sampler_iter_is_called_as_often_as_by_dataloader(
    num_workers: int, persistent: bool
) -> None:
    """torch's worker iterator calls iter(batch_sampler) twice for its first epoch and uses the
    second iterator: a sampler that counts its calls gives the same batches through both."""
    kwargs = {"num_workers": num_workers, "persistent_workers": persistent and num_workers > 0}
    theirs = torch_epochs(range(100), epochs=2, batch_sampler=CountingBatchSampler(), **kwargs)
    loader = ThreadDataLoader(range(100), batch_sampler=CountingBatchSampler(), **kwargs)
    assert_epochs_equal(collect_epochs(loader, 2), theirs)


class SometimesNone(Numbers):
    """Item 2 is None: a batch of its own with batch_size=None."""

    def __getitem__(self, index: int) -> Any:
        return None if index == 2 else super().__getitem__(index)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("num_workers", "isolation"), [(0, None), (1, None), (2, None), (3, None), (2, "process")]
)
def test_none_batches_are_delivered_like_dataloader(
    num_workers: int, isolation: str | None
) -> None:
    """None is a batch like any other (a None item with batch_size=None, or a collate_fn that
    returns None): it was taken for "this worker has nothing" and the epoch hung."""
    kwargs: dict[str, Any] = {"batch_size": None, "num_workers": num_workers}
    theirs = torch_epochs(SometimesNone(12), **kwargs)
    # timeout > 0: workers make every batch (the training thread never makes one itself)
    timeout = 10 if num_workers else 0
    ours = collect_epochs(
        ThreadDataLoader(SometimesNone(12), isolation=isolation, timeout=timeout, **kwargs), 1
    )
    assert_epochs_equal(ours, theirs)
    collated = ThreadDataLoader(
        Numbers(12),
        batch_size=3,
        num_workers=num_workers,
        collate_fn=collate_to_none,
        isolation=isolation,
        timeout=timeout,
    )
    assert list(collated) == [None] * 4


def collate_to_none(batch: list[Any]) -> None:
    return None
