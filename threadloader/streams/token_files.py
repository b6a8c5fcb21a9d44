"""Token files for ``TokenWindows``: sizes read once, memory maps opened lazily and shared by threads.

What opening costs, and why: a pretraining corpus is thousands of shard files, and tools that build
an index first make users wait minutes before step one. Here opening a raw ``.bin`` file is one
``os.stat`` (its size is its token count) and opening a ``.npy`` file reads its header (a few hundred
bytes). Nothing is mapped, indexed or copied until a window is read.

Reading: ``MapCache`` maps a file on its first read and keeps the mapping for the next ones, at most
``max_open`` at once (each mapping holds a file descriptor, and a global shuffle over 10,000 shards
would otherwise hold 10,000). ``gather`` copies windows of consecutive tokens out of the mapped
files into one int64 array, a whole batch at a time: one numpy row-gather when the batch lies in
one file, a byte copy per window otherwise, then one cast (its docstring says why), and windows
that cross a file boundary are stitched from their pieces.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format
from numpy.lib.stride_tricks import as_strided

DEFAULT_MAX_OPEN: Final = 256
"""Mappings kept open per dataset: well under the usual 1024 file-descriptor limit."""

_Tokens = npt.NDArray[np.integer[Any]]
_Mapped = tuple[_Tokens, memoryview]
"""A mapped file's tokens, as an array (for numpy gathers) and as bytes (for memcpy)."""


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """Where one file's tokens are: what ``scan`` learns without reading any token.

    Attributes:
        path: the file.
        dtype: the tokens' dtype (the given one for raw files, the header's for ``.npy``).
        offset: bytes before the first token (header).
        tokens: how many tokens the file holds.
    """

    path: str
    dtype: np.dtype[Any]
    offset: int
    tokens: int


def scan(paths: Sequence[str], dtype: np.dtype[Any], header_bytes: int) -> list[TokenFile]:
    """Learn each file's token count from its size (raw) or header (``.npy``); read no token.

    Args:
        paths: token files; names ending in ``.npy`` are numpy files, any other is raw.
        dtype: the token dtype of raw files (an integer dtype).
        header_bytes: bytes to skip at the start of each raw file (llm.c's shards have 1024).

    Returns:
        one ``TokenFile`` per path, in order.

    Raises:
        ValueError: naming the file, if it is empty, its size is not a whole number of tokens, or
            a ``.npy`` file holds no integers, is Fortran-ordered with several dimensions, or is
            shorter than its header says; ``header_bytes`` with a ``.npy`` file (it would be
            ignored).
        OSError: if a file cannot be stat-ed or opened.
    """
    if dtype.kind not in "iu":
        raise ValueError(f"token dtype must be an integer dtype, got {dtype}")
    if not isinstance(header_bytes, int) or header_bytes < 0:
        raise ValueError(f"header_bytes must be an int >= 0, got {header_bytes!r}")
    files = []
    for path in paths:
        if path.endswith(".npy"):
            if header_bytes:
                raise ValueError(
                    f"header_bytes={header_bytes} skips the header of raw token files, but "
                    f"{path} is a .npy file, whose own header says where its tokens start"
                )
            files.append(_scan_npy(path))
            continue
        size = os.stat(path).st_size - header_bytes
        if size <= 0:
            raise ValueError(
                f"token file {path} is empty (no bytes after a {header_bytes}-byte header)"
            )
        if size % dtype.itemsize:
            raise ValueError(
                f"token file {path} holds {size} bytes of tokens, not a multiple of the "
                f"{dtype.itemsize}-byte dtype {dtype}: wrong dtype, or a truncated file?"
            )
        files.append(TokenFile(path, dtype, header_bytes, size // dtype.itemsize))
    return files


_NPY_MAGIC: Final = b"\x93NUMPY"
_NPY_FIELDS: Final = re.compile(
    r"""^\{\s*'descr':\s*'(?P<descr>[^']+)',\s*'fortran_order':\s*(?P<fortran>True|False),"""
    r"""\s*'shape':\s*\((?P<shape>[\d,\s]*)\),?\s*\}\s*$"""
)


def _scan_npy(path: str) -> TokenFile:
    """Read a ``.npy`` header: one open, one read, one fstat.

    numpy's own reader (``ast.literal_eval`` on the header) costs ~60 µs a file: 0.6 s for
    10,000 shards. The headers numpy writes for plain arrays match one regular expression; any
    other header (structured dtypes, hand-written files) goes through numpy's reader.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 4096, 0)
    finally:
        os.close(fd)
    if not head.startswith(_NPY_MAGIC) or len(head) < 10:
        raise ValueError(f"token file {path} is not a .npy file (no numpy magic)")
    major = head[6]
    length_bytes = 2 if major == 1 else 4
    header_len = int.from_bytes(head[8 : 8 + length_bytes], "little")
    offset = 8 + length_bytes + header_len
    match = _NPY_FIELDS.match(head[8 + length_bytes : offset].decode("latin1"))
    if match is not None and len(head) >= offset:
        dtype = np.dtype(match["descr"])
        fortran = match["fortran"] == "True"
        shape = tuple(int(d) for d in match["shape"].replace(",", " ").split())
    else:
        dtype, fortran, shape, offset = _numpy_header(path)
    if dtype.kind not in "iu":
        raise ValueError(f"token file {path} holds {dtype}, not integer token ids")
    if fortran and len(shape) > 1:
        raise ValueError(f"token file {path} is Fortran-ordered {shape}: save it C-ordered or 1-D")
    count = math.prod(shape)
    if count == 0:
        raise ValueError(f"token file {path} is empty (shape {shape})")
    if size < offset + count * dtype.itemsize:
        raise ValueError(
            f"token file {path} is truncated: its header promises {count} tokens of {dtype}, "
            f"the file has {size - offset} bytes after the header"
        )
    return TokenFile(path, dtype, offset, count)


def _numpy_header(path: str) -> tuple[np.dtype[Any], bool, tuple[int, ...], int]:
    with open(path, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npy_format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = npy_format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
        except ValueError as e:
            raise ValueError(f"token file {path} is not a readable .npy file: {e}") from None
        return dtype, fortran, tuple(shape), f.tell()


class MapCache:
    """Read-only memory maps of token files, opened on first use, shared by every thread.

    Correct without the GIL: a hit is one ``dict.get`` (atomic in every CPython build); a miss takes
    the lock, checks again, maps the file and inserts it, so each file is mapped once however many
    threads miss at once. When ``max_open`` files are mapped, the oldest mapping is dropped from the
    cache; a thread still reading from it keeps it alive through its array, so nothing is unmapped
    under a reader (mappings are never closed explicitly, only released with their last array).

    Args:
        files: what to map.
        max_open: most mappings kept at once.
    """

    def __init__(self, files: Sequence[TokenFile], max_open: int = DEFAULT_MAX_OPEN) -> None:
        if max_open < 1:
            raise ValueError(f"max_open_files must be >= 1, got {max_open}")
        self.files = files
        self.max_open = max_open
        self._maps: dict[int, _Mapped] = {}
        self._lock = threading.Lock()

    def get(self, file_no: int) -> _Mapped:
        """Return file ``file_no``'s tokens: a read-only 1-D array and its bytes, over its mapping."""
        mapped = self._maps.get(file_no)
        if mapped is not None:
            return mapped
        with self._lock:
            mapped = self._maps.get(file_no)
            if mapped is None:
                mapped = _map(self.files[file_no])
                while len(self._maps) >= self.max_open:
                    del self._maps[next(iter(self._maps))]  # oldest first: dicts keep order
                self._maps[file_no] = mapped
        return mapped

    def __len__(self) -> int:
        return len(self._maps)

    def __getstate__(self) -> dict[str, Any]:
        # Mappings and locks do not pickle; a copy in a worker process maps its own.
        return {"files": self.files, "max_open": self.max_open}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.files, self.max_open = state["files"], state["max_open"]
        self._maps = {}
        self._lock = threading.Lock()


def _map(file: TokenFile) -> _Mapped:
    with open(file.path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tokens = np.frombuffer(mapping, dtype=file.dtype, count=file.tokens, offset=file.offset)
    return tokens, memoryview(mapping)[file.offset : file.offset + tokens.nbytes]


def gather(
    cache: MapCache,
    file_starts: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    width: int,
    dtype: np.dtype[Any] | None,
) -> npt.NDArray[np.int64]:
    """Copy ``width`` consecutive tokens from each start into one int64 array.

    Why it is shaped this way: worker threads share the GIL, and numpy releases it around every
    copy of more than a few hundred elements, so a numpy copy per window means a GIL hand-off per
    window, which on cheap windows costs more than the copy (measured: 2 threads fetching ~3x
    slower than one). So rows spread over several files are copied as raw bytes with the GIL held
    (memoryview slices: a memcpy each, no numpy call), and widened to int64 by one numpy cast for
    the whole batch: one release, for the one piece of work worth running in parallel.

    Args:
        cache: the mapped files.
        file_starts: ``F + 1`` cumulative token counts: file ``f`` holds the tokens at positions
            ``file_starts[f] <= p < file_starts[f + 1]`` of the concatenation.
        starts: positions in the concatenation, each with ``start + width <= file_starts[-1]``.
        width: tokens per row.
        dtype: the dtype every file shares, or None when they differ (slower path).

    Returns:
        ``(len(starts), width)`` int64 array; row ``k`` holds tokens ``starts[k] ...``.
    """
    if not len(starts):
        return np.empty((0, width), dtype=np.int64)
    file_of = np.searchsorted(file_starts, starts, side="right") - 1
    local = starts - file_starts[file_of]
    inside = starts + width <= file_starts[file_of + 1]
    if inside.all() and (file_of == file_of[0]).all():
        # One file (sequential or block-shuffled reading): one row-gather through a strided
        # (windows, width) view, then one cast.
        tokens = cache.get(int(file_of[0]))[0]
        step = tokens.strides[0]
        windows = as_strided(
            tokens,
            shape=(tokens.shape[0] - width + 1, width),
            strides=(step, step),
            writeable=False,
        )
        return windows[local].astype(np.int64)
    rows = zip(file_of.tolist(), local.tolist(), inside.tolist(), strict=True)
    if dtype is None:
        return _gather_mixed_dtypes(cache, rows, len(starts), width)
    size = dtype.itemsize
    row_bytes = width * size
    staging = bytearray(len(starts) * row_bytes)
    into = memoryview(staging)
    for row, (file_no, begin, whole) in enumerate(rows):
        at = row * row_bytes
        if whole:
            into[at : at + row_bytes] = cache.get(file_no)[1][
                begin * size : begin * size + row_bytes
            ]
            continue
        end = at + row_bytes  # the window crosses a file boundary: stitch its pieces
        while at < end:
            piece = cache.get(file_no)[1][begin * size : begin * size + end - at]
            into[at : at + len(piece)] = piece
            at += len(piece)
            file_no, begin = file_no + 1, 0
    return np.frombuffer(staging, dtype=dtype).reshape(len(starts), width).astype(np.int64)


def _gather_mixed_dtypes(
    cache: MapCache, rows: Iterable[tuple[int, int, bool]], count: int, width: int
) -> npt.NDArray[np.int64]:
    out = np.empty((count, width), dtype=np.int64)
    for row, (file_no, begin, whole) in enumerate(rows):
        if whole:
            out[row] = cache.get(file_no)[0][begin : begin + width]
            continue
        filled = 0
        while filled < width:
            piece = cache.get(file_no)[0][begin : begin + width - filled]
            out[row, filled : filled + piece.shape[0]] = piece
            filled += piece.shape[0]
            file_no, begin = file_no + 1, 0
    return out
