"""Trainer.fit with a ThreadDataLoader on 2 CPU processes; each rank logs what it trained on.

Run by tests/test_lightning.py, never collected by pytest (Lightning's ``ddp`` re-runs this
script once per extra rank, which it could not do with pytest's command line)::

    python tests/dist_scripts/lightning_fit.py OUT --strategy ddp --epochs 2 --stop-at 2 8

Fit 0 trains until global step 2, saves a checkpoint there (mid-epoch: 6 steps an epoch) and
stops, as a crash would. Fit 1, with a fresh Trainer, model and loader, resumes from it with
``fit(ckpt_path=...)`` and stops at step 8 (mid-epoch 1); fit 2 resumes from that and ends the
run. Each fit makes each rank write ``OUT/rank{r}-{fit}.json``: the options of the loader
Lightning re-created, and the ``(epoch, sample ids)`` of every ``training_step``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]

N = 48  # samples; 2 ranks x 6 batches of 4
BATCH = 4
#: Non-default options, ours included: each must survive Lightning's re-instantiation.
OPTIONS: dict[str, Any] = {
    "prefetch_factor": 3,
    "persistent_workers": True,
    "timeout": 60.0,
    "log_every_s": 3600.0,
}


class Ids(Dataset[tuple[int, torch.Tensor]]):
    """Item i is (i, features of i)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.full((4,), float(i) / N)


def make_loader(workers: int, in_order: bool) -> ThreadDataLoader[Any]:
    options = dict(OPTIONS) if workers else {"log_every_s": 3600.0}
    return ThreadDataLoader(
        Ids(), batch_size=BATCH, shuffle=True, num_workers=workers, in_order=in_order, **options
    )


class Model(pl.LightningModule):
    def __init__(self, workers: int, from_module: bool, in_order: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.workers, self.from_module, self.in_order = workers, from_module, in_order
        self.seen: list[tuple[int, list[int]]] = []  # (epoch, ids) per step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        self.seen.append((self.current_epoch, ids.tolist()))
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        if not self.from_module:
            return super().train_dataloader()  # the datamodule's
        return make_loader(self.workers, self.in_order)


class Data(pl.LightningDataModule):
    def __init__(self, workers: int, in_order: bool) -> None:
        super().__init__()
        self.workers, self.in_order = workers, in_order

    def train_dataloader(self) -> Any:
        return make_loader(self.workers, self.in_order)


class StopAt(pl.Callback):
    """Saves a checkpoint after step ``steps`` and stops there: a crash, mid-epoch."""

    def __init__(self, steps: int, path: str) -> None:
        self.steps, self.path = steps, path

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


class Record(pl.Callback):
    """Writes ``OUT/rank{r}-{phase}.json``: the trained-on loader's options and the ids seen.

    Written from inside the fit, so that ``ddp_spawn`` ranks (whose models the launching
    process never sees) report too.
    """

    def __init__(self, out: str, phase: int) -> None:
        self.out, self.phase = out, phase
        self.options: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        names = ["num_workers", "prefetch_factor", "persistent_workers", "timeout", "in_order"]
        self.options = {name: getattr(loader, name) for name in [*names, "log_every_s"]}
        self.options["type"] = type(loader).__name__
        self.options["sampler"] = type(loader.sampler).__name__

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        log = {"options": self.options, "seen": pl_module.seen, "world": trainer.world_size}
        path = Path(self.out) / f"rank{trainer.global_rank}-{self.phase}.json"
        path.write_text(json.dumps(log))


def fit(args: argparse.Namespace, phase: int) -> None:
    """Run fit number ``phase``: from the previous phase's checkpoint, to the next stop."""
    pl.seed_everything(7)
    model = Model(args.workers, args.source == "module", not args.out_of_order)
    data = None if args.source == "module" else Data(args.workers, not args.out_of_order)
    callbacks: list[Any] = [Record(args.out, phase)]
    if phase < len(args.stop_at):
        callbacks.append(StopAt(args.stop_at[phase], str(Path(args.out) / f"{phase}.ckpt")))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    ckpt = str(Path(args.out) / f"{phase - 1}.ckpt") if phase else None
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--source", choices=["module", "datamodule"], default="datamodule")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--stop-at", type=int, nargs="*", default=[], help="global steps")
    parser.add_argument("--out-of-order", action="store_true")
    args = parser.parse_args()
    for phase in range(len(args.stop_at) + 1):
        fit(args, phase)


if __name__ == "__main__":
    main()
