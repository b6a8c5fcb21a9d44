"""Batches the fetcher builds itself, for threadloader's own default collate.

torch's fetcher hands ``collate_fn`` a list of samples and ``default_collate`` stacks them. When
the loader collates with threadloader's wrapper of ``default_collate`` (``memory.pinned_collate``
underneath), which knows what that stack gives, the fetcher can skip work in two cases:

- **Gathered**: a dataset that reads a batch in one go (``TokenWindows``: one vectorised gather
  into a ``(batch, seq_len + 1)`` array; a ``Mixture`` of them: one gather per source into one
  such array) must still cut one sample per index from
  ``__getitems__``, which the collate then stacks back into the batch they were cut from. For 16
  token windows, cutting and stacking cost twice the gather (measured: 45 of 66 us). The fetcher
  asks the dataset for the gathered tensors instead and the collate copies each once.
- **Stacked**: large tensor samples (``__getitem__`` per index, in worker threads) are copied
  into the batch as each arrives, instead of all being held until a stack at the end: the batch
  holds one sample's memory less per sample in flight, and the memory a sample used is free for
  the next one (3x512x512 float32 samples, batch 16, 2 worker threads on 2 cores: ~5% more
  batches/s, and 48 MiB less memory per worker). The copies are timed as fetch, not collate.

torch's ``DataLoader``, a user ``collate_fn`` and anyone calling ``__getitems__`` still get the
list of samples. Where the code disagrees with these points, the code is wrong:

1. A dataset opts in to gathering by marking its ``__getitems__`` with ``@gathered_by("name")``,
   where method ``name(indices)`` returns ``parts``, one tensor per sample field, batch first,
   such that ``__getitems__(indices)`` is ``[tuple(p[i] for p in parts) for i ...]``, or None
   when it cannot gather this batch (the fetcher then calls ``__getitems__``).
   ``default_collate`` of that list is then ``[p.contiguous() for p in parts]`` (fresh memory,
   same dtype and values), in the calling process and in a worker: ``collate_gathered`` returns
   that, and for an empty batch raises ``default_collate([])``'s ``IndexError``.
2. ``parts_getter`` only trusts the mark on the ``__getitems__`` that torch's fetcher would call:
   a subclass that overrides ``__getitems__`` without the mark (or an instance attribute) gets
   its own ``__getitems__`` called, as torch would call it.
3. ``fetch_stacked`` returns a ``Stacked`` batch only where torch's *worker* ``default_collate``
   gives the same tensor: every sample a plain CPU strided tensor without autograd, of the first
   sample's shape and dtype, copied into one contiguous tensor of that dtype. At the first sample
   that is not, it returns the samples (those already copied as views of the batch, equal in
   shape, dtype and values), and the collate gives torch's result or error from them. Samples
   under ``STACK_MIN_BYTES`` a batch are fetched as a list: one stack beats a copy per sample.
4. Only collate functions with a true ``takes_gathered`` attribute are handed a ``Gathered`` or a
   ``Stacked``, and only those with a ``stack_into`` allocator get samples stacked into it (worker
   semantics: set only for collates that collate as a worker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from threadloader._primitives.worker_globals import library_code

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


#: Smallest batch (bytes of its first sample x samples) that ``fetch_stacked`` stacks (point 3).
STACK_MIN_BYTES = 1 << 20


class Stacked:
    """A batch of tensor samples copied together as they were fetched: the collated batch."""

    __slots__ = ("batch",)

    def __init__(self, batch: torch.Tensor) -> None:
        self.batch = batch


def _stackable(sample: Any) -> bool:
    return (
        type(sample) is torch.Tensor
        and sample.layout == torch.strided
        and sample.is_cpu
        and not sample.is_nested
        and not sample.requires_grad
        and not sample.is_quantized
    )


def fetch_stacked(dataset: Any, indices: Sequence[int], allocator: _Allocator) -> Any:
    """Fetch ``dataset[i]`` for each index, copying tensor samples into the batch as they come.

    Args:
        dataset: a map-style dataset (no ``__getitems__``: torch's fetcher would call that).
        indices: the batch's indices.
        allocator: where the batch goes (``memory.Allocator``).

    Returns:
        A ``Stacked`` batch, or the samples as a list (point 3).
    """
    try:
        n = len(indices)
    except TypeError:  # a batch sampler may yield any iterable
        n = 0
    it = iter(indices)
    if n == 0:
        return [dataset[i] for i in it]
    for i in it:
        first = dataset[i]
        break
    else:
        return []  # fewer indices than len() said: torch's collate raises for the empty batch
    with library_code():
        # _stackable first: nbytes raises for a sparse sample, whose error is torch's collate's.
        small = not _stackable(first) or first.nbytes * n < STACK_MIN_BYTES
    if small:
        return [first] + [dataset[i] for i in it]  # a list display is faster
    shape, dtype = first.shape, first.dtype
    out = allocator((n, *shape), dtype)
    out[0].copy_(first)
    del first
    k = 1
    for i in it:
        sample = dataset[i]
        if k == n or not _stackable(sample) or sample.shape != shape or sample.dtype != dtype:
            return [*out[:k].unbind(0), sample, *(dataset[i] for i in it)]
        out[k].copy_(sample)
        del sample  # free before the next is fetched
        k += 1
    if k < n:  # fewer indices than len() said
        return list(out[:k].unbind(0))
    return Stacked(out)


def mark_default_collate(collate: Any, allocator: _Allocator, as_worker: bool) -> None:
    """Mark a wrapper of ``default_collate`` as one that takes fetcher-built batches (point 4).

    Args:
        collate: the wrapper (``_recycle.RecyclingCollate``, ``memory.pinning_collate``'s).
        allocator: where its batches go; samples are stacked into it only ``as_worker``.
        as_worker: the wrapper collates as a DataLoader worker does.
    """
    collate.takes_gathered = True
    collate.stack_into = allocator if as_worker else None


def parts_getter(
    dataset: Any,
) -> Callable[[Sequence[int]], tuple[torch.Tensor, ...] | None] | None:
    """The dataset's gathering method, when its ``__getitems__`` is marked (point 2), else None.

    Args:
        dataset: the loader's dataset (a map-style one: only those are asked).

    Returns:
        ``method(indices) -> parts`` (point 1), or None.
    """
    getitems = getattr(dataset, "__getitems__", None)
    method = getattr(getattr(getitems, "__func__", None), _MARK, None)
    if method is None or "__getitems__" in getattr(dataset, "__dict__", ()):
        return None
    getter: Callable[[Sequence[int]], tuple[torch.Tensor, ...] | None] = getattr(dataset, method)
    return getter


def collate_gathered(batch: Any, allocator: _Allocator) -> Any:
    """``default_collate`` of a batch the fetcher built: a ``Stacked`` one as it is, a
    ``Gathered`` one by a copy of each part, anything else: None.

    Args:
        batch: what the fetcher passed to the collate function.
        allocator: where each copy goes (``memory.Allocator``); one with ``fresh_below`` lets
            smaller parts be copied into torch's own fresh memory.

    Returns:
        The stacked tensor; one contiguous tensor per field of a ``Gathered`` batch, in a list
        (``default_collate`` turns tuples into lists); None for any other ``batch``.
    """
    if type(batch) is Stacked:
        return batch.batch
    if type(batch) is not Gathered:
        return None
    if batch.parts[0].shape[0] == 0:
        raise IndexError("list index out of range")  # default_collate([]): no sample to stack
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
