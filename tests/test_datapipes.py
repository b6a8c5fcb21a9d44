"""torch DataPipes: sharded across worker threads and ranks, and seeded, exactly as torch does.

Each worker thread iterates its own deep copy of the graph (``_engine.datapipes``); torch's
``sharding_filter`` then keeps each worker's (and rank's) share, and shuffles use the shared seed
torch draws from the loader's generator. Every case compares with torch's DataLoader.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import torchrun
from torch.utils.data import DataLoader, MapDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper

from threadloader import ThreadDataLoader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's DataPipe deprecation


def _pipe(shuffle: bool = False) -> Any:
    pipe = IterableWrapper(range(30))
    return (pipe.shuffle() if shuffle else pipe).sharding_filter()


def _batches(loader: Any, epochs: int = 1) -> list[list[Any]]:
    out = []
    for _ in range(epochs):
        out.append([b.tolist() if isinstance(b, torch.Tensor) else b for b in loader])
    return out


def _both(epochs: int = 1, ours_only: Any = None, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    shuffle = kwargs.pop("shuffle_pipe", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _batches(
            DataLoader(_pipe(shuffle), generator=torch.Generator().manual_seed(5), **kwargs),
            epochs,
        )
        ours = _batches(
            ThreadDataLoader(
                _pipe(shuffle),
                generator=torch.Generator().manual_seed(5),
                **kwargs,
                **(ours_only or {}),
            ),
            epochs,
        )
    return ours, theirs


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "options",
    [{"batch_size": 4}, {"batch_size": 4, "drop_last": True}, {"batch_size": None}],
    ids=["batch4", "drop_last", "no-batching"],
)
def test_sharding_filter_splits_the_pipe_between_workers(
    num_workers: int, options: dict[str, Any]
) -> None:
    ours, theirs = _both(num_workers=num_workers, **options)
    assert ours == theirs
    flat = [x for b in ours[0] for x in (b if isinstance(b, list) else [b])]
    assert len(flat) == len(set(flat))  # no sample twice


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shuffled_pipe_uses_the_loaders_generator_as_torch_does(num_workers: int) -> None:
    ours, theirs = _both(num_workers=num_workers, batch_size=4, shuffle_pipe=True)
    assert ours == theirs
    assert sorted(x for b in ours[0] for x in b) == list(range(30))


@pytest.mark.parametrize("persistent", [False, True])
def test_each_epoch_is_reseeded_as_torch_does(persistent: bool) -> None:
    ours, theirs = _both(
        epochs=3, num_workers=2, batch_size=4, shuffle_pipe=True, persistent_workers=persistent
    )
    assert ours == theirs
    assert ours[0] != ours[1]  # a new order each epoch


def test_isolation_shards_as_torch_does() -> None:
    ours, theirs = _both(
        epochs=2,
        num_workers=2,
        batch_size=4,
        shuffle_pipe=True,
        persistent_workers=True,
        ours_only={"isolation": "process"},
    )
    assert ours == theirs


def test_the_users_worker_init_fn_runs_after_sharding() -> None:
    seen: list[tuple[int, int]] = []

    def init(worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        seen.append((worker_id, len(list(info.dataset))))  # this worker's shard only

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(ThreadDataLoader(_pipe(), batch_size=4, num_workers=3, worker_init_fn=init))
    assert sorted(seen) == [(0, 10), (1, 10), (2, 10)]


class _Uncopyable:
    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("cannot copy the holder")

    def __iter__(self) -> Any:
        return iter(range(4))


def test_an_uncopyable_pipe_raises_naming_why() -> None:
    pipe = IterableWrapper(_Uncopyable(), deepcopy=False).sharding_filter()
    with pytest.raises(RuntimeError, match=r"deepcopy failed.*cannot copy the holder"):
        list(ThreadDataLoader(pipe, batch_size=2, num_workers=2))


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"
)
def test_under_torchrun_each_rank_gets_torchs_shard(tmp_path: Path) -> None:
    script = Path(__file__).parent / "dist_scripts" / "datapipe_ranks.py"
    proc = torchrun([str(script), str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for nw in ("nw0", "nw2"):
        for rank in ranks:
            assert rank[nw]["thread"] == rank[nw]["torch"]
        shards = [{x for b in rank[nw]["thread"] for x in b} for rank in ranks]
        assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(24))


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_pipe_with_a_lambda_is_copied_for_each_worker(num_workers: int) -> None:
    """torch's forked workers never pickle the pipe; the copy must not need pickling either."""

    def make() -> Any:
        return IterableWrapper(range(12)).map(lambda x: x * 2).shuffle().sharding_filter()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers}
        theirs = list(DataLoader(make(), generator=torch.Generator().manual_seed(1), **kwargs))
        ours = list(ThreadDataLoader(make(), generator=torch.Generator().manual_seed(1), **kwargs))
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_walking_their_graphs_at_once_do_not_break_each_other(persistent: bool) -> None:
    """torch's graph walk sets class-wide pickle hooks; threads switching every microsecond (as
    free-threaded Python may) made concurrent sharding fail with "Attempt to override existing
    reduce_ex_hook" in every trial before the walks were serialised."""

    def make() -> Any:
        pipe = IterableWrapper(range(40)).shuffle().sharding_filter()
        for _ in range(30):
            pipe = pipe.map(abs)
        return pipe

    kwargs: dict[str, Any] = {"num_workers": 3, "batch_size": 4, "persistent_workers": persistent}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for trial in range(4):
                loader = ThreadDataLoader(
                    make(), generator=torch.Generator().manual_seed(trial), **kwargs
                )
                for _ in range(2):  # persistent workers reseed their graphs at once too
                    got = sorted(x for b in loader for x in b.tolist())
                    assert got == list(range(40))
    finally:
        sys.setswitchinterval(interval)


def test_every_graph_walk_holds_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic companion of the race test: torch's sharding and seeding, wherever they run
    (worker threads, the training thread's iterator code), run under the graph-walk lock."""
    from threadloader._engine import datapipes

    held: list[tuple[str, bool]] = []
    graph_settings = torch.utils.data.graph_settings
    for name in ("apply_sharding", "apply_random_seed"):
        original = getattr(graph_settings, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            held.append((_name, datapipes._GRAPH_LOCK.locked()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(graph_settings, name, spy)
    for options in ({"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}):
        loader = ThreadDataLoader(_pipe(shuffle=True), batch_size=4, **options)
        for _ in range(2):
            assert sorted(x for b in loader for x in b.tolist()) == list(range(30))
    assert {name for name, _ in held} == {"apply_sharding", "apply_random_seed"}
    assert all(locked for _, locked in held), held


class _SumOfShard(MapDataPipe):  # type: ignore[misc]
    """A map graph wrapping a sharded iterable one: each worker must shard its own copy."""

    def __init__(self) -> None:
        self.source = IterableWrapper(range(8)).sharding_filter()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return sum(self.source) * 100 + index


def test_a_map_graph_holding_a_sharding_node_is_copied_per_worker() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = [b.tolist() for b in DataLoader(_SumOfShard(), batch_size=2, num_workers=2)]
        ours = [b.tolist() for b in ThreadDataLoader(_SumOfShard(), batch_size=2, num_workers=2)]
    assert ours == theirs
    assert {b[0] // 100 for b in ours} == {12, 16}  # worker 0's shard sums to 12, worker 1's to 16
