"""Inside a worker thread, torch's get_worker_info() describes that worker as torch's would.

Seeds are compared with the ones torch's own process workers see for the same loader generator
seed: base_seed is drawn from the loader's generator, and worker w's seed is base_seed + w.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data._utils.worker as torch_worker_module
from helpers import assert_epochs_equal, collect, collect_epochs, torch_epochs
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import get_worker_info as imported_get_worker_info
from torch.utils.data._utils.worker import WorkerInfo
from torch.utils.data._utils.worker import get_worker_info as private_get_worker_info

from threadloader import ThreadDataLoader


def keep_list(items: list[Any]) -> list[Any]:
    """collate_fn that keeps a batch as the list of its items (seeds overflow int64 tensors)."""
    return items


class SeedReporter:
    """Map-style: item i is (i, worker id, worker seed) as get_worker_info() says at fetch time."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return (index, info.id, info.seed)


def _seeds_by_worker(epoch: list[list[tuple[int, int, int]]]) -> dict[int, int]:
    found: dict[int, set[int]] = {}
    for batch in epoch:
        for _, worker, seed in batch:
            found.setdefault(worker, set()).add(seed)
    assert all(len(seeds) == 1 for seeds in found.values()), found
    return {worker: seeds.pop() for worker, seeds in found.items()}


def _indices(epoch: list[list[tuple[int, int, int]]]) -> list[list[int]]:
    return [[index for index, _, _ in batch] for batch in epoch]


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_worker_seeds_equal_torch_process_workers_seeds(
    num_workers: int, shuffle: bool, persistent_workers: bool
) -> None:
    """Worker w's seed in each of two epochs equals torch's worker w seed for the same generator."""
    kwargs = {
        "batch_size": 2, "shuffle": shuffle, "num_workers": num_workers,
        "persistent_workers": persistent_workers, "collate_fn": keep_list,
    }  # fmt: skip
    theirs = torch_epochs(
        SeedReporter(), epochs=2, generator=torch.Generator().manual_seed(99), **kwargs
    )
    loader = ThreadDataLoader(SeedReporter(), generator=torch.Generator().manual_seed(99), **kwargs)
    ours = collect_epochs(loader, 2)
    for epoch in range(2):
        assert _indices(ours[epoch]) == _indices(theirs[epoch])
        reference = _seeds_by_worker(theirs[epoch])
        seen = _seeds_by_worker(ours[epoch])
        assert seen, "no item was fetched with a WorkerInfo"
        assert {w: reference[w] for w in seen} == seen


class InfoRecorder:
    """Map-style: records get_worker_info() and the thread of every fetch, by every import path."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        info = torch.utils.data.get_worker_info()
        self.calls.append(
            {
                "info": info,
                "imported": imported_get_worker_info(),
                "private": private_get_worker_info(),
                "module": torch_worker_module.get_worker_info(),
                "dataloader module": torch.utils.data.dataloader.get_worker_info(),
                "thread_safe_generator": torch.random.thread_safe_generator(),
                "ident": threading.get_ident(),
            }
        )
        return index


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_getitem_sees_this_workers_info(num_workers: int) -> None:
    """In __getitem__, get_worker_info() is a thread WorkerInfo for the worker's own copy of the
    dataset, id in range."""
    dataset = InfoRecorder()
    collect(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    assert len(dataset.calls) == 16  # the copies share the one list
    copies: dict[int, Any] = {}
    for call in dataset.calls:
        info = call["info"]
        assert isinstance(info, WorkerInfo)
        assert 0 <= info.id < num_workers
        assert info.num_workers == num_workers
        assert copies.setdefault(info.id, info.dataset) is info.dataset
        assert info.dataset is not dataset and type(info.dataset) is InfoRecorder
        assert info.worker_method == "thread"
        assert info.rng is not None
    assert len({id(copy) for copy in copies.values()}) == len(copies)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_every_import_path_of_get_worker_info_agrees(num_workers: int) -> None:
    """However get_worker_info was imported, it returns the same WorkerInfo inside a worker."""
    dataset = InfoRecorder()
    collect(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    for call in dataset.calls:
        for path in ["imported", "private", "module", "dataloader module"]:
            assert call[path] is call["info"], path


def test_get_worker_info_imported_before_threadloader_is_thread_aware() -> None:
    """A `from torch.utils.data import get_worker_info` done before importing threadloader works."""
    script = textwrap.dedent(
        """
        from torch.utils.data import get_worker_info
        from torch.utils.data._utils.worker import get_worker_info as private
        from torch.random import thread_safe_generator
        from threadloader import ThreadDataLoader

        class Data:
            def __len__(self):
                return 8
            def __getitem__(self, i):
                info = get_worker_info()
                assert info is not None and info is private()
                assert info.worker_method == "thread"
                assert thread_safe_generator() is info.rng.torch_generator
                return info.id

        ids = [int(i) for b in ThreadDataLoader(Data(), batch_size=2, num_workers=2) for i in b]
        assert get_worker_info() is None
        assert set(ids) <= {0, 1}, ids
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_workers_get_their_own_generators_on_a_torch_without_its_rng_container() -> None:
    """A torch before 2.13 has no ``_RNG``: threadloader imports, and each worker's
    ``WorkerInfo.rng`` still holds generators of its own, seeded as on a torch that has it."""
    script = textwrap.dedent(
        """
        import random, sys
        import torch
        import torch.utils.data._utils.worker as torch_worker
        from torch.utils.data import get_worker_info

        def draws(loader_cls):
            class Data:
                def __len__(self):
                    return 8
                def __getitem__(self, i):
                    rng = get_worker_info().rng
                    return (get_worker_info().id, rng.torch_generator.initial_seed(),
                            rng.random_generator.random(), torch.rand(1).item())
            gen = torch.Generator().manual_seed(3)
            loader = loader_cls(Data(), batch_size=2, num_workers=2, generator=gen,
                                collate_fn=list)
            return sorted(item for batch in loader for item in batch)

        if sys.argv[1] == "without":
            del torch_worker._RNG
        from threadloader import ThreadDataLoader
        print(draws(ThreadDataLoader))
        """
    )

    def run(case: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", script, case],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert run("without") == run("with")


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_thread_safe_generator_is_this_workers_generator(num_workers: int) -> None:
    """torch.random.thread_safe_generator() in a worker is a torch.Generator: its WorkerInfo's rng."""
    dataset = InfoRecorder()
    collect(ThreadDataLoader(dataset, batch_size=2, num_workers=num_workers))
    for call in dataset.calls:
        generator = call["thread_safe_generator"]
        assert isinstance(generator, torch.Generator)
        assert generator is call["info"].rng.torch_generator


def _generator_seeds(loader_seed: int, num_workers: int) -> dict[int, int]:
    dataset = InfoRecorder()
    generator = torch.Generator().manual_seed(loader_seed)
    collect(ThreadDataLoader(dataset, batch_size=1, num_workers=num_workers, generator=generator))
    seeds: dict[int, set[int]] = {}
    for call in dataset.calls:
        seeds.setdefault(call["info"].id, set()).add(call["thread_safe_generator"].initial_seed())
    assert all(len(s) == 1 for s in seeds.values()), seeds
    return {worker: s.pop() for worker, s in seeds.items()}


@pytest.mark.parametrize("num_workers", [2, 3])
def test_worker_generators_differ_between_workers_and_repeat_across_runs(num_workers: int) -> None:
    """Each worker's generator has its own seed, the same in a rerun with the same loader seed."""
    first = _generator_seeds(5, num_workers)
    assert len(set(first.values())) == len(first)
    again = _generator_seeds(5, num_workers)
    assert {w: again[w] for w in first if w in again} == {w: first[w] for w in again if w in first}
    other = _generator_seeds(6, num_workers)
    assert set(other.values()).isdisjoint(first.values())


class RandomStream(IterableDataset[Any]):
    """Each worker yields 4 draws from torch.random.thread_safe_generator() and its worker id."""

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        generator = torch.random.thread_safe_generator()
        assert info is not None and generator is not None
        for _ in range(4):
            yield info.id, torch.randint(0, 2**31, (3,), generator=generator)


def _random_stream(loader_seed: int, num_workers: int) -> list[Any]:
    generator = torch.Generator().manual_seed(loader_seed)
    loader = ThreadDataLoader(
        RandomStream(), batch_size=2, num_workers=num_workers, generator=generator
    )
    return collect(loader)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_per_worker_randomness_is_reproducible_from_the_loader_seed(num_workers: int) -> None:
    """Draws from thread_safe_generator() in an IterableDataset repeat exactly with the same seed."""
    first = _random_stream(17, num_workers)
    assert_epochs_equal(_random_stream(17, num_workers), first)
    draws = [tuple(row.tolist()) for _, values in first for row in values]
    assert len(set(draws)) == len(draws)  # workers do not share a random stream
    other = [tuple(row.tolist()) for _, values in _random_stream(18, num_workers) for row in values]
    assert set(other).isdisjoint(draws)


class Labelled(IterableDataset[Any]):
    """Yields its `label` attribute, which worker_init_fn sets on this worker's copy only."""

    label = "unset"

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for k in range(3):
            yield (self.label, k)


def label_this_workers_copy(worker_id: int) -> None:
    """worker_init_fn: label the worker's copy of the dataset with the worker's id."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.label = f"worker {worker_id}"


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_worker_init_fn_configures_only_its_workers_iterable_copy(num_workers: int) -> None:
    """worker_init_fn changing get_worker_info().dataset gives torch's output; the original keeps."""
    kwargs = {
        "batch_size": 2,
        "num_workers": num_workers,
        "worker_init_fn": label_this_workers_copy,
    }
    theirs = torch_epochs(Labelled(), **kwargs)[0]
    dataset = Labelled()
    ours = collect(ThreadDataLoader(dataset, **kwargs))
    assert_epochs_equal(ours, theirs)
    assert dataset.label == "unset"
    assert "label" not in vars(dataset)


class InitRecorder:
    """Records worker_init_fn calls and the threads that fetched items for each worker id."""

    def __init__(self) -> None:
        self.inits: list[tuple[int, WorkerInfo | None, int]] = []
        self.fetches: list[tuple[int, int]] = []

    def init(self, worker_id: int) -> None:
        self.inits.append((worker_id, torch.utils.data.get_worker_info(), threading.get_ident()))


class InitDataset:
    def __init__(self, recorder: InitRecorder) -> None:
        self.recorder = recorder

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        self.recorder.fetches.append((info.id, threading.get_ident()))
        return index


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_worker_init_fn_runs_once_per_worker_in_that_workers_thread(
    num_workers: int, persistent_workers: bool
) -> None:
    """worker_init_fn(w) runs once per worker (per epoch unless persistent), in w's own thread."""
    recorder = InitRecorder()
    dataset = InitDataset(recorder)
    loader = ThreadDataLoader(
        dataset, batch_size=2, num_workers=num_workers, worker_init_fn=recorder.init,
        persistent_workers=persistent_workers,
    )  # fmt: skip
    main = threading.get_ident()
    epochs = 3
    init_counts = []
    for _ in range(epochs):
        recorder.fetches.clear()
        collect(loader)
        init_counts.append(len(recorder.inits))
        thread_of = {worker: ident for worker, _, ident in recorder.inits[-num_workers:]}
        for worker, ident in recorder.fetches:
            assert ident in (thread_of[worker], main)
    if persistent_workers:
        assert init_counts == [num_workers] * epochs
    else:
        assert init_counts == [num_workers * (e + 1) for e in range(epochs)]
    for epoch_start in range(0, len(recorder.inits), num_workers):
        epoch_inits = recorder.inits[epoch_start : epoch_start + num_workers]
        assert sorted(w for w, _, _ in epoch_inits) == list(range(num_workers))
        assert len({ident for _, _, ident in epoch_inits}) == num_workers
        for worker, info, ident in epoch_inits:
            assert ident != main
            assert info is not None and info.id == worker and info.num_workers == num_workers
            assert info.dataset is not dataset and type(info.dataset) is type(dataset)
            assert info.worker_method == "thread"


def _seed_of_init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    _SEEN_IN_INIT.append((worker_id, info.seed))


_SEEN_IN_INIT: list[tuple[int, int]] = []


@pytest.mark.parametrize("num_workers", [1, 3])
def test_worker_init_fn_sees_torchs_worker_seed(num_workers: int) -> None:
    """In worker_init_fn, get_worker_info().seed is torch's seed for that worker id."""
    kwargs = {"batch_size": 2, "num_workers": num_workers, "collate_fn": keep_list}
    theirs = torch_epochs(SeedReporter(), generator=torch.Generator().manual_seed(3), **kwargs)[0]
    _SEEN_IN_INIT.clear()
    generator = torch.Generator().manual_seed(3)
    collect(
        ThreadDataLoader(
            SeedReporter(), generator=generator, worker_init_fn=_seed_of_init, **kwargs
        )
    )
    reference = _seeds_by_worker(theirs)
    assert sorted(_SEEN_IN_INIT) == sorted(reference.items())


class CollateRecorder:
    def __init__(self) -> None:
        self.infos: list[WorkerInfo | None] = []

    def __call__(self, items: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        self.infos.append(torch.utils.data.get_worker_info())
        return items


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_collate_fn_sees_the_worker_info_of_its_batch(num_workers: int) -> None:
    """In collate_fn, get_worker_info() is the WorkerInfo of the worker that fetched the batch."""
    collate = CollateRecorder()
    dataset = SeedReporter()
    batches = collect(
        ThreadDataLoader(dataset, batch_size=3, num_workers=num_workers, collate_fn=collate)
    )
    assert len(collate.infos) == len(batches) == 4
    by_batch = {tuple(i for i, _, _ in batch): batch[0][1] for batch in batches}
    assert all(info is not None for info in collate.infos)
    assert sorted(info.id for info in collate.infos) == sorted(by_batch.values())
    for info in collate.infos:
        assert info.num_workers == num_workers and type(info.dataset) is type(dataset)


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_get_worker_info_is_none_in_the_main_thread(num_workers: int) -> None:
    """get_worker_info() is None in the training thread before, during and after an epoch."""
    kwargs = {"num_workers": num_workers, "prefetch_factor": 4} if num_workers else {}
    loader = ThreadDataLoader(InfoRecorder(), batch_size=2, **kwargs)
    seen = [torch.utils.data.get_worker_info()]
    iterator = iter(loader)
    seen.append(torch.utils.data.get_worker_info())
    for _ in iterator:
        seen.append(torch.utils.data.get_worker_info())
        seen.append(imported_get_worker_info())
        seen.append(torch.random.thread_safe_generator())
    seen.append(torch.utils.data.get_worker_info())
    assert seen == [None] * len(seen)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_get_worker_info_is_none_in_other_user_threads(num_workers: int) -> None:
    """A thread of the user's own sees get_worker_info() None while loader workers run."""
    loader = ThreadDataLoader(InfoRecorder(), batch_size=2, num_workers=num_workers)
    iterator = iter(loader)
    next(iterator)
    seen: list[Any] = []
    other = threading.Thread(target=lambda: seen.append(torch.utils.data.get_worker_info()))
    other.start()
    other.join()
    collect(iterator)
    assert seen == [None]


class MainThreadOnly(InfoRecorder):
    def __getitem__(self, index: int) -> int:
        self.calls.append({"active": threading.active_count(), "info": imported_get_worker_info()})
        return super().__getitem__(index)


def _nothing(worker_id: int) -> None:
    raise AssertionError("worker_init_fn must not run without workers")


def test_num_workers_zero_fetches_in_the_calling_thread_like_torch() -> None:
    """With num_workers=0 items are fetched in the calling thread, no thread starts, no init runs."""
    dataset = MainThreadOnly()
    before = threading.active_count()
    ours = collect(ThreadDataLoader(dataset, batch_size=3, worker_init_fn=_nothing))
    assert_epochs_equal(ours, torch_epochs(InfoRecorder(), batch_size=3)[0])
    records = [c for c in dataset.calls if "active" in c]
    fetches = [c for c in dataset.calls if "ident" in c]
    assert {c["active"] for c in records} == {before}
    assert all(c["info"] is None for c in records)
    assert {c["ident"] for c in fetches} == {threading.get_ident()}
    assert all(c["thread_safe_generator"] is None for c in fetches)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_workers_leave_process_global_random_state_and_threads_alone(num_workers: int) -> None:
    """A threaded epoch does not reseed torch/random/numpy global RNGs or change torch threads."""
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    before = (
        torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
        torch.initial_seed(), torch.get_num_threads(),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    loader = ThreadDataLoader(
        SeedReporter(), batch_size=2, shuffle=True, generator=generator,
        num_workers=num_workers, collate_fn=keep_list,
    )  # fmt: skip
    collect(loader)
    after = (
        torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
        torch.initial_seed(), torch.get_num_threads(),
    )  # fmt: skip
    assert torch.equal(after[0], before[0])
    assert after[1] == before[1]
    assert np.array_equal(after[2], before[2])
    assert after[3:] == before[3:]


class IntraOpThreads:
    """Map-style: item i is where it was fetched (the training thread or another) and the number
    of intra-op threads torch uses there."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[bool, int]:
        time.sleep(0.002)
        return threading.current_thread() is threading.main_thread(), torch.get_num_threads()


def _threads_of_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_workers_run_torch_ops_on_one_intra_op_thread_like_torch_workers(num_workers: int) -> None:
    """Every item is made on one intra-op thread (``torch.get_num_threads() == 1``), as in
    torch's worker processes, also when the training thread runs a worker's task itself; the
    training thread and threads started after the loader keep the process's number."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # more than one, on any machine
    try:
        new_thread_before = _threads_of_a_new_thread()
        ours = collect(
            ThreadDataLoader(IntraOpThreads(), batch_size=2, num_workers=num_workers,
                             collate_fn=keep_list)
        )  # fmt: skip
        theirs = collect(
            DataLoader(IntraOpThreads(), batch_size=2, num_workers=num_workers,
                       collate_fn=keep_list)
        )  # fmt: skip
        assert {n for batch in theirs for _, n in batch} == {1}
        assert {n for batch in ours for _, n in batch} == {1}
        assert torch.get_num_threads() == 2
        assert _threads_of_a_new_thread() == new_thread_before == 2
    finally:
        torch.set_num_threads(before)


def test_one_intra_op_thread_without_an_openmp_runtime_found_leaves_other_threads_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the OpenMP runtime cannot be reached (no /proc), ``torch.set_num_threads`` makes
    the thread's number 1, and the number a later thread takes is put back."""
    from threadloader._primitives import intra_op

    monkeypatch.setattr(intra_op, "_openmp_setter", lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []

        def worker() -> None:
            intra_op.single_intra_op_thread()
            seen.append(torch.get_num_threads())

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert seen == [1]
        assert torch.get_num_threads() == 2
        assert _threads_of_a_new_thread() == 2
    finally:
        torch.set_num_threads(before)


def test_a_task_run_as_a_worker_without_an_openmp_runtime_found_starts_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training thread may run every batch as a worker: without the OpenMP runtime, each
    task's one intra-op thread and the number put back after cost no thread start."""
    from threadloader._primitives import intra_op

    monkeypatch.setattr(intra_op, "_openmp_setter", lambda: None)
    starts: list[threading.Thread] = []

    class Counted(threading.Thread):
        def start(self) -> None:
            starts.append(self)
            super().start()

    monkeypatch.setattr(intra_op.threading, "Thread", Counted)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        previous = intra_op.as_worker()
        assert torch.get_num_threads() == 1
        intra_op.restore(previous)
        assert previous == torch.get_num_threads() == 2
        assert starts == []
    finally:
        torch.set_num_threads(before)


class ForksAChild(torch.utils.data.Dataset[list[Any]]):
    """Item i forks a process that reports what get_worker_info() and the global RNG functions
    act on there (a dataset starting torch's DataLoader workers or a multiprocessing pool)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> list[Any]:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        theirs, ours = ctx.Pipe(duplex=False)

        def report() -> None:
            from threadloader._primitives import worker_globals

            ours.send([imported_get_worker_info() is None, worker_globals.current() is None])

        child = ctx.Process(target=report)
        child.start()
        got = theirs.recv()
        child.join()
        return [imported_get_worker_info() is not None, *got]


def test_a_process_forked_from_a_worker_thread_is_no_worker() -> None:
    """Forked from a worker thread, a process is no worker of ours: get_worker_info() answers
    torch's module global (None here; a torch worker's own there) and the global RNG functions
    act on the process's generators, as in a process forked from any other thread."""
    batches = list(ThreadDataLoader(ForksAChild(), batch_size=None, num_workers=1))
    assert batches == [[True, True, True], [True, True, True]]
