"""pinned_collate gives default_collate's batches, written into memory from the allocator.

Every expected value comes from torch's own ``default_collate`` (or ``pin_memory``) on the same
samples. The allocator here is pageable and records what it hands out, so the tests run without
an accelerator and can check that each output tensor lives in memory it returned (one copy).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from helpers import assert_batches_equal
from torch.utils.data import default_collate, default_convert
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import pin_memory as torch_pin

from threadloader.memory import (
    pageable_allocator,
    pin_batch,
    pinned_collate,
    pinning_collate,
)


class RecordingAllocator:
    """A pageable allocator that remembers the storage of every tensor it returned."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.calls.append((shape, dtype))
        self.storages.add(out.untyped_storage().data_ptr())
        return out

    def owns(self, t: torch.Tensor) -> bool:
        return t.numel() == 0 or t.untyped_storage().data_ptr() in self.storages


def tensors_in(data: Any) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, Mapping):
        for v in data.values():
            yield from tensors_in(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from tensors_in(v)


def assert_collates_like_torch(batch: list[Any]) -> Any:
    """pinned_collate(batch) == default_collate(batch), every tensor in allocator memory."""
    allocator = RecordingAllocator()
    ours = pinned_collate(batch, allocator)
    assert_batches_equal(ours, default_collate(batch))
    for t in tensors_in(ours):
        assert allocator.owns(t), "a tensor of the batch is not in allocator memory"
    return ours


class Point(NamedTuple):
    x: Any
    y: Any


class FrozenMap(Mapping[str, Any]):
    """An immutable mapping that can be built from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Labelled(list[Any]):
    """A list subclass carrying extra state, which default_collate keeps by copying it."""

    def __init__(self, items: Any, tag: str = "") -> None:
        super().__init__(items)
        self.tag = tag


def _samples(make: Any, n: int = 4) -> list[Any]:
    return [make(i) for i in range(n)]


CASES: dict[str, list[Any]] = {
    "float tensors": _samples(lambda i: torch.full((3, 2), float(i))),
    "int tensors": _samples(lambda i: torch.arange(5) * i),
    "bool tensors": _samples(lambda i: torch.tensor([i % 2 == 0, True])),
    "0-dim tensors": _samples(lambda i: torch.tensor(i, dtype=torch.float16)),
    "mixed dtypes promote": [torch.ones(2, dtype=torch.int64), torch.ones(2)],
    "permuted tensors": _samples(lambda i: torch.arange(6.0).reshape(2, 3).t() + i),
    "expanded tensors": _samples(lambda i: torch.tensor([[float(i)]]).expand(3, 4)),
    "empty tensors": _samples(lambda i: torch.empty(0, 3)),
    "numpy arrays": _samples(lambda i: np.arange(4, dtype=np.int32) + i),
    "numpy float arrays": _samples(lambda i: np.full((2, 2), i, dtype=np.float64)),
    "numpy scalars": _samples(lambda i: np.float32(i) / 3),
    "numpy bools": _samples(lambda i: np.bool_(i % 2)),
    "python ints": _samples(lambda i: i * 7),
    "python floats": _samples(lambda i: i / 7),
    "python bools": _samples(lambda i: i % 2 == 0),
    "strings": _samples(lambda i: f"item{i}"),
    "bytes": _samples(lambda i: bytes([i])),
    "dicts": _samples(lambda i: {"x": torch.ones(2) * i, "y": i, "name": str(i)}),
    "ordered dicts": _samples(lambda i: collections.OrderedDict(b=i, a=torch.tensor([i]))),
    "defaultdicts": _samples(lambda i: collections.defaultdict(list, {"k": torch.tensor(i)})),
    "immutable mappings": _samples(lambda i: FrozenMap({"v": torch.tensor([i, i])})),
    "namedtuples": _samples(lambda i: Point(torch.tensor([i]), float(i))),
    "tuples become lists": _samples(lambda i: (torch.zeros(2) + i, i)),
    "lists": _samples(lambda i: [torch.ones(1) * i, np.int64(i)]),
    "list subclasses": _samples(lambda i: Labelled([torch.tensor(i), i], tag="t")),
    "nested": _samples(
        lambda i: {
            "image": torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(i)),
            "meta": Point([i, i + 1], {"id": str(i), "score": np.float64(i)}),
            "pairs": [(i, torch.tensor(i))],
        }
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_output_equals_default_collate(name: str) -> None:
    """pinned_collate returns default_collate's types, dtypes, shapes and values."""
    assert_collates_like_torch(CASES[name])


def test_tensors_are_stacked_straight_into_the_allocator() -> None:
    """A tensor batch costs one allocation of the batch's shape: the stack's own output."""
    allocator = RecordingAllocator()
    out = pinned_collate([torch.ones(3, 4) for _ in range(5)], allocator)
    assert allocator.calls == [((5, 3, 4), torch.float32)]
    assert allocator.owns(out) and out.is_contiguous()


def test_list_subclass_keeps_its_state() -> None:
    """A mutable sequence type is copied (its attributes kept) as default_collate copies it."""
    out = assert_collates_like_torch(CASES["list subclasses"])
    assert isinstance(out, Labelled) and out.tag == "t"


def _error(fn: Any, batch: list[Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(batch)
    return info.value


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
    NESTED = [torch.nested.nested_tensor([torch.ones(2)]), torch.nested.nested_tensor([])]


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param([object(), object()], id="unsupported type"),
        pytest.param([np.array(["a"]), np.array(["b"])], id="numpy strings"),
        pytest.param([np.array([object()]), np.array([object()])], id="numpy objects"),
        pytest.param([[1, 2], [1]], id="unequal lengths"),
        pytest.param([torch.ones(2), torch.ones(3)], id="unequal shapes"),
        pytest.param(NESTED, id="nested tensors"),
        pytest.param([torch.ones(2).to_sparse(), torch.ones(2).to_sparse()], id="sparse"),
        pytest.param([], id="empty batch"),
        pytest.param([{"a": 1}, {"b": 2}], id="missing key"),
    ],
)
def test_errors_equal_default_collates(batch: list[Any]) -> None:
    """Unsupported batches raise default_collate's exception type and message."""
    theirs = _error(default_collate, batch)
    ours = _error(lambda b: pinned_collate(b, pageable_allocator), batch)
    assert type(ours) is type(theirs)
    assert str(ours) == str(theirs)


def test_registered_collate_fn_is_used_then_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A type a user registered in default_collate_fn_map is collated by the user's function."""

    @dataclasses.dataclass
    class Box:
        value: int

    def collate_boxes(batch: list[Box], *, collate_fn_map: Any = None) -> torch.Tensor:
        return torch.tensor([b.value for b in batch]) * 10

    monkeypatch.setitem(torch_collate.default_collate_fn_map, Box, collate_boxes)
    batch = [{"box": Box(i)} for i in range(3)]
    allocator = RecordingAllocator()
    ours = pinned_collate(batch, allocator)
    assert_batches_equal(ours, default_collate(batch))
    assert allocator.owns(ours["box"])


@pytest.fixture
def torch_pin_reference(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch's pin_memory(), runnable without an accelerator: Tensor.pin_memory() clones."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    return torch_pin.pin_memory


class SelfPinning:
    """A custom batch type: pin_memory() is its own business, as torch's docs show."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.pinned = False

    def pin_memory(self) -> SelfPinning:
        out = SelfPinning(self.data.clone())
        out.pinned = True
        return out

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SelfPinning)
            and torch.equal(self.data, other.data)
            and self.pinned == other.pinned
        )

    __hash__ = None  # type: ignore[assignment]


PIN_CASES: dict[str, Any] = {
    "tensor": torch.arange(6).reshape(2, 3),
    "dict": {"a": torch.ones(2), "b": "text", "c": 3},
    "namedtuple": Point(torch.zeros(2), [torch.ones(1), b"raw"]),
    "tuple": (torch.ones(1), 2.5),
    "list subclass": Labelled([torch.ones(2)], tag="x"),
    "range": range(3),
    "custom type": {"batch": SelfPinning(torch.ones(3))},
    "plain object": {"n": None},
}


@pytest.mark.parametrize("name", list(PIN_CASES))
def test_pin_batch_equals_torch_pin_memory(name: str, torch_pin_reference: Any) -> None:
    """pin_batch rebuilds containers and calls custom pin_memory() as torch's pin_memory does."""
    data = PIN_CASES[name]
    allocator = RecordingAllocator()
    ours = pin_batch(data, allocator)
    assert_batches_equal(ours, torch_pin_reference(data))
    for t in tensors_in(ours):
        assert allocator.owns(t)


def test_pin_batch_keeps_strides_of_permuted_tensors() -> None:
    """A transposed tensor stays transposed, as torch's pinned copy keeps the strides."""
    t = torch.arange(12.0).reshape(3, 4).t()
    out = pin_batch(t, pageable_allocator)
    assert out.stride() == t.stride() and torch.equal(out, t)


def test_pin_batch_leaves_device_tensors_to_torch() -> None:
    """Non-CPU tensors go to torch's own pin_memory(), which decides (here: meta raises)."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        pin_batch(torch.empty(2, device="meta"), pageable_allocator)


def test_pinning_collate_uses_one_copy_for_default_collate() -> None:
    """With default_collate the loader's collate writes straight into the allocator."""
    allocator = RecordingAllocator()
    collate = pinning_collate(default_collate, allocator)
    out = collate([torch.ones(2), torch.zeros(2)])
    assert allocator.calls == [((2, 2), torch.float32)] and allocator.owns(out)


def test_pinning_collate_pins_after_a_custom_collate_fn() -> None:
    """A custom collate_fn runs first; its output is then pinned."""
    allocator = RecordingAllocator()

    def custom(batch: list[torch.Tensor]) -> dict[str, Any]:
        return {"sum": torch.stack(batch).sum(0), "n": len(batch)}

    out = pinning_collate(custom, allocator)([torch.ones(2), torch.ones(2)])
    assert_batches_equal(out, custom([torch.ones(2), torch.ones(2)]))
    assert allocator.owns(out["sum"])


def test_pinning_collate_handles_default_convert() -> None:
    """batch_size=None (default_convert) samples are converted, then pinned."""
    allocator = RecordingAllocator()
    sample = {"x": np.arange(3), "y": 1}
    out = pinning_collate(default_convert, allocator)(sample)
    assert_batches_equal(out, default_convert(sample))
    assert allocator.owns(out["x"])
