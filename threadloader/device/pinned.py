"""Pinned host memory: collate a batch straight into it, or pin a batch into it.

Why collate into the destination: torch's ``DataLoader(pin_memory=True)`` collates a batch into
pageable memory (``torch.stack``), then its pin thread copies the whole batch again into
page-locked memory. ``pinned_collate`` asks an ``allocator`` for each output tensor and stacks
the samples straight into it: one copy instead of two, and no pin thread. With
``pinned_allocator`` the destination is page-locked memory from torch's caching host allocator
(``torch.empty(..., pin_memory=True)``), which recycles blocks safely across asynchronous copies
on its own; with ``pageable_allocator`` (or any allocator) the same code runs on machines with
no accelerator, which is how CI checks it.

How the pieces behave; where the code disagrees with this, the code is wrong.

1. ``pinned_collate(batch, allocator)`` returns what ``default_collate(batch)`` returns: same
   types, keys, dtypes, shapes, values and memory layout, the same exceptions with the same
   messages; every tensor in its output was written into memory that ``allocator`` returned
   (a tensor torch would not give a contiguous layout is stacked as torch stacks it, then
   pinned). It dispatches on torch's own ``default_collate_fn_map``, read at each call, so
   element types a user registered there are collated by the user's function and then pinned,
   as torch would pin them.
2. ``as_worker=True``: what ``default_collate`` returns inside a DataLoader *worker*, where torch
   stacks each tensor into a new contiguous tensor of the first sample's dtype (``out=``): other
   samples' dtypes are cast to it, a layout like channels-last becomes contiguous, and samples
   that require grad raise torch's ``out=`` error. The loader's worker threads collate this way,
   so their batches are those of torch's worker processes.
3. A batch the loader's fetcher built (``gathered``) collates to what ``default_collate`` of
   its samples returns: a ``Gathered`` one (the tensors a dataset such as
   ``streams.TokenWindows`` gathered, instead of the samples cut from them) by one copy of each
   tensor, a ``Stacked`` one (samples copied into the batch as they were fetched) as it is.
4. ``pin_batch(data, allocator)`` returns what torch's ``pin_memory(data)`` returns, with
   ``allocator`` providing the page-locked memory: containers rebuilt the same way, custom
   objects pinned by their own ``pin_memory()``, already-pinned tensors returned as they are.

The pool of staging buffers, recycled once the copy that reads them has finished
(``BufferPool``, ``Event``, ``PoolStats``), lives in ``buffer_pool`` and is re-exported here.
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data._utils import collate as _torch_collate

from threadloader.device.buffer_pool import BufferPool, Event, PoolStats
from threadloader.device.gathered import collate_gathered, mark_default_collate

__all__ = [
    "Allocator",
    "BufferPool",
    "Event",
    "PoolStats",
    "pageable_allocator",
    "pin_batch",
    "pinned_allocator",
    "pinned_collate",
    "pinning_collate",
]

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""``allocator(shape, dtype)`` returns an uninitialised, contiguous CPU tensor of that shape and
dtype; ``pinned_collate`` and ``pin_batch`` write every output tensor into one. An allocator
with a ``fresh_below`` attribute (bytes) accepts that smaller tensors come from torch's own
allocation instead (``_recycle.RecyclingAllocator``: ordinary memory either way)."""

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}
)


def pinned_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return page-locked host memory from torch's caching host allocator.

    The caching host allocator records an event whenever a block is the source of an
    asynchronous copy and reuses a freed block only once that event completed, so tensors from
    here can be handed to the user and freed whenever the user drops them.

    Args:
        shape: the tensor's shape.
        dtype: the tensor's dtype.

    Returns:
        An uninitialised, contiguous, pinned CPU tensor.

    Raises:
        RuntimeError: there is no accelerator (torch has no pinned allocator then); callers
            check ``torch.accelerator.is_available()`` first, as torch's DataLoader does.
    """
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pageable_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return ordinary (pageable) host memory: ``pinned_collate`` without pinning.

    Useful where no accelerator exists (tests, CPU training) and in worker threads, where torch's
    own ``default_collate`` would put every batch into a new shared-memory segment because
    ``get_worker_info()`` is set there.

    Args:
        shape: the tensor's shape.
        dtype: the tensor's dtype.

    Returns:
        An uninitialised, contiguous CPU tensor.
    """
    return torch.empty(shape, dtype=dtype)


#: Nothing ``pinned_collate`` builds with ``pageable_allocator`` is pinned: what torch's collate
#: functions make (numbers, user types) is already ordinary memory and is kept as made. In an
#: isolation helper, pinning would touch CUDA, which a process forked from one that uses CUDA
#: cannot do; the training process pins.
pageable_allocator.stacks_only = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Pinning any batch: torch's pin_memory(), with the destination memory from an allocator.


class _Descend:
    """Marker a leaf function returns for "not a leaf: map over its items"."""


_DESCEND = _Descend()


def _map_batch(data: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild ``data`` with ``leaf`` applied to its leaves, containers handled as torch's
    ``pin_memory()`` handles them (torch/utils/data/_utils/pin_memory.py).

    ``leaf(x)`` returns the replacement of ``x``, or ``_DESCEND`` when ``x`` is not a leaf for it;
    strings, bytes and objects that are no container are then returned unchanged.
    """
    out = leaf(data)
    if out is not _DESCEND:
        return out
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        try:
            if isinstance(data, collections.abc.MutableMapping):
                # The mapping type may carry extra state: copy it, then replace the values.
                clone = copy.copy(data)
                clone.update({k: _map_batch(v, leaf) for k, v in data.items()})
                return clone
            return type(data)({k: _map_batch(v, leaf) for k, v in data.items()})  # type: ignore[call-arg]
        except TypeError:
            # The type supports neither copy()/update() nor construction from a dict.
            return {k: _map_batch(v, leaf) for k, v in data.items()}
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*(_map_batch(v, leaf) for v in data))
        return type(data)(_map_batch(v, leaf) for v in data)
    if isinstance(data, Sequence):
        try:
            if isinstance(data, collections.abc.MutableSequence):
                seq = copy.copy(data)
                for i, item in enumerate(data):
                    seq[i] = _map_batch(item, leaf)
                return seq
            return type(data)([_map_batch(v, leaf) for v in data])  # type: ignore[call-arg]
        except TypeError:
            # e.g. range: neither copy()/__setitem__ nor construction from a list.
            return [_map_batch(v, leaf) for v in data]
    return data


def _pin_tensor(tensor: torch.Tensor, allocator: Allocator) -> torch.Tensor:
    """``tensor.pin_memory()``, with the page-locked memory taken from ``allocator``."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        # torch's own answer: an error for device tensors, its own path for sparse layouts.
        return tensor.pin_memory()
    if tensor.is_pinned():
        return tensor  # Tensor.pin_memory() returns an already pinned tensor itself
    if tensor.is_contiguous():
        out = allocator(tuple(tensor.shape), tensor.dtype)
    else:
        # Keep the strides torch's pinned copy would have (a permuted tensor stays permuted):
        # the layout empty_like picks is dense, so a flat buffer of numel elements holds it.
        strides = torch.empty_like(tensor, device="meta").stride()
        out = allocator((tensor.numel(),), tensor.dtype).as_strided(tensor.shape, strides)
    out.copy_(tensor)
    return out


def _pin_leaf(allocator: Allocator) -> Callable[[Any], Any]:
    def leaf(data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return _pin_tensor(data, allocator)
        if hasattr(data, "pin_memory"):  # a custom batch type pins itself, as in torch
            return data.pin_memory()
        return _DESCEND

    return leaf


def pin_batch(data: Any, allocator: Allocator) -> Any:
    """Return ``data`` with every tensor copied into memory from ``allocator``.

    Mirrors torch's ``pin_memory(data)`` (what ``DataLoader(pin_memory=True)`` applies to each
    batch): mappings, namedtuples, tuples and sequences are rebuilt as torch rebuilds them;
    objects with a ``pin_memory()`` method are replaced by its result; tensors already pinned are
    returned as they are; non-contiguous tensors keep their strides; anything else is returned
    unchanged. Used after a custom ``collate_fn``, where the batch was built by user code.

    Args:
        data: a batch, as a ``collate_fn`` returned it.
        allocator: provides the destination of each tensor (``pinned_allocator`` on CUDA hosts).

    Returns:
        The pinned batch.

    Raises:
        RuntimeError: a tensor is not on the CPU (torch's own ``pin_memory()`` error).
    """
    return _map_batch(data, _pin_leaf(allocator))


# --------------------------------------------------------------------------------------------
# Collating straight into the destination: torch's default_collate, one copy.


def _collate_tensors(
    batch: Sequence[torch.Tensor], allocator: Allocator, as_worker: bool
) -> torch.Tensor:
    """torch's ``collate_tensor_fn``, stacking into ``allocator`` memory (point 1 or 2)."""
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    tensors: Any = batch  # torch.stack takes a list or tuple and raises torch's TypeError otherwise
    if not elem.is_cpu:
        # Device tensors are not ours to pin: collate as torch does, then let pinning decide
        # (torch's pin_memory() raises for device tensors).
        return _finish(torch.stack(tensors, 0), allocator)
    if as_worker:
        # torch's worker: out= of the first sample's dtype, contiguous (point 2).
        if elem.nbytes * len(batch) < getattr(allocator, "fresh_below", 0):
            # Memory from anywhere will do: a plain stack is that result, checked on the one
            # output (a separate empty() costs ~2 us a tensor), unless promotion, autograd or
            # a kept layout made it differ; then the out= stack gives torch's result or error.
            stacked = torch.stack(tensors, 0)
            if (
                stacked.dtype == elem.dtype
                and not stacked.requires_grad
                and stacked.is_contiguous()
            ):
                return stacked
        return torch.stack(tensors, 0, out=allocator((len(batch), *elem.shape), elem.dtype))
    dtype = elem.dtype
    same_layout = True
    needs_grad = False
    for t in batch:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)  # torch.stack's type promotion
        needs_grad = needs_grad or t.requires_grad
        same_layout = same_layout and t.is_contiguous()
    if not same_layout or (needs_grad and torch.is_grad_enabled()):
        # out= refuses autograd inputs, and is contiguous where stack would keep another
        # layout (channels-last samples, transposed views): collate as torch does, then pin.
        return _finish(torch.stack(tensors, 0), allocator)
    out = allocator((len(batch), *elem.shape), dtype)
    return torch.stack(tensors, 0, out=out)


def _collate_numpy_arrays(batch: Sequence[Any], allocator: Allocator, as_worker: bool) -> Any:
    """torch's ``collate_numpy_array_fn``: the arrays become tensors, then collate as tensors."""
    elem = batch[0]
    if _torch_collate.np_str_obj_array_pattern.search(elem.dtype.str) is not None:
        raise TypeError(_torch_collate.default_collate_err_msg_format.format(elem.dtype))
    return _collate([torch.as_tensor(b) for b in batch], allocator, as_worker)


_OURS: dict[Callable[..., Any], Callable[[Any, Allocator, bool], Any]] = {
    _torch_collate.collate_tensor_fn: _collate_tensors,
    _torch_collate.collate_numpy_array_fn: _collate_numpy_arrays,
}
"""torch's per-type collate functions that have a one-copy version here. Any other function in
``default_collate_fn_map`` (numbers, strings, types a user registered) produces its result, small
or unknown to us, which is then pinned as torch's pin thread would pin it."""


def _finish(collated: Any, allocator: Allocator) -> Any:
    """What torch's collate made without us: pinned, unless the allocator only stacks.

    An allocator with a true ``stacks_only`` attribute hands out ordinary memory
    (``pageable_allocator``, ``recycle.RecyclingAllocator``, an isolation helper's
    ``shm_ring.SlotAllocator``); anything else torch built is already in ordinary memory and is
    kept as it is, exactly as default_collate made it, and nothing is pinned.
    """
    if getattr(allocator, "stacks_only", False):
        return collated
    return pin_batch(collated, allocator)


def _collate(batch: Sequence[Any], allocator: Allocator, as_worker: bool) -> Any:
    """torch's ``collate(batch, collate_fn_map=default_collate_fn_map)``, into ``allocator``."""
    elem = batch[0]
    elem_type = type(elem)
    fn_map = _torch_collate.default_collate_fn_map  # read now: users may update it in place
    fn = fn_map.get(elem_type)
    if fn is None:
        for collate_type, candidate in fn_map.items():
            if isinstance(elem, collate_type):
                fn = candidate
                break
    if fn is not None:
        ours = _OURS.get(fn)
        if ours is not None:
            return ours(batch, allocator, as_worker)
        return _finish(fn(batch, collate_fn_map=fn_map), allocator)

    if isinstance(elem, Mapping):
        try:
            if isinstance(elem, collections.abc.MutableMapping):
                clone = copy.copy(elem)
                clone.update(
                    {key: _collate([d[key] for d in batch], allocator, as_worker) for key in elem}
                )
                return clone
            return elem_type(
                {key: _collate([d[key] for d in batch], allocator, as_worker) for key in elem}
            )
        except TypeError:
            # As torch: a mapping type without copy()/update() or dict construction.
            return {key: _collate([d[key] for d in batch], allocator, as_worker) for key in elem}
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(
            *(_collate(samples, allocator, as_worker) for samples in zip(*batch, strict=False))
        )
    if isinstance(elem, Sequence):
        it = iter(batch)
        elem_size = len(next(it))
        if not all(len(e) == elem_size for e in it):
            raise RuntimeError("each element in list of batch should be of equal size")
        transposed = list(zip(*batch, strict=False))
        if isinstance(elem, tuple):
            return [
                _collate(samples, allocator, as_worker) for samples in transposed
            ]  # torch: a list
        try:
            if isinstance(elem, collections.abc.MutableSequence):
                seq = copy.copy(elem)
                for i, samples in enumerate(transposed):
                    seq[i] = _collate(samples, allocator, as_worker)
                return seq
            return elem_type([_collate(samples, allocator, as_worker) for samples in transposed])
        except TypeError:
            return [_collate(samples, allocator, as_worker) for samples in transposed]
    raise TypeError(_torch_collate.default_collate_err_msg_format.format(elem_type))


def pinned_collate(batch: Sequence[Any], allocator: Allocator, *, as_worker: bool = False) -> Any:
    """Collate ``batch`` as ``default_collate`` does, writing each tensor into ``allocator`` memory.

    Tensors and numpy arrays are stacked straight into a buffer from ``allocator`` (one copy,
    where ``default_collate`` followed by pinning makes two); numbers, numpy scalars and
    element types registered in ``default_collate_fn_map`` are collated by torch's (or the
    user's) function and the small result is then pinned. Dicts, namedtuples, tuples (which
    become lists), lists and other sequences are handled exactly as ``default_collate`` handles
    them; strings and bytes stay lists of strings and bytes.

    Args:
        batch: the samples of one batch, as ``default_collate`` receives them.
        allocator: ``allocator(shape, dtype)`` returns the destination tensor:
            ``pinned_allocator`` for batches the user keeps, a ``BufferPool`` for staging
            buffers, ``pageable_allocator`` where nothing is pinned.
        as_worker: collate as ``default_collate`` does inside a DataLoader worker process:
            each tensor stacked into a contiguous tensor of its first sample's dtype (point 2
            of the module docstring). False: as it does in the process that calls it.

    Returns:
        What ``default_collate(batch)`` returns, equal in types, dtypes, shapes, values and
        (where the samples' layout is kept) strides.

    Raises:
        TypeError: an element type ``default_collate`` does not support (its message).
        RuntimeError: samples of unequal length or shape, nested or sparse tensors (torch's
            messages).
        IndexError: ``batch`` is empty, as for ``default_collate``.
    """
    gathered = collate_gathered(batch, allocator)  # point 3
    if gathered is not None:
        return gathered
    return _collate(batch, allocator, as_worker)


class _CollateThenPin:
    """A user's ``collate_fn`` followed by ``pin_batch``: the batch is user-built, so two copies."""

    def __init__(self, collate_fn: Callable[[Any], Any], allocator: Allocator) -> None:
        self.collate_fn = collate_fn
        self.allocator = allocator

    def __repr__(self) -> str:
        return f"<pin_batch after {self.collate_fn!r}>"

    def __call__(self, batch: Any) -> Any:
        return pin_batch(self.collate_fn(batch), self.allocator)


def pinning_collate(
    collate_fn: Callable[[Any], Any], allocator: Allocator, *, as_worker: bool = False
) -> Callable[[Any], Any]:
    """Return a collate function whose output lives in ``allocator`` memory: the worker's one.

    With torch's ``default_collate`` (what DataLoader uses when ``collate_fn`` is None and
    batching is on) the result collates straight into the destination. Any other function,
    ``default_convert`` included, runs first and its result is pinned with ``pin_batch``: the
    pinning then happens in the worker thread, so no separate pin thread is needed.

    Args:
        collate_fn: the loader's collate function (``loader.collate_fn``).
        allocator: where tensors go (see ``pinned_collate``).
        as_worker: ``default_collate`` collates as in a DataLoader worker (``pinned_collate``).

    Returns:
        A callable taking what ``collate_fn`` takes.
    """
    if collate_fn is _torch_collate.default_collate:
        collate = functools.partial(pinned_collate, allocator=allocator, as_worker=as_worker)
        mark_default_collate(collate, allocator, as_worker)
        return collate
    return _CollateThenPin(collate_fn, allocator)
