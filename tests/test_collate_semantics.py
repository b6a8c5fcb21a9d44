"""Batches are collated as torch collates them: as a worker process does when there are workers.

torch's ``default_collate`` stacks differently inside a worker process: into a new contiguous
tensor of the first sample's dtype (``out=``), where the calling process lets ``torch.stack``
promote dtypes, keep a layout such as channels-last, and track gradients. Our worker threads
(and the training thread when it makes a batch for them, and the isolation helper) must give
torch's worker results; ``num_workers=0`` must give torch's in-process ones, whatever the batch
size (large batches are stacked into recycled memory, which must not change the result).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_outcomes_match, outcomes, torch_outcomes

from threadloader import ThreadDataLoader


def _row(i: int) -> torch.Tensor:
    return torch.arange(3) + i


def _mixed_ints(i: int) -> torch.Tensor:
    return torch.arange(3, dtype=torch.int64 if i % 2 else torch.int32) + i


def _int_then_float(i: int) -> torch.Tensor:
    return torch.arange(3, dtype=torch.float32 if i % 2 else torch.int64) + i


class _Permuted:
    """An HWC image of ``side`` x ``side`` viewed as CHW: not contiguous."""

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, i: int) -> torch.Tensor:
        side = self.side
        image = torch.arange(side * side * 3, dtype=torch.float32) + i
        return image.reshape(side, side, 3).permute(2, 0, 1)


def _channels_last(i: int) -> torch.Tensor:
    return (
        (torch.arange(2 * 3 * 4 * 4, dtype=torch.float32) + i)
        .reshape(2, 3, 4, 4)
        .contiguous(memory_format=torch.channels_last)
    )


def _needs_grad(i: int) -> torch.Tensor:
    return torch.full((3,), float(i)).requires_grad_()


def _sparse(i: int) -> torch.Tensor:
    return torch.zeros(4).to_sparse()


def _pairs_of_views(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    row = torch.arange(9) + i
    return row[:-1], row[1:]


CASES: dict[str, tuple[Callable[[int], Any], str]] = {
    # name: (item, a fragment of the error torch raises with workers; none: it raises nothing)
    "mixed integer dtypes": (_mixed_ints, ""),
    "int then float": (_int_then_float, "can't be cast"),
    "permuted views, small batch": (_Permuted(8), ""),
    "permuted views, batch over 1 MiB": (_Permuted(256), ""),  # 4 x 3 x 256 x 256 float32
    "channels-last samples": (_channels_last, ""),
    "samples requiring grad": (_needs_grad, "don't support automatic differentiation"),
    "sparse samples": (_sparse, "Batches of sparse tensors are not currently supported"),
    "pairs of views": (_pairs_of_views, ""),
}


class Items:
    """Map-style: item i is ``make(i)``."""

    def __init__(self, make: Callable[[int], Any], n: int = 8) -> None:
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.make(i)


def _strides(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.stride() if batch.layout == torch.strided else None
    return [_strides(b) for b in batch]


LOADERS = {"num_workers=0": (0, None), "num_workers=2": (2, None), "isolation": (2, "process")}


@pytest.mark.parametrize("loader_kind", LOADERS)
@pytest.mark.parametrize("case", CASES)
def test_default_collate_gives_torchs_dtype_layout_and_errors(case: str, loader_kind: str) -> None:
    """Same batches (dtype, values), same strides, same error types and messages as torch's
    DataLoader with the same num_workers."""
    make, message = CASES[case]
    num_workers, isolation = LOADERS[loader_kind]
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers}
    theirs = torch_outcomes(Items(make), limit=4, **kwargs)
    loader = ThreadDataLoader(Items(make), isolation=isolation, **kwargs)
    iterator = iter(loader)
    try:
        ours = outcomes(iterator, limit=4)
    finally:
        del iterator
    assert_outcomes_match(ours, theirs, [message] if message else [])
    if message and (num_workers or case == "sparse samples"):
        assert any(o.error is not None and message in str(o.error) for o in theirs), (
            "torch did not raise: the scenario is wrong"
        )
    for mine, ref in zip(ours, theirs, strict=True):
        if ref.error is None:
            assert _strides(mine.batch) == _strides(ref.batch)


def test_getitems_returning_a_generator_fails_as_in_torch() -> None:
    """A ``__getitems__`` that returns a generator reaches default_collate as torch's does."""

    class Generating(Items):
        def __getitems__(self, indices: list[int]) -> Any:
            return (self.make(i) for i in indices)

    theirs = torch_outcomes(Generating(_mixed_ints), limit=2, batch_size=4)
    ours = outcomes(iter(ThreadDataLoader(Generating(_mixed_ints), batch_size=4)), limit=2)
    assert_outcomes_match(ours, theirs)
    assert str(ours[0].error) == str(theirs[0].error)


@pytest.mark.parametrize("loader_kind", LOADERS)
def test_default_collate_of_one_tensor_sample_fails_as_in_torch(loader_kind: str) -> None:
    """``batch_size=None, collate_fn=default_collate`` hands default_collate a sample, not a
    list: torch.stack refuses a tensor there (TypeError), which no row-wise stack may hide."""
    num_workers, isolation = LOADERS[loader_kind]
    kwargs: dict[str, Any] = {
        "batch_size": None,
        "collate_fn": torch.utils.data.default_collate,
        "num_workers": num_workers,
    }
    theirs = torch_outcomes(Items(_row, n=3), limit=3, **kwargs)
    loader = ThreadDataLoader(Items(_row, n=3), isolation=isolation, **kwargs)
    ours = outcomes(iter(loader), limit=3)
    assert isinstance(theirs[0].error, TypeError), "torch did not raise: the scenario is wrong"
    assert_outcomes_match(ours, theirs)
    assert str(ours[0].error).splitlines()[-1] == str(theirs[0].error).splitlines()[-1]
