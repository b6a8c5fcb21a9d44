"""torch's global RNG in a process that resumes a loader without restoring that RNG itself.

Without a ``generator``, torch's loader draws each epoch's order and base seed from the global
RNG, so the epochs after a resume follow from where that RNG stands. A framework that restores
it with the checkpoint (Accelerate's ``load_state``, Trainer's ``rng_state.pth``) continues the
uninterrupted run's draws; a script that seeds at its top and resumes (Lightning's
``ckpt_path=``, which restores no RNG) stands where the first run stood before its first
epoch, and would draw that epoch's order again after the resumed one, at every resume.
torchdata's ``StatefulDataLoader`` avoids this only by drawing its order from a generator of
its own, seeded 1, which torch's loader does not do. Where the code disagrees with this, the
code is wrong.

1. A loader notes a digest of the global RNG at its first ``iter()`` (``mark``) and saves it in
   every state, with the global RNG as ``state_dict()`` finds it. A resumed loader keeps the
   loaded digest as its own, so a state it saves names the first run's.
2. At the first ``iter()`` after ``load_state_dict``, before anything is drawn: where the
   global RNG stands exactly where the saving run's stood at its first ``iter()`` (the same
   seed, the same code before it: nothing restored it), it is set to the saved one, as a
   framework restoring it would; the epochs after the resumed one then draw as without the
   interruption. Anywhere else (restored by the user or a framework, seeded otherwise), it is
   left alone. States without these entries (an older version's) leave it alone too.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from threadloader._engine.state_codec import encode_rng

__all__ = ["at_iter", "loaded", "mark", "saved"]


def mark() -> str:
    """A digest of torch's global RNG state as it stands."""
    return hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16).hexdigest()


def at_iter(loader: Any) -> None:
    """Point 2 at a loader's ``iter()``, or point 1's digest at its first."""
    restore, loader._global_rng_restore = loader._global_rng_restore, None
    if restore is not None:
        digest, state = restore
        if mark() == digest:
            torch.set_rng_state(state)
    elif loader._global_rng_mark is None:
        loader._global_rng_mark = mark()


def saved(loader: Any) -> dict[str, Any]:
    """What a state holds of point 1: empty before the loader's first ``iter()``."""
    if loader._global_rng_mark is None:
        return {}
    return {
        "global_rng_mark": loader._global_rng_mark,
        "global_rng_at_save": encode_rng(torch.get_rng_state()),
    }


def loaded(loader: Any, digest: str | None, state: torch.Tensor | None) -> None:
    """Point 1's digest and RNG of a loaded state (checked): the next ``iter()`` decides."""
    loader._global_rng_restore = None  # an earlier load's, not this state's
    if digest is None or state is None:
        return
    loader._global_rng_mark = digest
    loader._global_rng_restore = (digest, state)
