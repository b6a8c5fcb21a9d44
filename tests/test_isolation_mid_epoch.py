"""isolation="auto" moves its first epoch into helper processes mid-epoch, once it has measured
enough (``threadloader.isolation.mid_epoch``): the batches, the workers' random draws, what the
workers did to their dataset copies and ``state_dict()`` carry on as if nothing moved.

Whether items hold the GIL is a measurement a loaded machine can change: these tests decide it
(``held_the_gil`` patched) and shorten the measuring time, and check what follows.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_epochs_equal, torch_epochs, torch_loader
from test_isolation import _fast_helper_starts, _no_helper_left_behind  # noqa: F401
from torch.utils.data import Dataset, RandomSampler, get_worker_info

from threadloader import ThreadDataLoader
from threadloader._engine.threaded import ThreadedDataLoaderIter
from threadloader._primitives import concurrency
from threadloader.isolation import auto, mid_epoch
from threadloader.isolation.parent import IsolatedDataLoaderIter

N = 96  # items: 24 batches of 4


class Counting(Dataset[Any]):
    """Item i: (i, the worker's draws from torch, random and numpy's globals, how many items
    this copy made before, how many times worker_init_fn ran on it, the pid that made it).

    The counts live in the copy: a worker process's copy counts that worker's items, and so
    must a copy carried into a helper mid-epoch; a fresh copy would start again at 0.
    """

    def __init__(self) -> None:
        self.made = 0
        self.inits = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        made, self.made = self.made, self.made + 1
        draws = (float(torch.rand(())), random.random(), float(np.random.rand()))
        return index, *draws, made, self.inits, os.getpid()


def _count_init(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.inits += 1


KWARGS: dict[str, Any] = {
    "batch_size": 4,
    "shuffle": True,
    "num_workers": 2,
    "worker_init_fn": _count_init,
}


@pytest.fixture
def move_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items hold the GIL, and a move is due as soon as a batch was delivered. This process
    counts as running only its main thread unless a test starts one: threads other tests left
    running (a test server's) would keep every epoch from forking."""
    monkeypatch.setattr(auto, "held_the_gil", lambda stats: True)
    # Epochs of milliseconds: a helper's start would weigh as if helpers ran the loop slower.
    monkeypatch.setattr(auto, "loop_pace", lambda stats, since=None: 100.0)
    before = threading.active_count()
    monkeypatch.setattr(
        mid_epoch.zygote, "may_fork", lambda besides=0: threading.active_count() <= before + besides
    )
    monkeypatch.setattr(mid_epoch, "MEASURE_S", 0.0)
    monkeypatch.setattr(mid_epoch, "CHECK_EVERY_S", 0.0)
    monkeypatch.setattr(mid_epoch, "MIN_REMAINING_S", 0.0)


def _data(batch: list[Any]) -> list[Any]:
    return batch[:6]  # everything but the pid


def _pids(batches: list[Any]) -> list[set[int]]:
    return [set(b[6].tolist()) for b in batches]


def _torch(epochs: int = 1, **extra: Any) -> list[list[Any]]:
    theirs = torch_epochs(
        Counting(), epochs=epochs, generator=torch.Generator().manual_seed(7), **{**KWARGS, **extra}
    )
    return [[_data(b) for b in epoch] for epoch in theirs]


def _ours(**extra: Any) -> ThreadDataLoader[Any]:
    return ThreadDataLoader(
        Counting(), generator=torch.Generator().manual_seed(7), **{**KWARGS, **extra}
    )


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_first_epoch_that_holds_the_gil_moves_into_helpers_and_gives_torchs_batches() -> None:
    """The first batches come from this process, the rest from two helpers; every batch,
    draw and per-copy count is torch's, and worker_init_fn ran once per worker."""
    loader = _ours()
    batches = list(loader)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    pids = _pids(batches)
    assert pids[0] == {os.getpid()}
    later = set().union(*pids[len(pids) // 2 :])
    assert os.getpid() not in later and len(later) == 2
    assert {int(i) for b in batches for i in b[5]} == {1}
    stats = loader.stats()
    assert stats.mode == "process"
    assert "first epoch" in str(stats.mode_reason) and "held the GIL" in str(stats.mode_reason)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_the_epochs_after_a_move_start_in_helpers_with_torchs_batches() -> None:
    """Epoch 2 runs wholly in helpers (the move decided it), with torch's batches."""
    loader = _ours()
    ours = [list(loader), list(loader)]
    theirs = _torch(epochs=2)
    for epoch in range(2):
        assert_epochs_equal([_data(b) for b in ours[epoch]], theirs[epoch])
    assert os.getpid() not in set().union(*_pids(ours[1]))
    assert loader.stats().mode == "process"


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_move_first_delivers_every_batch_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every worker thread fetching ahead (the concurrency controller held at its
    maximum), the batches in flight at the move come from the threads, in order, and the
    rest from the helpers."""
    monkeypatch.setattr(concurrency.ConcurrencyController, "_decide", lambda *a: None)
    loader = _ours()
    batches = list(loader)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    pids = _pids(batches)
    here = [i for i, p in enumerate(pids) if p == {os.getpid()}]
    # The first batch's delivery makes the move due; the 2 * 2 batches then in flight (and
    # the first) were made here.
    assert here == list(range(len(here))) and len(here) >= 1 + 2 * 2
    assert len(set().union(*pids[len(here) :]) - {os.getpid()}) == 2


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_state_saved_after_a_move_resumes_the_rest_of_the_epoch_exactly() -> None:
    """A state_dict taken in helpers, after the move, resumes what an uninterrupted run in
    threads gives, generator draws included (save_worker_rng)."""
    whole = [_data(b) for b in _ours(isolation="threads", save_worker_rng=True)]
    loader = _ours(save_worker_rng=True)
    it = iter(loader)
    got = [_data(next(it)) for _ in range(12)]
    assert loader.stats().mode == "process"
    state = loader.state_dict()
    del it
    resumed = _ours(save_worker_rng=True)
    resumed.load_state_dict(state)
    got += [_data(b) for b in resumed]
    assert_epochs_equal(got[:12], whole[:12])
    # Per-copy counts start again in a resumed run (the copies are new; torch's are too):
    # compare the index and the draws.
    assert_epochs_equal([b[:4] for b in got[12:]], [b[:4] for b in whole[12:]])


@pytest.fixture
def warmed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The multiprocessing contexts ``auto`` started a forkserver for (none is started, none is
    ready, and no zygote runs: another test's may)."""
    calls: list[Any] = []
    monkeypatch.setattr(
        auto, "warm_forkserver", lambda context, code=(): calls.append(context) or True
    )
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    return calls


@pytest.fixture
def server_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forkserver counts as ready (it starts with the first helper, if it did not run), and
    this process may not be forked (``move_soon`` counts threads: one another test left may end
    meanwhile)."""
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: True)
    monkeypatch.setattr(mid_epoch.zygote, "may_fork", lambda besides=0: False)


@contextlib.contextmanager
def _another_thread() -> Iterator[None]:
    """A Python thread of the user's runs meanwhile: this process may not be forked."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="user-thread")
    other.start()
    try:
        yield
    finally:
        stop.set()
        other.join()


def _assert_stayed_in_threads(loader: ThreadDataLoader[Any], batches: list[Any]) -> None:
    """The epoch gave torch's batches, all made in this process, and ran in threads."""
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    assert set().union(*_pids(batches)) == {os.getpid()}
    assert loader.stats().mode == "threads"


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "warmed")
def test_no_move_while_another_python_thread_runs_and_no_forkserver_is_ready() -> None:
    """Forking would copy a lock the other thread may hold, and a helper from a forkserver
    that is not ready would wait for it to import torch: the epoch stays in threads."""
    with _another_thread():
        loader = _ours()
        batches = list(loader)
    _assert_stayed_in_threads(loader, batches)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_move_due_while_another_thread_runs_starts_the_forkserver_once(
    warmed: list[Any],
) -> None:
    """The epoch cannot move (forking is not safe), but the next one's helpers will come from a
    forkserver: it starts now, once, and imports torch while this epoch goes on."""
    with _another_thread():
        loader = _ours()
        it = iter(loader)
        assert isinstance(it, ThreadedDataLoaderIter)
        batches = [next(it)]
        # A move is considered once both workers started: on a busy machine the training
        # thread could make the whole epoch before they did.
        deadline = time.monotonic() + 30
        while not it.workers_ready and time.monotonic() < deadline:
            time.sleep(0.01)
        batches += list(it)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    assert loader.stats().mode == "threads"
    assert warmed == [None]


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_move_that_may_fork_starts_no_forkserver(warmed: list[Any]) -> None:
    loader = _ours()
    list(loader)
    assert loader.stats().mode == "process"
    assert warmed == []


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_no_forkserver_starts_for_a_collate_fn_that_cannot_be_pickled(warmed: list[Any]) -> None:
    with _another_thread():
        loader = _ours(collate_fn=lambda batch: len(batch))
        assert list(loader) == [4] * (N // 4)
    assert warmed == []


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_thread_started_while_the_workers_joined_keeps_the_epoch_in_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The move checks again once the worker threads are joined; declined then, the training
    thread makes every later batch itself, and none is lost or repeated."""
    real = mid_epoch.zygote.may_fork
    monkeypatch.setattr(
        mid_epoch.zygote, "may_fork", lambda besides=0: real(besides) if besides else False
    )
    loader = _ours()
    it = iter(loader)
    assert isinstance(it, ThreadedDataLoaderIter)
    batches = list(it)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    assert set().union(*_pids(batches)) == {os.getpid()}
    assert it.pool.alive_threads == 0
    assert loader.stats().mode == "threads"


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_helper_that_fails_to_start_is_reported_and_the_epoch_goes_on_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(epoch: Any, count: int, carried: Any = None, **limits: Any) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(IsolatedDataLoaderIter, "take_over", fail)
    loader = _ours()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    reported = [w for w in caught if "no more processes" in str(w.message)]
    assert reported and loader.stats().mode == "threads"
    assert reported[0].filename == __file__  # the loop's line: list(loader), not ours


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_leaving_a_moved_epoch_early_ends_its_helpers() -> None:
    loader = _ours()
    for i, _ in enumerate(loader):
        if i == 15:
            break
    assert loader.stats().mode == "process"


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_collate_fn_that_cannot_be_pickled_stays_in_threads_in_every_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The move itself pickles nothing, but the next epochs' helpers may have to receive the
    collate_fn pickled (from the zygote or a forkserver): as auto's rule 4, nothing moves."""
    monkeypatch.setattr(auto, "MIN_EPOCH_S", 0.0)  # epoch 2's reason: the pickling, not length
    loader = ThreadDataLoader(
        Counting(), batch_size=4, num_workers=2, collate_fn=lambda batch: len(batch)
    )
    for _ in range(2):
        assert list(loader) == [4] * (N // 4)
        assert loader.stats().mode == "threads"
    assert "cannot be pickled" in str(loader.stats().mode_reason)


@pytest.mark.usefixtures("move_soon")
@pytest.mark.parametrize(
    "extra",
    [
        {"persistent_workers": True},
        {"in_order": False},
        {"timeout": 30},
        {"isolation": "threads"},
        {"num_workers": 1},
    ],
    ids=["persistent", "out of order", "timeout", "threads", "one worker"],
)
def test_epochs_the_move_does_not_apply_to_stay_in_threads(extra: dict[str, Any]) -> None:
    kwargs = {**KWARGS, **extra}
    loader = ThreadDataLoader(Counting(), **kwargs)
    batches = list(loader)
    assert len(batches) == N // 4
    assert set().union(*_pids(batches)) == {os.getpid()}
    assert loader.stats().mode == "threads"


def test_a_short_rest_of_the_epoch_does_not_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """The epoch's rest must last MIN_REMAINING_S at the pace so far: a 24-batch epoch of
    microsecond items never does."""
    monkeypatch.setattr(auto, "held_the_gil", lambda stats: True)
    monkeypatch.setattr(mid_epoch, "MEASURE_S", 0.0)
    monkeypatch.setattr(mid_epoch, "CHECK_EVERY_S", 0.0)
    loader = _ours()
    assert set().union(*_pids(list(loader))) == {os.getpid()}
    assert loader.stats().mode == "threads"


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_break_while_a_move_drains_leaves_the_sampler_where_torch_leaves_it() -> None:
    """While the batches in flight drain, nothing is dispatched, but the sampler is drawn as
    torch draws it: a sampler drawing lazily from the loader's generator, which also seeds the
    next epoch, gives torch's next epoch after a break there."""

    def two_epochs(make: Any) -> list[list[Any]]:
        g = torch.Generator().manual_seed(5)
        sampler = RandomSampler(range(N), replacement=True, num_samples=N, generator=g)
        loader = make(Counting(), batch_size=4, num_workers=3, generator=g, sampler=sampler)
        first = []
        for k, batch in enumerate(loader):
            if k == 3:
                break
            first.append(_data(batch))
        return [first, [_data(b) for b in loader]]

    theirs = two_epochs(torch_loader)
    ours = two_epochs(ThreadDataLoader)
    for epoch in range(2):
        assert_epochs_equal(ours[epoch], theirs[epoch])


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_move_after_a_live_weight_change_on_the_lean_path_finishes_the_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers the new weights' restart has not reached yet (the training thread made every
    batch, limit 0) start it before the move: in helpers they would drop its every task."""
    from threadloader._engine import threaded
    from threadloader.streams import Mixture, MixtureSampler

    def lean(loader: Any, num_workers: int, minimum: int) -> concurrency.ConcurrencyController:
        controller = concurrency.ConcurrencyController(num_workers, minimum=0, initial=0)
        monkeypatch.setattr(controller, "on_batch", lambda *args, **kwargs: None)
        return controller

    def run(isolation: str) -> tuple[list[Any], str]:
        monkeypatch.setattr(threaded, "_controller", lean)
        held = [False]
        monkeypatch.setattr(auto, "held_the_gil", lambda stats: held[0])
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        loader = ThreadDataLoader(
            mixture, batch_size=8, num_workers=2, isolation=isolation,
            sampler=MixtureSampler(mixture, samples_per_epoch=400),
        )  # fmt: skip
        it = iter(loader)
        batches = [next(it) for _ in range(3)]
        loader.set_mixture_weights({"a": 0.1, "b": 0.9})
        held[0] = True  # a move is due from the next batch on
        batches += list(it)
        return batches, loader.stats().mode

    moved, mode = run("auto")
    assert mode == "process"
    stayed, _ = run("threads")
    assert_epochs_equal(moved, stayed)


# --------------------------------------------------------------------------------------------
# While another Python thread runs: the workers travel pickled to helpers from a forkserver


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_move_while_another_thread_runs_carries_the_workers_into_forkserver_helpers() -> None:
    """This process may not be forked (a progress bar's thread runs): the helpers come from the
    forkserver and receive each worker pickled, its copy's counts and its generators as they
    stand. Every batch, draw and per-copy count is torch's; the worker threads are gone once
    the helpers took over."""
    with _another_thread():
        loader = _ours()
        it = iter(loader)
        assert isinstance(it, ThreadedDataLoaderIter)
        pool = it.pool
        batches = list(it)
        assert pool.alive_threads == 0
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    pids = _pids(batches)
    assert pids[0] == {os.getpid()}
    later = set().union(*pids[len(pids) // 2 :])
    assert os.getpid() not in later and len(later) == 2
    stats = loader.stats()
    assert stats.mode == "process" and "first epoch" in str(stats.mode_reason)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_state_saved_after_a_pickled_move_resumes_the_rest_of_the_epoch_exactly() -> None:
    """``state_dict()`` after the move, its generators included, resumes where torchdata's
    StatefulDataLoader's own state would: the rest of the epoch is the uninterrupted one's."""
    with _another_thread():
        whole = list(_ours(save_worker_rng=True))
        loader = _ours(save_worker_rng=True)
        it = iter(loader)
        got = [next(it) for _ in range(12)]
        assert loader.stats().mode == "process"
        state = loader.state_dict()
        del it
        resumed = _ours(save_worker_rng=True)
        resumed.load_state_dict(state)
        got += list(resumed)
    assert_epochs_equal([_data(b)[:4] for b in got], [_data(b)[:4] for b in whole])


class _Unloadable:
    """What an item leaves on its worker's copy that no helper can load: a class only the
    training process can import, or one that loads too slowly."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self) -> tuple[Any, ...]:
        return _unload_elsewhere, (os.getpid(), self.how)


def _unload_elsewhere(pid: int, how: str) -> _Unloadable:
    if os.getpid() != pid:
        if how == "slow":
            time.sleep(60)  # a load that never ends, as far as the move can wait
        raise ModuleNotFoundError("No module named 'only_in_training'")
    return _Unloadable(how)


class LeavesBehind(Counting):
    """Counting, whose items leave ``leave()`` on the worker's copy."""

    def __init__(self, leave: Callable[[], Any]) -> None:
        super().__init__()
        self.leave = leave

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        self.left = self.leave()
        return super().__getitem__(index)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("elsewhere", "No module named 'only_in_training'"),
        ("slow", "had not started after"),
    ],
    ids=["cannot be loaded", "loads too slowly"],
)
def test_workers_helpers_cannot_take_keep_the_epoch_in_its_threads(
    how: str, error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items left something on the worker's copy that a helper cannot load, or not soon: the move declines with a warning naming why, and the epoch goes
    on in its worker threads with torch's batches, none lost or repeated."""
    monkeypatch.setattr(mid_epoch, "CARRIED_WAIT_S", 1.0)
    with _another_thread():
        loader = ThreadDataLoader(
            LeavesBehind(functools.partial(_Unloadable, how)),
            generator=torch.Generator().manual_seed(7),
            **KWARGS,
        )
        it = iter(loader)
        assert isinstance(it, ThreadedDataLoaderIter)
        threads: list[int] = []

        def each(batch: Any) -> Any:
            threads.append(it.pool.alive_threads)
            return batch

        with pytest.warns(RuntimeWarning, match=error) as caught:
            batches = [each(batch) for batch in it]
    assert caught[0].filename == __file__
    assert min(threads[len(threads) // 2 : -1]) == 2  # the epoch went on in its threads
    _assert_stayed_in_threads(loader, batches)


def _open_on_copy(worker_id: int) -> None:
    """Opens a file on the worker's copy, as a database handle is often opened per worker."""
    info = get_worker_info()
    assert info is not None
    info.dataset.handle = open(os.devnull, "rb")  # noqa: SIM115  # the copy's for its life
    _count_init(worker_id)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_worker_copy_that_cannot_be_pickled_stays_in_threads_and_the_next_epoch_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """worker_init_fn opened a handle on each copy: the copies cannot be carried, so the first
    epoch goes on in its threads without a warning, stats() says why, and the next epoch,
    whose helpers receive the dataset as built and run worker_init_fn, moves."""
    monkeypatch.setattr(auto, "MIN_EPOCH_S", 0.0)
    with _another_thread():
        loader = _ours(worker_init_fn=_open_on_copy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            first = list(loader)
        reason = str(loader.stats().mode_reason)
        assert loader.stats().mode == "threads"
        second = list(loader)
        assert loader.stats().mode == "process"
    assert "cannot be pickled" in reason and "BufferedReader" in reason
    theirs = _torch(epochs=2)
    assert_epochs_equal([_data(b) for b in first + second], theirs[0] + theirs[1])
    assert set().union(*_pids(first)) == {os.getpid()}
    assert os.getpid() not in set().union(*_pids(second))


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind")
def test_a_move_waits_for_the_forkserver_to_be_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the forkserver is ready, a helper would wait for it to import torch: no move; the
    first check that finds it ready moves the epoch."""
    ready = [False]
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: ready[0])
    monkeypatch.setattr(auto, "warm_forkserver", lambda context, code=(): True)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    monkeypatch.setattr(mid_epoch.zygote, "may_fork", lambda besides=0: False)
    with _another_thread():
        loader = _ours()
        it = iter(loader)
        first = [next(it) for _ in range(6)]
        assert loader.stats().mode == "threads"
        ready[0] = True
        batches = first + list(it)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    pids = _pids(batches)
    assert set().union(*pids[:6]) == {os.getpid()}
    assert os.getpid() not in pids[-1]
    assert loader.stats().mode == "process"


def _pairs(batch: list[Any]) -> list[Any]:
    """A collate_fn of the user's: the items as a list of tuples, pids dropped."""
    return [tuple(item[:6]) for item in batch]


def _random_configuration(rng: random.Random) -> tuple[dict[str, Any], int]:
    """Loader arguments torch accepts, and after how many batches the move is due."""
    workers = rng.choice([2, 3, 4])
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "prefetch_factor": rng.choice([1, 2, 3]),
    }
    batching = rng.choice(["batch_size", "sampler", "batch_sampler"])
    if batching == "batch_sampler":
        order = list(range(N))
        rng.shuffle(order)
        sizes = [rng.randint(1, 5) for _ in range(N)]
        batches, at = [], 0
        for size in sizes:
            if at >= N:
                break
            batches.append(order[at : at + size])
            at += size
        kwargs["batch_sampler"] = batches
    else:
        kwargs["batch_size"] = rng.choice([1, 3, 4])
        kwargs["drop_last"] = rng.random() < 0.5
        if batching == "sampler":
            kwargs["sampler"] = rng.randint(N // 2, N)  # drawn with replacement (_sampler)
        else:
            kwargs["shuffle"] = rng.random() < 0.7
    if rng.random() < 0.3:
        kwargs["collate_fn"] = _pairs
    if rng.random() < 0.5:
        kwargs["worker_init_fn"] = _count_init
    return kwargs, rng.randint(1, 6)


def _comparable(batch: Any) -> Any:
    return batch if isinstance(batch, list) and isinstance(batch[0], tuple) else _data(batch)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
@pytest.mark.parametrize("seed", range(int(os.environ.get("FUZZ_SEEDS", "6"))))
def test_random_configurations_carried_into_forkserver_helpers_give_torchs_batches(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random worker counts, helper counts, prefetch factors, samplers, batch shapes, collate
    functions, and a move due after a random number of batches: every batch and draw is
    torch's.
    ``FUZZ_SEEDS=200`` runs more."""
    rng = random.Random(seed)
    kwargs, after = _random_configuration(rng)
    helpers = rng.choice([None, 1, 2])
    monkeypatch.setattr(auto, "held_the_gil", lambda stats: stats.batches >= after)
    samples = kwargs.pop("sampler", None)

    def sampler() -> dict[str, Any]:
        if samples is None:
            return {}
        generator = torch.Generator().manual_seed(seed + 1)
        return {"sampler": RandomSampler(range(N), True, samples, generator=generator)}

    seeded = torch.Generator().manual_seed
    theirs = torch_epochs(Counting(), generator=seeded(seed), **sampler(), **kwargs)[0]
    with _another_thread():
        loader = ThreadDataLoader(
            Counting(), generator=seeded(seed), helpers=helpers, **sampler(), **kwargs
        )
        ours = list(loader)
    assert_epochs_equal([_comparable(b) for b in ours], [_comparable(b) for b in theirs])
    if len(ours) > after + kwargs["prefetch_factor"] * kwargs["num_workers"]:  # time to move
        assert loader.stats().mode == "process", (kwargs, after, loader.stats().mode_reason)


def _mapped() -> np.ndarray:
    """A file mapped onto a worker's copy (here an 8 MB array the copy alone holds)."""
    return np.ones(2**20)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_worker_copies_holding_more_than_the_dataset_stay_in_threads_without_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What items put on each copy would reach each helper copied (a memory map pickles as its
    contents): past the dataset's size and the slack, the move declines while pickling;
    stats() says why, and the epoch goes on in its threads with torch's batches."""
    monkeypatch.setattr(mid_epoch, "CARRIED_SLACK_BYTES", 2**20)
    with _another_thread():
        loader = ThreadDataLoader(
            LeavesBehind(_mapped),
            generator=torch.Generator().manual_seed(7),
            **KWARGS,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batches = list(loader)
    assert_epochs_equal([_data(b) for b in batches], _torch()[0])
    assert set().union(*_pids(batches)) == {os.getpid()}
    stats = loader.stats()
    assert stats.mode == "threads"
    assert "exceeds" in str(stats.mode_reason) and "held the GIL" in str(stats.mode_reason)


def _map_on_copy(worker_id: int) -> None:
    """What a slow worker_init_fn does: maps a file onto the worker's copy."""
    info = get_worker_info()
    assert info is not None
    info.dataset.left = _mapped()
    _count_init(worker_id)


class Slow(Counting):
    def __getitem__(self, index: int) -> tuple[Any, ...]:
        time.sleep(0.005)
        return super().__getitem__(index)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_the_time_worker_init_fn_takes_does_not_raise_what_a_helper_may_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Running worker_init_fn again lengthens the helpers' start, not the dataset's size: the
    file it mapped onto each copy still exceeds what a helper may receive."""
    monkeypatch.setattr(mid_epoch, "CARRIED_SLACK_BYTES", 2**20)
    with _another_thread():
        loader = ThreadDataLoader(
            Slow(),
            generator=torch.Generator().manual_seed(7),
            **{**KWARGS, "worker_init_fn": _map_on_copy},
        )
        it = iter(loader)
        assert isinstance(it, ThreadedDataLoaderIter)
        batches = [next(it)]
        for worker in it.pool.workers:
            worker.init_s = 0.1  # 5 MB at 100 MB/s
        batches += list(it)
    _assert_stayed_in_threads(loader, batches)
    assert "exceeds" in str(loader.stats().mode_reason)


class _SharesState(Counting):
    """A dataset whose copies share process-wide state, as RemoteFiles' read pool."""

    def __copy__(self) -> _SharesState:
        twin = _SharesState.__new__(_SharesState)
        twin.__dict__.update(self.__dict__)
        return twin


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_dataset_whose_copies_share_state_is_not_carried_pickled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pickled apart, each copy would get its own state: the epoch stays in threads, though the
    forkserver is ready, and the warm-up runs for the next epoch, which moves the dataset whole."""
    warmed: list[Any] = []
    monkeypatch.setattr(
        auto, "warm_forkserver", lambda context, code=(): warmed.append(context) or True
    )
    with _another_thread():
        loader = ThreadDataLoader(
            _SharesState(), generator=torch.Generator().manual_seed(7), **KWARGS
        )
        batches = list(loader)
    assert set().union(*_pids(batches)) == {os.getpid()}
    assert loader.stats().mode == "threads"
    assert warmed == [None]


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_mixture_with_many_workers_per_helper_is_carried_with_its_generator_history() -> None:
    """A mixture keeps each worker's recent generator states (for a live weight change's
    rewind): 16 workers in one helper carry dozens of them, which travel as plain data (as
    tensors, each would need a file descriptor: more than a message may carry). The epoch
    moves and gives the threads' batches."""
    from threadloader.streams import Mixture, MixtureSampler

    def run(isolation: str) -> tuple[list[Any], str]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        loader = ThreadDataLoader(
            mixture, batch_size=2, num_workers=16, prefetch_factor=16, isolation=isolation,
            generator=torch.Generator().manual_seed(3),
            **({"helpers": 1} if isolation == "auto" else {}),
            sampler=MixtureSampler(mixture, samples_per_epoch=1200),
        )  # fmt: skip
        batches = list(loader)
        return batches, loader.stats().mode

    with _another_thread():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            moved, mode = run("auto")
        stayed, _ = run("threads")
    assert mode == "process"
    assert_epochs_equal(moved, stayed)


_GLOBAL: dict[Any, Any] = {"scale": 1}


class Scaled(Counting):
    """Counting, whose items also carry what ``worker_init_fn`` set in a module's global: a
    scale, and the ``WorkerInfo`` it saw (id, workers, seed's last digits) for this worker."""

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        info = get_worker_info()
        assert info is not None
        return *super().__getitem__(index), _GLOBAL["scale"], *_GLOBAL[info.id]


def _init_outside_and_in(worker_id: int) -> None:
    """Sets a module's global that items read (outside the worker's copy), counts itself on
    the copy (twice would be wrong) and draws from the worker's generators."""
    _count_init(worker_id)
    random.random()
    torch.rand(())
    info = get_worker_info()
    assert info is not None
    _GLOBAL["scale"] = 10
    _GLOBAL[worker_id] = (info.id, info.num_workers, info.seed % 1000)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_worker_init_fn_runs_again_in_pickled_helpers_for_what_it_set_outside_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helpers from the forkserver import this module afresh: the global worker_init_fn set
    reaches them only if it runs there again, as the worker (its WorkerInfo); it does so on a
    scratch copy with fresh generators, so the carried copy counts one run and the items'
    draws are torch's."""
    monkeypatch.setitem(globals(), "_GLOBAL", {"scale": 1})
    kwargs = {**KWARGS, "worker_init_fn": _init_outside_and_in}
    theirs = torch_epochs(Scaled(), generator=torch.Generator().manual_seed(7), **kwargs)[0]
    assert _GLOBAL == {"scale": 1}  # torch's worker processes set their own
    with _another_thread():
        loader = ThreadDataLoader(Scaled(), generator=torch.Generator().manual_seed(7), **kwargs)
        batches = list(loader)
    assert loader.stats().mode == "process"
    pids = _pids(batches)
    assert os.getpid() not in pids[-1]
    assert_epochs_equal(
        [[*_data(b), *b[7:]] for b in batches], [[*_data(b), *b[7:]] for b in theirs]
    )
    assert all(b[5].tolist() == [1] * len(b[5]) for b in batches)  # inits: once on each copy
    assert all(b[7].tolist() == [10] * len(b[7]) for b in batches)
    assert {int(w) for b in batches for w in b[8]} == {0, 1}
    assert all(b[9].tolist() == [2] * len(b[9]) for b in batches)


def _fails_elsewhere(training: int, error: type[BaseException], worker_id: int) -> None:
    if os.getpid() != training:
        raise error("only the training process has the shard index")
    _count_init(worker_id)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_a_worker_init_fn_failing_in_a_helper_keeps_the_epoch_in_its_threads(
    error: type[BaseException],
) -> None:
    """Run again in the helper, worker_init_fn raised: the move declines with a warning naming
    the error, and the epoch goes on in its threads with torch's batches (a KeyboardInterrupt
    there is not raised in the training loop: nobody pressed Ctrl-C)."""
    init = functools.partial(_fails_elsewhere, os.getpid(), error)
    with _another_thread():
        loader = _ours(worker_init_fn=init)
        with pytest.warns(RuntimeWarning, match=error.__name__) as caught:
            batches = list(loader)
    assert caught[0].filename == __file__
    _assert_stayed_in_threads(loader, batches)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_slow_worker_init_fn_counts_in_the_helpers_start() -> None:
    """Helpers run worker_init_fn again before they carry on: one that took longer than the
    rest of the epoch would last keeps the epoch in its threads."""
    with _another_thread():
        loader = _ours()
        it = iter(loader)
        assert isinstance(it, ThreadedDataLoaderIter)
        batches = [next(it)]
        for worker in it.pool.workers:
            worker.init_s = 1e6
        batches += list(it)
    _assert_stayed_in_threads(loader, batches)


@pytest.mark.usefixtures("move_soon", "_no_helper_left_behind", "server_ready")
def test_a_helper_source_gone_between_the_check_and_the_move_keeps_the_epoch_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The move was due on a ready forkserver (or a live zygote); by the time the batches in
    flight were delivered it was gone: the move asks again and declines, rather than waiting
    for a server that imports torch."""
    answers = iter([True])
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: next(answers, False))
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)  # another test's may run
    with _another_thread():
        loader = _ours()
        batches = list(loader)
    _assert_stayed_in_threads(loader, batches)


@pytest.mark.parametrize("budget_s", [0.0, 0.5, 1e6])
@pytest.mark.parametrize("start_s", [0.0, 0.01, 2.0])
def test_a_helper_may_always_receive_the_dataset_and_the_slack(
    start_s: float, budget_s: float
) -> None:
    """However little of the epoch is left when the move is due, each helper may receive the
    dataset and the slack; however much, no more than every copy it carries and the slack."""
    move = mid_epoch.MidEpochMove(2, policy=None, workers=4)  # type: ignore[arg-type]
    dataset = start_s * auto.PICKLED_BYTES_PER_S / 2
    limit = move._carried_limit(start_s, budget_s)
    assert dataset + mid_epoch.CARRIED_SLACK_BYTES <= limit + 1
    assert limit <= dataset * 3 + mid_epoch.CARRIED_SLACK_BYTES
