"""An option of ours that would be accepted and then do nothing is refused, naming what it needs.

torch refuses ``persistent_workers=True`` and ``prefetch_factor`` without workers; ours follow:
``isolation="process"`` and ``save_worker_rng=True`` need workers, ``device_prefetch`` needs
``device``, ``RemoteFiles``' ``cache_max_bytes`` needs ``cache_dir`` and its HTTP reads take
only ``headers``, ``DevicePrefetcher``'s ``pool`` needs a CUDA device, ``TokenWindows``'
``header_bytes`` is for raw files. (A ``Mixture`` without its ``MixtureSampler``:
``test_mixture.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from threadloader import BufferPool, DevicePrefetcher, RemoteFiles, ThreadDataLoader, TokenWindows


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"isolation": "process"}, r"isolation='process' .* needs num_workers > 0"),
        ({"save_worker_rng": True}, r"save_worker_rng=True .* needs num_workers > 0"),
        ({"device_prefetch": 4}, r"device_prefetch=4 .* needs device="),
        ({"device_prefetch": 4, "num_workers": 2}, r"device_prefetch=4 .* needs device="),
    ],
    ids=["isolation", "save_worker_rng", "device_prefetch", "device_prefetch-workers"],
)
def test_an_option_that_would_do_nothing_is_refused(options: dict[str, Any], message: str) -> None:
    """Each of these used to be accepted and silently ignored."""
    with pytest.raises(ValueError, match=message):
        ThreadDataLoader(range(10), batch_size=2, **options)


@pytest.mark.parametrize("every", [0, -1.0, float("nan"), "1", True])
def test_log_every_s_must_be_a_positive_number_of_seconds(every: Any) -> None:
    """Zero, negative, nan, text or a bool would log never, always or fail at the first
    batch: refused where the loader is built."""
    with pytest.raises(ValueError, match="log_every_s must be a positive number of seconds"):
        ThreadDataLoader(range(10), batch_size=2, log_every_s=every)


@pytest.mark.parametrize(
    "options",
    [
        {"isolation": "process", "num_workers": 2},
        {"save_worker_rng": True, "num_workers": 2},
        {"device": "cpu", "device_prefetch": 4},
        {"device": "cpu"},
        {},
    ],
)
def test_the_same_options_with_what_they_need_are_accepted(options: dict[str, Any]) -> None:
    loader = ThreadDataLoader(range(10), batch_size=2, **options)
    assert sum(len(b) for b in loader) == 10


def test_a_disk_cache_bound_without_a_disk_cache_is_refused() -> None:
    """``cache_max_bytes`` bounds the disk cache: without ``cache_dir`` it would do nothing."""
    with pytest.raises(ValueError, match=r"cache_max_bytes=1024 .* needs cache_dir="):
        RemoteFiles(["http://127.0.0.1:9/a"], cache_max_bytes=1024)


def test_storage_options_that_http_reads_ignore_are_refused() -> None:
    """HTTP(S) objects are read by threadloader's own HTTP client, which takes only ``headers``:
    other ``storage_options`` would be ignored."""
    with pytest.raises(ValueError, match=r"\['client_kwargs'\] would be ignored"):
        RemoteFiles(["https://example.invalid/a"], storage_options={"client_kwargs": {}})
    RemoteFiles(["https://example.invalid/a"], storage_options={"headers": {"X": "1"}})


def test_a_staging_pool_for_a_device_that_stages_nothing_is_refused() -> None:
    """``DevicePrefetcher``'s pool stages host-to-CUDA copies: with a CPU device it would
    do nothing."""
    with pytest.raises(ValueError, match="pool= stages host-to-CUDA copies"):
        DevicePrefetcher(iter([torch.zeros(2)]), "cpu", pool=BufferPool())


def test_a_header_to_skip_in_npy_token_files_is_refused(tmp_path: Path) -> None:
    """``header_bytes`` skips raw files' headers; a ``.npy`` file's own header says where its
    tokens start, so the option would be ignored."""
    path = tmp_path / "shard.npy"
    np.save(path, np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"header_bytes=1024 .* is a \.npy file"):
        TokenWindows([path], seq_len=8, header_bytes=1024)
    assert len(TokenWindows([path], seq_len=8)) > 0
