"""Gathered batches: a dataset's batch as the tensors it gathered, without cutting samples.

Why: a dataset that reads a batch in one go (``TokenWindows``: one vectorised gather into a
``(batch, seq_len + 1)`` array) must still return one sample per index from ``__getitems__``,
because torch's fetcher hands that list to ``collate_fn``; ``default_collate`` then stacks the
per-sample views back into the batch they were cut from. For 16 token windows, cutting and
stacking cost twice the gather (measured: 45 of 66 us). When the loader's collate is threadloader's
own default collate, which knows the result (point 1), the fetcher asks the dataset for the
gathered tensors instead and the collate copies each once. torch's ``DataLoader``, a user
``collate_fn`` and anyone calling ``__getitems__`` still get the list of samples.

Where the code disagrees with these points, the code is wrong:

1. A dataset opts in by marking its ``__getitems__`` with ``@gathered_by("name")``, where method
   ``name(indices)`` returns ``parts``, one tensor per sample field, batch first, such that
   ``__getitems__(indices)`` is ``[tuple(p[i] for p in parts) for i ...]``. ``default_collate`` of
   that list is then ``[p.contiguous() for p in parts]`` (fresh memory, same dtype and values),
   in the calling process and in a worker, which ``collate_gathered`` returns.
2. ``parts_getter`` only trusts the mark on the ``__getitems__`` that torch's fetcher would call:
   a subclass that overrides ``__getitems__`` without the mark (or an instance attribute) gets
   its own ``__getitems__`` called, as torch would call it.
3. Only collate functions with a true ``takes_gathered`` attribute are handed a ``Gathered``;
   they are threadloader's wrappers of ``default_collate`` (``memory.pinned_collate`` underneath).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

_Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
_F = TypeVar("_F", bound=Callable[..., Any])
_MARK = "__gathered_by__"


def gathered_by(method: str) -> Callable[[_F], _F]:
    """Mark a ``__getitems__`` whose samples are row views of what ``method`` returns (point 1).

    Args:
        method: name of the dataset method ``(indices) -> tuple[torch.Tensor, ...]``.

    Returns:
        A decorator returning the function it marks.
    """

    def mark(getitems: _F) -> _F:
        setattr(getitems, _MARK, method)
        return getitems

    return mark


class Gathered:
    """One batch as the dataset gathered it: what a ``takes_gathered`` collate receives.

    Args:
        parts: one tensor per sample field, batch first (CPU, strided, no autograd).
    """

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts


def parts_getter(dataset: Any) -> Callable[[Sequence[int]], tuple[torch.Tensor, ...]] | None:
    """The dataset's gathering method, when its ``__getitems__`` is marked (point 2), else None."""
    getitems = getattr(dataset, "__getitems__", None)
    method = getattr(getattr(getitems, "__func__", None), _MARK, None)
    if method is None or "__getitems__" in getattr(dataset, "__dict__", ()):
        return None
    getter: Callable[[Sequence[int]], tuple[torch.Tensor, ...]] = getattr(dataset, method)
    return getter


def collate_gathered(batch: Any, allocator: _Allocator) -> list[torch.Tensor] | None:
    """``default_collate`` of the batch's samples, by one copy of each part, or None.

    Args:
        batch: what the fetcher passed to the collate function.
        allocator: where each copy goes (``memory.Allocator``); one with ``fresh_below`` lets
            smaller parts be copied into torch's own fresh memory.

    Returns:
        One contiguous tensor per field, in a list (``default_collate`` turns tuples into
        lists), or None if ``batch`` is not a ``Gathered``.
    """
    if type(batch) is not Gathered:
        return None
    fresh_below = getattr(allocator, "fresh_below", 0)
    out = []
    for part in batch.parts:
        if part.nbytes < fresh_below:
            out.append(part.clone(memory_format=torch.contiguous_format))
        else:
            copy = allocator(tuple(part.shape), part.dtype)
            copy.copy_(part)
            out.append(copy)
    return out
