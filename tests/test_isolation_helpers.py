"""isolation="process" with several helper processes: worker ``w`` runs in helper ``w % P``.

Nothing a user sees depends on P: the batches, their order, which worker made which batch, the
workers' seeds, errors, resume and stats are torch's, as with one helper. What P changes: the
worker threads run on P processes (P GILs), each holding one copy of the dataset, and every one
of them ends with the epoch.
"""

from __future__ import annotations

import functools
import gc
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from helpers import (
    assert_epochs_equal,
    assert_outcomes_match,
    assert_same_multiset,
    collect,
    collect_epochs,
    torch_epochs,
    torch_outcomes,
)
from test_isolation import (
    PICKLED,
    CountsPickling,
    SlowItems,
    _all_outcomes,
    _fast_helper_starts,  # noqa: F401  # the module's autouse fixtures, here too
    _helpers,
    _no_helper_left_behind,  # noqa: F401
    _wait_gone,
)
from test_resume import Ids, StatefulShards, assert_resumes_exactly
from test_same_batches_as_torch import SCENARIOS, Dicts, SizedStream
from test_worker_errors import FailsAtFive
from test_worker_info import SeedReporter, _seeds_by_worker, keep_list
from torch.utils.data import Dataset, default_collate, get_worker_info

import threadloader
from threadloader import ThreadDataLoader
from threadloader.isolation.parent import combined_stats
from threadloader.remote import RemoteStats


def _loader(dataset: Any, *, helpers: int, **kwargs: Any) -> ThreadDataLoader[Any]:
    return ThreadDataLoader(dataset, isolation="process", helpers=helpers, **kwargs)


@pytest.mark.parametrize(("num_workers", "helpers"), [(2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("scenario", ["shuffle with generator", "dicts", "__getitems__"])
def test_same_batches_in_same_order_as_dataloader(
    scenario: str, num_workers: int, helpers: int
) -> None:
    """Every batch equals torch's, in torch's order, however the workers are spread."""
    make_dataset, make_kwargs = SCENARIOS[scenario]
    theirs = torch_epochs(make_dataset(), **make_kwargs())[0]
    loader = _loader(make_dataset(), helpers=helpers, num_workers=num_workers, **make_kwargs())
    assert_epochs_equal(collect(loader), theirs)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_three_shuffled_epochs_match_dataloader(persistent_workers: bool) -> None:
    """Three epochs, shuffled, with and without persistent workers: torch's three."""
    make_dataset, make_kwargs = SCENARIOS["tensors shuffled"]
    kwargs = {**make_kwargs(), "num_workers": 3, "persistent_workers": persistent_workers}
    theirs = torch_epochs(make_dataset(), epochs=3, **kwargs)
    kwargs["generator"] = make_kwargs()["generator"]  # a fresh one, as torch_epochs had
    loader = _loader(make_dataset(), helpers=2, **kwargs)
    ours = collect_epochs(loader, 3)
    for epoch in range(3):
        assert_epochs_equal(ours[epoch], theirs[epoch])
    del loader
    gc.collect()


def test_in_order_false_yields_the_same_multiset_of_batches() -> None:
    """in_order=False: torch's batches, each exactly once, from both helpers."""
    kwargs = {"batch_size": 3, "shuffle": True}
    theirs = torch_epochs(Dicts(), generator=torch.Generator().manual_seed(8), **kwargs)[0]
    loader = _loader(
        Dicts(), helpers=2, generator=torch.Generator().manual_seed(8), in_order=False,
        num_workers=2, **kwargs,
    )  # fmt: skip
    assert_same_multiset(collect(loader), theirs)


def test_iterable_dataset_is_sharded_and_ordered_like_dataloader() -> None:
    """Sharding by get_worker_info() gives torch's batches in torch's order over 2 helpers."""
    theirs = torch_epochs(SizedStream(actual=23), batch_size=3, num_workers=3)[0]
    ours = collect(_loader(SizedStream(actual=23), helpers=2, batch_size=3, num_workers=3))
    assert_epochs_equal(ours, theirs)


def test_worker_seeds_equal_torch_process_workers_seeds() -> None:
    """Worker w's seed equals torch's worker w seed, whichever helper runs it."""
    kwargs = {"batch_size": 2, "shuffle": True, "num_workers": 3, "collate_fn": keep_list}
    theirs = torch_epochs(SeedReporter(), generator=torch.Generator().manual_seed(99), **kwargs)
    loader = _loader(
        SeedReporter(), helpers=2, generator=torch.Generator().manual_seed(99), **kwargs
    )
    ours = collect_epochs(loader, 1)
    assert _seeds_by_worker(ours[0]) == _seeds_by_worker(theirs[0])


class WhereMade(Dataset[Any]):
    """Item i: (i, the worker that made it, the process it was made in)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = get_worker_info()
        assert info is not None
        return index, info.id, os.getpid()


def test_worker_w_runs_in_helper_w_mod_p() -> None:
    """4 workers over 2 helpers: workers 0 and 2 in one process, 1 and 3 in the other."""
    iterator = iter(_loader(WhereMade(), helpers=2, batch_size=2, num_workers=4))
    pids = iterator.helper_pids  # type: ignore[attr-defined]
    made_in: dict[int, set[int]] = {}
    for batch in iterator:
        for worker, pid in zip(batch[1].tolist(), batch[2].tolist(), strict=True):
            made_in.setdefault(worker, set()).add(pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert made_in == {w: {pids[w % 2]} for w in range(4)}


def test_helpers_started_together_receive_one_pickle_of_the_dataset() -> None:
    """Three workers over two helpers: the dataset is pickled once per epoch for both."""
    CountsPickling.pickled = 0
    loader = _loader(
        CountsPickling(), helpers=2, batch_size=2, num_workers=3, multiprocessing_context=PICKLED
    )
    for epoch in range(2):
        assert [int(x) for b in loader for x in b] == list(range(12))
        assert CountsPickling.pickled == epoch + 1


class CountsPicklingWithCopyregTypes(CountsPickling):
    """Holds objects that ``ForkingPickler`` reduces through copyreg: nothing per process."""

    def __init__(self) -> None:
        self.pattern, self.scale = re.compile("a+"), 1 + 0j


class CountsPicklingWithATensor(CountsPickling):
    """Holds a tensor: its shared memory travels to each helper as a descriptor of its own."""

    def __init__(self) -> None:
        self.values = torch.arange(12) * 10

    def __getitem__(self, index: int) -> int:
        return int(self.values[index])


@pytest.mark.parametrize(
    ("dataset_type", "pickles"),
    [(CountsPicklingWithCopyregTypes, 1), (CountsPicklingWithATensor, 2)],
)
def test_one_pickle_serves_both_helpers_unless_it_carries_shared_memory(
    dataset_type: type[CountsPickling], pickles: int
) -> None:
    """A compiled regex, a complex number, a ``functools.partial`` collate_fn: one pickle serves
    both helpers. A tensor's shared memory travels to one process as a descriptor of its own:
    each helper gets its pickle. Both read the dataset's values."""
    dataset_type.pickled = 0
    loader = _loader(
        dataset_type(),
        helpers=2,
        batch_size=2,
        num_workers=2,
        collate_fn=functools.partial(default_collate),
        multiprocessing_context=PICKLED,
    )
    expected = [dataset_type()[i] for i in range(12)]
    assert [int(x) for b in loader for x in b] == expected
    assert dataset_type.pickled == pickles


@pytest.mark.parametrize("cut", [1, 4])
def test_resume_yields_exactly_the_batches_not_yet_seen(cut: int) -> None:
    """A state taken after ``cut`` batches resumes with exactly the rest."""
    assert_resumes_exactly(
        lambda: _loader(
            Ids(), helpers=2, batch_size=8, shuffle=True, num_workers=3,
            generator=torch.Generator().manual_seed(7),
        ),
        cut,
    )  # fmt: skip


def test_stateful_iterable_dataset_resumes_per_worker() -> None:
    """Each worker's IterableDataset state comes back from its own helper and resumes there."""
    assert_resumes_exactly(
        lambda: _loader(StatefulShards(), helpers=2, batch_size=4, num_workers=2), 3
    )


def test_getitem_error_is_raised_from_next_and_the_epoch_goes_on() -> None:
    """A __getitem__ error in one helper reaches next() as torch's; later batches follow."""
    kwargs = {"batch_size": 2, "num_workers": 2}
    theirs = torch_outcomes(FailsAtFive(), limit=30, **kwargs)
    ours = _all_outcomes(_loader(FailsAtFive(), helpers=2, **kwargs))
    assert_outcomes_match(ours, theirs, ["cannot read item 5"])


def test_one_helper_killed_raises_naming_its_pid_and_ends_the_others() -> None:
    """A helper that dies makes next() raise with its pid; the other helper ends too."""
    iterator = iter(_loader(SlowItems(delay=0.05), helpers=2, batch_size=2, num_workers=2))
    next(iterator)
    pids = list(iterator.helper_pids)  # type: ignore[attr-defined]
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"pid\(s\) {pids[1]}\) exited unexpectedly"):
        for _ in range(40):
            next(iterator)
    del iterator
    assert _wait_gone(pids) == []


def test_a_persistent_loader_that_lost_a_helper_starts_new_ones_at_its_next_epoch() -> None:
    """A persistent loader's helper dies between epochs: the next epoch raises naming it (as
    torch's), ends the other helper, and the epoch after runs on new helpers with every batch
    (it raised "this iterator was closed" at every later iter())."""
    loader = _loader(Ids(16), helpers=2, batch_size=4, num_workers=2, persistent_workers=True)
    expected = [b.tolist() for b in loader]
    pids = list(loader._iterator.helper_pids)  # type: ignore[union-attr]
    os.kill(pids[1], signal.SIGKILL)
    assert _wait_gone([pids[1]]) == []
    with pytest.raises(RuntimeError, match=rf"pid\(s\) {pids[1]}\) exited unexpectedly"):
        list(loader)
    assert _wait_gone(pids) == []
    assert [b.tolist() for b in loader] == expected
    assert not set(loader._iterator.helper_pids) & set(pids)  # type: ignore[union-attr]
    del loader


def test_every_helper_ends_after_break_and_after_exhaustion() -> None:
    """break (then del) and the end of the epoch each end every helper."""
    loader = _loader(Ids(400), helpers=3, batch_size=4, num_workers=3)
    iterator = iter(loader)
    next(iterator)
    assert len(_helpers()) == 3
    pids = list(iterator.helper_pids)  # type: ignore[attr-defined]
    del iterator
    assert _helpers() == [] and _wait_gone(pids) == []
    assert len(list(_loader(Ids(40), helpers=2, batch_size=4, num_workers=2))) == 10
    assert _helpers() == []


def test_stats_count_every_helpers_batches() -> None:
    """stats(): every batch, from both helpers, with their fetch times and fetching threads."""
    loader = _loader(SlowItems(n=32, delay=0.01), helpers=2, batch_size=4, num_workers=2)
    assert len(collect(loader)) == 8
    stats = loader.stats()
    assert stats.batches == 8 and stats.num_workers == 2
    assert stats.stages["fetch"].count == 8 and stats.stages["fetch"].total_s > 0.25
    assert all(busy > 0.1 for busy in stats.worker_busy_s)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"isolation": "process", "helpers": 0}, ValueError, "between 1 and num_workers=2"),
        ({"isolation": "process", "helpers": 3}, ValueError, "between 1 and num_workers=2"),
        ({"helpers": 2, "isolation": "threads"}, ValueError, "needs isolation='process'"),
        ({"isolation": "process", "helpers": 1.5}, TypeError, "helpers must be an int"),
        ({"isolation": "process", "helpers": True}, TypeError, "helpers must be an int"),
    ],
)
def test_bad_helpers_are_refused_naming_the_cause(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """A helper count that cannot work is refused when the loader is built."""
    with pytest.raises(error, match=match):
        ThreadDataLoader(Ids(), num_workers=2, **kwargs)


def _remote_stats(reads: int, skipped: tuple[str, ...]) -> RemoteStats:
    return RemoteStats(
        reads=reads, read_bytes=10 * reads, read_s=0.5 * reads, retries=1, failures=0,
        skipped=len(skipped), cache_hits=2, cache_misses=reads, cache_hit_bytes=4,
        cache_stored_bytes=8, cache_evictions=0, skipped_urls=skipped,
    )  # fmt: skip


def test_dataset_stats_of_the_helpers_add_up() -> None:
    """RemoteFiles' counters from two helpers' copies are summed; other types keep the latest."""
    a, b = _remote_stats(3, ("s3://x/1",)), _remote_stats(5, ("s3://x/2",))
    total = combined_stats([a, None, b])
    assert total.reads == 8 and total.read_bytes == 80 and total.read_s == 4.0
    assert total.retries == 2 and total.skipped_urls == ("s3://x/1", "s3://x/2")
    assert combined_stats([None, a]) is a and combined_stats([None, None]) is None
    assert combined_stats([{"n": 1}, {"n": 2}]) == {"n": 2}


def _run_script(tmp_path: Any, source: str, **environ: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    repo = str(pathlib.Path(threadloader.__file__).parents[1])  # this checkout's, not installed
    env = {
        **os.environ, **environ,
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip


def test_building_an_isolated_loader_forks_the_zygote(tmp_path: Any) -> None:
    """With only the main thread running, building the loader forks the zygote, not a
    forkserver: no second interpreter imports torch (tests/test_isolation_zygote.py says which
    process each helper is forked from)."""
    done = _run_script(
        tmp_path,
        """
        import multiprocessing.forkserver as forkserver
        import time

        import psutil
        from threadloader import ThreadDataLoader
        from threadloader.isolation import zygote

        if __name__ == "__main__":
            assert zygote.server_pid() is None
            loader = ThreadDataLoader(list(range(8)), num_workers=2, isolation="process", helpers=2)
            server = zygote.server_pid()
            deadline = time.monotonic() + 10  # it names itself once it runs
            while psutil.Process(server).name() != "threadloader-zy" and time.monotonic() < deadline:
                time.sleep(0.01)
            print("zygote", server is not None, psutil.Process(server).name())
            print("batches", len(list(loader)))
            print("forkserver", forkserver._forkserver._forkserver_pid is not None)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "zygote", "True", "threadloader-zy", "batches", "8",
        "forkserver", "False",
    ]  # fmt: skip


def test_a_forked_helper_collects_none_of_the_objects_it_inherited(tmp_path: Any) -> None:
    """A helper forked from the training process freezes what it inherited before it builds a
    worker: its collections never visit (and so never copy) the training process's objects,
    whose first full collection cost 100-400 ms before each epoch's first batch (helper
    point 5). Every epoch forks new helpers; both epochs' must be frozen."""
    done = _run_script(
        tmp_path,
        """
        import gc
        import os

        import torch
        from threadloader import ThreadDataLoader

        class FreezeCount(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return torch.tensor([gc.get_freeze_count(), os.getpid()])

        if __name__ == "__main__":
            loader = ThreadDataLoader(
                FreezeCount(), batch_size=2, num_workers=2, isolation="process", helpers=2
            )
            for epoch in range(2):
                inherited = len(gc.get_objects())
                for batch in loader:
                    for frozen, pid in batch.tolist():
                        assert pid != os.getpid()
                        print(frozen >= inherited // 2, frozen, inherited)
        """,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8
    assert all(line.startswith("True") for line in lines), lines


@pytest.mark.parametrize("long_tmpdir", [False, True])
def test_building_an_isolated_loader_with_threads_running_starts_the_forkserver(
    tmp_path: Any, long_tmpdir: bool
) -> None:
    """A Python thread running when the loader is built: never fork then; the forkserver starts
    when the loader is built, so it imports torch while the script builds its model. Its socket
    is bound under ``TMPDIR``, and a socket path over ~100 bytes cannot be: with a longer
    ``TMPDIR`` the helpers come from ``spawn`` instead of failing with ``OSError: AF_UNIX path
    too long``."""
    environ = {}
    if long_tmpdir:
        long_tmp = tmp_path / ("t" * max(1, 120 - len(str(tmp_path))))
        long_tmp.mkdir()
        environ["TMPDIR"] = str(long_tmp)
    done = _run_script(
        tmp_path,
        """
        import multiprocessing.forkserver as forkserver
        import threading
        from threadloader import ThreadDataLoader
        from threadloader.isolation import zygote

        if __name__ == "__main__":
            stop = threading.Event()
            busy = threading.Thread(target=stop.wait)
            busy.start()
            try:
                assert forkserver._forkserver._forkserver_pid is None
                loader = ThreadDataLoader(list(range(8)), num_workers=2, isolation="process")
                print("started", forkserver._forkserver._forkserver_pid is not None)
                print("zygote", zygote.server_pid() is not None)
                print("batches", [batch.tolist() for batch in loader] == [[i] for i in range(8)])
            finally:
                stop.set()
                busy.join()
        """,
        **environ,
    )
    assert done.returncode == 0, done.stderr
    started = str(not long_tmpdir)
    assert done.stdout.split() == ["started", started, "zygote", "False", "batches", "True"]


def test_a_loader_built_at_module_level_starts_one_server(tmp_path: Any) -> None:
    """A script that builds its loader outside ``if __name__ == "__main__"`` runs: the server,
    importing the script as multiprocessing does, does not start a server of its own."""
    done = _run_script(
        tmp_path,
        """
        from threadloader import ThreadDataLoader

        loader = ThreadDataLoader(list(range(8)), num_workers=2, isolation="process", helpers=2)

        if __name__ == "__main__":
            print("batches", len(list(loader)))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["batches", "8"]


def test_helpers_never_pin_so_a_training_process_using_cuda_can_fork_them(
    tmp_path: Any,
) -> None:
    """A process forked from one that initialised CUDA fails at its first CUDA call
    (``Tensor.is_pinned()`` included). Here every pinning call raises outside the training
    process, as it would there: the helpers, forked from it, collate numbers, tensors and a
    type with its own ``pin_memory()`` without one, and the batches are the in-process ones."""
    done = _run_script(
        tmp_path,
        """
        import os
        import torch
        from torch.utils.data._utils.collate import default_collate_fn_map
        from threadloader import ThreadDataLoader

        TRAINING = os.getpid()

        def cuda_only_in_training(original):
            def call(self, *args, **kwargs):
                if os.getpid() != TRAINING:
                    raise RuntimeError("CUDA error: initialization error")
                return original(self, *args, **kwargs)
            return call

        torch.Tensor.is_pinned = cuda_only_in_training(torch.Tensor.is_pinned)
        torch.Tensor.pin_memory = cuda_only_in_training(torch.Tensor.pin_memory)

        class Box:
            def __init__(self, i):
                self.i = i
            def __eq__(self, other):
                return self.i == other.i
            def pin_memory(self):
                if os.getpid() != TRAINING:
                    raise RuntimeError("CUDA error: initialization error")
                return self

        def collate_boxes(batch, *, collate_fn_map=None):
            return Box(tuple(box.i for box in batch))  # a batch type with its own pin_memory()

        default_collate_fn_map[Box] = collate_boxes

        class Items:
            def __len__(self):
                return 24
            def __getitem__(self, i):
                return {"x": torch.full((3, 4), i), "label": i, "score": i / 2, "box": Box(i)}

        def epochs(isolation):
            loader = ThreadDataLoader(Items(), batch_size=4, num_workers=2, shuffle=True,
                                      generator=torch.Generator().manual_seed(0),
                                      persistent_workers=True, isolation=isolation,
                                      **({"helpers": 2} if isolation == "process" else {}))
            return [[(b["x"].tolist(), b["label"].tolist(), b["score"].tolist(), b["box"])
                     for b in loader] for _ in range(2)]

        if __name__ == "__main__":
            assert epochs("process") == epochs("threads")
            print("ok")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


def test_helpers_started_before_one_that_failed_to_start_are_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second helper's start fails: iter() raises its error, and the first helper, already
    running, is killed and waited for (no zombie left for the training process's lifetime)."""
    from threadloader.isolation import link

    started: list[Any] = []
    real_start = link._start_process

    def second_fails(ctx: Any, **kwargs: Any) -> Any:
        if started:
            raise OSError("no more processes")
        started.append(real_start(ctx, **kwargs))
        return started[-1]

    monkeypatch.setattr(link, "_start_process", second_fails)
    with pytest.raises(OSError, match="no more processes"):
        iter(_loader(Ids(40), helpers=2, batch_size=4, num_workers=2))
    assert len(started) == 1 and started[0].exitcode is not None


class _Part:
    """Something a dataset's ``__reduce__`` makes while it is pickled."""


def _rebuild(part: _Part, values: torch.Tensor) -> list[Any]:
    return [part, values]


def test_pickling_for_a_helper_keeps_only_what_torch_s_reductions_made() -> None:
    """Between pickling a helper's start and its launch, what torch's reductions made (a tensor
    whose descriptor goes with the launch) is kept, and nothing else the pickler saw: the memo
    of a dataset of millions of objects is larger than its pickle."""
    import weakref

    from threadloader.isolation.helper import PickledOnce

    made: list[Any] = []

    class MakesParts:
        def __reduce__(self) -> Any:
            part, values = _Part(), torch.arange(4.0)
            made.extend([weakref.ref(part), weakref.ref(values)])
            return _rebuild, (part, values)

    once = PickledOnce(MakesParts())
    data = once.__getstate__()
    gc.collect()
    part, values = made
    assert part() is None
    assert values() is not None and values().is_shared()
    once.release()
    gc.collect()
    assert values() is None
    assert len(data) > 0
