"""isolation="auto": the first epoch in worker threads, later ones in helper processes once an
epoch's items held the GIL or its workers slowed the training step, back to threads when helpers
ran the loop slower; the batches never show which ran.

Whether a real dataset holds the GIL is a measurement that a loaded machine can change, so these
tests decide it (``held_the_gil`` patched) and check what follows from the decision; the verdict
on an epoch's numbers is tested in tests/test_stats.py, the controller's part of it in
tests/test_concurrency.py, both on numbers given, not measured.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import pickle
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_epochs_equal, collect_epochs, torch_epochs
from test_isolation import _fast_helper_starts, _no_helper_left_behind  # noqa: F401
from torch.utils.data import Dataset

from threadloader import ThreadDataLoader
from threadloader.isolation import auto


class WherePid(Dataset[Any]):
    """Item i: (i, a draw from the global torch RNG, the pid of the process that made it)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[int, float, int]:
        return index, float(torch.rand(())), os.getpid()


def _epochs(loader: ThreadDataLoader[Any], epochs: int) -> tuple[list[list[Any]], list[str]]:
    out, modes = [], []
    for _ in range(epochs):
        out.append([b[:2] for b in loader])
        modes.append(loader.stats().mode)
    return out, modes


def _verdict(monkeypatch: pytest.MonkeyPatch, held: bool, slowed: bool = False) -> None:
    monkeypatch.setattr(auto, "held_the_gil", lambda stats: held)
    monkeypatch.setattr(auto, "slowed_the_training", lambda stats: slowed)
    monkeypatch.setattr(auto, "MIN_EPOCH_S", 0.0)  # these epochs last milliseconds
    monkeypatch.setattr(auto, "MIN_EPOCH_S_SERVER", 0.0)
    # Every epoch at one pace: helpers never lose (a tiny epoch's helper start-up would).
    monkeypatch.setattr(auto, "loop_pace", lambda stats: 100.0)


def _paces(monkeypatch: pytest.MonkeyPatch, paces: list[float]) -> None:
    """Epoch k (from 1) measures ``paces[k - 1]`` batches/s."""
    left = iter(paces)
    monkeypatch.setattr(auto, "loop_pace", lambda stats: next(left))


def test_workers_move_to_helper_processes_after_an_epoch_that_held_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Epoch 1 in threads, epochs 2 and 3 in helpers; each epoch's batches are torch's."""
    _verdict(monkeypatch, True)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=3, generator=torch.Generator().manual_seed(5), **kwargs
    )
    loader = ThreadDataLoader(
        WherePid(), isolation="auto", generator=torch.Generator().manual_seed(5), **kwargs
    )
    pids: list[set[int]] = []
    ours = []
    for _ in range(3):
        epoch = list(loader)
        pids.append({p for b in epoch for p in b[2].tolist()})
        ours.append([b[:2] for b in epoch])
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], [b[:2] for b in theirs[epoch]])
    assert pids[0] == {os.getpid()}
    assert os.getpid() not in pids[1] | pids[2] and len(pids[1]) == 2  # one helper per worker
    stats = loader.stats()
    assert stats.mode == "process" and "held the GIL" in str(stats.mode_reason)
    assert "mode        process" in str(stats)


def test_items_that_release_the_gil_stay_in_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GIL-bound epoch, no helper process: every epoch runs in this process."""
    _verdict(monkeypatch, False)
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="auto")
    for _ in range(2):
        assert {p for b in loader for p in b[2].tolist()} == {os.getpid()}
    assert loader.stats().mode == "threads"
    assert "released the GIL" in str(loader.stats().mode_reason)


def test_persistent_workers_stay_threads_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Persistent workers keep their state between epochs: moving them would change the data."""
    _verdict(monkeypatch, True)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=2, persistent_workers=True,
        generator=torch.Generator().manual_seed(3), **kwargs,
    )  # fmt: skip
    loader = ThreadDataLoader(
        WherePid(), isolation="auto", persistent_workers=True,
        generator=torch.Generator().manual_seed(3), **kwargs,
    )  # fmt: skip
    ours = collect_epochs(loader, 2)
    for epoch in range(2):
        assert_epochs_equal([b[:2] for b in ours[epoch]], [b[:2] for b in theirs[epoch]])
    assert loader.stats().mode == "threads"
    assert "persistent workers" in str(loader.stats().mode_reason)
    del loader
    gc.collect()


class Unpicklable(WherePid):
    """A dataset holding a lambda: a helper process could not receive it."""

    def __init__(self) -> None:
        self.transform = lambda x: x


def test_a_dataset_that_cannot_be_pickled_stays_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pickling check names what cannot be pickled, and the epochs run in threads."""
    _verdict(monkeypatch, True)
    loader = ThreadDataLoader(Unpicklable(), batch_size=4, num_workers=2, isolation="auto")
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "threads"]
    assert "dataset cannot be pickled" in str(loader.stats().mode_reason)


class HoldsTokens(WherePid):
    """A dataset holding 80 KB of numpy tokens: pickled out of band by protocol 5."""

    def __init__(self) -> None:
        self.tokens = np.arange(10_000, dtype=np.int64)


def test_a_dataset_holding_a_large_numpy_array_moves_to_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pickling check accepts buffers the pickler hands over whole (a large array)."""
    _verdict(monkeypatch, True)
    loader = ThreadDataLoader(HoldsTokens(), batch_size=4, num_workers=2, isolation="auto")
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "process"], loader.stats().mode_reason


def test_helpers_that_cannot_start_leave_the_epochs_in_threads_with_torchs_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting helpers fails (after the epoch drew its base seed): the epoch runs in threads,
    with the worker seeds it would have had, and later epochs do not try again."""
    from threadloader.isolation import parent

    _verdict(monkeypatch, True)
    starts = []

    def fail(*args: Any, **kwargs: Any) -> Any:
        starts.append(1)
        raise OSError("no more processes")

    monkeypatch.setattr(parent, "_start_links", fail)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=3, generator=torch.Generator().manual_seed(5), **kwargs
    )
    loader = ThreadDataLoader(
        WherePid(), isolation="auto", generator=torch.Generator().manual_seed(5), **kwargs
    )
    with pytest.warns(RuntimeWarning, match="no more processes") as caught:
        ours, modes = _epochs(loader, 3)
    # Attributed to the loop's line (in _epochs, here), not to threadloader's or torch's code.
    assert {w.filename for w in caught if "no more processes" in str(w.message)} == {__file__}
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], [b[:2] for b in theirs[epoch]])
    assert modes == ["threads"] * 3 and starts == [1]
    assert "could not start" in str(loader.stats().mode_reason)


def _load_elsewhere(pid: int, how: str) -> WherePid:
    """Unpickles a ``LoadsElsewhere`` at once in the process that made it; anywhere else it
    fails (``how="fail"``) or takes 30 s (``"slow"``)."""
    if os.getpid() != pid:
        if how == "fail":
            raise ModuleNotFoundError("No module named 'only_in_training'")
        time.sleep(30)
    return LoadsElsewhere(how)


class LoadsElsewhere(WherePid):
    """A dataset a helper process cannot load (as one whose class lives in a module only the
    training process can import: one it loaded from a file path), or loads slowly."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self) -> tuple[Any, ...]:
        return _load_elsewhere, (os.getpid(), self.how)


@pytest.mark.usefixtures("_no_helper_left_behind")
def test_helpers_that_cannot_load_the_dataset_leave_the_epochs_in_threads_with_torchs_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The helpers start, then fail unpickling the dataset: "auto" waits for them to load it,
    so the epoch runs in threads with the worker seeds it would have had, instead of raising
    from the loop's next(); later epochs do not try again."""
    _verdict(monkeypatch, True)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=3, generator=torch.Generator().manual_seed(5), **kwargs
    )
    loader = ThreadDataLoader(
        LoadsElsewhere("fail"), generator=torch.Generator().manual_seed(5),
        multiprocessing_context="forkserver", **kwargs,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="No module named 'only_in_training'"):
        ours, modes = _epochs(loader, 3)
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], [b[:2] for b in theirs[epoch]])
    assert modes == ["threads"] * 3
    reason = str(loader.stats().mode_reason)
    assert "helper processes could not start (ModuleNotFoundError: No module named" in reason
    assert "Traceback" not in reason


@pytest.mark.usefixtures("_no_helper_left_behind")
def test_helpers_slower_to_load_the_dataset_than_the_timeout_leave_the_epoch_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``timeout`` bounds the wait for the helpers to load what they run; they are ended."""
    _verdict(monkeypatch, True)
    loader = ThreadDataLoader(
        LoadsElsewhere("slow"), batch_size=4, num_workers=2, timeout=1.0,
        multiprocessing_context="forkserver",
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="had not started after 1.0 seconds"):
        _, modes = _epochs(loader, 2)
    assert modes == ["threads", "threads"]


def test_a_state_saved_in_a_helper_epoch_resumes_in_a_new_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state taken mid-epoch while helpers ran resumes with exactly the rest of the indices
    in a fresh auto loader (worker RNG draws continue only with save_worker_rng, as in process)."""
    _verdict(monkeypatch, True)

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            WherePid(), batch_size=4, shuffle=True, num_workers=2, isolation="auto",
            generator=torch.Generator().manual_seed(11),
        )  # fmt: skip

    loader = make()
    list(loader)  # epoch 1, threads
    it = iter(loader)  # epoch 2, helpers
    seen = [next(it)[0] for _ in range(3)]
    state = loader.state_dict()
    rest = [b[0] for b in it]
    assert loader.stats().mode == "process"
    resumed = make()
    resumed.load_state_dict(state)
    assert_epochs_equal([b[0] for b in resumed], rest)
    assert sorted(torch.cat(seen + rest).tolist()) == list(range(32))


def test_helpers_with_auto_sets_how_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """helpers=1 with auto: the workers move into one helper process."""
    _verdict(monkeypatch, True)
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="auto", helpers=1)
    list(loader)
    pids = {p for b in loader for p in b[2].tolist()}
    assert len(pids) == 1 and os.getpid() not in pids


def test_a_training_step_slowed_by_the_workers_moves_them_to_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Items that release the GIL, but steps slower while workers ran: helpers, and says why."""
    _verdict(monkeypatch, False, slowed=True)
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="auto")
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "process"]
    assert "training step took" in str(loader.stats().mode_reason)


def test_helpers_that_run_the_loop_slower_give_way_to_threads_until_threads_slow_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Helpers at half the threads' pace: back to threads, and there while threads keep their
    pace (the GIL signal notwithstanding); threads falling below the helpers' pace: helpers
    again. Every epoch's batches are torch's."""
    _verdict(monkeypatch, True)
    _paces(monkeypatch, [100.0, 50.0, 100.0, 90.0, 40.0, 60.0])
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=6, generator=torch.Generator().manual_seed(9), **kwargs
    )
    loader = ThreadDataLoader(
        WherePid(), isolation="auto", generator=torch.Generator().manual_seed(9), **kwargs
    )
    ours, modes = _epochs(loader, 6)
    assert modes == ["threads", "process", "threads", "threads", "threads", "process"]
    for epoch in range(6):
        assert_epochs_equal(ours[epoch], [b[:2] for b in theirs[epoch]])
    assert "held the GIL" in str(loader.stats().mode_reason)


def test_helpers_that_lost_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason for moving back names both paces."""
    _verdict(monkeypatch, True)
    _paces(monkeypatch, [100.0, 50.0])
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="auto")
    _, modes = _epochs(loader, 3)
    assert modes == ["threads", "process", "threads"]
    reason = str(loader.stats().mode_reason)
    assert "50.0 batches/s with helper processes against 100.0 with threads" in reason


def test_the_default_is_auto_and_moves_with_the_same_batches_as_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loader built with no isolation argument is "auto": a GIL-bound epoch moves the next
    into helpers, and both epochs give DataLoader's batches."""
    _verdict(monkeypatch, True)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    theirs = torch_epochs(
        WherePid(), epochs=2, generator=torch.Generator().manual_seed(3), **kwargs
    )
    loader = ThreadDataLoader(WherePid(), generator=torch.Generator().manual_seed(3), **kwargs)
    assert loader.isolation == "auto"
    ours, modes = _epochs(loader, 2)
    assert modes == ["threads", "process"]
    for epoch in range(2):
        assert_epochs_equal(ours[epoch], [b[:2] for b in theirs[epoch]])


@pytest.mark.parametrize("isolation", ["threads", None])
def test_threads_never_move(monkeypatch: pytest.MonkeyPatch, isolation: str | None) -> None:
    """isolation="threads" (or None) keeps the workers in this process whatever an epoch says."""
    _verdict(monkeypatch, True)
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation=isolation)
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "threads"]
    assert loader.stats().mode_reason == f"isolation={isolation!r}"


def test_an_epoch_too_short_to_pay_for_helpers_stays_in_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting helpers costs more than a short epoch could win back: no move, and says so."""
    _verdict(monkeypatch, True)
    monkeypatch.setattr(auto, "MIN_EPOCH_S", 1e9)
    monkeypatch.setattr(auto, "MIN_EPOCH_S_SERVER", 1e9)
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2)
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "threads"]
    assert "too short to win back starting helper processes" in str(loader.stats().mode_reason)


def _short_epoch() -> Any:
    """A loader with 2 workers, and the stats of a 0.47 s epoch whose items held the GIL."""
    import types

    loader = types.SimpleNamespace(
        persistent_workers=False, num_workers=2, helpers=None, multiprocessing_context=None,
        dataset=WherePid(), collate_fn=None, worker_init_fn=None,
    )  # fmt: skip
    last = types.SimpleNamespace(
        gil_bound=True, training_slowed=False, wait_fraction=1.0, batches=300, wall_s=0.47
    )
    return loader, last


def test_a_third_of_a_second_epoch_of_gil_bound_items_moves_to_forked_helpers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pure-Python items, no step: 0.47 s epochs in threads, 0.25 s in forked helpers.

    Forked helpers start within tens of milliseconds, so such an epoch is long enough to move;
    a forkserver's (an interpreter importing torch) still needs seconds.
    """
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: True)
    loader, last = _short_epoch()
    policy = auto.AutoIsolation()
    assert policy.next_epoch(loader, last).mode == "process"
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    monkeypatch.setattr(auto, "warm_forkserver", lambda context, code=(): False)  # spawn: no server
    choice = auto.AutoIsolation().next_epoch(loader, last)
    assert choice.mode == "threads" and "too short" in choice.reason


def test_auto_stays_in_threads_while_the_zygote_lacks_the_scripts_code_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread runs and the zygote holds a class of the script as it was at its fork:
    zygote helpers would run the old code, a forkserver's the script's top level. The epoch
    stays in threads, saying which class; once the zygote has it, it moves."""
    monkeypatch.setattr(auto.zygote, "may_fork", lambda besides=0: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): True)
    monkeypatch.setattr(auto.zygote, "missing", lambda code: ["WherePid"])
    loader, last = _short_epoch()
    last.wall_s = 30.0
    choice = auto.AutoIsolation().next_epoch(loader, last)
    assert choice.mode == "threads", choice
    assert "WherePid, defined in __main__, changed since threadloader's zygote" in choice.reason
    monkeypatch.setattr(auto.zygote, "missing", lambda code: [])
    assert auto.AutoIsolation().next_epoch(loader, last).mode == "process"


def test_a_start_refused_for_stale_script_code_leaves_later_epochs_free_to_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zygote lacks the script's code at one epoch's start (its pickle says so): that epoch
    runs in threads, saying why, and nothing marks the loader for threads for good: once a
    zygote has the code, a later epoch may move."""
    import threadloader.loader as loader_module
    from threadloader.isolation import zygote

    def stale(*args: Any, **kwargs: Any) -> Any:
        raise zygote.StaleScriptCode("WherePid, defined in __main__, changed since ...")

    monkeypatch.setattr(loader_module, "IsolatedDataLoaderIter", stale)
    monkeypatch.setattr(
        auto.AutoIsolation, "next_epoch", lambda self, loader, last: auto.Choice(auto.PROCESS, "")
    )
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2)
    assert len(list(loader)) == 8
    assert loader.stats().mode == "threads" and "changed since" in str(loader.stats().mode_reason)
    assert loader._auto._start_problem is None


def test_a_short_epoch_moves_once_the_forkserver_it_started_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread runs, so helpers come from a forkserver: the first such epoch starts it
    and stays in threads while it imports torch, saying so; once it is ready, an epoch of
    MIN_EPOCH_S moves, its helpers starting as fast as forked ones."""
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    warmed: list[Any] = []
    ready = [False]
    monkeypatch.setattr(
        auto, "warm_forkserver", lambda context, code=(): warmed.append(context) or True
    )
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: ready[0])
    loader, last = _short_epoch()
    policy = auto.AutoIsolation()
    choice = policy.next_epoch(loader, last)
    assert choice.mode == "threads", choice
    assert "the forkserver helper processes come from is still importing torch" in choice.reason
    assert warmed == [None]
    ready[0] = True
    assert policy.next_epoch(loader, last).mode == "process"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"wall_s": 0.1}, "too short to win back"),
        ({"gil_bound": False}, "threads scale"),
    ],
)
def test_no_forkserver_starts_for_an_epoch_that_would_not_move(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], reason: str
) -> None:
    """A forkserver costs an interpreter with torch imported: it starts only for an epoch that
    says the workers should move and lasts long enough to move once it is ready."""
    import types

    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    warmed: list[Any] = []
    monkeypatch.setattr(
        auto, "warm_forkserver", lambda context, code=(): warmed.append(context) or True
    )
    loader, last = _short_epoch()
    last = types.SimpleNamespace(**{**vars(last), **change})
    choice = auto.AutoIsolation().next_epoch(loader, last)
    assert choice.mode == "threads" and reason in choice.reason, choice
    assert warmed == []


def test_helpers_that_receive_a_large_dataset_pickled_need_a_longer_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a ready forkserver a helper starts in milliseconds, plus the time to pickle and
    unpickle what it runs (3M Python strings: about a second); forked helpers pickle nothing."""
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    monkeypatch.setattr(auto, "warm_forkserver", lambda context, code=(): True)
    monkeypatch.setattr(auto, "forkserver_is_ready", lambda: True)
    loader, last = _short_epoch()
    nbytes = auto._pickle_check(loader).nbytes
    assert nbytes >= len(pickle.dumps(loader.dataset, protocol=pickle.HIGHEST_PROTOCOL))
    # One second to pickle for every helper, one after another.
    monkeypatch.setattr(auto, "PICKLED_BYTES_PER_S", nbytes * auto.helper_count(loader) / 1.0)
    choice = auto.AutoIsolation().next_epoch(loader, last)
    assert choice.mode == "threads", choice
    assert "too short to win back starting helper processes (epochs of 1.3 s" in choice.reason
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: True)
    assert auto.AutoIsolation().next_epoch(loader, last).mode == "process"


@pytest.mark.parametrize(
    ("workers", "reason"), [(1, "need 2 workers"), (2, "helper processes could not start")]
)
def test_a_reason_that_lasts_is_given_before_the_epochs_length(
    monkeypatch: pytest.MonkeyPatch, workers: int, reason: str
) -> None:
    """A short epoch of a loader that can never move says why it never will, not that a longer
    epoch would."""
    import types

    loader, last = _short_epoch()
    loader.num_workers = workers
    last = types.SimpleNamespace(**{**vars(last), "wall_s": 0.1})
    policy = auto.AutoIsolation()
    if workers == 2:
        policy.helpers_failed(OSError("no more processes"))
    choice = policy.next_epoch(loader, last)
    assert choice.mode == "threads" and reason in choice.reason, choice
    assert "too short" not in choice.reason


def test_no_forkserver_starts_for_a_script_it_would_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forkserver imports the main script: an unguarded one would run again in it."""
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    monkeypatch.setattr(auto, "unguarded_main_script", lambda: "train.py")
    warmed: list[Any] = []
    monkeypatch.setattr(
        auto, "warm_forkserver", lambda context, code=(): warmed.append(context) or True
    )
    loader, last = _short_epoch()
    policy = auto.AutoIsolation()
    choice = policy.next_epoch(loader, last)
    assert choice.mode == "threads" and "would run it again" in choice.reason, choice
    policy.warm_up(loader)
    assert warmed == []


def test_the_default_accepts_what_torch_accepts() -> None:
    """The default mode refuses nothing DataLoader takes: no workers, a fork context, helpers."""
    ThreadDataLoader(WherePid(), num_workers=0)
    ThreadDataLoader(WherePid(), num_workers=2, multiprocessing_context="fork")
    assert ThreadDataLoader(WherePid(), num_workers=2, helpers=2).helpers == 2
    with pytest.raises(ValueError, match="with isolation='threads' the threads always run"):
        ThreadDataLoader(WherePid(), num_workers=2, helpers=2, isolation="threads")
    with pytest.raises(ValueError, match="helpers must be between 1 and num_workers=0"):
        ThreadDataLoader(WherePid(), helpers=1)


def test_a_fork_context_stays_in_threads_while_other_threads_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """multiprocessing_context='fork' with another Python thread running: forking could copy a
    lock that thread holds, so the workers stay threads and the reason says so."""
    _verdict(monkeypatch, True)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        loader = ThreadDataLoader(
            WherePid(), batch_size=4, num_workers=2, multiprocessing_context="fork"
        )
        _, modes = _epochs(loader, 2)
    finally:
        stop.set()
        other.join()
    assert modes == ["threads", "threads"]
    assert "multiprocessing_context='fork'" in str(loader.stats().mode_reason)


def test_helpers_with_a_fork_context_go_back_to_threads_once_other_threads_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An epoch in helpers forked with multiprocessing_context='fork'; by the next iter()
    another Python thread runs (this process may no longer fork): the next epoch goes back to
    threads, instead of failing to start its helpers."""
    _verdict(monkeypatch, True)
    forkable = [True]  # whether only the main thread runs: other tests may have left threads
    monkeypatch.setattr(auto.zygote, "may_fork", lambda besides=0: forkable[0])
    loader = ThreadDataLoader(
        WherePid(), batch_size=4, num_workers=2, multiprocessing_context="fork"
    )
    _, modes = _epochs(loader, 2)
    forkable[0] = False
    _, later = _epochs(loader, 1)
    assert modes + later == ["threads", "process", "threads"]
    assert "multiprocessing_context='fork'" in str(loader.stats().mode_reason)


@pytest.mark.parametrize(("wait_fraction", "moves"), [(0.1, True), (0.9, False)])
def test_a_slowed_step_moves_the_workers_only_when_the_loop_does_not_wait_for_data(
    wait_fraction: float, moves: bool
) -> None:
    """A loop that mostly waits for its batches is paced by the workers: a slower step only
    shortens its wait (measured: examples/remote_images.py, whose helpers made its cached epoch
    3x slower), so it is no reason to move."""
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2)
    list(loader)
    slowed = dataclasses.replace(
        loader.stats(), training_slowed=True, gil_bound=False, wait_fraction=wait_fraction
    )
    assert auto.slowed_the_training(slowed) is moves


def test_helpers_from_spawn_need_a_longer_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where helpers would come from spawn (another Python thread runs, no zygote, no
    forkserver), a move must win back an interpreter's start: the epoch must last
    MIN_EPOCH_S_SERVER. (A forkserver's: test_a_short_epoch_moves_once_the_forkserver_...)"""
    _verdict(monkeypatch, True)
    monkeypatch.setattr(auto, "MIN_EPOCH_S_SERVER", 1e9)
    monkeypatch.setattr(auto.zygote, "may_fork", lambda: False)
    monkeypatch.setattr(auto.zygote, "running", lambda code=(): False)
    monkeypatch.setattr(auto, "warm_forkserver", lambda context, code=(): False)  # spawn: no server
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2)
    _, modes = _epochs(loader, 2)
    assert modes == ["threads", "threads"]
    assert "epochs of 1e+09 s or more move" in str(loader.stats().mode_reason)


def test_an_epoch_that_moved_mid_way_counts_for_helpers_from_the_move_on() -> None:
    """A first epoch that ran 100 batches/s in threads, then 80 in helpers: 90 over the whole
    epoch would hide that helpers lost (90 >= 0.9 x 100); the pace after the move shows it."""
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="threads")
    list(loader)
    measured = loader.stats()
    before = dataclasses.replace(measured, batches=100, wall_s=1.0)
    whole = dataclasses.replace(measured, batches=180, wall_s=2.0)
    policy = auto.AutoIsolation()
    policy.moved(auto.Choice(auto.PROCESS, "moved", helpers=2), before)
    choice = policy.next_epoch(loader, whole)
    assert choice.mode == auto.THREADS
    assert "80.0 batches/s with helper processes against 100.0 with threads" in choice.reason


def test_the_helpers_pace_after_a_move_starts_once_the_batches_in_flight_are_delivered() -> None:
    """Between the decision to move and the move, the worker threads deliver the batches in
    flight quickly (20 in 0.05 s here): counted for helpers they would hide that helpers ran
    80 batches/s against the threads' 100 (95 over the whole time after the decision)."""
    loader = ThreadDataLoader(WherePid(), batch_size=4, num_workers=2, isolation="threads")
    list(loader)
    measured = loader.stats()
    decided = dataclasses.replace(measured, batches=100, wall_s=1.0)
    began = dataclasses.replace(measured, batches=120, wall_s=1.05)
    whole = dataclasses.replace(measured, batches=200, wall_s=2.05)
    policy = auto.AutoIsolation()
    policy.moved(auto.Choice(auto.PROCESS, "moved", helpers=2), decided, began)
    choice = policy.next_epoch(loader, whole)
    assert choice.mode == auto.THREADS
    assert "80.0 batches/s with helper processes against 100.0 with threads" in choice.reason
