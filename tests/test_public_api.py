"""ThreadDataLoader is a DataLoader: same constructor, same attributes, same argument errors."""

from __future__ import annotations

import inspect
import os
import typing
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import call_with_args, torch_loader
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
)

import threadloader
from threadloader import ThreadDataLoader


class Squares(Dataset[int]):
    """Map-style: item i is i * i."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        return index * index


class Count(IterableDataset[int]):
    """Iterable-style: 0, 1, ..., 9."""

    def __iter__(self) -> typing.Iterator[int]:
        return iter(range(10))


def _params(cls: type) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]


def test_signature_starts_with_dataloaders_own_parameters() -> None:
    """ThreadDataLoader's parameters begin with DataLoader's: same names, kinds, defaults, order."""
    theirs = _params(DataLoader)
    assert _params(ThreadDataLoader)[: len(theirs)] == theirs


def test_new_parameters_are_keyword_only_and_follow_torchs() -> None:
    """Any parameter ThreadDataLoader adds comes after DataLoader's and is keyword-only."""
    theirs = _params(DataLoader)
    extra = _params(ThreadDataLoader)[len(theirs) :]
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in extra), extra


def test_threaddataloader_is_a_dataloader() -> None:
    """A ThreadDataLoader instance passes isinstance(..., DataLoader)."""
    assert issubclass(ThreadDataLoader, DataLoader)
    assert isinstance(ThreadDataLoader(Squares()), DataLoader)


def test_class_is_subscriptable_like_dataloader() -> None:
    """ThreadDataLoader[int] is a generic alias of ThreadDataLoader, as DataLoader[int] is."""
    alias = ThreadDataLoader[int]
    assert typing.get_origin(alias) is ThreadDataLoader
    assert typing.get_args(alias) == typing.get_args(DataLoader[int])


def test_package_exports_threaddataloader_in_all() -> None:
    """`threadloader.__all__` is sorted and lists ThreadDataLoader."""
    assert "ThreadDataLoader" in threadloader.__all__
    assert sorted(threadloader.__all__) == threadloader.__all__


_SAMPLER = SequentialSampler(range(10))
_BATCH_SAMPLER = BatchSampler(SequentialSampler(range(10)), 3, drop_last=False)


def _map(**kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (Squares(),), kwargs


def _iterable(**kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (Count(),), kwargs


BAD_ARGUMENTS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "negative num_workers": _map(num_workers=-1),
    "negative timeout": _map(timeout=-1),
    "prefetch_factor without workers": _map(prefetch_factor=2),
    "negative prefetch_factor": _map(num_workers=2, prefetch_factor=-1),
    "persistent_workers without workers": _map(persistent_workers=True),
    "sampler with shuffle": _map(sampler=_SAMPLER, shuffle=True),
    "batch_sampler with batch_size": _map(batch_sampler=_BATCH_SAMPLER, batch_size=2),
    "batch_sampler with shuffle": _map(batch_sampler=_BATCH_SAMPLER, shuffle=True),
    "batch_sampler with sampler": _map(batch_sampler=_BATCH_SAMPLER, sampler=_SAMPLER),
    "batch_sampler with drop_last": _map(batch_sampler=_BATCH_SAMPLER, drop_last=True),
    "batch_size None with drop_last": _map(batch_size=None, drop_last=True),
    "iterable with shuffle": _iterable(shuffle=True),
    "iterable with sampler": _iterable(sampler=_SAMPLER),
    "iterable with batch_sampler": _iterable(batch_sampler=_BATCH_SAMPLER),
    "unknown multiprocessing_context": _map(num_workers=2, multiprocessing_context="nonsense"),
    "multiprocessing_context of wrong type": _map(num_workers=2, multiprocessing_context=3),
    "multiprocessing_context without workers": _map(multiprocessing_context="fork"),
    "unknown keyword": _map(no_such_option=1),
    "too many positional arguments": ((Squares(), *[None] * 13, 1), {}),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=list(BAD_ARGUMENTS))
def test_bad_arguments_raise_torchs_error(case: str) -> None:
    """Each invalid argument combination raises torch's exception type with torch's message."""
    args, kwargs = BAD_ARGUMENTS[case]
    theirs = call_with_args(DataLoader, *args, **kwargs)
    ours = call_with_args(ThreadDataLoader, *args, **kwargs)
    assert theirs is not None, f"torch accepted {case}; the case is wrong"
    assert type(ours) is type(theirs), f"{type(ours).__name__}: {ours}"
    assert str(ours) == str(theirs).replace("DataLoader", "ThreadDataLoader") or str(ours) == str(
        theirs
    )


@pytest.mark.parametrize("attr", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset"])
def test_frozen_attributes_cannot_be_set_after_init_like_torch(attr: str) -> None:
    """Setting an attribute torch freezes after __init__ raises torch's ValueError."""
    theirs = call_with_args(setattr, DataLoader(Squares()), attr, None)
    ours = call_with_args(setattr, ThreadDataLoader(Squares()), attr, None)
    assert type(ours) is type(theirs) is ValueError
    assert str(ours) == str(theirs).replace("DataLoader", "ThreadDataLoader")


def _collate_identity(items: list[int]) -> list[int]:
    return items


def _init_nothing(worker_id: int) -> None:
    return None


def _attributes(loader: DataLoader) -> dict[str, Any]:
    names = [
        "dataset", "batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory",
        "pin_memory_device", "timeout", "worker_init_fn", "generator", "collate_fn",
        "persistent_workers", "in_order", "multiprocessing_context", "_dataset_kind",
        "_auto_collation",
    ]  # fmt: skip
    found = {name: getattr(loader, name) for name in names}
    found["sampler"] = type(loader.sampler)
    found["batch_sampler"] = type(loader.batch_sampler)
    found["_index_sampler"] = type(loader._index_sampler)
    return found


def _same_args() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ((Squares(),), {}),
        ((Squares(), 4, True), {"generator": generator, "drop_last": True}),
        ((Squares(),), {"batch_size": None, "num_workers": 2}),
        ((Squares(),), {"batch_sampler": _BATCH_SAMPLER, "collate_fn": _collate_identity}),
        (
            (Squares(),),
            {
                "num_workers": 3,
                "prefetch_factor": 5,
                "persistent_workers": True,
                "timeout": 2.5,
                "worker_init_fn": _init_nothing,
                "in_order": False,
            },
        ),
        ((Count(),), {"batch_size": 3, "num_workers": 2}),
    ]


@pytest.mark.parametrize("index", range(len(_same_args())))
def test_attributes_are_the_ones_torch_sets(index: int) -> None:
    """After construction the loader's public attributes equal those torch's DataLoader sets."""
    args, kwargs = _same_args()[index]
    theirs = torch_loader(*args, **kwargs)
    ours = ThreadDataLoader(*args, **kwargs)
    assert _attributes(ours) == _attributes(theirs)


def test_many_threads_on_few_cores_do_not_get_the_process_warning() -> None:
    """num_workers above the core count is legitimate for threads: no 'worker processes' warning."""
    cores = torch._utils.cpu_count() or os.cpu_count() or 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = ThreadDataLoader(Squares(), batch_size=2, num_workers=2 * cores)
        batches = list(loader)
    assert len(batches) == 5
    messages = [str(w.message) for w in caught]
    assert not any("worker processes" in m for m in messages), messages


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_timeout_without_workers_fails_like_torch(kind: str) -> None:
    """iter() of a loader with timeout > 0 and num_workers=0 raises what torch raises."""
    dataset = Squares() if kind == "map" else Count()

    def first(make: Callable[..., DataLoader]) -> BaseException | None:
        return call_with_args(lambda: next(iter(make(dataset, timeout=1.0))))

    theirs, ours = first(DataLoader), first(ThreadDataLoader)
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


# torch's iterator, failing in __init__, then fails again in __del__ (no _shutdown attribute).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_prefetch_factor_zero_with_workers_fails_at_iter_like_torch() -> None:
    """torch accepts prefetch_factor=0 in the constructor and fails in iter(): never 0 batches."""

    def first(make: Callable[..., DataLoader]) -> BaseException | None:
        loader = make(Squares(), num_workers=1, prefetch_factor=0)
        return call_with_args(lambda: next(iter(loader)))

    theirs, ours = first(DataLoader), first(ThreadDataLoader)
    assert isinstance(theirs, AssertionError)
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("isolation", ["threads", "process", "auto"])
def test_negative_workers_set_after_construction_fail_at_iter_like_torch(isolation: str) -> None:
    """The constructor refuses num_workers=-1; set afterwards, torch's iterator refuses it
    (AssertionError): never an empty epoch, nor a message about a queue's capacity."""

    def first(make: Callable[..., DataLoader], **options: Any) -> BaseException | None:
        loader = make(Squares(), batch_size=2, num_workers=2, **options)
        loader.num_workers = -1
        return call_with_args(lambda: next(iter(loader)))

    theirs, ours = first(DataLoader), first(ThreadDataLoader, isolation=isolation)
    assert isinstance(theirs, AssertionError)
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_workers_set_after_construction_fail_clearly_instead_of_an_empty_epoch() -> None:
    """num_workers raised after the constructor leaves prefetch_factor None: torch fails (a
    TypeError comparing None); so do we, with a message that says what to set."""
    loader = ThreadDataLoader(Squares(), batch_size=2)
    loader.num_workers = 2
    with pytest.raises(TypeError, match="prefetch_factor is None with num_workers=2"):
        next(iter(loader))
    reference = DataLoader(Squares(), batch_size=2)
    reference.num_workers = 2
    with pytest.raises(TypeError):
        next(iter(reference))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_float_prefetch_factor_fails_at_iter_with_a_type_error_like_torch() -> None:
    """torch accepts prefetch_factor=2.5 in the constructor and fails in iter() (range() of a
    float); ours fails there too, naming the argument, instead of truncating it to 2."""
    with pytest.raises(TypeError, match="prefetch_factor must be an int"):
        next(iter(ThreadDataLoader(Squares(), num_workers=1, prefetch_factor=2.5)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        next(iter(DataLoader(Squares(), num_workers=1, prefetch_factor=2.5)))  # type: ignore[arg-type]
