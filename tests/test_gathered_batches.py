"""A dataset that gathers whole batches (TokenWindows) is collated from what it gathered.

ThreadDataLoader's default collate copies TokenWindows' gathered inputs and targets once instead
of stacking per-window views (``_gathered``); the batches must stay exactly torch's: the same
values, dtype, a list of two contiguous tensors in memory of their own. A subclass that changes
``__getitems__``, a custom ``collate_fn`` and plain ``DataLoader`` still see the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, _DatasetKind, default_collate

from threadloader import ThreadDataLoader, _gathered
from threadloader._fetch import Fetcher
from threadloader._recycle import RecyclingAllocator, RecyclingCollate
from threadloader._timing import StageRecorder
from threadloader.memory import pageable_allocator, pinned_collate, pinning_collate
from threadloader.samplers import ShuffleSampler
from threadloader.streams import TokenWindows


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gathered") / "tokens.bin"
    np.arange(400_000, dtype=np.uint32).tofile(path)
    return str(path)


def _assert_torch_batches(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b) is list and len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype == torch.int64
            assert x.is_contiguous() and torch.equal(x, y)
        # inputs and targets overlap in the gather; the batch's two tensors must not
        (x, y) = sorted(a, key=lambda t: t.data_ptr())
        assert x.data_ptr() + x.nbytes <= y.data_ptr()


@pytest.mark.parametrize(
    ("seq_len", "batch_size"),
    [(31, 8), (20_000, 9)],  # small batches; parts over 1 MiB (recycled memory)
)
@pytest.mark.parametrize(
    "options",
    [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "isolation": "process"}],
    ids=["inline", "threads", "isolation"],
)
def test_batches_equal_dataloaders(
    token_file: str, seq_len: int, batch_size: int, options: dict[str, Any]
) -> None:
    ds = TokenWindows(token_file, seq_len=seq_len, dtype=np.uint32)
    theirs = list(
        DataLoader(ds, batch_size=batch_size, sampler=ShuffleSampler(ds, seed=1), num_workers=0)
    )
    ours = list(
        ThreadDataLoader(ds, batch_size=batch_size, sampler=ShuffleSampler(ds, seed=1), **options)
    )
    _assert_torch_batches(ours, theirs)


def test_the_fetcher_hands_gathered_tensors_only_to_a_collate_that_takes_them(
    token_file: str,
) -> None:
    ds = TokenWindows(token_file, seq_len=5, dtype=np.uint32)
    recorder = StageRecorder("test")
    collate = RecyclingCollate(RecyclingAllocator(2), as_worker=True)
    seen: list[Any] = []

    def custom(batch: Any) -> Any:
        seen.append(batch)
        return default_collate(batch)

    ours = Fetcher(_DatasetKind.Map, ds, True, collate, False)
    assert type(ours._items([3, 1])) is _gathered.Gathered
    theirs = Fetcher(_DatasetKind.Map, ds, True, custom, False)
    _assert_torch_batches([theirs.fetch([3, 1], recorder)], [ours.fetch([3, 1], recorder)])
    assert type(seen[0]) is list and len(seen[0]) == 2
    assert torch.equal(seen[0][0][0], torch.arange(15, 20))


def test_pinning_collate_of_default_collate_takes_gathered_batches(token_file: str) -> None:
    ds = TokenWindows(token_file, seq_len=5, dtype=np.uint32)
    collate = pinning_collate(default_collate, pageable_allocator)
    assert getattr(collate, "takes_gathered", False)
    gathered = _gathered.Gathered(ds._inputs_targets([7, 2, 9]))
    _assert_torch_batches([collate(gathered)], [default_collate(ds.__getitems__([7, 2, 9]))])
    # pinned_collate itself: one copy into the allocator's memory, for every part size
    allocated: list[torch.Tensor] = []

    def allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        allocated.append(torch.empty(shape, dtype=dtype))
        return allocated[-1]

    batch = pinned_collate(gathered, allocator)
    assert [t.data_ptr() for t in batch] == [t.data_ptr() for t in allocated]


class _Shifted(TokenWindows):
    """Overrides __getitems__ without the mark: its own samples must be collated."""

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x + 1000, y) for x, y in super().__getitems__(indices)]


class _Scaled(TokenWindows):
    """Overrides only the gathering method, which the marked __getitems__ also calls."""

    def _inputs_targets(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super()._inputs_targets(indices)
        return inputs * 2, targets


@pytest.mark.parametrize("dataset_type", [_Shifted, _Scaled])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_subclasses_get_what_dataloader_gives_them(
    token_file: str, dataset_type: type[TokenWindows], num_workers: int
) -> None:
    ds = dataset_type(token_file, seq_len=11, dtype=np.uint32)
    theirs = list(DataLoader(ds, batch_size=4, shuffle=False))
    ours = list(ThreadDataLoader(ds, batch_size=4, num_workers=num_workers))
    _assert_torch_batches(ours, theirs)
    assert theirs[0][0][0, 1] in (1001, 2)  # the override took effect (plain: 1)


def test_an_instance_getitems_is_called_as_torch_calls_it(token_file: str) -> None:
    ds = TokenWindows(token_file, seq_len=11, dtype=np.uint32)
    plain = ds.__getitems__
    ds.__getitems__ = lambda indices: [(x - 1, y) for x, y in plain(indices)]  # type: ignore[method-assign]
    assert _gathered.parts_getter(ds) is None
    theirs = list(DataLoader(ds, batch_size=4))
    _assert_torch_batches(list(ThreadDataLoader(ds, batch_size=4, num_workers=2)), theirs)
    assert theirs[0][0][0, 0] == -1
