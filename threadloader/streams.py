"""Token streams for LLM pretraining: zero-build token windows, block shuffle, live data mixing.

::

    web = TokenWindows("data/web/*.bin", seq_len=1024)          # opens 10,000 shards in ~0.1 s
    code = TokenWindows("data/code/*.npy", seq_len=1024)
    mix = Mixture({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=0)
    sampler = MixtureSampler(mix, num_replicas=world_size, rank=rank)
    loader = ThreadDataLoader(mix, batch_size=16, sampler=sampler, num_workers=2)
    ...
    mix.set_weights({"web": 0.5, "code": 0.5})   # live; recorded in sampler.state_dict()

- ``TokenWindows`` reads only file sizes (``.npy``: headers) when opened, maps each file on its first
  read, and slices whole batches at once (``__getitems__``). Any sampler works: ``ShuffleSampler``
  or ``DistributedShuffleSampler`` for a global shuffle in O(1) memory, ``BlockShuffleSampler`` to
  shuffle blocks of consecutive windows when random reads are costly.
- ``Mixture`` concatenates named map-style datasets; ``MixtureSampler`` decides, for every position
  of one infinite global stream, which source it draws from and which sample, from the seed, the
  position and the weights in force there (``threadloader._mixing`` has the rules). Rank ``r`` of
  ``W`` reads positions ``r, r + W, ...``, so the stream does not depend on the world size and a
  state saved on ``W`` ranks resumes on any ``W'``.
"""

from __future__ import annotations

import bisect
import glob
import operator
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from threadloader import _mixing, _token_files
from threadloader.samplers import DistributedShuffleSampler, ShuffleSampler

__all__ = ["BlockShuffleSampler", "Mixture", "MixtureSampler", "TokenWindows"]

STATE_VERSION: Final = 1
MIXTURE_BLOCK: Final = 4096
"""Positions a ``MixtureSampler`` resolves per numpy block (~0.3 µs a position)."""

_Window = tuple[torch.Tensor, torch.Tensor]
_Ints = npt.NDArray[np.int64]


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


def _as_indices(indices: Any, length: int) -> _Ints:
    array = np.asarray(indices)
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got {array.dtype}")
    array = array.astype(np.int64, copy=False).reshape(-1)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= length):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise IndexError(f"index {bad} is out of range for {length} items")
    return array


class TokenWindows(Dataset[_Window]):
    """Windows of ``seq_len + 1`` consecutive tokens over token files, as ``(input, target)``.

    Window ``i`` is tokens ``i * seq_len ... i * seq_len + seq_len`` (inclusive) of the files'
    concatenation; ``input`` is its first ``seq_len`` tokens and ``target`` its last ``seq_len``,
    both int64 (views of one ``seq_len + 1`` tensor). Consecutive windows share one token, so every
    token but the last is a target exactly once per epoch, as in nanoGPT and Megatron.

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
        max_open_files: int = _token_files.DEFAULT_MAX_OPEN,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.span_files = span_files
        self.files = tuple(_token_files.scan(_token_paths(files), np.dtype(dtype), header_bytes))
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
        self._cache = _token_files.MapCache(self.files, max_open_files)

    def __len__(self) -> int:
        """Number of windows."""
        return self._length

    def token_starts(self, indices: npt.ArrayLike) -> _Ints:
        """Return where each window starts in the files' concatenation (vectorised).

        Raises:
            IndexError: if an index is outside ``[0, len(self))``.
        """
        index = _as_indices(indices, self._length)
        if self._window_starts is None:
            return index * self.seq_len
        file_no = np.searchsorted(self._window_starts, index, side="right") - 1
        return self._file_starts[file_no] + (index - self._window_starts[file_no]) * self.seq_len

    def windows(self, indices: npt.ArrayLike) -> _Ints:
        """Return windows as one ``(len(indices), seq_len + 1)`` int64 array, one gather per file.

        Raises:
            IndexError: if an index is outside ``[0, len(self))``.
        """
        starts = self.token_starts(indices)
        return _token_files.gather(
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

    def __getitems__(self, indices: Sequence[int]) -> list[_Window]:
        """Return a batch of windows: one vectorised gather, then per-window views for collation.

        ``torch.utils.data`` calls this instead of ``__getitem__`` once per batch; the collate
        function then stacks the views.
        """
        rows = torch.from_numpy(self.windows(indices))
        return list(zip(rows[:, :-1].unbind(0), rows[:, 1:].unbind(0), strict=True))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.files)} files, {self.num_tokens} tokens, "
            f"seq_len={self.seq_len}, span_files={self.span_files}, windows={self._length}, "
            f"mapped={len(self._cache)})"
        )


def _default_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """torch.distributed's world when it is initialised, else a world of one."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _block_order(length: int, block: int, seed: int, epoch: int) -> Any:
    """Return the map from positions (uint64) to indices (uint64) of one block-shuffled epoch.

    ``length // block`` full blocks are permuted by a ``ShuffleSampler`` order; the tail block of
    ``length % block`` windows sits at a slot of its own, drawn from ``(seed, epoch)`` among the
    ``full + 1`` slots. Windows inside a block keep their order. O(1) memory, vectorised.
    """
    full, tail = divmod(length, block)
    blocks = ShuffleSampler(full, seed=seed)
    cut = full * block
    if tail and full:
        cut = int(ShuffleSampler(full + 1, seed=seed + 1).index_at([full], epoch=epoch)[0]) * block

    def order(positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        p = positions.astype(np.int64)
        in_tail = (p >= cut) & (p < cut + tail)
        shifted = np.where(p >= cut + tail, p - tail, p)
        out = np.empty_like(p)
        rest = ~in_tail
        if full:
            q = shifted[rest]
            out[rest] = blocks.index_at(q // block, epoch=epoch) * block + q % block
        out[in_tail] = full * block + (p[in_tail] - cut)
        return out.astype(np.uint64)

    return order


class BlockShuffleSampler(DistributedShuffleSampler):
    """A global shuffle of blocks of ``block_size`` consecutive windows: locality for slow storage.

    Epoch ``e`` permutes the blocks (a ``ShuffleSampler`` order keyed by ``(seed, e)``) and reads
    each block's windows in order, so a run of ``block_size`` consecutive samples reads one
    contiguous byte range: one request per block from object storage, readahead that is used on
    disks. The price is randomness: samples of one block land in the same and neighbouring
    batches. Memory stays O(1), every window is read once per epoch, and everything else
    (world-size-independent order, rank striding, padding, ``state_dict`` and rescaling) is
    ``DistributedShuffleSampler``'s. Rank ``r`` of ``W`` reads every ``W``-th window of the stream,
    so each rank still reads within ``W`` neighbouring blocks at a time.

    Args:
        dataset: the dataset (e.g. ``TokenWindows``) or anything with ``len``.
        block_size: windows per block; 1 is a full shuffle.
        num_replicas: world size; torch.distributed's when initialised, else 1.
        rank: this rank; torch.distributed's when initialised, else 0.
        seed: the same on every rank.
        drop_last: as ``DistributedShuffleSampler``.

    Raises:
        ValueError: if ``block_size < 1`` or the rank is out of range.
    """

    def __init__(
        self,
        dataset: Sized,
        block_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        num_replicas, rank = _default_world(num_replicas, rank)
        self.block_size = block_size
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last)

    def _stream(self, epoch: int) -> Any:
        length = self._length
        order = _block_order(length, self.block_size, self.seed, epoch)

        def stream(positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
            if positions.size and int(positions.max()) >= length:
                positions = positions % np.uint64(length)  # padding wraps, as the parent's does
            return order(positions)

        return stream

    def state_dict(self) -> dict[str, int | bool]:
        """``DistributedShuffleSampler``'s state plus ``block_size``."""
        return {**super().state_dict(), "block_size": self.block_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume as ``DistributedShuffleSampler`` does, after checking the block size.

        Raises:
            ValueError: if the state has another ``block_size``, or the parent rejects it.
        """
        saved = state.get("block_size") if isinstance(state, Mapping) else None
        if saved != self.block_size:
            raise ValueError(
                f"{type(self).__name__} state was saved with block_size={saved}, this sampler "
                f"has block_size={self.block_size}"
            )
        super().load_state_dict(state)


class Mixture(Dataset[Any]):
    """Named map-style datasets mixed in given proportions, with weights that change live.

    As a dataset, a ``Mixture`` is the concatenation of its sources in sorted name order
    (``__getitem__``/``__getitems__``; a batch is fetched with one ``__getitems__`` per source
    when the source has it). The order comes from a ``MixtureSampler``: each global stream
    position draws from the source the low-discrepancy schedule gives it (any 10,000 consecutive
    positions match the weights within 0.05%), and that source's next sample in its own shuffled
    epoch; a source that runs out starts its own next epoch.

    ``set_weights`` changes the weights from a given global position on. Like every loader call
    it belongs to the training thread (the thread that iterates the loader).

    Args:
        sources: source name -> map-style dataset with ``len`` (e.g. ``TokenWindows``).
        weights: source name -> weight >= 0 (normalised; names left out get 0).
        seed: keys every source's shuffle and the interleaving.

    Raises:
        ValueError: naming the source, for an empty source, an unknown name in ``weights``, a
            negative or non-finite weight; or if all weights are zero or no source is given.
        TypeError: naming the source, for a source without ``len`` (an iterable dataset).
    """

    def __init__(
        self, sources: Mapping[str, Any], weights: Mapping[str, float], seed: int = 0
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty dict of name -> dataset")
        names = tuple(sorted(sources))
        if not all(isinstance(n, str) for n in names) or len(names) > _mixing.PERIOD:
            raise ValueError(f"source names must be strings, at most {_mixing.PERIOD}")
        lengths = []
        for name in names:
            source = sources[name]
            if not isinstance(source, Sized):
                raise TypeError(f"source {name!r} has no len(): a Mixture mixes map-style datasets")
            if len(source) == 0:
                raise ValueError(f"source {name!r} is empty")
            lengths.append(len(source))
        self.names = names
        self.sources = {name: sources[name] for name in names}
        self.seed = seed
        self._lengths = tuple(lengths)
        self._orders = _mixing.SourceOrders(lengths, [_mixing.source_seed(seed, n) for n in names])
        self._offsets = self._orders.offsets.tolist()
        self._schedule = _mixing.Schedule.initial(
            names, seed, _mixing.check_weights(weights, names)
        )
        self._lock = threading.Lock()  # serialises writers of _schedule; readers take a reference
        self._sampler: weakref.ref[MixtureSampler] | None = None

    def __len__(self) -> int:
        """Total samples over all sources (the concatenated index space)."""
        return self._offsets[-1]

    def __getitem__(self, index: int) -> Any:
        """Return sample ``index`` of the concatenation (``source_of`` tells which it is)."""
        name, local = self.source_of(index)
        return self.sources[name][local]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Return a batch: one ``__getitems__`` (or item loop) per source, in the asked order."""
        index = _as_indices(indices, len(self))
        source = np.searchsorted(self._orders.offsets, index, side="right") - 1
        out: list[Any] = [None] * index.size
        for s, rows in _mixing.groups(source):
            local = (index[rows] - self._offsets[s]).tolist()
            dataset = self.sources[self.names[s]]
            getitems = getattr(dataset, "__getitems__", None)
            items = getitems(local) if getitems is not None else [dataset[i] for i in local]
            for row, item in zip(rows.tolist(), items, strict=True):
                out[row] = item
        return out

    def source_of(self, index: int) -> tuple[str, int]:
        """Return ``(source name, index in that source)`` of a concatenated index.

        Raises:
            IndexError: if ``index`` is outside ``[0, len(self))``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} samples")
        s = bisect.bisect_right(self._offsets, index) - 1
        return self.names[s], index - self._offsets[s]

    @property
    def weights(self) -> dict[str, float]:
        """The normalised weights of the latest change (or the initial ones)."""
        return dict(zip(self.names, self._schedule.regimes[-1].weights, strict=True))

    @property
    def schedule(self) -> list[tuple[int, dict[str, float]]]:
        """``(position, weights)`` of each change still recorded, oldest first."""
        return [
            (r.position, dict(zip(self.names, r.weights, strict=True)))
            for r in self._schedule.regimes
        ]

    def set_weights(self, weights: Mapping[str, float], at_position: int | None = None) -> int:
        """Use ``weights`` from global stream position ``at_position`` on; return that position.

        The change is part of the stream's definition: it is recorded in the sampler's state with
        its position, so a resume reproduces it, and every rank must make the same call with the
        same position. Positions before it keep their samples; each source continues its epoch
        where it was. A later call whose position is at or before a change already scheduled
        replaces that change.

        Args:
            weights: source name -> weight >= 0 (normalised; names left out get 0).
            at_position: first global position to use the new weights. Default: the bound
                sampler's ``next_position``, the first position it has not handed out yet (the
                batches already prefetched keep the old weights; with no sampler, the schedule's
                start). A position before ``next_position`` but within the sampler's current pass
                rewinds the sampler's iterator to it: its next index is the first of this rank
                at or after ``at_position``, and the caller must discard the indices it got from
                there on (a loader drops the batches in flight, see ``MixtureSampler``).

        Returns:
            the position the new weights take effect from.

        Raises:
            ValueError: naming the source, for an unknown name, a negative or non-finite weight;
                if all weights are zero; if ``at_position`` comes before the current pass of the
                sampler or before the recorded schedule.
        """
        values = _mixing.check_weights(weights, self.names)
        with self._lock:
            sampler = self._sampler() if self._sampler is not None else None
            if at_position is None:
                at_position = sampler.next_position if sampler is not None else self._schedule.start
            schedule = self._schedule.changed(values, at_position)
            if sampler is not None:
                sampler._prepare_change(at_position)
            self._schedule = schedule
        return at_position

    def counts_at(self, position: int) -> dict[str, int]:
        """Samples each source gives before global position ``position`` under the current schedule.

        ``counts_at(b) - counts_at(a)`` are the realised counts of positions ``a ... b - 1``.
        """
        counts = self._schedule.counts_at(position)
        return dict(zip(self.names, counts, strict=True))

    def indices_at(self, positions: npt.ArrayLike) -> _Ints:
        """Return the concatenated index each global stream position reads (vectorised).

        Raises:
            ValueError: if a position precedes the recorded schedule.
        """
        positions = np.asarray(positions, dtype=np.int64)
        return self._indices(self._schedule, positions.reshape(-1)).reshape(positions.shape)

    def _indices(self, schedule: _mixing.Schedule, positions: _Ints) -> _Ints:
        return self._orders.indices(*schedule.locate(positions))

    def _load(self, seed: int, schedule_state: Any, start: int, owner: str) -> None:
        schedule = _mixing.Schedule.from_state(schedule_state, self.names, seed, owner)
        if start < schedule.start:
            raise ValueError(
                f"{owner} state starts its epoch at {start}, before its schedule's start "
                f"{schedule.start}"
            )
        with self._lock:
            if seed != self.seed:  # the saved seed wins, as for the samplers
                self.seed = seed
                seeds = [_mixing.source_seed(seed, n) for n in self.names]
                self._orders = _mixing.SourceOrders(self._lengths, seeds)
            self._schedule = schedule

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={len(self.sources[n])}:{w:.3f}" for n, w in self.weights.items())
        return f"{type(self).__name__}({parts}, seed={self.seed})"


class _StreamPass:
    """One ``iter()`` of a ``MixtureSampler``: ``count`` local indices from global ``start``.

    As in ``threadloader.samplers._Pass``, ``progress`` is (end of the current block, the block's
    iterator), replaced by one assignment, and the consumer's position is read from the iterator's
    length hint: nothing is counted per index.
    """

    __slots__ = ("count", "done", "progress", "start")

    def __init__(self, start: int, count: int) -> None:
        self.start = start
        self.count = count
        self.done = False
        self.progress: tuple[int, Iterator[int]] = (0, iter(()))

    def next_local(self) -> int:
        end, block = self.progress
        return end - operator.length_hint(block)


class MixtureSampler(Sampler[int]):
    """The global stream of a ``Mixture``, strided over ranks, resumable on any world size.

    The stream is infinite: positions ``0, 1, 2, ...``, each resolved by the mixture's schedule to
    a source and a sample of that source's current epoch (sources roll over their own epochs).
    The sampler's epochs are consecutive stretches of it: epoch ``e`` covers global positions
    ``[start, end)``, ``samples_per_epoch // num_replicas`` per rank, and ``set_epoch(e + 1)``
    moves on to the stretch that begins at ``end``. Rank ``r`` reads ``start + r + j * W``.
    As with torch's ``DistributedSampler``, ``iter()`` without ``set_epoch`` reads the same epoch
    again.

    How state works; where the code disagrees with this, the code is wrong.

    1. ``state_dict()`` is a plain dict: ``version``, ``seed``, ``epoch``, ``start``, ``cursor``,
       ``end``, ``num_replicas``, ``sources`` (name -> length) and ``schedule``. ``cursor`` counts
       the epoch's positions handed out by all ranks together (ranks advance in lockstep, so every
       rank saves the same state, without communication); ``state_dict_at(consumed)`` counts only
       the first ``consumed`` indices of this rank's latest ``iter()``, for a loader that saves
       what its training loop received rather than what it prefetched.
    2. ``schedule`` lists the weight regimes ``{position, weights, quotas, counts}`` from the
       epoch's ``start`` on: O(#sources), plus one entry per change made during the epoch.
    3. ``load_state_dict`` makes the next ``iter()`` resume at ``start + cursor`` on this sampler's
       world size ``W'``: each rank takes ``(end - start - cursor) // W'`` positions, and the
       epoch's ``end`` becomes the position after them, so the next epoch starts right there:
       across any number of resumes, each position of the stream is read exactly once, so each
       sample of every source's epoch is. ``set_epoch`` with the saved epoch keeps the resume.
    4. A state for another format version, or naming a source this mixture lacks or with another
       length, raises ``ValueError`` naming it. Sources the state lacks join with weight 0.

    Args:
        mixture: the ``Mixture``; the sampler binds itself to it (``set_weights``' default).
        num_replicas: world size; torch.distributed's when initialised, else 1.
        rank: this rank; torch.distributed's when initialised, else 0.
        samples_per_epoch: global positions per epoch; ``len(mixture)`` by default.

    Raises:
        ValueError: if the rank is out of range or ``samples_per_epoch < num_replicas``.
    """

    def __init__(
        self,
        mixture: Mixture,
        num_replicas: int | None = None,
        rank: int | None = None,
        samples_per_epoch: int | None = None,
    ) -> None:
        self.num_replicas, self.rank = _default_world(num_replicas, rank)
        self.samples_per_epoch = len(mixture) if samples_per_epoch is None else samples_per_epoch
        if self.samples_per_epoch < self.num_replicas:
            raise ValueError(
                f"samples_per_epoch must be >= num_replicas ({self.num_replicas}), got "
                f"{self.samples_per_epoch}"
            )
        self.mixture = mixture
        self.epoch = 0
        self._start, self._end = 0, self._epoch_span()  # the epoch's global [start, end)
        self._pending: int | None = None  # global position to resume at, from load_state_dict
        self._pass: _StreamPass | None = None
        mixture._sampler = weakref.ref(self)

    def _epoch_span(self) -> int:
        return self.samples_per_epoch // self.num_replicas * self.num_replicas

    def __len__(self) -> int:
        """Indices the next (or current) pass of this epoch yields on this rank."""
        current = self._pass
        if self._pending is None and current is not None and not current.done:
            return current.count
        first = self._start if self._pending is None else self._pending
        return max(self._end - first, 0) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        """Read the epoch from its start, or once from the loaded position (point 3)."""
        first = self._start if self._pending is None else self._pending
        self._pending = None
        count = max(self._end - first, 0) // self.num_replicas
        self._end = first + count * self.num_replicas  # the next epoch starts right after
        mixture = self.mixture
        with mixture._lock:
            mixture._schedule = mixture._schedule.compacted(self._start)
        pass_ = _StreamPass(first, count)
        self._pass = pass_
        return self._generate(pass_)

    def _generate(self, pass_: _StreamPass) -> Iterator[int]:
        mixture, stride, offset = self.mixture, self.num_replicas, pass_.start + self.rank
        while (first := pass_.next_local()) < pass_.count:
            schedule = mixture._schedule
            end = min(first + MIXTURE_BLOCK, pass_.count)
            positions = np.arange(first, end, dtype=np.int64) * stride + offset
            block = iter(mixture._indices(schedule, positions).tolist())
            pass_.progress = (end, block)
            for index in block:
                yield index
                if mixture._schedule is not schedule:
                    break  # weights changed: resolve the rest again (and maybe rewind)
        pass_.done = True

    def set_epoch(self, epoch: int) -> None:
        """Move to epoch ``epoch``: the stretch of the stream after the current epoch's end.

        Skipped epochs are skipped stretches of the stream. Setting the current epoch keeps a
        loaded resume.

        Raises:
            ValueError: if ``epoch`` is before the current one: the stream only moves forward.
        """
        if epoch == self.epoch:
            return
        if epoch < self.epoch:
            raise ValueError(
                f"{type(self).__name__} is at epoch {self.epoch}: a stream cannot go back to "
                f"epoch {epoch}"
            )
        self._start = self._end + (epoch - self.epoch - 1) * self._epoch_span()
        self._end = self._start + self._epoch_span()
        self.epoch = epoch
        self._pending = None
        self._pass = None

    @property
    def next_position(self) -> int:
        """The global position of this sampler's next not-yet-handed-out index (its row's start).

        The loaded position before a resumed pass, the epoch's start before its first pass, the
        epoch's end once its pass has handed everything out.
        """
        if self._pending is not None:
            return self._pending
        current = self._pass
        if current is None:
            return self._start
        if current.done:
            return self._end
        return current.start + current.next_local() * self.num_replicas

    def position_after(self, consumed: int) -> int:
        """The global position after the first ``consumed`` indices of this rank's latest ``iter()``.

        With ``consumed`` = the indices in the batches the training loop received, this is where
        the loop stands: the position a loader passes to ``Mixture.set_weights`` so that a change
        takes effect from the next batch the loop requests.
        """
        if self._pending is not None or self._pass is None:
            return self.next_position + consumed * self.num_replicas
        return self._pass.start + min(consumed, self._pass.count) * self.num_replicas

    def _prepare_change(self, position: int) -> None:
        """Check a weight change at ``position``; rewind the current pass if it handed that out."""
        if position >= self.next_position:
            return
        current = self._pass
        if self._pending is not None or current is None or current.done or position < current.start:
            raise ValueError(
                f"cannot change the weights at position {position}: this sampler has already "
                f"handed out positions up to {self.next_position} outside a pass it can rewind"
            )
        local = max(0, -(-(position - current.start - self.rank) // self.num_replicas))
        current.progress = (local, iter(()))

    def state_dict(self) -> dict[str, Any]:
        """Return this rank's state (point 1); the same on every rank in lockstep training."""
        return self._state(self.next_position)

    def state_dict_at(self, consumed: int) -> dict[str, Any]:
        """The state once ``consumed`` indices of this rank's latest ``iter()`` have been used.

        A loader hands indices to workers ahead of the training loop; this counts only those the
        loop received. Before any pass of the epoch, or with a resume pending, it is
        ``state_dict()``.
        """
        if self._pending is not None or self._pass is None:
            return self.state_dict()
        return self._state(self.position_after(consumed))

    def _state(self, position: int) -> dict[str, Any]:
        mixture = self.mixture
        return {
            "version": STATE_VERSION,
            "seed": mixture.seed,
            "epoch": self.epoch,
            "start": self._start,
            "cursor": position - self._start,
            "end": self._end,
            "num_replicas": self.num_replicas,
            "sources": dict(zip(mixture.names, mixture._lengths, strict=True)),
            "schedule": mixture._schedule.compacted(self._start).to_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` resume at the saved position, with the saved schedule and seed.

        The state may come from any rank and any world size (point 3).

        Args:
            state: a dict from ``state_dict()`` or ``state_dict_at()``.

        Raises:
            ValueError: naming the mismatch, for another format version, a source the mixture
                lacks or whose length differs, or a missing, mistyped or out-of-range entry.
        """
        owner = type(self).__name__
        if not isinstance(state, Mapping):
            raise ValueError(f"{owner} state must be a dict, got {type(state).__name__}")  # noqa: TRY004
        keys = ("version", "seed", "epoch", "start", "cursor", "end")
        missing = sorted({*keys, "sources", "schedule"} - set(state))
        if missing:
            raise ValueError(f"{owner} state lacks {missing}: got keys {sorted(state)}")
        values = {}
        for key in keys:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(  # noqa: TRY004  # a corrupted state, as in threadloader.samplers
                    f"{owner} state[{key!r}] must be an int, got {type(value).__name__}"
                )
            values[key] = int(value)
        if values["version"] != STATE_VERSION:
            raise ValueError(
                f"{owner} state has format version {values['version']}, this threadloader reads "
                f"version {STATE_VERSION}"
            )
        start, cursor, end = values["start"], values["cursor"], values["end"]
        if not 0 <= start <= end or cursor < 0:
            raise ValueError(
                f"{owner} state has start {start}, cursor {cursor}, end {end}: expected "
                "0 <= start <= end and cursor >= 0"
            )
        self._check_sources(state["sources"], owner)
        self.mixture._load(values["seed"], state["schedule"], start, owner)
        self.epoch = values["epoch"]
        self._start, self._end = start, end
        self._pending = start + cursor
        self._pass = None

    def _check_sources(self, sources: Any, owner: str) -> None:
        if not isinstance(sources, Mapping):
            raise ValueError(f"{owner} state['sources'] must be a dict of name -> length")  # noqa: TRY004
        mine = dict(zip(self.mixture.names, self.mixture._lengths, strict=True))
        for name, length in sources.items():
            if name not in mine:
                raise ValueError(
                    f"{owner} state has source {name!r}, which this mixture lacks "
                    f"(its sources are {list(mine)})"
                )
            if length != mine[name]:
                raise ValueError(
                    f"{owner} state has source {name!r} of length {length}, this mixture's has "
                    f"length {mine[name]}"
                )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_replicas={self.num_replicas}, rank={self.rank}, "
            f"samples_per_epoch={self.samples_per_epoch}, epoch={self.epoch}, "
            f"next_position={self.next_position})"
        )
