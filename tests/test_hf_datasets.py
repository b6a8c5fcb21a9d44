"""Hugging Face ``datasets`` through ThreadDataLoader, against torchdata's StatefulDataLoader.

Both loaders get the same dataset and the same save point; after ``load_state_dict`` both must
deliver the batches an uninterrupted run gives.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest

datasets = pytest.importorskip("datasets", reason="needs Hugging Face datasets")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

from threadloader import ThreadDataLoader


def _stream(shards: int) -> Any:
    return datasets.Dataset.from_dict({"x": list(range(60))}).to_iterable_dataset(num_shards=shards)


def _table() -> Any:
    return datasets.Dataset.from_dict({"x": list(range(60))}).with_format("torch")


def _values(batches: list[Any]) -> list[list[int]]:
    return [b["x"].tolist() for b in batches]


def _cut_and_resume(
    loader_class: Any, make: Callable[[], Any], cut: int, options: Callable[[], dict[str, Any]]
) -> tuple[list[list[int]], list[list[int]]]:
    """An uninterrupted epoch, and one cut after ``cut`` batches and resumed in a new loader;
    each loader gets a fresh dataset and fresh ``options()`` (a generator is stateful)."""
    full = _values(list(loader_class(make(), **options())))
    loader = loader_class(make(), **options())
    it = iter(loader)
    head = _values(list(itertools.islice(it, cut)))
    state = loader.state_dict()
    del it
    resumed = loader_class(make(), **options())
    resumed.load_state_dict(state)
    return full, head + _values(list(resumed))


@pytest.mark.parametrize("cut", [1, 4, 7])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("shards", [1, 3])
def test_a_hugging_face_stream_resumes_exactly_as_with_statefuldataloader(
    shards: int, num_workers: int, cut: int
) -> None:
    """An IterableDataset from to_iterable_dataset() resumes with no item lost or repeated,
    also with more workers than shards (the idle workers' copies must not reset the stream)."""

    def options() -> dict[str, Any]:
        return {"batch_size": 4, "num_workers": num_workers}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datasets: "Too many dataloader workers"
        full, ours = _cut_and_resume(ThreadDataLoader, lambda: _stream(shards), cut, options)
        their_full, theirs = _cut_and_resume(
            StatefulDataLoader, lambda: _stream(shards), cut, options
        )
    assert ours == full == their_full == theirs
    assert sorted(itertools.chain.from_iterable(ours)) == list(range(60))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("cut", [1, 6])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_a_hugging_face_table_resumes_exactly_as_with_statefuldataloader(
    num_workers: int, cut: int, shuffle: bool
) -> None:
    """A map-style Dataset resumes exactly. Shuffled, StatefulDataLoader swaps in its own
    RandomSampler, whose order is not DataLoader's; ours keeps DataLoader's order."""
    import torch
    from torch.utils.data import DataLoader

    def options() -> dict[str, Any]:
        return {
            "batch_size": 4, "num_workers": num_workers, "shuffle": shuffle,
            "generator": torch.Generator().manual_seed(5),
        }  # fmt: skip

    full, ours = _cut_and_resume(ThreadDataLoader, _table, cut, options)
    their_full, theirs = _cut_and_resume(StatefulDataLoader, _table, cut, options)
    assert ours == full and theirs == their_full
    assert full == _values(list(DataLoader(_table(), **options())))
    if not shuffle:
        assert full == their_full
