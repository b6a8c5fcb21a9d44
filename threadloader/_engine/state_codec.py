"""RNG states as plain text in a loader state, so that ``json.dumps(loader.state_dict())`` works.

A torch RNG state is a uint8 tensor (5,056 bytes for a CPU generator). A loader state stores it
as its bytes in base64 (6,744 characters): JSON, YAML, ``torch.save`` with
``weights_only=True`` and ``torch.distributed.checkpoint`` all take a str. States saved when
these were tensors still load: ``decode_rng`` takes either form.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import torch

#: A loader state's top-level generator states, written as text (``encode_rng``).
RNG_KEYS = (
    "rng_state",
    "global_rng_state",
    "sampler_rng_state",
    "iter_rng_state",
    "global_rng_at_save",
)


def encode_rng(state: torch.Tensor) -> str:
    """A uint8 RNG state tensor as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(value: Any) -> Any:
    """``encode_rng``'s text as a uint8 tensor again; a tensor (an older state) as it is.

    Anything else is returned unchanged, for the caller's check to name.
    """
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            return value
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    return value


def decode_state(state: Any) -> Any:
    """A loader state with its top-level RNG states as tensors (a shallow copy); anything but
    a mapping as it is, for the state's check to name."""
    if not isinstance(state, Mapping):
        return state
    decoded = dict(state)
    for key in RNG_KEYS:
        if key in decoded:
            decoded[key] = decode_rng(decoded[key])
    return decoded
