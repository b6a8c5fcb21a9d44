"""Shared helpers for tests that compare ThreadDataLoader with torch's own DataLoader.

Every expected value in these tests comes from running ``torch.utils.data.DataLoader`` on the same
inputs; these helpers run that reference quietly and compare what the two loaders produced.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

# torch warns when num_workers exceeds the cores; the references run 3 processes on 2 cores.
_TORCH_WORKER_COUNT_WARNING = r"This DataLoader will create \d+ worker processes"


def assert_batches_equal(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Assert two (nested) batches are identical: same types, dtypes, shapes, keys and values.

    Tensors and arrays compare element-wise exactly (dtype and shape included); mappings compare
    keys in order; namedtuples compare their type and fields; lists and tuples their type and
    length; anything else with ``==`` and the same type.

    Raises:
        AssertionError: naming the path of the first difference, e.g. ``batch[1]['x']``.
    """
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{path}: {type(ours).__name__} is not a Tensor"
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, (
            f"{path}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        )
        assert ours.device == theirs.device, f"{path}: device {ours.device} != {theirs.device}"
        assert torch.equal(ours, theirs), f"{path}: values differ\n{ours}\n!=\n{theirs}"
        return
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), f"{path}: {type(ours).__name__} is not an ndarray"
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
        assert np.array_equal(ours, theirs), f"{path}: values differ\n{ours}\n!=\n{theirs}"
        return
    assert type(ours) is type(theirs), (
        f"{path}: type {type(ours).__name__} != {type(theirs).__name__}"
    )
    if isinstance(theirs, Mapping):
        assert list(ours.keys()) == list(theirs.keys()), (
            f"{path}: keys {list(ours.keys())} != {list(theirs.keys())}"
        )
        for key in theirs:
            assert_batches_equal(ours[key], theirs[key], f"{path}[{key!r}]")
        return
    if isinstance(theirs, (list, tuple)):  # namedtuples included: their type compared above
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_batches_equal(a, b, f"{path}[{i}]")
        return
    assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def batch_key(batch: Any) -> Any:
    """A hashable, exact description of a batch, to compare batches as a multiset."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", str(batch.dtype), tuple(batch.shape), repr(batch.tolist()))
    if isinstance(batch, np.ndarray):
        return ("ndarray", str(batch.dtype), batch.shape, repr(batch.tolist()))
    if isinstance(batch, Mapping):
        return (type(batch).__name__, tuple((k, batch_key(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, tuple(batch_key(v) for v in batch))
    return (type(batch).__name__, repr(batch))


def assert_same_multiset(ours: list[Any], theirs: list[Any]) -> None:
    """Assert two lists of batches hold the same batches, each as often, in any order."""
    assert Counter(batch_key(b) for b in ours) == Counter(batch_key(b) for b in theirs)


def collect(loader: Iterable[Any]) -> list[Any]:
    """All batches of one epoch of ``loader``, in the order it yields them."""
    return [batch for batch in loader]


def collect_epochs(loader: Iterable[Any], epochs: int) -> list[list[Any]]:
    """The batches of ``epochs`` successive epochs of the same ``loader`` object."""
    return [collect(loader) for _ in range(epochs)]


def assert_epochs_equal(ours: list[Any], theirs: list[Any]) -> None:
    """Assert two lists of batches (one epoch) are equal batch by batch, in order."""
    assert len(ours) == len(theirs), f"{len(ours)} batches != {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert_batches_equal(a, b, f"batch {i}")


def torch_loader(*args: Any, **kwargs: Any) -> DataLoader:
    """torch's own DataLoader, built without its worker-count warning (references use 3 workers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TORCH_WORKER_COUNT_WARNING)
        return DataLoader(*args, **kwargs)


def torch_epochs(*args: Any, epochs: int = 1, **kwargs: Any) -> list[list[Any]]:
    """Batches of ``epochs`` epochs of torch's DataLoader built with these arguments."""
    loader = torch_loader(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TORCH_WORKER_COUNT_WARNING)
        return collect_epochs(loader, epochs)


@dataclass(frozen=True)
class Outcome:
    """What one ``next()`` on a loader iterator gave: a batch, or an exception."""

    batch: Any = None
    error: BaseException | None = None


def outcomes(iterator: Iterator[Any], limit: int, stop_at_error: bool = False) -> list[Outcome]:
    """Call ``next(iterator)`` until StopIteration or ``limit`` calls, recording each outcome.

    With ``stop_at_error`` the first exception is the last outcome recorded.
    """
    result: list[Outcome] = []
    for _ in range(limit):
        try:
            result.append(Outcome(batch=next(iterator)))
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001  # the outcome under test
            result.append(Outcome(error=without_traceback(exc)))
            if stop_at_error:
                break
    return result


def torch_outcomes(
    *args: Any, limit: int, stop_at_error: bool = False, **kwargs: Any
) -> list[Outcome]:
    """``outcomes`` of one epoch of torch's DataLoader built with these arguments."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TORCH_WORKER_COUNT_WARNING)
        loader = DataLoader(*args, **kwargs)
        iterator = iter(loader)
        try:
            return outcomes(iterator, limit, stop_at_error)
        finally:
            del iterator


def assert_outcomes_match(
    ours: list[Outcome], theirs: list[Outcome], original_messages: Iterable[str] = ()
) -> None:
    """Assert two outcome sequences agree: equal batches, and errors where torch raised them.

    An error matches when the exception types are the same and our message contains every
    one of ``original_messages`` that torch's message contains.
    """
    kinds = ["error" if o.error is not None else "batch" for o in ours]
    ref_kinds = ["error" if o.error is not None else "batch" for o in theirs]
    if kinds != ref_kinds:
        at = next(
            (i for i, (a, b) in enumerate(zip(kinds, ref_kinds, strict=False)) if a != b), None
        )
        at = min(len(kinds), len(ref_kinds)) if at is None else at
        raise AssertionError(
            f"{len(kinds)} outcomes, torch's {len(ref_kinds)}; first difference at {at}: "
            f"{ours[at] if at < len(ours) else 'end'} != torch's "
            f"{theirs[at] if at < len(theirs) else 'end'}"
        )
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if b.error is None:
            assert_batches_equal(a.batch, b.batch, f"outcome {i}")
            continue
        assert type(a.error) is type(b.error), (
            f"outcome {i}: {type(a.error).__name__} != torch's {type(b.error).__name__}"
        )
        for message in original_messages:
            if message in str(b.error):
                assert message in str(a.error), f"outcome {i}: {message!r} missing from {a.error}"


def worker_ids_named(message: str) -> list[int]:
    """Worker ids a loader's error message names, e.g. 'worker 2' or 'worker process 2' -> [2]."""
    return [int(m) for m in re.findall(r"worker\D{0,20}?(\d+)", message)]


def call_with_args(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException | None:
    """Call ``fn`` and return the exception it raised, or None; torch warnings are silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TORCH_WORKER_COUNT_WARNING)
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  # the outcome under test
            return without_traceback(exc)
    return None


def without_traceback(exc: BaseException) -> BaseException:
    """``exc`` (and the exceptions chained to it) with their tracebacks dropped.

    torch's ``ExceptionWrapper.reraise`` leaves a cycle (exception -> traceback -> the frame whose
    local is the exception) that keeps a torch process iterator alive until the garbage collector
    runs. If that happens later inside a forked worker process, the child tries to shut down the
    inherited iterator's workers and hangs until torch's 5 s join timeouts expire. Dropping the
    traceback frees the iterator at once; a loader's message already quotes the original one.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after ``torch.save`` and ``torch.load``, as a checkpoint would bring it back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def cut_and_resume(make: Callable[[], Any], cut: int) -> tuple[list[Any], dict[str, Any]]:
    """Cut an epoch after ``cut`` batches, save (through torch.save), load into a new loader,
    finish: every batch the two loaders gave, and the state in between."""
    loader = make()
    it = iter(loader)
    seen = list(itertools.islice(it, cut))
    state = roundtrip(loader.state_dict())
    del it
    resumed = make()
    resumed.load_state_dict(state)
    return seen + list(resumed), state


def assert_resumes_exactly(make: Callable[[], Any], cut: int) -> None:
    """Run an epoch; then cut one after ``cut`` batches, save, load into a new loader, finish."""
    reference = list(make())
    got, _ = cut_and_resume(make, cut)
    assert len(got) == len(reference)
    for mine, want in zip(got, reference, strict=True):
        assert_batches_equal(mine, want)


def interrupted_next(iterator: Iterator[Any], after_s: float = 0.1) -> None:
    """Call ``next(iterator)`` and press Ctrl-C (SIGINT to the main thread) ``after_s`` into
    the wait; assert that ``KeyboardInterrupt`` came out of ``next()``."""
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(after_s, signal.pthread_kill, args=(main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(iterator)
    finally:
        timer.join()


def press_ctrl_c_during(action: Callable[[], object], after_s: float) -> float:
    """Run ``action`` and press Ctrl-C (SIGINT to this process) ``after_s`` seconds into it.

    Asserts the ``KeyboardInterrupt`` reaches the caller, in ``action`` or within 5 s after
    it (one a finalizer dropped is sent again a little later).

    Returns:
        Seconds from the start of ``action`` to the ``KeyboardInterrupt``.
    """
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            action()
            time.sleep(5)
        return time.monotonic() - started
    finally:
        timer.join()


#: What a rank prints when it aborts as its process exits: a C++ thread still joinable as the
#: interpreter ends (torch's gloo process group; seen with and without threadloader's threads).
EXIT_ABORT = "terminate called without an active exception"


def torchrun(
    args: list[str], timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node=2 *args``.

    A launch whose rank aborted at exit (``EXIT_ABORT``, gloo's teardown: about 1 run in 25
    here, also without threadloader) runs again, twice at most: every rank had done its work,
    so the scripts, which write their results before they exit, start over. Any other failure,
    or that abort three times, is returned as it is.

    Returns:
        The last launch's completed process (stdout and stderr captured as text).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for _ in range(3):
        proc = subprocess.run(
            [*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode == 0 or EXIT_ABORT not in proc.stderr:
            break
    return proc


def threadloader_threads() -> list[threading.Thread]:
    """The live threads threadloader started (workers, transfer, helpers' readers)."""
    return [t for t in threading.enumerate() if t.name.startswith("threadloader-")]


def threadloader_threads_after(within_s: float = 10.0) -> list[threading.Thread]:
    """``threadloader_threads()`` once none is left or ``within_s`` has passed: ``[]`` where
    every one ended in time."""
    deadline = time.monotonic() + within_s
    while threadloader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return threadloader_threads()
