"""Each ``next()`` opens the profiler range torch's DataLoader opens, under the same name."""

from __future__ import annotations

from typing import Any

import pytest
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset, IterableDataset

from threadloader import ThreadDataLoader


class Squares(Dataset[int]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        return index * index


class Counting(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        yield from range(3 * self.n)  # more batches than __len__ says samples


def _ranges(loader: Any, batches: int) -> tuple[str, int]:
    """The iterator's range name, and how many such ranges ``batches`` calls of next() opened."""
    it = iter(loader)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(batches):
            next(it)
    name = f"enumerate(DataLoader)#{type(it).__name__}.__next__"
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return name, sum(1 for event in prof.events() if event.name == name)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_next_opens_torchs_named_range(num_workers: int) -> None:
    ours_name, ours = _ranges(ThreadDataLoader(Squares(), batch_size=4, num_workers=num_workers), 5)
    torch_name, theirs = _ranges(DataLoader(Squares(), batch_size=4), 5)
    assert theirs == 5 and ours == 5
    assert ours_name.startswith("enumerate(DataLoader)#") and torch_name.startswith(
        "enumerate(DataLoader)#"
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_longer_than_its_len_warns_as_torch_does(num_workers: int) -> None:
    """The warning torch's ``__next__`` gives, word for word (ours reimplements that method)."""

    def warnings_of(loader: Any) -> list[str]:
        len(loader)  # torch warns only once len() was asked
        with pytest.warns(UserWarning) as record:
            list(loader)
        return sorted({str(w.message) for w in record if "Length of IterableDataset" in str(w)})

    dataset = Counting(6)
    ours = warnings_of(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    theirs = warnings_of(DataLoader(dataset, batch_size=2, num_workers=num_workers))
    assert ours and ours == theirs
