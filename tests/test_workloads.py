"""The built-in workloads build, give documented items, pickle, and repeat themselves; the
memory probe measures and cleans up after itself."""

from __future__ import annotations

import os
import pickle
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from threadloader.compare.memory_probe import PeakSampler, tree_pss_bytes
from threadloader.compare.workloads import WORKLOAD_NAMES, WorkloadSpec, make_workload

# name: (item shape, item dtype, batch size), size "small"
DOCUMENTED: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {
    "tokens": ((2049,), torch.int64, 16),
    "images": ((3, 224, 224), torch.float32, 32),
    "tensors": ((3, 256, 256), torch.float32, 16),
    "python": ((200,), torch.float32, 32),
    "objects": ((), torch.int64, 256),
}


@pytest.fixture(scope="module")
def workload_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("workloads"))


@pytest.fixture(scope="module")
def specs(workload_root: str) -> dict[str, WorkloadSpec]:
    return {name: make_workload(name, root=workload_root, size="small") for name in WORKLOAD_NAMES}


def test_every_documented_workload_is_built() -> None:
    """The table above and WORKLOAD_NAMES name the same workloads."""
    assert set(DOCUMENTED) == set(WORKLOAD_NAMES)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_items_have_the_documented_shape_dtype_and_batch_size(
    name: str, specs: dict[str, WorkloadSpec]
) -> None:
    """Every workload's items have the shape and dtype its docstring promises."""
    spec = specs[name]
    shape, dtype, batch_size = DOCUMENTED[name]
    assert spec.name == name
    assert spec.batch_size == batch_size
    assert spec.description
    assert len(spec.dataset) >= batch_size  # type: ignore[arg-type]
    for index in (0, len(spec.dataset) - 1):  # type: ignore[arg-type]
        item = spec.dataset[index]
        assert isinstance(item, torch.Tensor)
        assert item.shape == shape and item.dtype == dtype


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_index_gives_the_same_item_also_after_pickling(
    name: str, specs: dict[str, WorkloadSpec]
) -> None:
    """Items are a function of the index alone, in this process and in a pickled copy."""
    dataset = specs[name].dataset
    first = dataset[5]
    copy = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(dataset[5], first)
    assert torch.equal(copy[5], first)
    assert not torch.equal(dataset[6], first) or name == "objects"  # objects: lengths repeat


@pytest.mark.parametrize("name", ["tokens", "images", "tensors", "python"])
def test_index_past_the_end_raises_index_error(name: str, specs: dict[str, WorkloadSpec]) -> None:
    """Out-of-range indices raise IndexError, so plain iteration stops where it should."""
    dataset = specs[name].dataset
    with pytest.raises(IndexError):
        dataset[len(dataset)]  # type: ignore[arg-type]


def test_token_file_is_reused_not_rewritten(workload_root: str) -> None:
    """A second build with the same parameters opens the cached file."""
    path = make_workload("tokens", root=workload_root).dataset.path  # type: ignore[attr-defined]
    mtime = os.stat(path).st_mtime_ns
    again = make_workload("tokens", root=workload_root).dataset
    assert again.path == path  # type: ignore[attr-defined]
    assert os.stat(path).st_mtime_ns == mtime
    assert not [n for n in os.listdir(workload_root) if n.startswith(".")]  # no temp leftovers


def test_memmap_opened_before_fork_is_reopened_in_the_worker(
    specs: dict[str, WorkloadSpec],
) -> None:
    """A worker process gives the same token windows as the parent that opened the memmap."""
    dataset = specs["tokens"].dataset
    dataset[0]  # opens the memmap in this process before the worker forks
    here = list(DataLoader(dataset, batch_size=4, num_workers=0, sampler=range(8)))
    there = list(DataLoader(dataset, batch_size=4, num_workers=1, sampler=range(8)))
    assert all(torch.equal(a, b) for a, b in zip(here, there, strict=True))


def test_unknown_workload_or_size_raises_value_error() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("videos")
    with pytest.raises(ValueError, match="unknown size"):
        make_workload("python", size="huge")


def test_tree_pss_counts_this_process() -> None:
    """The tree's PSS is positive and grows when this process touches new memory."""
    before = tree_pss_bytes()
    block = bytearray(32 * 2**20)  # zero-filled by the kernel on touch: write to every page
    block[::4096] = b"x" * len(block[::4096])
    after = tree_pss_bytes()
    del block
    assert before > 0
    assert after - before > 16 * 2**20


def test_peak_sampler_reports_a_peak_and_leaves_no_thread() -> None:
    """The sampler's thread exists only inside the with-block, and the peak covers it."""
    threads = threading.active_count()
    with PeakSampler(interval_s=0.005) as peak:
        assert threading.active_count() == threads + 1
        block = bytearray(32 * 2**20)
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.05)
        del block
    assert threading.active_count() == threads
    assert peak.samples >= 2
    assert peak.peak_bytes >= max(peak.first_bytes, peak.last_bytes) > 0
    assert peak.peak_bytes - peak.first_bytes > 16 * 2**20
    with pytest.raises(RuntimeError, match="only once"), peak:
        pass


def test_peak_sampler_stops_when_the_block_raises() -> None:
    threads = threading.active_count()
    with pytest.raises(KeyError), PeakSampler():
        raise KeyError("boom")
    assert threading.active_count() == threads
