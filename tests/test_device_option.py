"""device=: batches arrive through the transfer stage, state stays consumer-aligned.

These run with ``device="cpu"`` (a pass-through transfer stage with the same thread, ordering and
shutdown as CUDA); tests/cuda/ checks the copies themselves on a GPU.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from helpers import assert_batches_equal, threadloader_threads, threadloader_threads_after
from torch.utils.data import DataLoader, Dataset

from threadloader import ThreadDataLoader


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i)}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_device_batches_equal_torchs(num_workers: int, persistent: bool) -> None:
    """With device= the batches, their order and their types are the host loader's (which
    tests/test_same_batches_as_torch.py compares with DataLoader's), epoch after epoch."""
    if persistent and not num_workers:
        pytest.skip("persistent_workers needs workers")
    kwargs = {
        "batch_size": 5,
        "shuffle": True,
        "num_workers": num_workers,
        "persistent_workers": persistent,
    }
    ours = ThreadDataLoader(
        Pairs(), generator=torch.Generator().manual_seed(2), device="cpu", **kwargs
    )
    theirs = ThreadDataLoader(Pairs(), generator=torch.Generator().manual_seed(2), **kwargs)
    first = DataLoader(
        Pairs(), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    for a, b in zip(
        list(
            ThreadDataLoader(
                Pairs(),
                batch_size=5,
                shuffle=True,
                generator=torch.Generator().manual_seed(2),
                device="cpu",
            )
        ),
        list(first),
        strict=True,
    ):
        assert_batches_equal(a, b)
    for _ in range(2):
        got, want = list(ours), list(theirs)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_batches_equal(a, b)
    del ours, theirs
    assert threadloader_threads_after() == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_state_counts_received_batches_and_resumes(num_workers: int) -> None:
    """The transfer stage runs ahead, but state_dict() counts what the loop received."""

    def make() -> ThreadDataLoader[dict[str, torch.Tensor]]:
        return ThreadDataLoader(
            Pairs(),
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(9),
            device="cpu",
            device_prefetch=3,
        )

    reference = list(make())
    loader = make()
    it = iter(loader)
    seen = list(itertools.islice(it, 3))
    time.sleep(0.05)  # let the transfer stage run ahead
    state = loader.state_dict()
    assert state["batches_yielded"] == 3
    assert loader.stats().batches == 3
    del it
    resumed = make()
    resumed.load_state_dict(state)
    for a, b in zip(seen + list(resumed), reference, strict=True):
        assert_batches_equal(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_break_and_del_end_the_transfer_thread_too(num_workers: int) -> None:
    """Leaving an epoch early joins the transfer thread and the workers."""
    loader = ThreadDataLoader(Pairs(), batch_size=4, num_workers=num_workers, device="cpu")
    for _ in loader:
        break
    assert threadloader_threads_after() == []
    it = iter(loader)
    next(it)
    del it
    assert threadloader_threads_after() == []


def test_worker_error_reaches_the_loop_through_the_transfer_stage() -> None:
    """An exception in a worker is raised by next() at its batch, with the original type."""

    class Bad(Pairs):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == 6:
                raise KeyError("missing sample 6")
            return super().__getitem__(i)

    it = iter(ThreadDataLoader(Bad(), batch_size=4, num_workers=2, device="cpu"))
    next(it)
    with pytest.raises(KeyError, match="missing sample 6"):
        next(it)
    del it
    assert threadloader_threads_after() == []


def test_bad_device_arguments_fail_at_construction() -> None:
    """Unknown devices, CUDA without CUDA, and bad device_prefetch raise naming the value."""
    with pytest.raises((ValueError, RuntimeError), match="nonsense"):
        ThreadDataLoader(Pairs(), device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            ThreadDataLoader(Pairs(), device="cuda")
    with pytest.raises(ValueError, match="device_prefetch"):
        ThreadDataLoader(Pairs(), device="cpu", device_prefetch=0)
    with pytest.raises(ValueError, match="isolation"):
        ThreadDataLoader(Pairs(), isolation="thread")


class SlowIds(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tensor(i)


@pytest.mark.parametrize("isolation", [None, "process"])
def test_persistent_epoch_started_while_the_last_is_held_loses_nothing(
    isolation: str | None,
) -> None:
    """``it = iter(loader)`` each epoch, the last epoch's iterator still alive and part-read:
    its transfer thread must stop pulling before the persistent epoch resets (it took the new
    epoch's first batches, or corrupted its reorder table), and only one stays alive."""
    loader = ThreadDataLoader(
        SlowIds(),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        device="cpu",
        isolation=isolation,
    )
    it = None
    for _ in range(5):
        it = iter(loader)  # the last epoch's `it` is alive until this assignment
        got = [next(it).tolist() for _ in range(3)]
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        transfer = [
            t for t in threadloader_threads() if t.name.endswith("-transfer") and t.is_alive()
        ]
        assert len(transfer) == 1, transfer
    assert len(list(it)) == 100 - 3
    del it, loader
    assert threadloader_threads_after() == []
