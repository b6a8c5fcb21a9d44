"""What torch's own tests and user code read off a DataLoader iterator, read off ours.

``iter(loader)._workers`` lists one object per worker with ``is_alive()`` and ``join()``
(torch's: the worker processes; ours: the worker threads, or stand-ins for the helper's
threads with ``isolation="process"``), all ended once the epoch is over however it ended; and
the too-many-workers warning keeps torch's sentence.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from threadloader import ThreadDataLoader

JOIN_S = 10.0
TORCH_SENTENCE = r"excessive worker creation might get DataLoader running slow or even freeze"


class Items(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13 and getattr(self, "fail", False):
            raise ValueError("item 13 is corrupt")
        return torch.tensor(i)


def _loaders() -> dict[str, Callable[[Dataset[Any]], DataLoader[Any]]]:
    return {
        "torch": lambda d: DataLoader(d, batch_size=4, num_workers=2),
        "threads": lambda d: ThreadDataLoader(d, batch_size=4, num_workers=2),
        "process": lambda d: ThreadDataLoader(d, batch_size=4, num_workers=2, isolation="process"),
    }


def _workers_after(make: Callable[[Dataset[Any]], DataLoader[Any]], ending: str) -> list[Any]:
    """Run an epoch to ``ending``, drop the iterator, and return its ``_engine.workers``."""
    dataset = Items()
    dataset.fail = ending == "error"  # type: ignore[attr-defined]
    it = iter(make(dataset))
    workers = list(it._workers)
    assert len(workers) == 2
    assert all(w.is_alive() for w in workers) or ending != "break"
    if ending == "exhaustion":
        assert len(list(it)) == 8
    elif ending == "break":
        for i, _ in enumerate(it):
            if i == 2:
                break
    else:
        with pytest.raises(ValueError, match="item 13 is corrupt"):
            list(it)
    del it
    gc.collect()
    for w in workers:
        w.join(JOIN_S)
    return workers


@pytest.mark.parametrize("ending", ["exhaustion", "break", "error"])
@pytest.mark.parametrize("loader", ["torch", "threads", "process"])
def test_iterator_workers_are_listed_and_end_with_the_epoch(
    loader: str, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``iter(loader)._workers`` has one entry per worker, with ``is_alive()`` and ``join()``,
    and none is alive once the epoch ended (exhausted, ``break`` then ``del``, or a worker error
    then ``del``): as torch's worker processes."""
    # torch's workers notice their shutdown at their next status check, 5 s apart: after a
    # worker error, 10 s of this test were torch's; they check every 0.5 s here.
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    workers = _workers_after(_loaders()[loader], ending)
    assert [w.is_alive() for w in workers] == [False, False]
    assert [w.exitcode for w in workers] == [0, 0]


def test_iterator_workers_list_is_empty_without_workers() -> None:
    """With ``num_workers=0`` nothing runs besides the loop: ``_engine.workers`` is empty."""
    it = iter(ThreadDataLoader(Items(), batch_size=4))
    assert it._workers == []


@pytest.mark.parametrize("make", [DataLoader, ThreadDataLoader], ids=["torch", "threadloader"])
def test_too_many_workers_warning_keeps_torchs_sentence(make: type[DataLoader[Any]]) -> None:
    """The excessive-workers warning matches torch's own regex, so filters written for it work."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anything else
        warnings.filterwarnings("error", message=f".*{TORCH_SENTENCE}")
        with pytest.raises(UserWarning, match=TORCH_SENTENCE):
            make(Items(), batch_size=4, num_workers=10_000)
