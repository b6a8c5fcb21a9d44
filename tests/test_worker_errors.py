"""An exception in a worker is raised from next() in the training thread, as torch raises it.

torch wraps a worker's exception (``ExceptionWrapper``) and raises the same type from ``__next__``
with a message naming the worker and carrying the original traceback; the iterator stays usable,
so the next ``next()`` gives the following batch. Each test runs the same scenario through torch's
process DataLoader and compares what happened.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import (
    Outcome,
    assert_outcomes_match,
    call_with_args,
    outcomes,
    torch_loader,
    torch_outcomes,
    worker_ids_named,
)
from torch.utils.data import IterableDataset

from threadloader import ThreadDataLoader

BAD_INDEX = 5


class FailsAtFive:
    """Map-style of 12 ints; fetching index 5 raises ValueError; records who fetched it."""

    def __init__(self) -> None:
        self.failed_in: list[int] = []

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == BAD_INDEX:
            info = torch.utils.data.get_worker_info()
            self.failed_in.append(-1 if info is None else info.id)
            explode_in_getitem(index)
        return index


def explode_in_getitem(index: int) -> None:
    raise ValueError(f"cannot read item {index}")


class StreamFailsInWorkerOne(IterableDataset[Any]):
    """Worker w yields 10w .. 10w+3, except worker 1, which raises after its second item."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        for k in range(4):
            if worker == 1 and k == 2:
                explode_in_iter(worker)
            yield 10 * worker + k


def explode_in_iter(worker: int) -> None:
    raise ValueError(f"stream of worker {worker} broke")


def collate_fails_on_five(items: list[int]) -> torch.Tensor:
    """collate_fn raising on the batch that holds item 5."""
    if BAD_INDEX in items:
        explode_in_collate(items)
    return torch.tensor(items)


def explode_in_collate(items: list[int]) -> None:
    raise ValueError(f"cannot collate {items}")


def init_fails_in_worker_one(worker_id: int) -> None:
    """worker_init_fn raising in worker 1 only."""
    if worker_id == 1:
        explode_in_init(worker_id)


def explode_in_init(worker_id: int) -> None:
    raise ValueError(f"worker {worker_id} could not start")


def _all_outcomes(loader: Any, limit: int = 30, stop_at_error: bool = False) -> list[Outcome]:
    iterator = iter(loader)
    try:
        return outcomes(iterator, limit, stop_at_error)
    finally:
        del iterator


def _assert_wraps_original(error: BaseException, message: str, raiser: str) -> None:
    text = str(error)
    assert message in text, text
    assert "Traceback (most recent call last)" in text, text
    assert raiser in text, text  # the original frame is in the quoted traceback
    assert __file__.rsplit("/", 1)[-1] in text, text


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_getitem_error_is_raised_from_next_with_worker_and_traceback(num_workers: int) -> None:
    """A __getitem__ exception reaches next() as torch's type, naming the worker, with traceback."""
    dataset = FailsAtFive()
    found = _all_outcomes(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    errors = [o.error for o in found if o.error is not None]
    assert len(errors) == 1
    assert type(errors[0]) is ValueError
    _assert_wraps_original(errors[0], "cannot read item 5", "explode_in_getitem")
    assert dataset.failed_in[0] in range(num_workers)
    assert dataset.failed_in[0] in worker_ids_named(str(errors[0]).splitlines()[0])


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 2, None])
def test_next_after_a_getitem_error_continues_like_dataloader(
    batch_size: int | None, num_workers: int
) -> None:
    """After a failed batch, next() goes on with the following batches, exactly as torch's does."""
    kwargs = {"batch_size": batch_size, "num_workers": num_workers}
    theirs = torch_outcomes(FailsAtFive(), limit=30, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(FailsAtFive(), **kwargs))
    assert_outcomes_match(ours, theirs, ["cannot read item 5"])


@pytest.mark.parametrize("num_workers", [2, 3])
@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_iterable_error_ends_that_shard_and_others_continue_like_dataloader(
    batch_size: int | None, num_workers: int
) -> None:
    """An exception inside IterableDataset iteration is raised once; other workers go on as torch's."""
    kwargs = {"batch_size": batch_size, "num_workers": num_workers}
    theirs = torch_outcomes(StreamFailsInWorkerOne(), limit=30, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(StreamFailsInWorkerOne(), **kwargs))
    assert_outcomes_match(ours, theirs, ["stream of worker 1 broke"])
    error = next(o.error for o in ours if o.error is not None)
    _assert_wraps_original(error, "stream of worker 1 broke", "explode_in_iter")
    assert 1 in worker_ids_named(str(error).splitlines()[0])
    assert "indices" not in str(error).splitlines()[0]  # an iterable's batch has none


class RaisesWhenIterCalled(IterableDataset[Any]):
    """__iter__ itself (not the iteration) raises in every worker."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        raise RuntimeError(f"no stream for worker {None if info is None else info.id}")


@pytest.mark.parametrize("num_workers", [1, 2])
def test_error_calling_iter_on_the_dataset_is_raised_from_first_next(num_workers: int) -> None:
    """An exception from IterableDataset.__iter__ is raised by the first next(), type preserved."""
    reference = torch_outcomes(RaisesWhenIterCalled(), limit=1, num_workers=num_workers)
    iterator = iter(ThreadDataLoader(RaisesWhenIterCalled(), num_workers=num_workers))
    error = call_with_args(next, iterator)
    del iterator
    assert reference[0].error is not None
    assert type(error) is type(reference[0].error)
    _assert_wraps_original(error, "no stream for worker 0", "__iter__")
    assert 0 in worker_ids_named(str(error).splitlines()[0])


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_collate_fn_error_is_raised_from_next_and_iteration_continues(num_workers: int) -> None:
    """A collate_fn exception is raised from next() with its traceback; later batches follow."""
    kwargs = {"batch_size": 2, "num_workers": num_workers, "collate_fn": collate_fails_on_five}
    theirs = torch_outcomes(list(range(12)), limit=30, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(list(range(12)), **kwargs))
    assert_outcomes_match(ours, theirs, ["cannot collate [4, 5]"])
    error = next(o.error for o in ours if o.error is not None)
    _assert_wraps_original(error, "cannot collate [4, 5]", "explode_in_collate")
    assert any(w in range(num_workers) for w in worker_ids_named(str(error).splitlines()[0]))


@pytest.mark.parametrize("num_workers", [2, 3])
def test_worker_init_fn_error_is_raised_for_that_workers_first_batch(num_workers: int) -> None:
    """A worker_init_fn failure in worker 1 is raised by next() at worker 1's first batch, as torch's."""
    kwargs = {
        "batch_size": 2,
        "num_workers": num_workers,
        "worker_init_fn": init_fails_in_worker_one,
    }
    theirs = torch_outcomes(list(range(12)), limit=2, **kwargs)
    iterator = iter(ThreadDataLoader(list(range(12)), **kwargs))
    ours = outcomes(iterator, 2)
    del iterator
    assert_outcomes_match(ours, theirs, ["worker 1 could not start"])
    error = ours[1].error
    assert error is not None
    _assert_wraps_original(error, "worker 1 could not start", "explode_in_init")
    assert 1 in worker_ids_named(str(error).splitlines()[0])


@pytest.mark.parametrize("isolation", [None, "process"])
def test_batches_after_a_failed_worker_start_raise_a_clear_error(isolation: str | None) -> None:
    """After worker 1's start error was raised, its later batches raise an error saying it never
    started (torch's worker process fails on an unbound name there); other workers' batches
    come as usual."""
    kwargs: dict[str, Any] = {
        "batch_size": 2,
        "num_workers": 2,
        "worker_init_fn": init_fails_in_worker_one,
        "timeout": 30,  # workers make every batch, in torch's round robin
    }
    iterator = iter(ThreadDataLoader(list(range(12)), isolation=isolation, **kwargs))
    ours = outcomes(iterator, 10)
    del iterator
    kinds = ["error" if o.error is not None else "batch" for o in ours]
    assert kinds == ["batch", "error"] * 3
    assert "worker 1 could not start" in str(ours[1].error)
    for later in (ours[3].error, ours[5].error):
        assert isinstance(later, RuntimeError)
        assert "worker thread 1 failed to start" in str(later)


class NeedsTwoArguments(Exception):
    """An exception whose __init__ cannot be called with one message string."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


class WithMessageField(Exception):
    """An exception built from a `message=` keyword, which torch's reraise passes."""

    message = "default"

    def __init__(self, *, message: str) -> None:
        super().__init__(message)
        self.message = message


class RaisesGiven:
    """Map-style of 4; item 2 raises the exception made by `make`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise _make_exception(self.kind)
        return index


def _make_exception(kind: str) -> Exception:
    if kind == "KeyError":
        return KeyError("missing key 'alpha'")
    if kind == "two arguments":
        return NeedsTwoArguments(7, "disk quota exceeded")
    return WithMessageField(message="payload was not json")


ORIGINAL_TEXT = {
    "KeyError": "missing key 'alpha'",
    "two arguments": "disk quota exceeded",
    "message field": "payload was not json",
}


@pytest.mark.parametrize("kind", ORIGINAL_TEXT)
def test_unusual_exception_classes_reraise_sensibly(kind: str) -> None:
    """KeyError, an exception needing two arguments, one built from message=: raised readably."""
    kwargs = {"batch_size": 1, "num_workers": 2}
    reference = torch_outcomes(RaisesGiven(kind), limit=5, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(RaisesGiven(kind), **kwargs))
    assert [o.error is None for o in ours] == [o.error is None for o in reference]
    theirs_error = next(o.error for o in reference if o.error is not None)
    error = next(o.error for o in ours if o.error is not None)
    # torch falls back to RuntimeError for a class it cannot build from one message; keeping the
    # original class is at least as good.
    assert type(error) in (type(theirs_error), type(_make_exception(kind)))
    text = str(error)
    assert ORIGINAL_TEXT[kind] in text
    assert "Traceback (most recent call last)" in text
    assert "\\n" not in text  # a KeyError's message reads as text, not as an escaped repr
    assert worker_ids_named(text.splitlines()[0])


class Aborted(BaseException):
    """A BaseException of the user's own, which is no Exception."""


class Halts:
    """Map-style of 8 ints; item 3 raises ``error``, which is no ``Exception``."""

    def __init__(self, error: type[BaseException]) -> None:
        self.error = error

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 3:
            raise self.error("item 3 stops its worker")
        return index


@pytest.mark.parametrize("isolation", ["threads", "process"])
@pytest.mark.parametrize("error", [SystemExit, Aborted])
def test_a_base_exception_in_a_worker_raises_runtime_error_as_torchs_dead_worker_does(
    error: type[BaseException], isolation: str
) -> None:
    """torch's worker process dies of it and its loader raises RuntimeError, which a loop that
    catches Exception to skip a bad batch survives: the same type here, naming the original
    (and the worker goes on: torch loses that worker's later batches)."""
    kwargs = {"batch_size": 2, "num_workers": 2}
    # torch's dying worker sometimes hangs at its exit instead (a feeder thread flushing to a
    # queue): its loader then raises a RuntimeError of its timeout, the same type.
    theirs = torch_outcomes(Halts(error), limit=10, stop_at_error=True, timeout=20, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(Halts(error), isolation=isolation, **kwargs))
    assert [type(o.error) for o in theirs if o.error is not None] == [RuntimeError]
    errors = [o.error for o in ours if o.error is not None]
    assert [type(e) for e in errors] == [RuntimeError]
    assert f"Caught {error.__name__}" in str(errors[0])
    assert "item 3 stops its worker" in str(errors[0])
    assert [o.batch.tolist() for o in ours if o.error is None] == [[0, 1], [4, 5], [6, 7]]


@pytest.mark.parametrize("where", ["getitem", "collate", "iter"])
def test_without_workers_the_original_exception_propagates_like_torch(where: str) -> None:
    """With num_workers=0 an error is raised unwrapped, same type and message as torch's."""
    if where == "getitem":
        make, kwargs = FailsAtFive, {"batch_size": 2}
    elif where == "collate":
        make, kwargs = (
            (lambda: list(range(12))),
            {"batch_size": 2, "collate_fn": collate_fails_on_five},
        )
    else:
        make, kwargs = StreamFailsInWorkerOne, {"batch_size": 2}
    theirs = torch_outcomes(make(), limit=30, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(make(), **kwargs))
    assert_outcomes_match(ours, theirs)
    for mine, ref in zip(ours, theirs, strict=True):
        assert str(mine.error) == str(ref.error)


class SlowItem:
    """Map-style of ``n`` items, each holding the GIL for ``cheap_s``; the last one waits for
    ``release`` (a multiprocessing Event, so that torch's worker processes see it too)."""

    def __init__(self, n: int, cheap_s: float, release: Any) -> None:
        self.n = n
        self.cheap_s = cheap_s
        self.release = release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.n - 1:
            self.release.wait(60)
        end = time.perf_counter() + self.cheap_s
        while time.perf_counter() < end:  # like slicing token windows: no GIL release
            pass
        return index


# After many cheap batches a loader may have decided to fetch in the training thread; a
# timeout must still fire then.
SLOW_AFTER = {"a few batches": (4, 0.0), "many cheap batches": (600, 0.0005)}
#: Beyond the start of torch's worker processes on a loaded machine (0.4 s seen on 2 busy
#: cores), which the first batch's wait includes: only the held-back item may time out.
SLOW_TIMEOUT_S = 2.0


def _outcomes_then_release(loader: Any, limit: int, release: Any) -> list[Outcome]:
    iterator = iter(loader)
    try:
        return outcomes(iterator, limit, stop_at_error=True)
    finally:
        release.set()  # the held-back item returns: the worker can end
        del iterator


@pytest.mark.parametrize("after", SLOW_AFTER)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_slow_batch_raises_torchs_timeout_error(num_workers: int, after: str) -> None:
    """A batch later than `timeout` raises torch's RuntimeError 'DataLoader timed out after ...'."""
    kwargs = {"batch_size": 1, "num_workers": num_workers, "timeout": SLOW_TIMEOUT_S}
    n, cheap_s = SLOW_AFTER[after]
    release = multiprocessing.Event()
    theirs = _outcomes_then_release(
        torch_loader(SlowItem(n, cheap_s, release), **kwargs), n, release
    )
    before = threading.active_count()
    release = multiprocessing.Event()
    loader = ThreadDataLoader(SlowItem(n, cheap_s, release), **kwargs)
    ours = _outcomes_then_release(loader, n, release)
    assert theirs[-1].error is not None, "torch did not time out; the scenario is wrong"
    assert_outcomes_match(ours, theirs)
    assert str(ours[-1].error) == str(theirs[-1].error)
    deadline = time.monotonic() + 30  # the held-back item returns; no thread may stay behind
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


#: What item 5 of ``SlowFirstEpoch`` waits for in this process (a helper process's copy of
#: this module never sees it set: the helper is ended instead).
_RELEASE_ITEM_5 = threading.Event()


class SlowFirstEpoch:
    """Map-style of 6 items; item 5 waits for ``_RELEASE_ITEM_5`` until ``slow`` is cleared."""

    def __init__(self) -> None:
        self.slow = True

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> int:
        if index == 5 and self.slow:
            _RELEASE_ITEM_5.wait(600)
        return index


#: The epoch's timeout: the first batch's wait includes a helper process's start, which a
#: loaded machine stretched to 5 s with the helper server already running.
ENDED_EARLY_TIMEOUT_S = {None: 2.0, "process": 10.0}


@pytest.mark.parametrize("isolation", [None, "process"])
@pytest.mark.parametrize("ended_by", ["timeout", "close"])
def test_persistent_loader_starts_a_working_epoch_after_one_ended_early(
    ended_by: str, isolation: str | None
) -> None:
    """A timeout or Ctrl-C (which closes the iterator, as close() does) ends an epoch of a
    persistent loader; torch's next iter() works, and so must ours, on fresh workers."""
    if isolation is not None:  # start the helper server now: its first start is not timed
        assert [int(b) for b in ThreadDataLoader(range(2), num_workers=1, isolation=isolation)]
    dataset = SlowFirstEpoch()
    loader = ThreadDataLoader(
        dataset,
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        timeout=ENDED_EARLY_TIMEOUT_S[isolation] if ended_by == "timeout" else 0,
        isolation=isolation,
    )
    _RELEASE_ITEM_5.clear()
    try:
        it = iter(loader)
        assert int(next(it)) == 0
        if ended_by == "timeout":
            with pytest.raises(RuntimeError, match="timed out"):
                list(it)
        else:
            it.close()
        dataset.slow = False
        for _ in range(2):
            assert [int(b) for b in loader] == list(range(6))
    finally:
        _RELEASE_ITEM_5.set()  # a worker thread of the first epoch may still wait in item 5


def test_timeout_does_not_fire_when_batches_arrive_in_time() -> None:
    """A generous timeout changes nothing: torch's batches arrive."""
    kwargs = {"batch_size": 2, "num_workers": 2, "timeout": 30.0}
    theirs = torch_outcomes(list(range(10)), limit=10, **kwargs)
    ours = _all_outcomes(ThreadDataLoader(list(range(10)), **kwargs))
    assert_outcomes_match(ours, theirs)


def test_torch_reference_loader_is_still_usable_here() -> None:
    """Sanity: torch's process loader runs in this test process (the references above rely on it)."""
    assert [int(b) for b in torch_loader(list(range(4)), num_workers=2)] == [0, 1, 2, 3]
