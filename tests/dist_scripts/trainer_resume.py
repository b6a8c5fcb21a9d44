"""A Hugging Face ``Trainer`` run, tiny model, synthetic data, CPU; run by tests/test_trainer.py::

    python -m threadloader run tests/dist_scripts/trainer_resume.py OUT     # no line changed
    python tests/dist_scripts/trainer_resume.py OUT --patch                 # the one line below
    python tests/dist_scripts/trainer_resume.py OUT                         # torch's DataLoader

Trains 2 epochs of 6 steps with a checkpoint every 4 steps (step 4: mid-epoch 0; step 8:
mid-epoch 1), then resumes from each checkpoint with a new Trainer, as a restarted job would.
Writes ``OUT/log.json``: the sample ids each run trained on, step by step; the class of the
loader Trainer built; the threads that read the samples; the most worker processes seen.
"""

from __future__ import annotations

import sys

if "--patch" in sys.argv:
    import threadloader

    threadloader.patch()  # the one line: every DataLoader Trainer builds is a ThreadDataLoader

import json
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

N, BATCH = 24, 4  # 6 steps an epoch
SEEN: list[list[int]] = []
READERS: set[str] = set()
CHILDREN = [0]


class Ids(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        READERS.add(threading.current_thread().name)
        return {"x": torch.tensor([float(i), 1.0]), "labels": torch.tensor(float(i % 3))}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            SEEN.append(x[:, 0].long().tolist())
            CHILDREN[0] = max(CHILDREN[0], len(multiprocessing.active_children()))
        loss = torch.nn.functional.mse_loss(self.linear(x[:, 1:]).squeeze(-1), labels)
        return {"loss": loss}


class LoaderClass(TrainerCallback):
    def __init__(self) -> None:
        self.inner: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs["train_dataloader"]
        self.inner = type(getattr(loader, "base_dataloader", loader)).__name__


def train(out: Path, resume: str | None) -> dict[str, Any]:
    SEEN.clear()
    args = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=2,
        per_device_train_batch_size=BATCH,
        dataloader_num_workers=2,
        save_strategy="steps",
        save_steps=4,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_only_model=False,
    )
    callback = LoaderClass()
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Ids(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return {"seen": list(SEEN), "inner": callback.inner}


def main() -> None:
    out = Path(sys.argv[1])
    log = {"full": train(out / "full", None)}
    for step in (4, 8):
        log[f"from{step}"] = train(out / "full", str(out / "full" / f"checkpoint-{step}"))
    log["readers"] = sorted(READERS)
    log["children"] = CHILDREN[0]
    (out / "log.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
