"""A worker's own generators (``WorkerInfo.rng``) as plain state, and back.

Each worker thread has its own ``random.Random``, ``torch.Generator`` and numpy ``Generator``
(torch 2.13's ``_RNG``; ``torch.random.thread_safe_generator()`` returns the torch one), and a
``numpy.random`` legacy global of its own (``_primitives.worker_globals``). Random
augmentations drawn from them are reproducible run to run, because a worker's tasks run one at a
time and in dispatch order. A resume reseeds them, though, so the augmentations after a resume
differ from an uninterrupted run's, unless the loader saves them (``save_worker_rng=True``).

Workers run ahead of the training loop, so the state to save is the one each worker had right
after making its last *delivered* batch (consumer-aligned, like an IterableDataset's state):
every batch carries a snapshot of them all (``random.Random.getstate`` copies 625 ints, the
numpy legacy state 624), which is why saving is opt-in.

A saved state is plain data (lists, ints and str: the torch state as base64 text), like the rest
of a loader state, so ``json.dumps`` and ``torch.load(weights_only=True)`` take it.
"""

from __future__ import annotations

from typing import Any

from threadloader._engine.state_codec import decode_rng, encode_rng
from threadloader._primitives.worker_globals import WorkerRNGs


def rng_state(rngs: WorkerRNGs) -> dict[str, Any]:
    """The state of a worker's generators now: its own and its ``numpy.random`` global (None
    while the worker has not used it: still as seeded, and reading its state costs ~0.1 ms)."""
    numpy_generator: Any = rngs.rng.numpy_generator
    legacy = rngs.numpy_legacy.get_state(legacy=False) if rngs.numpy_legacy_made else None
    return {
        "random": rngs.random.getstate(),
        "torch": rngs.torch.get_state(),
        "numpy": numpy_generator.bit_generator.state if numpy_generator is not None else None,
        "numpy_global": legacy,
    }


def as_plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with lists for ``random``'s tuples: what a loader state may hold.

    Done when the state is saved, not at every batch's snapshot. A state already plain (a
    resumed worker's that has delivered nothing since) comes back as it is.
    """
    version, internal, gauss_next = state["random"]
    plain = {**state, "random": [version, list(internal), gauss_next]}
    torch_state = state["torch"]
    plain["torch"] = torch_state if isinstance(torch_state, str) else encode_rng(torch_state)
    legacy = state.get("numpy_global")
    if legacy is not None:
        inner = legacy["state"]
        key = inner["key"]
        plain["numpy_global"] = {
            **legacy,
            "state": {**inner, "key": key.tolist() if hasattr(key, "tolist") else key},
        }
    return plain


def load_rng_state(rngs: WorkerRNGs, state: dict[str, Any]) -> None:
    """Put a worker's generators back in ``state`` (from ``rng_state``).

    A state saved before the ``numpy.random`` global was per worker has no ``numpy_global``:
    that one keeps its state; ``None`` there puts it back as seeded, unused.

    Raises:
        ValueError: ``state`` is not a worker generator state.
        TypeError: likewise (e.g. a tuple where ``random.setstate`` expects one of another form).
    """
    if not isinstance(state, dict) or not {"random", "torch"} <= state.keys():
        raise ValueError(f"not a worker generator state: {type(state).__name__}")
    random_state = state["random"]
    if isinstance(random_state, list):  # as_plain's form
        random_state = (random_state[0], tuple(random_state[1]), random_state[2])
    rngs.random.setstate(random_state)
    rngs.torch.set_state(decode_rng(state["torch"]))
    numpy_generator: Any = rngs.rng.numpy_generator
    if numpy_generator is not None and state.get("numpy") is not None:
        numpy_generator.bit_generator.state = state["numpy"]
    if "numpy_global" in state:
        if state["numpy_global"] is None:
            rngs.forget_numpy_legacy()
        else:
            rngs.numpy_legacy.set_state(state["numpy_global"])
