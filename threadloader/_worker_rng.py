"""A worker's own generators (``WorkerInfo.rng``) as plain state, and back.

Each worker thread has its own ``random.Random``, ``torch.Generator`` and numpy ``Generator``
(torch 2.13's ``_RNG``; ``torch.random.thread_safe_generator()`` returns the torch one). Random
augmentations drawn from them are reproducible run to run, because a worker's tasks run one at a
time and in dispatch order. A resume reseeds them, though, so the augmentations after a resume
differ from an uninterrupted run's, unless the loader saves them (``save_worker_rng=True``).

Workers run ahead of the training loop, so the state to save is the one each worker had right
after making its last *delivered* batch (consumer-aligned, like an IterableDataset's state):
every batch carries a snapshot: 8 us alone (``random.Random.getstate`` copies 625 ints; the
torch and numpy states ~1 us together), 15 us a batch in a loader on token windows (the 625 new
ints also bring the garbage collector round more often), which is why saving is opt-in.

A saved state is plain data (lists and ints, a uint8 tensor, a dict of ints and a str), like the
rest of a loader state, so ``torch.save`` and ``torch.load(weights_only=True)`` take it.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data._utils.worker import WorkerInfo


def rng_state(info: WorkerInfo) -> dict[str, Any] | None:
    """The state of ``info``'s generators now; None when it has none."""
    rng = getattr(info, "rng", None)
    if rng is None:
        return None
    numpy_generator: Any = rng.numpy_generator
    return {
        "random": rng.random_generator.getstate(),
        "torch": rng.torch_generator.get_state(),
        "numpy": numpy_generator.bit_generator.state if numpy_generator is not None else None,
    }


def as_plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with lists for ``random``'s tuples: what a loader state may hold.

    Done when the state is saved, not at every batch's snapshot.
    """
    version, internal, gauss_next = state["random"]
    return {**state, "random": [version, list(internal), gauss_next]}


def load_rng_state(info: WorkerInfo, state: dict[str, Any]) -> None:
    """Put ``info``'s generators back in ``state`` (from ``rng_state``).

    Raises:
        ValueError: ``state`` is not a worker generator state.
        TypeError: likewise (e.g. a tuple where ``random.setstate`` expects one of another form).
    """
    rng = getattr(info, "rng", None)
    if rng is None or not isinstance(state, dict) or not {"random", "torch"} <= state.keys():
        raise ValueError(f"not a worker generator state: {type(state).__name__}")
    random_state = state["random"]
    if isinstance(random_state, list):  # as_plain's form
        random_state = (random_state[0], tuple(random_state[1]), random_state[2])
    rng.random_generator.setstate(random_state)
    rng.torch_generator.set_state(state["torch"])
    numpy_generator: Any = rng.numpy_generator
    if numpy_generator is not None and state.get("numpy") is not None:
        numpy_generator.bit_generator.state = state["numpy"]
