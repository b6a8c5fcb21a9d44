"""Hugging Face Accelerate: ``accelerator.prepare(ThreadDataLoader(...))`` keeps the threads.

Single process in this one; ``test_accelerate_ranks.py`` runs 2 ranks under torchrun.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("accelerate")
from accelerate import Accelerator

import threadloader
from threadloader import ThreadDataLoader


class Ids(Dataset[torch.Tensor]):
    """Item i: [i, a draw from the worker's global RNG, the worker thread's number]."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        name = threading.current_thread().name
        worker = float(name.rsplit("worker", 1)[1]) if "worker" in name else -1.0
        return torch.tensor([float(i), torch.rand(()).item(), worker])


def _ids(batches: list[torch.Tensor]) -> list[list[int]]:
    return [b[:, 0].long().tolist() for b in batches]


def test_prepare_returns_a_loader_on_worker_threads() -> None:
    """Batches come from our worker threads (no process starts); options, stats() survive."""
    accelerator = Accelerator(cpu=True)
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=2, log_every_s=60.0)
    prepared: Any = accelerator.prepare(loader)
    assert prepared is not loader  # Accelerate's own adapter, sharding and placing batches
    assert isinstance(prepared, ThreadDataLoader) and isinstance(prepared, DataLoader)
    base = prepared.base_dataloader
    assert type(base) is ThreadDataLoader and base.log_every_s == 60.0 and base.num_workers == 2
    batches = []
    for batch in prepared:
        batches.append(batch)
        assert not multiprocessing.active_children()
    assert sorted(i for b in _ids(batches) for i in b) == list(range(24))
    assert {int(w) for b in batches for w in b[:, 2].tolist()} <= {-1, 0, 1}
    assert any(w >= 0 for b in batches for w in b[:, 2].tolist())  # workers made batches
    assert prepared.stats().batches == 6  # ours, through the adapter
    plain: Any = accelerator.prepare(DataLoader(Ids(), batch_size=4))
    assert type(plain.base_dataloader) is DataLoader  # other loaders are Accelerate's as ever


def test_prepare_carries_our_options_not_a_subclass_attribute_of_the_same_name() -> None:
    """A subclass's own ``device`` (it moves batches itself) is not the ``device=`` option:
    the rebuilt loader must not turn the transfer stage on for it."""

    class Moving(ThreadDataLoader[Any]):
        def __init__(self, dataset: Any, **kwargs: Any) -> None:
            super().__init__(dataset, **kwargs)
            self.device = torch.device("meta")

    prepared: Any = Accelerator(cpu=True).prepare(Moving(Ids(), batch_size=4, num_workers=2))
    base = prepared.base_dataloader
    assert base._options.device is None and base._options.log_every_s is None
    assert all(b.device.type == "cpu" for b in prepared)


def test_save_state_load_state_resume_mid_epoch(tmp_path: Path) -> None:
    """save_state after 3 batches; a new loader after load_state gives the rest of the epoch and
    the next epoch exactly as the uninterrupted run."""

    def make() -> tuple[Accelerator, Any]:
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = ThreadDataLoader(Ids(), batch_size=4, shuffle=True, num_workers=2)
        _, _, prepared = accelerator.prepare(model, optimizer, loader)
        return accelerator, prepared

    torch.manual_seed(0)
    accelerator, prepared = make()
    it = iter(prepared)
    head = [next(it) for _ in range(3)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    rest = list(it)
    next_epoch = list(prepared)
    assert len(head) + len(rest) == 6

    torch.manual_seed(1)  # the resume must not depend on the global RNG
    accelerator, resumed = make()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "dl_state_dict.bin").exists()
    assert _ids(list(resumed)) == _ids(rest)
    assert _ids(list(resumed)) == _ids(next_epoch)
    assert sorted(i for b in _ids(head + rest) for i in b) == list(range(24))


def test_skip_first_batches_keeps_the_threads() -> None:
    """``accelerator.skip_first_batches`` rebuilds the loader: still ours, the same batches."""
    accelerator = Accelerator(cpu=True)
    prepared: Any = accelerator.prepare(ThreadDataLoader(Ids(), batch_size=4, num_workers=2))
    skipped: Any = accelerator.skip_first_batches(prepared, 2)
    assert type(skipped.base_dataloader) is ThreadDataLoader
    assert _ids(list(skipped)) == _ids(list(prepared))[2:]


@pytest.mark.parametrize("patched", [False, True], ids=["torch", "patched"])
def test_patched_dataloader_keeps_torchs_checkpoint_semantics(
    tmp_path: Path, patched: bool
) -> None:
    """A DataLoader built under the patch: save_state stores no loader state (as for torch's), so
    Accelerate's documented load_state + skip_first_batches resume skips once, not twice, and
    gives what it gives with torch's DataLoader."""

    def make() -> tuple[Accelerator, Any]:
        accelerator = Accelerator(cpu=True)
        with threadloader.patched() if patched else contextlib.nullcontext():
            loader = DataLoader(
                Ids(),
                batch_size=4,
                shuffle=True,
                num_workers=2,
                generator=torch.Generator().manual_seed(7),  # the replay's order: seeded
            )
        assert (type(loader) is ThreadDataLoader) == patched
        return accelerator, accelerator.prepare(loader)

    accelerator, prepared = make()
    it = iter(prepared)
    head = [next(it) for _ in range(2)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    rest = list(it)
    assert not (tmp_path / "ckpt" / "dl_state_dict.bin").exists()

    accelerator, resumed = make()
    accelerator.load_state(str(tmp_path / "ckpt"))
    skipped: Any = accelerator.skip_first_batches(resumed, 2)
    assert (type(skipped.base_dataloader) is ThreadDataLoader) == patched
    assert _ids(list(skipped)) == _ids(rest)
    assert sorted(i for b in _ids(head + rest) for i in b) == list(range(24))
