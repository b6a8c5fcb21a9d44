"""threadloader.streams.TokenWindows and BlockShuffleSampler: zero-build windows over token files.

Every window is checked against the files' concatenation, written as consecutive token ids so a
window's expected value is an ``arange``.
"""

from __future__ import annotations

import builtins
import itertools
import mmap
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from threadloader import ThreadDataLoader
from threadloader.samplers import ShuffleSampler
from threadloader.streams import BlockShuffleSampler, TokenWindows

# Token ids 0..9999 cut into files of uneven sizes; odd files are .npy, even files raw .bin.
_CUTS = (0, 1000, 1003, 5000, 5001, 10_000)


def _write_files(root: Path, dtype: type = np.uint16) -> list[str]:
    tokens = np.arange(_CUTS[-1], dtype=dtype)
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(_CUTS)):
        path = root / (f"shard{i:02d}.npy" if i % 2 else f"shard{i:02d}.bin")
        if path.suffix == ".npy":
            np.save(path, tokens[a:b])
        else:
            tokens[a:b].tofile(path)
        paths.append(str(path))
    return paths


@pytest.fixture
def token_files(tmp_path: Path) -> list[str]:
    return _write_files(tmp_path)


def test_windows_are_consecutive_tokens_shifted_by_one_across_file_boundaries(
    token_files: list[str],
) -> None:
    """Window i is tokens i*T..i*T+T of the concatenation as int64 input and target, also when it
    spans .bin and .npy files."""
    ds = TokenWindows(token_files, seq_len=7)
    assert len(ds) == (_CUTS[-1] - 1) // 7
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, torch.arange(i * 7, i * 7 + 7))
        assert torch.equal(y, torch.arange(i * 7 + 1, i * 7 + 8))


def test_getitems_returns_what_getitem_returns_in_the_asked_order(token_files: list[str]) -> None:
    """The vectorised batch path equals item-by-item reads, repeated and boundary windows included."""
    for span in (True, False):
        ds = TokenWindows(token_files, seq_len=5, span_files=span)
        indices = [*np.random.default_rng(0).integers(0, len(ds), 300).tolist(), 0, len(ds) - 1]
        for (bx, by), i in zip(ds.__getitems__(indices), indices, strict=True):
            x, y = ds[i]
            assert torch.equal(bx, x) and torch.equal(by, y)
        assert ds.__getitems__([]) == []


def test_windows_stay_inside_one_file_when_spanning_is_off(token_files: list[str]) -> None:
    """With span_files=False no window crosses a file and each file gives (tokens - 1) // T windows."""
    ds = TokenWindows(token_files, seq_len=7, span_files=False)
    sizes = np.diff(_CUTS)
    assert len(ds) == sum((n - 1) // 7 for n in sizes)
    starts = np.asarray(_CUTS)
    for x, y in ds.__getitems__(range(len(ds))):
        first, last = int(x[0]), int(y[-1])
        file_no = np.searchsorted(starts, first, side="right") - 1
        assert last < starts[file_no + 1]
        assert torch.equal(x, torch.arange(first, first + 7))


def test_npy_and_raw_files_of_the_same_tokens_give_the_same_windows(tmp_path: Path) -> None:
    """A .npy file (header skipped, its own dtype) reads like the raw file of the same tokens."""
    tokens = np.random.default_rng(1).integers(0, 2**31, 5000).astype(np.uint32)
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens)
    raw = TokenWindows(tmp_path / "t.bin", seq_len=64, dtype=np.uint32)
    npy = TokenWindows(tmp_path / "t.npy", seq_len=64)
    assert len(raw) == len(npy)
    assert np.array_equal(raw.windows(range(len(raw))), npy.windows(range(len(npy))))
    assert np.array_equal(raw.windows([3])[0], tokens[192:257].astype(np.int64))


def test_files_of_different_dtypes_and_byte_orders_concatenate(tmp_path: Path) -> None:
    """uint16 .bin, uint32 .npy and big-endian int32 .npy shards read as one token stream."""
    np.arange(0, 500, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", np.arange(500, 1000, dtype=np.uint32))
    np.save(tmp_path / "c.npy", np.arange(1000, 1500, dtype=">i4"))
    ds = TokenWindows([tmp_path / "a.bin", tmp_path / "b.npy", tmp_path / "c.npy"], seq_len=9)
    indices = np.random.default_rng(0).integers(0, len(ds), 200)
    assert np.array_equal(ds.windows(indices), indices[:, None] * 9 + np.arange(10))


def test_header_bytes_are_skipped_in_raw_files(tmp_path: Path) -> None:
    """llm.c-style shards: a fixed header before the tokens is skipped."""
    path = tmp_path / "llmc.bin"
    path.write_bytes(
        np.full(256, 7, np.int32).tobytes() + np.arange(100, dtype=np.uint16).tobytes()
    )
    ds = TokenWindows([path], seq_len=9, header_bytes=1024)
    assert ds.num_tokens == 100
    assert torch.equal(ds[2][0], torch.arange(18, 27))


def test_opening_reads_only_sizes_and_npy_headers(
    token_files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening maps nothing and opens only .npy files (for their header); reads map lazily later."""
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file: object, *args: object, **kwargs: object) -> object:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    def spy_os_open(path: str, *args: object, **kwargs: object) -> int:
        opened.append(str(path))
        return real_os_open(path, *args, **kwargs)  # type: ignore[arg-type]

    def no_mmap(*args: object, **kwargs: object) -> None:
        raise AssertionError("opening the dataset mapped a file")

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    ds = TokenWindows(token_files, seq_len=7)
    assert sorted(opened) == sorted(p for p in token_files if p.endswith(".npy"))
    monkeypatch.undo()
    assert "mapped=0" in repr(ds)
    ds[0]
    assert "mapped=1" in repr(ds)


def test_concurrent_readers_get_correct_windows_while_mappings_are_evicted(
    token_files: list[str],
) -> None:
    """Eight threads reading batches through a 2-file mapping cache all get the right windows."""
    ds = TokenWindows(token_files, seq_len=3, max_open_files=2)
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(150):
            indices = rng.integers(0, len(ds), 16)
            got = ds.windows(indices)
            want = indices[:, None] * 3 + np.arange(4)
            if not np.array_equal(got, want):
                errors.append(f"thread {seed}: wrong windows for {indices.tolist()}")

    threads = [threading.Thread(target=read, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize(
    ("content", "dtype", "match"),
    [
        (b"", np.uint16, "empty"),
        (b"\x01\x02\x03", np.uint16, "not a multiple of the 2-byte dtype"),
        (b"\x01\x02\x03\x04\x05\x06", np.uint32, "not a multiple of the 4-byte dtype"),
    ],
    ids=["empty", "odd-size-uint16", "odd-size-uint32"],
)
def test_bad_raw_file_raises_value_error_naming_it(
    tmp_path: Path, token_files: list[str], content: bytes, dtype: type, match: str
) -> None:
    """An empty file or one whose size is not a whole number of tokens is named in the error."""
    bad = tmp_path / "bad.bin"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        TokenWindows([*token_files[:1], str(bad)], seq_len=4, dtype=dtype)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("header_bytes", [-2, 1.5])
def test_a_header_size_that_is_not_a_byte_count_is_rejected(
    token_files: list[str], header_bytes: Any
) -> None:
    """A negative (or fractional) header_bytes raises at once, not numpy's error on each read."""
    with pytest.raises(ValueError, match="header_bytes must be an int >= 0"):
        TokenWindows(token_files, seq_len=4, header_bytes=header_bytes)


def test_bad_npy_files_raise_value_error_naming_them(tmp_path: Path) -> None:
    """A float, an empty, a non-numpy and a truncated .npy file are each rejected by name."""
    cases = {
        "float.npy": (np.zeros(10, np.float32), "not integer token ids"),
        "empty.npy": (np.zeros(0, np.uint16), "empty"),
    }
    for name, (array, match) in cases.items():
        np.save(tmp_path / name, array)
        with pytest.raises(ValueError, match=match) as info:
            TokenWindows(tmp_path / name, seq_len=2)
        assert name in str(info.value)
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"junk\.npy is not a \.npy file"):
        TokenWindows(tmp_path / "junk.npy", seq_len=2)
    np.save(tmp_path / "cut.npy", np.arange(100, dtype=np.uint16))
    data = (tmp_path / "cut.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated") as info:
        TokenWindows(tmp_path / "cut.npy", seq_len=2)
    assert "cut.npy" in str(info.value)


def test_no_fitting_window_float_dtype_and_bad_indices_are_rejected(token_files: list[str]) -> None:
    """Too-short files, a float dtype, seq_len 0 and out-of-range indices raise clear errors."""
    with pytest.raises(ValueError, match="no window of seq_len"):
        TokenWindows(token_files[1:2], seq_len=3)  # 3 tokens: no window of 4
    with pytest.raises(ValueError, match="integer dtype"):
        TokenWindows(token_files, seq_len=3, dtype=np.float32)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(token_files, seq_len=0)
    ds = TokenWindows(token_files, seq_len=3)
    for bad in (-1, len(ds)):
        with pytest.raises(IndexError):
            ds[bad]
        with pytest.raises(IndexError):
            ds.__getitems__([0, bad])


def test_glob_directory_and_path_list_open_the_same_files(tmp_path: Path) -> None:
    """A glob pattern and a directory are expanded in sorted order, like the explicit list."""
    paths = _write_files(tmp_path)
    by_list = TokenWindows(paths, seq_len=11)
    by_glob = TokenWindows(str(tmp_path / "shard*"), seq_len=11)
    by_dir = TokenWindows(tmp_path, seq_len=11)
    assert [f.path for f in by_glob.files] == [f.path for f in by_dir.files] == paths
    assert len(by_list) == len(by_glob) == len(by_dir)
    with pytest.raises(ValueError, match="no token file matches"):
        TokenWindows(str(tmp_path / "nothing*.bin"), seq_len=2)


def test_a_pickled_dataset_reads_the_same_windows(token_files: list[str]) -> None:
    """Pickling drops the mappings, so worker processes can receive the dataset and map their own."""
    ds = TokenWindows(token_files, seq_len=13)
    ds[5]
    copy = pickle.loads(pickle.dumps(ds))
    assert "mapped=0" in repr(copy)
    assert np.array_equal(copy.windows(range(len(ds))), ds.windows(range(len(ds))))


def test_thread_loader_with_a_global_shuffle_gives_dataloaders_batches(
    token_files: list[str],
) -> None:
    """ThreadDataLoader(num_workers=2) over TokenWindows with ShuffleSampler equals DataLoader's."""
    ds = TokenWindows(token_files, seq_len=31)
    theirs = list(DataLoader(ds, batch_size=8, sampler=ShuffleSampler(ds, seed=4)))
    ours = list(
        ThreadDataLoader(ds, batch_size=8, sampler=ShuffleSampler(ds, seed=4), num_workers=2)
    )
    assert len(ours) == len(theirs)
    for (ax, ay), (bx, by) in zip(ours, theirs, strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)


# --- BlockShuffleSampler ------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "block"), [(1000, 10), (1003, 10), (7, 10), (64, 1), (97, 96)])
def test_block_shuffle_is_a_permutation_of_whole_blocks_read_in_order(
    length: int, block: int
) -> None:
    """Each epoch reads every index once, in runs of consecutive indices the size of a block."""
    sampler = BlockShuffleSampler(length, block_size=block, seed=3)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = np.fromiter(sampler, np.int64)
        assert np.array_equal(np.sort(order), np.arange(length))
        where = np.empty(length, np.int64)
        where[order] = np.arange(length)  # where[i]: the position index i is read at
        for first in range(0, length, block):
            members = where[first : min(first + block, length)]
            assert np.array_equal(members, members[0] + np.arange(len(members)))


def test_block_shuffle_orders_differ_by_epoch_and_are_not_sequential() -> None:
    """Epochs give different block orders, and an order is not the identity."""
    sampler = BlockShuffleSampler(10_000, block_size=50, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    assert first != sorted(first)


def test_block_shuffle_resumes_on_another_world_size_reading_each_window_once() -> None:
    """A state saved on 2 ranks resumes on 3: the epoch reads every window exactly once."""
    n, block = 1000, 16
    ranks = [BlockShuffleSampler(n, block, num_replicas=2, rank=r, seed=5) for r in range(2)]
    iters = [iter(s) for s in ranks]
    seen = [i for _ in range(101) for it in iters for i in [next(it)]]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict() and state["block_size"] == block
    resumed = [BlockShuffleSampler(n, block, num_replicas=3, rank=r, seed=5) for r in range(3)]
    for s in resumed:
        s.load_state_dict(state)
        seen += list(s)
    assert sorted(seen) == list(range(n))
    other = BlockShuffleSampler(n, 8, num_replicas=3, rank=0, seed=5)
    with pytest.raises(ValueError, match="block_size"):
        other.load_state_dict(state)
