"""PyTorch Lightning: thread-safe worker seeding, and a callback that logs the loader's stats.

Imported only where Lightning is installed, as ``lightning`` (``lightning.pytorch``) or
``pytorch_lightning``; ``import threadloader`` never imports it::

    from threadloader.integrations.lightning import ThreadLoaderMonitor
    trainer = Trainer(callbacks=[ThreadLoaderMonitor(every_n_steps=50)])

What works with no help from this module (``tests/test_lightning.py`` proves each):

- ``Trainer.fit`` with a ThreadDataLoader returned by a LightningModule or LightningDataModule,
  also under ``strategy="ddp"`` / ``"ddp_spawn"``. Lightning re-creates the loader to insert its
  ``DistributedSampler``, from the ``__init__`` arguments it recorded or from the instance's
  attributes; every ThreadDataLoader option is stored as an attribute of its own name, so every
  option, keyword-only ones included, survives either way.
- Checkpoints: Lightning saves the train loader's ``state_dict()`` and, for ``fit(ckpt_path=...)``
  from a mid-epoch checkpoint, calls ``load_state_dict()`` before ``iter()``: the epoch resumes
  with the batches not trained on yet, each rank its own.
- ``Fabric.setup_dataloaders``. Its wrapper has no ``state_dict``, and sets the sampler's epoch
  from its own count of ``iter()`` calls, which a new wrapper starts at 0: save and load through
  ``fabric_state_dict`` / ``fabric_load_state_dict``, which reach the loader and align the count.

Where Lightning and a stateful loader meet, and what follows:

- Lightning writes checkpoints on rank 0, so every rank resumes from rank 0's loader state. That
  is right for map-style datasets (ranks advance in lockstep, and each rank re-derives its own
  indices from its own sampler) and wrong for an IterableDataset that shards by rank: save each
  rank's ``state_dict()`` yourself then. So with ``in_order=False``: another rank loading rank
  0's mid-epoch state raises ``ValueError``, as the batches it delivered ahead are rank 0's.
- An IterableDataset without ``__len__``: Lightning fetches one batch ahead of ``training_step``
  to know which batch is the last, so a checkpoint's loader state already counts that batch, and
  a resume skips it.
- ``DistributedShuffleSampler`` (resumes on another world size): pass it with
  ``Trainer(use_distributed_sampler=False)``; otherwise Lightning wraps it in its
  ``DistributedSamplerWrapper``, which materialises every index and deals them out again by rank.
- A checkpoint taken at the end of an epoch does not restore loader state (Lightning's choice):
  the next epoch starts from the sampler's ``set_epoch``, as with torch's DataLoader. One taken
  at the epoch's last step (``every_n_train_steps``), when every batch was delivered but
  ``next()`` has not raised ``StopIteration`` yet, holds a state that starts the next epoch.
- ``seed_everything(workers=True)`` makes Lightning set every loader's ``worker_init_fn`` to one
  that reseeds the process-global ``torch``, ``random`` and ``numpy`` RNGs. In a worker thread
  those are the worker's own, as in a worker process, so each worker and each rank draws what
  it would draw with torch's DataLoader, and the training thread's RNG is left alone.
- A resume on *more* ranks than saved the checkpoint loses the tail of the epoch: Lightning reads
  ``len(loader)`` before ``load_state_dict()`` and ends the epoch when its own batch count,
  restored from the checkpoint, reaches it. Fewer ranks, or the same number, are exact.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from threadloader.loader import ThreadDataLoader


def _import_lightning() -> tuple[Any, Any]:
    """Lightning's trainer package and its fabric package: ``lightning``'s, else the standalone."""
    for trainer, fabric in (
        ("lightning.pytorch", "lightning.fabric"),
        ("pytorch_lightning", "lightning_fabric"),
    ):
        try:
            return importlib.import_module(trainer), importlib.import_module(fabric)
        except ImportError:
            continue
    raise ImportError(
        "threadloader.lightning needs PyTorch Lightning: pip install lightning "
        "(or pytorch-lightning)"
    )


pl, _fabric = _import_lightning()
_Callback: Any = pl.Callback

__all__ = [
    "ThreadLoaderMonitor",
    "fabric_load_state_dict",
    "fabric_state_dict",
]


def _unwrap(dataloader: Any) -> ThreadDataLoader[Any]:
    """The ThreadDataLoader inside Fabric's ``_FabricDataLoader`` wrapper (or given itself)."""
    inner = getattr(dataloader, "_dataloader", dataloader)
    if not isinstance(inner, ThreadDataLoader):
        raise TypeError(f"expected a ThreadDataLoader, or Fabric's wrapper of one; got {inner!r}")
    return inner


def fabric_state_dict(dataloader: Any) -> dict[str, Any]:
    """``state_dict()`` of the ThreadDataLoader that ``Fabric.setup_dataloaders`` returned.

    Raises:
        TypeError: ``dataloader`` is not a ThreadDataLoader or Fabric's wrapper of one.
    """
    return _unwrap(dataloader).state_dict()


def fabric_load_state_dict(dataloader: Any, state: Mapping[str, Any]) -> None:
    """``load_state_dict(state)`` for a loader from ``Fabric.setup_dataloaders``.

    Fabric's wrapper calls the sampler's ``set_epoch`` with its own count of ``iter()`` calls
    before each epoch, and a new wrapper counts from 0: resuming epoch 3 it would set epoch 0,
    and the rest of epoch 0's order (or, with ``DistributedShuffleSampler``, all of it) would
    come instead. Both count ``iter()`` calls, so the count is set from the state's ``epoch``.

    Raises:
        TypeError: ``dataloader`` is not a ThreadDataLoader or Fabric's wrapper of one.
        ValueError: as ``ThreadDataLoader.load_state_dict``.
    """
    _unwrap(dataloader).load_state_dict(state)
    if dataloader is not _unwrap(dataloader) and hasattr(dataloader, "_num_iter_calls"):
        started = int(state["epoch"])  # iter() calls before the state was taken, this one included
        dataloader._num_iter_calls = started - 1 if state["in_progress"] else started


def _thread_loaders(tree: Any, name: str = "") -> Iterator[tuple[str, ThreadDataLoader[Any]]]:
    """Each ThreadDataLoader in a Lightning train-dataloader structure, with a name for it."""
    if isinstance(tree, ThreadDataLoader):
        yield name, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _thread_loaders(value, f"{name}/{key}" if name else str(key))
    elif isinstance(tree, Sequence) and not isinstance(tree, (str, bytes)):
        for i, value in enumerate(tree):
            yield from _thread_loaders(value, f"{name}/{i}" if name else str(i))


class ThreadLoaderMonitor(_Callback):
    """Log each ThreadDataLoader's data wait and throughput to the Trainer's loggers.

    Every ``every_n_steps`` training batches it reads ``loader.stats()`` and logs, over the
    batches since its previous log (or since the epoch started):

    - ``threadloader/wait_fraction``: share of wall time ``training_step``'s loop spent blocked
      in ``next()``; near 0 the loader keeps up, near 1 training is data-bound;
    - ``threadloader/batches_per_s`` and, with a ``batch_size``, ``threadloader/samples_per_s``;
    - ``threadloader/workers_fetching``: how many worker threads may fetch at once (adaptive).

    With several train loaders, each metric name carries the loader's key or position
    (``threadloader/<key>/wait_fraction``). Metrics are logged at ``trainer.global_step``
    through ``trainer.loggers``, which write on rank 0 only, so they describe rank 0's loader.

    Args:
        every_n_steps: log after every this many training batches.

    Raises:
        ValueError: ``every_n_steps`` is below 1.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._batches = 0
        self._last: dict[str, tuple[int, float, float]] = {}  # name -> batches, wall_s, wait_s

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch; every ``every_n_steps`` batches, log the loaders' stats."""
        self._batches += 1
        if self._batches % self.every_n_steps:
            return
        metrics = self.metrics(trainer.train_dataloader)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def metrics(self, loaders: Any) -> dict[str, float]:
        """The metrics for ``loaders`` (a loader, or a list or dict of them) since the last call.

        Loaders that are not ThreadDataLoaders, or have not started an epoch, are skipped.
        """
        metrics: dict[str, float] = {}
        for name, loader in _thread_loaders(loaders):
            try:
                stats = loader.stats()
            except RuntimeError:  # no epoch started yet
                continue
            batches, wall, wait = stats.batches, stats.wall_s, stats.wait_s
            last = self._last.get(name)
            if last is not None and batches >= last[0] and wall >= last[1]:  # same epoch
                batches, wall, wait = batches - last[0], wall - last[1], wait - last[2]
            self._last[name] = (stats.batches, stats.wall_s, stats.wait_s)
            prefix = f"threadloader/{name}/" if name else "threadloader/"
            metrics[prefix + "wait_fraction"] = wait / wall if wall > 0 else 0.0
            metrics[prefix + "batches_per_s"] = batches / wall if wall > 0 else 0.0
            if loader.batch_size:
                metrics[prefix + "samples_per_s"] = (
                    batches * loader.batch_size / wall if wall else 0.0
                )
            metrics[prefix + "workers_fetching"] = float(stats.concurrency_limit)
        return metrics
