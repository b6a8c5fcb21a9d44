"""Built-in synthetic map-style datasets: the demo, ``python -m threadloader compare`` and bench/.

Each workload models one kind of data-loading cost that decides which loader wins:

========  ==========================================================  =====  ===============
name      item                                                         batch  cost
========  ==========================================================  =====  ===============
tokens    2049-token window at a per-index random offset in a memmap   16     ~15 µs, GIL held
images    JPEG (~500x375) decoded, resized to 224x224, float CHW       32     ms, GIL released
tensors   3xSxS float32 from numpy's RNG and a multiply-add (S below)  16     ms, GIL released
python    a loop building ~200 floats, then ``torch.tensor``           32     ~40 µs, GIL held
objects   ``len`` of one of millions of small ``str``, as a tensor     256    µs; memory case
========  ==========================================================  =====  ===============

Each comes in two sizes (:data:`SIZES`): ``small``, which builds in a second and is what
``python -m threadloader compare`` runs by default, and ``bench``, what bench/ measures. They
differ in the number of items (and the token file's length), and for ``tensors`` in the item:
S = 256 (0.75 MiB, ~5 ms) in ``small``, so that a one-second timed run holds dozens of batches
even without workers, and S = 512 (3 MiB) in ``bench``.

Every dataset is a picklable top-level class, so torch's worker processes can receive it, and is
deterministic: the same index gives the same item, in any process, in any order. Files (the token
file, the JPEGs) are generated once into ``root`` under a name that encodes every parameter, and
are written atomically so concurrent first calls never see a half-written file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "SIZES",
    "WORKLOAD_NAMES",
    "ImageFiles",
    "ManySmallObjects",
    "NumpyTensors",
    "PythonFloats",
    "TokenWindows",
    "WorkloadSpec",
    "default_root",
    "make_workload",
]

WORKLOAD_NAMES: tuple[str, ...] = ("tokens", "images", "tensors", "python", "objects")
"""Names accepted by :func:`make_workload`, in the order reports list them."""

SIZES: tuple[str, ...] = ("small", "bench")
"""``small``: builds in under a second (tests, quick demos). ``bench``: what bench/ measures."""

_VOCAB_SIZE = 50_257  # GPT-2's vocabulary: token ids fit in uint16, as in real pretraining shards


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A built workload: the dataset and how to batch it.

    Attributes:
        name: One of :data:`WORKLOAD_NAMES`.
        dataset: The map-style dataset (``len()`` and ``[i]``).
        batch_size: The batch size the workload is measured with.
        description: One line saying what an item is and what it costs.
        samples_per_item: Samples one item counts for in a samples/s figure.
    """

    name: str
    dataset: Dataset[Any]
    batch_size: int
    description: str
    samples_per_item: int = 1


def default_root() -> str:
    """Return the directory generated workload files are cached in.

    Returns:
        ``<tempdir>/threadloader-workloads-<uid>``; per user, so two users never share files.
    """
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"threadloader-workloads-{uid}")


def _check_index(index: int, length: int, what: str) -> None:
    """Raise the IndexError every workload raises for an index outside ``[0, length)``."""
    if not 0 <= index < length:
        raise IndexError(f"index {index} out of range for {length} {what}")


# --------------------------------------------------------------------------------------------
# tokens


class _SharedMap:
    """A file's read-only memmap, opened on first use in each process and never pickled.

    Held by a dataset, it is shared by the dataset's shallow copies (each worker thread's), so
    the file is mapped once per process, not once per worker: every extra mapping of the same
    file would fault its pages in again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokens: np.memmap[Any, np.dtype[np.uint16]] | None = None
        self._pid = -1

    def get(self) -> np.memmap[Any, np.dtype[np.uint16]]:
        tokens, pid = self._tokens, os.getpid()
        if tokens is None or self._pid != pid:
            # Two threads may both get here; each maps the same read-only file, either is fine.
            tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
            self._tokens, self._pid = tokens, pid
        return tokens

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]


class TokenWindows(Dataset[torch.Tensor]):
    """Windows of ``seq_len`` tokens sliced from a memory-mapped uint16 token file.

    Item ``i`` starts at an offset drawn from ``numpy.random.default_rng((seed, i))``: the
    per-index generator costs ~10 µs with the GIL held, which puts the item at ~15 µs, the
    cost of a real pretraining sampler (offset lookup, slice, widen to int64).

    The memmap is opened lazily, once per process (``_SharedMap``): worker threads' copies of
    the dataset share it, and a forked or spawned worker process opens its own.

    Args:
        path: A file of native-endian uint16 token ids.
        seq_len: Tokens per window.
        length: Number of items; defaults to ``num_tokens // seq_len``.
        seed: Seed mixed into every item's offset.

    Raises:
        ValueError: If the file holds fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, path: str, seq_len: int = 2049, length: int | None = None, seed: int = 0):
        self.path = path
        self.seq_len = seq_len
        self.seed = seed
        self.num_tokens = os.path.getsize(path) // np.dtype(np.uint16).itemsize
        if self.num_tokens <= seq_len:
            raise ValueError(f"{path} holds {self.num_tokens} tokens, need more than {seq_len}")
        self.length = self.num_tokens // seq_len if length is None else length
        self._map = _SharedMap(path)  # one mapping for every worker thread's copy

    def _open(self) -> np.memmap[Any, np.dtype[np.uint16]]:
        return self._map.get()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return window ``index`` as an int64 tensor of shape ``(seq_len,)``.

        Raises:
            IndexError: If ``index`` is outside ``[0, len(self))``.
        """
        _check_index(index, self.length, "windows")
        offset = int(
            np.random.default_rng((self.seed, index)).integers(self.num_tokens - self.seq_len)
        )
        window = self._open()[offset : offset + self.seq_len]
        return torch.from_numpy(window.astype(np.int64))


def _write_token_file(root: str, num_tokens: int, seed: int) -> str:
    path = os.path.join(root, f"tokens-n{num_tokens}-v{_VOCAB_SIZE}-s{seed}.u16")
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tokens-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            chunk = 1 << 22  # 8 MB at a time: bench's 50M tokens never sit in memory at once
            for start in range(0, num_tokens, chunk):
                count = min(chunk, num_tokens - start)
                f.write(rng.integers(0, _VOCAB_SIZE, size=count, dtype=np.uint16).tobytes())
        os.replace(tmp, path)  # atomic: a concurrent reader sees no file or the whole file
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# --------------------------------------------------------------------------------------------
# images


class ImageFiles(Dataset[torch.Tensor]):
    """JPEG files decoded with PIL, resized to ``out_size`` and returned as float CHW in [0, 1].

    Decode and resize run in Pillow's C code with the GIL released, so threads scale.
    Item ``i`` reads ``paths[i % len(paths)]``: a long epoch needs only a few hundred files.

    Args:
        paths: JPEG files to read.
        length: Number of items; defaults to ``len(paths)``.
        out_size: Output height and width.

    Raises:
        ValueError: If ``paths`` is empty.
    """

    def __init__(self, paths: list[str], length: int | None = None, out_size: int = 224):
        if not paths:
            raise ValueError("ImageFiles needs at least one path")
        self.paths = list(paths)
        self.length = len(self.paths) if length is None else length
        self.out_size = out_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return image ``index`` as a float32 tensor of shape ``(3, out_size, out_size)``.

        Raises:
            IndexError: If ``index`` is outside ``[0, len(self))``.
        """
        from PIL import Image

        _check_index(index, self.length, "images")
        with Image.open(self.paths[index % len(self.paths)]) as img:
            rgb = img.convert("RGB").resize(
                (self.out_size, self.out_size), Image.Resampling.BILINEAR
            )
        hwc = torch.from_numpy(np.array(rgb))  # a writable copy; asarray's view is read-only
        return hwc.permute(2, 0, 1).contiguous().to(torch.float32).div_(255.0)


def _write_jpegs(root: str, count: int, width: int, height: int, seed: int) -> list[str]:
    from PIL import Image

    folder = os.path.join(root, f"images-n{count}-{width}x{height}-s{seed}")
    names = [f"{i:05d}.jpg" for i in range(count)]
    if os.path.exists(os.path.join(folder, ".complete")):
        return [os.path.join(folder, n) for n in names]
    tmp = tempfile.mkdtemp(dir=root, prefix=".images-")
    try:
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        for i, name in enumerate(names):
            rng = np.random.default_rng((seed, i))
            # Photo-like content (smooth gradients, blurred blobs, light grain) so the file
            # size and decode cost resemble a real photo; pure noise would decode slower.
            coarse = rng.uniform(0, 255, size=(height // 25 + 1, width // 25 + 1, 3))
            blobs = np.asarray(
                Image.fromarray(coarse.astype(np.uint8)).resize(
                    (width, height), Image.Resampling.BICUBIC
                ),
                dtype=np.float32,
            )
            angle = rng.uniform(0, 2 * math.pi)
            ramp = (np.cos(angle) * xx + np.sin(angle) * yy) / max(width, height) * 80.0
            grain = rng.normal(0, 6, size=(height, width, 3))
            pixels = np.clip(blobs * 0.8 + ramp[..., None] + grain, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(tmp, name), quality=90)
        with open(os.path.join(tmp, ".complete"), "w") as f:
            f.write("ok\n")
        try:
            os.rename(tmp, folder)  # atomic; fails if another process finished first
        except OSError:
            if not os.path.exists(os.path.join(folder, ".complete")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [os.path.join(folder, n) for n in names]


# --------------------------------------------------------------------------------------------
# tensors, python, objects: no files


class NumpyTensors(Dataset[torch.Tensor]):
    """Large float32 tensors made with numpy: a per-index RNG fill, then a multiply-add.

    numpy releases the GIL inside both, so the work scales with threads; the result is
    wrapped with ``torch.from_numpy`` (no copy).

    Args:
        length: Number of items.
        shape: Shape of every item.
        seed: Seed mixed into every item's generator.
    """

    def __init__(self, length: int, shape: tuple[int, ...] = (3, 512, 512), seed: int = 0):
        self.length = length
        self.shape = tuple(shape)
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return item ``index``: a float32 tensor of shape ``shape``.

        Raises:
            IndexError: If ``index`` is outside ``[0, len(self))``.
        """
        _check_index(index, self.length, "tensors")
        x = np.random.default_rng((self.seed, index)).standard_normal(self.shape, dtype=np.float32)
        np.multiply(x, np.float32(0.5), out=x)
        np.add(x, np.float32(0.25), out=x)
        return torch.from_numpy(x)


class PythonFloats(Dataset[torch.Tensor]):
    """A pure-Python item: a loop that builds ``width`` floats, then ``torch.tensor``.

    Every step holds the GIL, so no number of threads makes it faster than one thread; this
    workload shows what a loader costs when the dataset itself cannot run in parallel.

    Args:
        length: Number of items.
        width: Floats per item.
    """

    def __init__(self, length: int, width: int = 200):
        self.length = length
        self.width = width

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return item ``index``: a float32 tensor of shape ``(width,)``.

        Raises:
            IndexError: If ``index`` is outside ``[0, len(self))``.
        """
        _check_index(index, self.length, "items")
        values = []
        x = (index * 0.6180339887) % 1.0
        for k in range(self.width):
            x = 3.9 * x * (1.0 - x)  # logistic map: cheap, deterministic, not constant-folded
            values.append(x * 2.0 - 1.0 + k * 1e-3)
        return torch.tensor(values, dtype=torch.float32)


class ManySmallObjects(Dataset[torch.Tensor]):
    """A dataset that holds ``count`` small ``str`` objects in one list; item = ``len`` of one.

    Models metadata-heavy datasets (file lists, captions, JSON records). A forked worker
    process that reads an object writes its reference count, which copies the page it lives
    on; a shuffled epoch touches nearly every page, so each worker process ends up with its
    own copy of the dataset. Worker threads share the one copy.

    Args:
        count: Number of strings.
    """

    def __init__(self, count: int):
        self.items = [f"sample-{i:x}/{i * 7919 % 100_003}" for i in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return ``len(items[index])`` as a 0-d int64 tensor.

        Raises:
            IndexError: If ``index`` is out of range.
        """
        return torch.tensor(len(self.items[index]), dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# factory

_PARAMS: dict[str, dict[str, dict[str, int]]] = {
    "tokens": {"small": {"num_tokens": 1 << 20}, "bench": {"num_tokens": 50_000_000}},
    "images": {"small": {"files": 8, "length": 256}, "bench": {"files": 256, "length": 1 << 16}},
    "tensors": {"small": {"length": 64, "side": 256}, "bench": {"length": 1 << 16, "side": 512}},
    "python": {"small": {"length": 1024}, "bench": {"length": 1 << 20}},
    "objects": {"small": {"count": 20_000}, "bench": {"count": 3_000_000}},
}


def make_workload(name: str, root: str | None = None, size: str = "small") -> WorkloadSpec:
    """Build a built-in workload, generating its files on first use.

    Args:
        name: One of :data:`WORKLOAD_NAMES`.
        root: Directory for generated files; :func:`default_root` when ``None``. Files are
            reused across calls and processes: a second call with the same parameters only
            opens them.
        size: ``"small"`` (fast to build, for tests and quick demos) or ``"bench"`` (what
            bench/ measures: a 100 MB token file, 256 JPEGs, 3x512x512 tensors, a 3M-string
            dataset).

    Returns:
        The dataset with its batch size and a one-line description.

    Raises:
        ValueError: If ``name`` or ``size`` is unknown.
        ImportError: If ``name == "images"`` and Pillow is not installed.
    """
    if name not in _PARAMS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    p = _PARAMS[name][size]
    files_root = default_root() if root is None else root
    if name in ("tokens", "images"):
        os.makedirs(files_root, exist_ok=True)
    if name == "tokens":
        path = _write_token_file(files_root, p["num_tokens"], seed=0)
        return WorkloadSpec(
            name=name,
            dataset=TokenWindows(path),
            batch_size=16,
            description=f"2049-token int64 windows at random offsets in a "
            f"{p['num_tokens']:,}-token memmap (~15 µs/item, GIL held)",
        )
    if name == "images":
        try:
            import PIL  # noqa: F401
        except ImportError as e:
            raise ImportError("the 'images' workload needs Pillow: pip install pillow") from e
        paths = _write_jpegs(files_root, p["files"], 500, 375, seed=0)
        return WorkloadSpec(
            name=name,
            dataset=ImageFiles(paths, length=p["length"]),
            batch_size=32,
            description=f"{p['files']} JPEGs of 500x375 decoded and resized to 3x224x224 float "
            "(ms/item, GIL released)",
        )
    if name == "tensors":
        side = p["side"]
        return WorkloadSpec(
            name=name,
            dataset=NumpyTensors(p["length"], shape=(3, side, side)),
            batch_size=16,
            description=f"3x{side}x{side} float32 from numpy RNG + multiply-add "
            "(ms/item, GIL released)",
        )
    if name == "python":
        return WorkloadSpec(
            name=name,
            dataset=PythonFloats(p["length"]),
            batch_size=32,
            description="pure-Python loop building 200 floats, then torch.tensor (GIL held)",
        )
    return WorkloadSpec(
        name=name,
        dataset=ManySmallObjects(p["count"]),
        batch_size=256,
        description=f"{p['count']:,} small str objects; item = len as tensor (memory case)",
    )
