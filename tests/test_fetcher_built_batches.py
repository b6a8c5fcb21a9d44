"""Batches the fetcher builds for ThreadDataLoader's default collate are torch's batches.

A dataset that gathers whole batches (TokenWindows) is collated from what it gathered: its
inputs and targets are copied once instead of stacking per-window views; large tensor samples
are copied into the batch as they arrive (``device.gathered``). The batches must stay exactly torch's:
the same values, dtype, layout and errors. A subclass that changes ``__getitems__``, a custom
``collate_fn`` and plain ``DataLoader`` still see the samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, _DatasetKind, default_collate

from threadloader import ThreadDataLoader
from threadloader._engine.fetch import Fetcher
from threadloader._primitives.timing import StageRecorder
from threadloader.device import gathered as _gathered
from threadloader.device.recycle import RecyclingAllocator, RecyclingCollate
from threadloader.memory import pageable_allocator, pinned_collate, pinning_collate
from threadloader.samplers import ShuffleSampler
from threadloader.streams import Mixture, MixtureSampler, TokenWindows


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gathered") / "tokens.bin"
    np.arange(400_000, dtype=np.uint32).tofile(path)
    return str(path)


@pytest.fixture(scope="module")
def short_token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """200 windows of 11 tokens: enough batches to compare whole epochs with DataLoader's."""
    path = tmp_path_factory.mktemp("gathered") / "short_tokens.bin"
    np.arange(2_201, dtype=np.uint32).tofile(path)
    return str(path)


def _assert_torch_batches(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b) is list and len(a) == len(b) == 2
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype
            assert x.is_contiguous() and torch.equal(x, y)
        # inputs and targets overlap in the gather; the batch's two tensors must not
        (x, y) = sorted(a, key=lambda t: t.data_ptr())
        assert x.data_ptr() + x.nbytes <= y.data_ptr()


class _Counted(TokenWindows):
    """TokenWindows that counts calls of its (still marked) __getitems__."""

    getitems_calls = 0

    @_gathered.gathered_by("_inputs_targets")
    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        type(self).getitems_calls += 1
        return super().__getitems__(indices)


@pytest.mark.parametrize(
    ("seq_len", "batch_size"),
    [(31, 8), (20_000, 9)],  # small batches; parts over 1 MiB (recycled memory)
)
@pytest.mark.parametrize(
    "options",
    [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "isolation": "process"}],
    ids=["inline", "threads", "isolation"],
)
def test_batches_equal_dataloaders(
    token_file: str, seq_len: int, batch_size: int, options: dict[str, Any]
) -> None:
    ds = _Counted(token_file, seq_len=seq_len, dtype=np.uint32)
    _Counted.getitems_calls = 0
    theirs = list(
        DataLoader(ds, batch_size=batch_size, sampler=ShuffleSampler(ds, seed=1), num_workers=0)
    )
    assert _Counted.getitems_calls == len(theirs)  # torch cuts samples
    _Counted.getitems_calls = 0
    ours = list(
        ThreadDataLoader(ds, batch_size=batch_size, sampler=ShuffleSampler(ds, seed=1), **options)
    )
    _assert_torch_batches(ours, theirs)
    if "isolation" not in options:  # (the helper process has its own class attribute)
        assert _Counted.getitems_calls == 0  # the gathered path was taken for every batch


def test_the_fetcher_hands_gathered_tensors_only_to_a_collate_that_takes_them(
    token_file: str,
) -> None:
    ds = TokenWindows(token_file, seq_len=5, dtype=np.uint32)
    recorder = StageRecorder("test")
    collate = RecyclingCollate(RecyclingAllocator(2), as_worker=True)
    seen: list[Any] = []

    def custom(batch: Any) -> Any:
        seen.append(batch)
        return default_collate(batch)

    ours = Fetcher(_DatasetKind.Map, ds, True, collate, False)
    assert type(ours._items([3, 1])) is _gathered.Gathered
    theirs = Fetcher(_DatasetKind.Map, ds, True, custom, False)
    _assert_torch_batches([theirs.fetch([3, 1], recorder)], [ours.fetch([3, 1], recorder)])
    assert type(seen[0]) is list and len(seen[0]) == 2
    assert torch.equal(seen[0][0][0], torch.arange(15, 20))


def test_pinning_collate_of_default_collate_takes_gathered_batches(token_file: str) -> None:
    ds = TokenWindows(token_file, seq_len=5, dtype=np.uint32)
    collate = pinning_collate(default_collate, pageable_allocator)
    assert getattr(collate, "takes_gathered", False)
    gathered = _gathered.Gathered(ds._inputs_targets([7, 2, 9]))
    _assert_torch_batches([collate(gathered)], [default_collate(ds.__getitems__([7, 2, 9]))])
    # pinned_collate itself: one copy into the allocator's memory, for every part size
    allocated: list[torch.Tensor] = []

    def allocator(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        allocated.append(torch.empty(shape, dtype=dtype))
        return allocated[-1]

    batch = pinned_collate(gathered, allocator)
    assert [t.data_ptr() for t in batch] == [t.data_ptr() for t in allocated]


class _Shifted(TokenWindows):
    """Overrides __getitems__ without the mark: its own samples must be collated."""

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x + 1000, y) for x, y in super().__getitems__(indices)]


class _Scaled(TokenWindows):
    """Overrides only the gathering method, which the marked __getitems__ also calls."""

    def _inputs_targets(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super()._inputs_targets(indices)
        return inputs * 2, targets


@pytest.mark.parametrize("dataset_type", [_Shifted, _Scaled])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_subclasses_get_what_dataloader_gives_them(
    short_token_file: str, dataset_type: type[TokenWindows], num_workers: int
) -> None:
    ds = dataset_type(short_token_file, seq_len=11, dtype=np.uint32)
    theirs = list(DataLoader(ds, batch_size=4, shuffle=False))
    ours = list(ThreadDataLoader(ds, batch_size=4, num_workers=num_workers))
    _assert_torch_batches(ours, theirs)
    assert theirs[0][0][0, 1] in (1001, 2)  # the override took effect (plain: 1)


def test_an_instance_getitems_is_called_as_torch_calls_it(short_token_file: str) -> None:
    ds = TokenWindows(short_token_file, seq_len=11, dtype=np.uint32)
    plain = ds.__getitems__
    ds.__getitems__ = lambda indices: [(x - 1, y) for x, y in plain(indices)]  # type: ignore[method-assign]
    assert _gathered.parts_getter(ds) is None
    theirs = list(DataLoader(ds, batch_size=4))
    _assert_torch_batches(list(ThreadDataLoader(ds, batch_size=4, num_workers=2)), theirs)
    assert theirs[0][0][0, 0] == -1


# --- large tensor samples, stacked as they arrive ---------------------------------------------


class _Samples(Dataset[torch.Tensor]):
    """Large float samples; ``odd`` maps an index to a replacement sample (shape, dtype, grad)."""

    def __init__(self, n: int = 24, odd: dict[int, Any] | None = None, shape=(8, 64, 64)) -> None:
        self.n, self.odd, self.shape = n, odd or {}, shape
        self.alive_at_fetch: list[int] = []
        self._last: weakref.ref[torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.alive_at_fetch.append(self._last is not None and self._last() is not None)
        if index in self.odd:
            sample = self.odd[index]
        else:
            base = torch.arange(int(np.prod(self.shape)), dtype=torch.float32) + index
            sample = base.view(self.shape)
            if index % 3 == 1 and len(self.shape) == 3:
                sample = sample.permute(2, 0, 1)  # non-contiguous samples are stacked as torch does
                sample = sample.contiguous().permute(1, 2, 0)
        self._last = weakref.ref(sample)
        return sample


def _torch_worker_batches(ds: Any, **options: Any) -> list[Any]:
    return list(DataLoader(ds, num_workers=1, **options))


def test_large_tensor_samples_give_torch_workers_batches() -> None:
    ds = _Samples()
    theirs = _torch_worker_batches(ds, batch_size=8)
    for options in ({"num_workers": 2}, {"num_workers": 1}):
        ours = list(ThreadDataLoader(ds, batch_size=8, **options))
        assert len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)


def test_each_sample_is_freed_before_the_next_is_fetched() -> None:
    """The memory point of stacking while fetching: one sample alive at a time, not a batch."""
    ds = _Samples()
    recorder = StageRecorder("test")
    fetcher = Fetcher(
        _DatasetKind.Map, ds, True, RecyclingCollate(RecyclingAllocator(2), as_worker=True), False
    )
    assert type(fetcher._items(list(range(8)))) is _gathered.Stacked
    ds.alive_at_fetch.clear()
    fetcher.fetch(list(range(8, 16)), recorder)
    assert ds.alive_at_fetch == [False] * 8
    # small batches are one stack at the end, as before
    small = _Samples(shape=(4,))
    small_fetcher = Fetcher(_DatasetKind.Map, small, True, fetcher._collate, False)
    assert type(small_fetcher._items([0, 1])) is list


@pytest.mark.parametrize(
    "odd",
    [
        {5: torch.zeros(8, 64, 64, dtype=torch.float64) + 0.5},  # cast to the first dtype
        {5: torch.zeros(8, 64, 63)},  # torch's unequal-size error
        {5: torch.zeros(8, 64, 64, requires_grad=True)},  # torch's out= autograd error
        {0: torch.zeros(8, 64, 64, dtype=torch.float16), 5: torch.zeros(8, 64, 64)},
        {5: torch.nn.Parameter(torch.zeros(8, 64, 64), requires_grad=False)},
    ],
    ids=["dtype", "shape", "grad", "first-dtype", "subclass"],
)
def test_an_odd_sample_gets_torch_workers_result_or_error(odd: dict[int, Any]) -> None:
    """Values as torch's worker gives them; errors as the collate of the same samples gives them
    (torch's worker: its own message, except for unequal sizes, where its resize error is replaced
    by the stack's own message, see README)."""
    ds = _Samples(odd=odd)
    try:
        expected: Any = pinned_collate(
            [ds[i] for i in range(8)], pageable_allocator, as_worker=True
        )
    except Exception as error:  # noqa: BLE001  # compared with ours below
        expected = error
    try:
        ours: Any = list(ThreadDataLoader(ds, batch_size=8, num_workers=2))
    except Exception as error:  # noqa: BLE001
        ours = error
    if isinstance(expected, Exception):
        assert type(ours) is type(expected)
        assert str(expected) in str(ours)
        return
    assert not isinstance(ours, Exception), ours
    theirs = _torch_worker_batches(ds, batch_size=8)
    assert torch.equal(expected, theirs[0])
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)


class _OddBatches(Sampler[Any]):
    """Batches as a generator, a tuple and a tensor: torch's fetcher iterates whatever comes."""

    def __iter__(self) -> Iterator[Any]:
        yield (i for i in range(8))
        yield tuple(range(8, 16))
        yield torch.arange(16, 24)
        yield []

    def __len__(self) -> int:
        return 4


def test_any_iterable_of_indices_is_fetched_as_torch_fetches_it() -> None:
    ds = _Samples()

    def first_batches(loader: Any) -> list[Any]:
        it, out = iter(loader), []
        for _ in range(3):
            out.append(next(it))
        with pytest.raises(IndexError):  # default_collate of an empty batch
            next(it)
        return out

    theirs = first_batches(DataLoader(ds, batch_sampler=_OddBatches()))  # a worker process
    # cannot receive a generator: torch hangs there
    ours = first_batches(ThreadDataLoader(ds, batch_sampler=_OddBatches(), num_workers=1))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_empty_batch_of_windows_raises_as_torch_does(token_file: str, num_workers: int) -> None:
    ds = TokenWindows(token_file, seq_len=7, dtype=np.uint32)
    with pytest.raises(IndexError, match="list index out of range"):
        list(DataLoader(ds, batch_sampler=[[0, 1], []]))
    loader = ThreadDataLoader(ds, batch_sampler=[[0, 1], []], num_workers=num_workers)
    with pytest.raises(IndexError, match="list index out of range"):
        list(loader)


# --- a Mixture of TokenWindows ------------------------------------------------------------------


class _CountedMixture(Mixture):
    """A Mixture that counts calls of its (still marked) __getitems__."""

    getitems_calls = 0

    @_gathered.gathered_by("_gather_windows")
    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        type(self).getitems_calls += 1
        return super().__getitems__(indices)


def _mixture(token_file: str, code_type: type = TokenWindows, code_seq_len: int = 9) -> Any:
    web = TokenWindows(token_file, seq_len=9, dtype=np.uint32)
    code = code_type(token_file, seq_len=code_seq_len, dtype=np.uint32, span_files=False)
    return _CountedMixture({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixture_of_token_windows_is_gathered_into_dataloaders_batches(
    token_file: str, num_workers: int
) -> None:
    ds = _mixture(token_file)

    def batches(loader_type: type, **options: Any) -> list[Any]:
        loader = loader_type(ds, batch_size=8, sampler=MixtureSampler(ds), **options)
        return [b for _, b in zip(range(40), loader, strict=False)]

    theirs = batches(DataLoader)
    _CountedMixture.getitems_calls = 0
    ours = batches(ThreadDataLoader, num_workers=num_workers)
    _assert_torch_batches(ours, theirs)
    assert _CountedMixture.getitems_calls == 0  # gathered: one array for the batch


class _FloatWindows(TokenWindows):
    """Overrides only windows(): its dtype and values reach torch's batches."""

    def windows(self, indices: Any) -> Any:
        return super().windows(indices) / 7.0


@pytest.mark.parametrize(
    ("code_type", "code_seq_len"),
    [(_Scaled, 9), (_Shifted, 9), (_FloatWindows, 9), (TokenWindows, 8)],
)
def test_a_mixture_that_cannot_be_gathered_gets_its_samples_collated(
    token_file: str, code_type: type, code_seq_len: int
) -> None:
    """A source that changes how it gathers, or another seq_len: __getitems__, as torch."""
    ds = _mixture(token_file, code_type, code_seq_len)

    def batches(loader_type: type, **options: Any) -> Any:
        loader = loader_type(ds, batch_size=8, sampler=MixtureSampler(ds), **options)
        try:
            return [b for _, b in zip(range(20), loader, strict=False)]
        except RuntimeError as error:  # unequal sizes: the stack's own message in both
            return str(error).splitlines()[-1]

    theirs = batches(DataLoader)
    _CountedMixture.getitems_calls = 0
    ours = batches(ThreadDataLoader, num_workers=0)
    assert _CountedMixture.getitems_calls > 0
    if isinstance(theirs, str):
        assert ours == theirs and "equal size" in ours
    else:
        _assert_torch_batches(ours, theirs)


def test_a_mixture_goes_to_the_isolation_helper(token_file: str) -> None:
    """A Mixture pickles without its lock and sampler link (it used to raise TypeError)."""
    ds = _mixture(token_file)

    def first_ten(loader: Any) -> list[Any]:
        return [b for _, b in zip(range(10), loader, strict=False)]

    theirs = first_ten(DataLoader(ds, 8, sampler=MixtureSampler(ds)))
    ours = first_ten(
        ThreadDataLoader(ds, 8, sampler=MixtureSampler(ds), num_workers=1, isolation="process")
    )
    _assert_torch_batches(ours, theirs)
