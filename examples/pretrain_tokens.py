"""Pretrain a tiny model on a 70/30 mix of two token sources; change the mix live; resume exactly.

Example::

    python examples/pretrain_tokens.py            # ~10 s on a 2-core CPU

What it does: writes two token sources to a temporary directory ("web": four raw uint16 ``.bin``
shards as nanoGPT writes them; "code": two ``.npy`` shards), opens them as ``TokenWindows`` (zero
build: only sizes and headers are read), mixes them 70/30 with a ``Mixture``, and trains a
bigram model through ``ThreadDataLoader(num_workers=2)`` for 150 steps. At step 60 the loop calls
``mixture.set_weights({"web": 0.3, "code": 0.7})``; at step 100 it checkpoints the model, the
optimizer and ``loader.state_dict()``, trains on, then builds everything again from scratch (with
the *old* 70/30 weights), loads the checkpoint and trains steps 100-149 a second time. Web token
ids are below 256 and code token ids from 256 on, so the realised mix is measured from the very
tokens the model saw.

Result (2-core CPU, 10-15 s, mostly interpreter and torch start-up)::

    opened 4 web + 2 code shards (300,000 tokens) in 3.0 ms
    step   0  loss 6.442
    step  60  set_weights(web 0.3, code 0.7): effective from global position 960 = step 60
    step  99  loss 2.435
    checkpoint at step 100: sampler state 1581 bytes, 2 weight regimes
    step 149  loss 2.048
    rebuilt with 70/30, loaded the checkpoint: schedule 0.3 code from 0, 0.7 code from 960
    resumed from step 100: same 50 batches: True, same losses: True
    realised share of code windows (weights 0.3 / 0.7):
      steps   0- 59: 0.300 (set: 0.300)
      steps  60-149: 0.700 (set: 0.700)

The realised shares are exact, not approximately right: which source each position draws from
is a low-discrepancy schedule (any 10,000 consecutive samples are within 0.05% of the weights),
not a coin flip per sample.

Where the change lands: by default at the first position the sampler has not handed out yet.
These windows are cheap, so the loader soon finds that the training thread fetching alone is
fastest and dispatches nothing ahead of the loop: the change lands at step 60. When workers do
prefetch, the ``num_workers * prefetch_factor`` batches in flight keep the old weights (step 64
here, with 4 batches ahead). Either way the position is recorded in the loader's state, so the
resumed run switches at the same sample. ``loader.set_mixture_weights(...)`` always lands at the
next batch the loop asks for: it rewinds the sampler and drops the batches in flight (see
``threadloader.streams.MixtureSampler``).
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from threadloader import ThreadDataLoader
from threadloader.streams import Mixture, MixtureSampler, TokenWindows

SEQ_LEN, BATCH, STEPS = 64, 16, 150
CHANGE_AT, CHECKPOINT_AT = 60, 100
VOCAB = 512  # web: ids 0-255, code: ids 256-511


def write_sources(root: Path) -> dict[str, list[Path]]:
    """Web: a random walk over 0..255 (learnable bigrams); code: repeated snippets over 256..511."""
    rng = np.random.default_rng(0)
    web = []
    for shard in range(4):
        steps = rng.choice([-2, -1, 1, 2, 3], size=50_000)
        tokens = (np.cumsum(steps) % 256).astype(np.uint16)
        path = root / f"web-{shard:02d}.bin"
        tokens.tofile(path)  # raw uint16, as nanoGPT's prepare.py writes it
        web.append(path)
    code = []
    snippets = [rng.integers(256, 512, rng.integers(5, 30)) for _ in range(40)]
    for shard in range(2):
        picks = rng.integers(0, len(snippets), 5_000)
        tokens = np.concatenate([snippets[i] for i in picks])[:50_000].astype(np.uint16)
        path = root / f"code-{shard:02d}.npy"
        np.save(path, tokens)
        code.append(path)
    return {"web": web, "code": code}


def build(files: dict[str, list[Path]]) -> tuple[Mixture, ThreadDataLoader[Any]]:
    """The data pipeline: one TokenWindows per source, mixed 70/30, two worker threads."""
    sources = {name: TokenWindows(paths, seq_len=SEQ_LEN) for name, paths in files.items()}
    mixture = Mixture(sources, {"web": 0.7, "code": 0.3}, seed=0)
    sampler = MixtureSampler(mixture, samples_per_epoch=STEPS * BATCH)  # the run is one epoch
    loader = ThreadDataLoader(mixture, batch_size=BATCH, sampler=sampler, num_workers=2)
    return mixture, loader


def new_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial weights every time: the resumed run's losses can be compared."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, VOCAB))  # a bigram model
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = write_sources(Path(tmp))
        start = time.perf_counter()
        mixture, loader = build(files)
        opened_ms = (time.perf_counter() - start) * 1e3
        tokens = sum(ds.num_tokens for ds in mixture.sources.values())
        print(f"opened 4 web + 2 code shards ({tokens:,} tokens) in {opened_ms:.1f} ms")

        model, optimizer = new_model()
        code_share: list[float] = []
        batches: list[torch.Tensor] = []
        losses: list[float] = []
        checkpoint = b""
        it = iter(loader)
        for step in range(STEPS):
            if step == CHANGE_AT:
                position = mixture.set_weights({"web": 0.3, "code": 0.7})
                print(
                    f"step {step:3d}  set_weights(web 0.3, code 0.7): effective from global "
                    f"position {position} = step {position // BATCH}"
                )
            if step == CHECKPOINT_AT:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "step": step,
                }
                checkpoint = saved(state)
                sampler_state = state["loader"]["sampler"]
                print(
                    f"checkpoint at step {step}: sampler state {len(saved(sampler_state))} bytes, "
                    f"{len(sampler_state['schedule'])} weight regimes"
                )
            x, y = next(it)
            code_share.append(float((x[:, 0] >= 256).float().mean()))
            batches.append(x)
            losses.append(train_step(model, optimizer, x, y))
            if step in (0, CHECKPOINT_AT - 1, STEPS - 1):
                print(f"step {step:3d}  loss {losses[-1]:.3f}")

        # A new process would do exactly this: build everything, then load the checkpoint.
        state = torch.load(io.BytesIO(checkpoint), weights_only=False)
        mixture2, loader2 = build(files)  # built with the old 70/30 weights: the state wins
        model2, optimizer2 = new_model()
        model2.load_state_dict(state["model"])
        optimizer2.load_state_dict(state["optimizer"])
        loader2.load_state_dict(state["loader"])
        changes = ", ".join(f"{w['code']:.1f} code from {p}" for p, w in mixture2.schedule)
        print(f"rebuilt with 70/30, loaded the checkpoint: schedule {changes}")
        again, losses2 = [], []
        for x, y in loader2:
            again.append(x)
            losses2.append(train_step(model2, optimizer2, x, y))
        same = len(again) == STEPS - CHECKPOINT_AT and all(
            torch.equal(a, b) for a, b in zip(again, batches[CHECKPOINT_AT:], strict=True)
        )
        print(
            f"resumed from step {CHECKPOINT_AT}: same {len(again)} batches: {same}, "
            f"same losses: {losses2 == losses[CHECKPOINT_AT:]}"
        )

        switch = position // BATCH
        print("realised share of code windows (weights 0.3 / 0.7):")
        for lo, hi, want in ((0, switch, 0.3), (switch, STEPS, 0.7)):
            got = float(np.mean(code_share[lo:hi]))
            print(f"  steps {lo:3d}-{hi - 1:3d}: {got:.3f} (set: {want:.3f})")


def saved(obj: object) -> bytes:
    """``obj`` as ``torch.save`` writes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


if __name__ == "__main__":
    main()
