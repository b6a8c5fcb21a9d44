"""TokenWindows: fixed-length ``(input, target)`` windows over memory-mapped token files.

Window ``i`` starts at token ``i * seq_len`` of the files' concatenation (with
``span_files=False``: of its own file, from the per-file window counts), so finding a window is
arithmetic, with no index to build. Opening resolves the paths (a list, a glob, a directory) and
reads only file sizes (``.npy``: headers); ``token_files`` maps each file on its first read and
gathers a whole batch in one go (``__getitems__``). Any sampler works: ``ShuffleSampler`` or
``DistributedShuffleSampler`` for a global shuffle in O(1) memory, ``BlockShuffleSampler``
(``block_shuffle``) to shuffle blocks of consecutive windows when random reads are costly.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from threadloader.device import gathered as _gathered
from threadloader.streams import token_files
from threadloader.streams.args import Ints, as_indices

_Window = tuple[torch.Tensor, torch.Tensor]


def _token_paths(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        path = os.fspath(files)
        if glob.has_magic(path):
            paths = sorted(glob.glob(path))
            if not paths:
                raise ValueError(f"no token file matches {path!r}")
            return paths
        if os.path.isdir(path):
            paths = sorted(e.path for e in os.scandir(path) if e.name.endswith((".bin", ".npy")))
            if not paths:
                raise ValueError(f"directory {path!r} holds no .bin or .npy token file")
            return paths
        return [path]
    paths = [os.fspath(p) for p in files]
    if not paths:
        raise ValueError("no token files given")
    return paths


class TokenWindows(Dataset[_Window]):
    """Windows of ``seq_len + 1`` consecutive tokens over token files, as ``(input, target)``.

    Window ``i`` is tokens ``i * seq_len ... i * seq_len + seq_len`` (inclusive) of the files'
    concatenation; ``input`` is its first ``seq_len`` tokens and ``target`` its last ``seq_len``,
    both int64 (views of one ``seq_len + 1`` tensor). Consecutive windows share one token, so every
    token but the first is a target (every token but the last an input) exactly once per epoch,
    as in nanoGPT and Megatron; tokens after the last whole window are not read.

    Zero build: opening reads each file's size (``.npy``: its header), nothing else; each file is
    memory-mapped on its first read, by whichever thread needs it, and kept open (at most
    ``max_open_files`` at once, oldest dropped first). The dataset is safe to share by worker
    threads without the GIL: after ``__init__`` only the mapping cache changes, under its lock.

    Args:
        files: token files, in order: a sequence of paths, a glob pattern (sorted), a directory
            (its ``.bin`` and ``.npy`` files, sorted) or one path. ``.npy`` files carry their own
            integer dtype; other files are raw token ids (nanoGPT's ``.bin``).
        seq_len: tokens per input (and per target).
        dtype: dtype of raw files, e.g. ``np.uint16`` (GPT-2 ids) or ``np.uint32``.
        span_files: ``True``: windows run over the concatenation, and may start in one file and
            end in the next (no token wasted; right when files are shards of one document stream).
            ``False``: every window lies in one file; each file's last ``< seq_len`` tokens are
            not used (right when a file boundary is a document boundary that must not be crossed).
        header_bytes: bytes to skip at the start of every raw file (llm.c's shards: 1024).
        max_open_files: most files mapped at once (each mapping holds a file descriptor).

    Raises:
        ValueError: naming the file, if a file is empty, its size is not a multiple of the
            dtype's size, or a ``.npy`` file does not hold integers; if no file is given; if no
            window fits.
        OSError: if a file cannot be read.
    """

    def __init__(
        self,
        files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        seq_len: int,
        dtype: npt.DTypeLike = np.uint16,
        *,
        span_files: bool = True,
        header_bytes: int = 0,
        max_open_files: int = token_files.DEFAULT_MAX_OPEN,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.span_files = span_files
        self.files = tuple(token_files.scan(_token_paths(files), np.dtype(dtype), header_bytes))
        tokens = np.fromiter((f.tokens for f in self.files), np.int64, len(self.files))
        self._file_starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self.num_tokens = int(self._file_starts[-1])
        if span_files:
            self._window_starts = None
            self._length = max(self.num_tokens - 1, 0) // seq_len
        else:
            per_file = np.maximum(tokens - 1, 0) // seq_len
            self._window_starts = np.concatenate([[0], np.cumsum(per_file)]).astype(np.int64)
            self._length = int(self._window_starts[-1])
        if self._length == 0:
            raise ValueError(
                f"no window of seq_len + 1 = {seq_len + 1} tokens fits in {len(self.files)} "
                f"file(s) holding {self.num_tokens} tokens (first: {self.files[0].path})"
            )
        self._file_starts_list = self._file_starts.tolist()  # bisect for the one-item path
        dtypes = {f.dtype for f in self.files}
        self._dtype = dtypes.pop() if len(dtypes) == 1 else None
        self._cache = token_files.MapCache(self.files, max_open_files)

    def __len__(self) -> int:
        """Number of windows."""
        return self._length

    def token_starts(self, indices: npt.ArrayLike) -> Ints:
        """Return where each window starts in the files' concatenation (vectorised).

        Raises:
            IndexError: if an index is outside ``[0, len(self))``.
        """
        index = as_indices(indices, self._length)
        if self._window_starts is None:
            return index * self.seq_len
        file_no = np.searchsorted(self._window_starts, index, side="right") - 1
        return self._file_starts[file_no] + (index - self._window_starts[file_no]) * self.seq_len

    def windows(self, indices: npt.ArrayLike) -> Ints:
        """Return windows as one ``(len(indices), seq_len + 1)`` int64 array, one gather per file.

        Raises:
            IndexError: if an index is outside ``[0, len(self))``.
        """
        starts = self.token_starts(indices)
        return token_files.gather(
            self._cache, self._file_starts, starts, self.seq_len + 1, self._dtype
        )

    def __getitem__(self, index: int) -> _Window:
        """Return window ``index`` as ``(input, target)``, each int64 of shape ``(seq_len,)``.

        Raises:
            IndexError: if ``index`` is outside ``[0, len(self))``.
        """
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} is out of range for {self._length} windows")
        width = self.seq_len + 1
        if self._window_starts is None:
            start = index * self.seq_len
            file_no = bisect.bisect_right(self._file_starts_list, start) - 1
            begin = start - self._file_starts_list[file_no]
            if start + width <= self._file_starts_list[file_no + 1]:  # one file: plain slice
                row = torch.from_numpy(
                    self._cache.get(file_no)[0][begin : begin + width].astype(np.int64)
                )
                return row[:-1], row[1:]
        row = torch.from_numpy(self.windows([index])[0])
        return row[:-1], row[1:]

    @_gathered.gathered_by("_inputs_targets")
    def __getitems__(self, indices: Sequence[int]) -> list[_Window]:
        """Return a batch of windows: one vectorised gather, then per-window views for collation.

        ``torch.utils.data`` calls this instead of ``__getitem__`` once per batch; the collate
        function then stacks the views. ThreadDataLoader, when it collates with torch's
        ``default_collate``, takes the gathered inputs and targets instead and copies each once
        (``device.gathered``: the same batch, at half the cost).
        """
        inputs, targets = self._inputs_targets(indices)
        return list(zip(inputs.unbind(0), targets.unbind(0), strict=True))

    def _inputs_targets(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's inputs and targets: two ``(len(indices), seq_len)`` views of one gather."""
        rows = torch.from_numpy(self.windows(indices))
        return rows[:, :-1], rows[:, 1:]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.files)} files, {self.num_tokens} tokens, "
            f"seq_len={self.seq_len}, span_files={self.span_files}, windows={self._length}, "
            f"mapped={len(self._cache)})"
        )
