"""What ``python -m threadloader compare`` is asked to compare: the options and the dataset.

:class:`CompareConfig` holds the options and checks them, :func:`load_source` builds the dataset
they name, and :class:`CompareError` says what the user got wrong. Running the loaders is
:mod:`threadloader.compare.runner`; the table, JSON and plot are :mod:`threadloader.compare.report`.

What a comparison reads; where the code disagrees with this, the code is wrong.

1. The dataset is a built-in workload (:mod:`threadloader.compare.workloads`) or whatever a user's
   ``module:factory`` returns: a map-style dataset (``__getitem__`` and ``__len__``) or a
   ``torch.utils.data.IterableDataset``. Every loader reads it with the same batch size, and a
   map-style dataset through the same index order: ``0, 1, 2, ...`` wrapping around at the end
   (:class:`_WrapAroundSampler`), so a small dataset still feeds as many batches as were asked
   for.
2. Everything the user got wrong (a module that does not import, a factory that raises, a
   dataset that fails to load) raises :class:`CompareError`, whose message is one line; a
   loader failing on the dataset is turned into one by :func:`threadloader.compare.runner.run_compare`.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, Sampler

LOADERS: tuple[str, ...] = ("thread", "dataloader", "dataloader0", "torchdata", "spdl")
"""Loader keys, in the order the table lists them."""

BASELINE = "dataloader"
"""The loader every ratio is taken against: torch's DataLoader with the same num_workers."""

WORKLOADS: tuple[str, ...] = ("tokens", "images", "tensors", "python")
"""Built-in workloads the command accepts (see :mod:`threadloader.compare.workloads`)."""

_DEFAULT_DATASET_BATCH_SIZE = 32


class CompareError(Exception):
    """A problem with the user's input or dataset; its message is one line, shown as is."""


def min_timed_batches(num_workers: int) -> int:
    """The fewest ``--batches`` worth timing: ten of the waves in which ``num_workers`` parallel
    workers deliver their batches (timing one batch of a wave measures ~0 s)."""
    return 10 * max(1, num_workers)


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What to compare and for how long.

    Attributes:
        workload: A name from :data:`WORKLOADS`; ignored when ``dataset`` is set.
        dataset: ``"module:factory"``; the factory is called with no arguments.
        batch_size: Batch size; ``None`` uses the workload's, or 32 for ``dataset``.
        batches: Timed batches per run (after the first); ``None`` when ``seconds`` is set.
        seconds: Timed seconds per run; ``None`` when ``batches`` is set.
        num_workers: Workers (threads or processes) of every parallel loader.
        rounds: How many times every loader runs.
        step_ms: Milliseconds the loop sleeps after each batch (a stand-in training step).
        loaders: Keys from :data:`LOADERS` to run.
        size: Workload size, ``"small"`` or ``"bench"`` (see :func:`make_workload`).
        progress: Show which run is measuring on stderr, one line.
        traceback: Let exceptions from loading propagate instead of raising CompareError.
    """

    workload: str = "tensors"
    dataset: str | None = None
    batch_size: int | None = None
    batches: int | None = None
    seconds: float | None = 1.0
    num_workers: int = 2
    rounds: int = 3
    step_ms: float = 0.0
    loaders: tuple[str, ...] = LOADERS
    size: str = "small"
    progress: bool = False
    traceback: bool = False

    def validate(self) -> None:
        """Check every field.

        Raises:
            CompareError: On the first field that is out of range or unknown.
        """
        if self.dataset is None and self.workload not in WORKLOADS:
            raise CompareError(
                f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}"
            )
        if (self.batches is None) == (self.seconds is None):
            raise CompareError("give exactly one of batches and seconds")
        positive: dict[str, float | None] = {
            "batch size": self.batch_size,
            "batches": self.batches,
            "seconds": self.seconds,
            "num_workers": self.num_workers,
            "rounds": self.rounds,
        }
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise CompareError(f"{name} must be positive, got {value}")
        least = min_timed_batches(self.num_workers)
        if self.batches is not None and self.num_workers > 0 and self.batches < least:
            raise CompareError(
                f"batches must be at least {least} with {self.num_workers} workers, got "
                f"{self.batches}: parallel workers deliver batches {self.num_workers} at a time, "
                "so fewer timed batches make samples/s a guess (or give seconds instead)"
            )
        if not self.step_ms >= 0:
            raise CompareError(f"step_ms must be zero or positive, got {self.step_ms}")
        unknown = [k for k in self.loaders if k not in LOADERS]
        if unknown or not self.loaders:
            raise CompareError(
                f"unknown loader {unknown[0] if unknown else '(none)'!r}; "
                f"choose from {', '.join(LOADERS)}"
            )


@dataclasses.dataclass(frozen=True)
class Source:
    """The dataset every loader reads.

    Attributes:
        name: The workload name or the ``module:factory`` string.
        dataset: The dataset.
        batch_size: The batch size every loader uses.
        description: One line saying what an item is.
        map_style: False for an ``IterableDataset``.
        samples_per_item: Samples one item counts for.
    """

    name: str
    dataset: Any
    batch_size: int
    description: str
    map_style: bool
    samples_per_item: int = 1


# --------------------------------------------------------------------------------------------
# the dataset


def load_source(config: CompareConfig) -> Source:
    """Build the built-in workload or call the user's factory.

    Args:
        config: A validated config.

    Returns:
        The dataset, its batch size and a description.

    Raises:
        CompareError: If the module does not import, the attribute is missing, the factory
            raises, or what it returns is not a dataset a DataLoader can read.
    """
    if config.dataset is None:
        from threadloader.compare.workloads import make_workload

        try:
            spec = make_workload(config.workload, size=config.size)
        except (ImportError, ValueError, OSError) as e:
            raise CompareError(f"cannot build workload {config.workload!r}: {_one_line(e)}") from e
        return Source(
            name=spec.name,
            dataset=spec.dataset,
            batch_size=config.batch_size or spec.batch_size,
            description=spec.description,
            map_style=True,
            samples_per_item=spec.samples_per_item,
        )
    dataset = _call_factory(config.dataset)
    map_style = _check_dataset(dataset, config.dataset)
    kind = "map-style" if map_style else "iterable"
    size = f", {len(dataset):,} items" if map_style else ""
    return Source(
        name=config.dataset,
        dataset=dataset,
        batch_size=config.batch_size or _DEFAULT_DATASET_BATCH_SIZE,
        description=f"{type(dataset).__name__} from {config.dataset} ({kind}{size})",
        map_style=map_style,
    )


def _call_factory(spec: str) -> Any:
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise CompareError(f"--dataset expects module:factory (e.g. mypkg.data:make), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:
        raise CompareError(f"cannot import module {module_name!r}: {_one_line(e)}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise CompareError(f"{module_name!r} has no attribute {attr_path!r}") from e
    if _is_dataset(obj) and not isinstance(obj, type):
        return obj  # `module:ds` naming a dataset object rather than a factory
    if not callable(obj):
        raise CompareError(f"{spec} is a {type(obj).__name__}, not a factory or a dataset")
    try:
        return obj()
    except (Exception, SystemExit) as e:
        raise CompareError(f"{spec}() raised {_one_line(e)}") from e


def _is_dataset(obj: Any) -> bool:
    if isinstance(obj, IterableDataset):
        return True
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def _check_dataset(dataset: Any, spec: str) -> bool:
    """Return True for a map-style dataset, False for an IterableDataset."""
    if isinstance(dataset, IterableDataset):
        return False
    if not _is_dataset(dataset) or isinstance(dataset, str | bytes):
        hint = (
            "; wrap an iterator in a torch.utils.data.IterableDataset"
            if hasattr(dataset, "__iter__")
            else ""
        )
        raise CompareError(
            f"{spec}() returned a {type(dataset).__name__}, not a dataset: need __getitem__ "
            f"and __len__ (map-style) or a torch.utils.data.IterableDataset{hint}"
        )
    try:
        length = len(dataset)
    except Exception as e:
        raise CompareError(f"len() of the dataset from {spec} raised {_one_line(e)}") from e
    if length <= 0:
        raise CompareError(f"the dataset from {spec} is empty")
    return True


class _WrapAroundSampler(Sampler[int]):
    """``0, 1, ..., n-1, 0, 1, ...``: ``count`` indices, or endless when ``count`` is None."""

    def __init__(self, n: int, count: int | None) -> None:
        self.n = n
        self.count = count

    def __iter__(self) -> Iterator[int]:
        indices = itertools.cycle(range(self.n))
        return indices if self.count is None else itertools.islice(indices, self.count)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
