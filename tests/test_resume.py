"""A state taken mid-epoch resumes exactly: the batches not yet seen, in order, nothing else."""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import assert_resumes_exactly, cut_and_resume
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    get_worker_info,
)

from threadloader import DistributedShuffleSampler, ShuffleSampler, ThreadDataLoader
from threadloader.streams import Mixture, MixtureSampler


class SharedCount:
    """A count every worker's copy of a dataset adds to (a copy is shallow); picklable."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.value += 1

    def __getstate__(self) -> int:
        return self.value

    def __setstate__(self, value: int) -> None:
        self.value, self.lock = value, threading.Lock()


class Ids(Dataset[torch.Tensor]):
    """Item i is i; counts reads so a test can prove resume re-reads nothing."""

    def __init__(self, n: int = 100) -> None:
        self.n = n
        self.read = SharedCount()

    @property
    def reads(self) -> int:
        return self.read.value

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.read.add()
        return torch.tensor(i)


class Shards(IterableDataset[int]):
    """Worker w yields its own shard; with state_dict, it remembers how far it got."""

    def __init__(self, n: int = 50, stateful: bool = True) -> None:
        self.n = n
        self.pos = 0
        self.stateful = stateful

    def _mine(self) -> list[int]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return [i for i in range(self.n) if i % (nw + 1) == wid or (wid == 0 and i % 7 == 0)]

    def __iter__(self) -> Iterator[int]:
        items = self._mine()
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0


class StatefulShards(Shards):
    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


CUTS = [0, 1, 5, 12]


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_exactly_the_batches_not_yet_seen(cut: int, num_workers: int) -> None:
    """Shuffled map-style epoch with a seeded generator: the rest of the epoch, in order."""
    assert_resumes_exactly(
        lambda: ThreadDataLoader(
            Ids(),
            batch_size=8,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(7),
        ),
        cut,
    )


@pytest.mark.parametrize("cut", [0, 3, 11])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_resume_with_global_rng_shuffle(cut: int, num_workers: int) -> None:
    """shuffle=True without a generator resumes the same permutation, from torch's global RNG."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(Ids(), batch_size=8, shuffle=True, num_workers=num_workers)

    torch.manual_seed(3)
    reference = list(make())
    torch.manual_seed(3)
    loader = make()
    seen = list(itertools.islice(iter(loader), cut))
    state = loader.state_dict()
    torch.manual_seed(12345)  # the resuming process's RNG is elsewhere
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    user_rng = torch.get_rng_state()  # after iter(): torch draws the base seed from it there
    rest = list(it)
    assert torch.equal(torch.cat(seen + rest), torch.cat(reference))
    if num_workers == 0:  # the sampler's first draw happened under the saved RNG, not the user's
        assert torch.equal(torch.get_rng_state(), user_rng)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_never_rereads_map_style_data(num_workers: int) -> None:
    """Map-style resume fast-forwards the index stream: only the remaining items are read."""
    loader = ThreadDataLoader(Ids(), batch_size=10, shuffle=True, num_workers=num_workers)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it
    fresh = Ids()
    resumed = ThreadDataLoader(fresh, batch_size=10, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert sum(len(b) for b in resumed) == 60
    assert fresh.reads == 60


@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_state_is_consumer_aligned_not_prefetch_aligned(num_workers: int) -> None:
    """state_dict() counts batches the loop received, however many workers prefetched."""
    loader = ThreadDataLoader(Ids(), batch_size=4, num_workers=num_workers)
    it = iter(loader)
    next(it), next(it), next(it)
    assert loader.state_dict()["batches_yielded"] == 3


@pytest.mark.parametrize("cut", [0, 2, 9])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_resume_with_shuffle_sampler_is_positional(
    cut: int, num_workers: int, batch_size: int | None
) -> None:
    """With threadloader's ShuffleSampler the loader resumes at the sampler's cursor."""
    assert_resumes_exactly(
        lambda: ThreadDataLoader(
            Ids(60),
            batch_size=batch_size,
            sampler=ShuffleSampler(60, seed=4),
            num_workers=num_workers,
        ),
        cut,
    )


@pytest.mark.parametrize("cut", [1, 4])
def test_resume_with_persistent_workers_in_a_later_epoch(cut: int) -> None:
    """A persistent loader saved mid-way through its second epoch resumes that epoch exactly."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(40),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(1),
        )

    reference = make()
    list(reference)
    second = list(reference)
    loader = make()
    list(loader)
    seen = list(itertools.islice(iter(loader), cut))
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert torch.equal(torch.cat(seen + rest), torch.cat(second))
    assert state["epoch"] == 2


def test_state_after_an_epoch_starts_the_next_one() -> None:
    """A state taken after an epoch ended makes the next iter() the following epoch."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(30), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    reference = make()
    list(reference)
    second = list(reference)
    loader = make()
    list(loader)
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(torch.cat(list(resumed)), torch.cat(second))


@pytest.mark.parametrize("cut", [0, 1, 4, 7])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_stateful_iterable_dataset_resumes_per_worker(cut: int, num_workers: int) -> None:
    """Each worker's IterableDataset copy resumes from its state at its last delivered batch."""
    assert_resumes_exactly(
        lambda: ThreadDataLoader(StatefulShards(), batch_size=3, num_workers=num_workers), cut
    )


class SlowFirstShard(IterableDataset[int]):
    """Worker w yields w, w + N, ... below 9; worker 0 sleeps before its first item, so the other
    workers' ends arrive before batches made ahead of them are delivered."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        while wid + self.pos * nw < 9:
            if wid == 0 and self.pos == 0:
                time.sleep(0.3)
            self.pos += 1
            yield wid + (self.pos - 1) * nw

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_worker_whose_end_arrived_before_its_last_batches_resumes_them(
    isolation: str, in_order: bool
) -> None:
    """A worker's end of data counts in the state only once its earlier batches were delivered:
    a state taken before that resumes the worker, and no batch of it is lost."""
    make = lambda: ThreadDataLoader(
        SlowFirstShard(), batch_size=3, num_workers=4, isolation=isolation, in_order=in_order
    )
    loader = make()
    it = iter(loader)
    first = [next(it).tolist()]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed]
    if in_order:
        assert first + rest == [[0, 4, 8], [1, 5], [2, 6], [3, 7]]
    else:
        assert sorted(map(tuple, first + rest)) == [(0, 4, 8), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_without_state_is_replayed_with_a_warning(num_workers: int) -> None:
    """An IterableDataset without state_dict resumes by replaying, and says so."""
    make = lambda: ThreadDataLoader(Shards(stateful=False), batch_size=3, num_workers=num_workers)
    reference = list(make())
    loader = make()
    it = iter(loader)
    seen = [next(it) for _ in range(4)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="fetching and dropping the first 4 batches"):
        rest = list(resumed)
    assert [b.tolist() for b in seen + rest] == [b.tolist() for b in reference]


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (0, 2), (3, 0), (1, 2), (0, 1)])
def test_a_replayed_iterable_is_refused_on_another_number_of_workers(
    saved: int, loaded: int
) -> None:
    """Replaying drops as many batches of each worker as the loop had received, and the workers
    shard the dataset by their number: on another number of workers the resumed epoch would
    repeat and skip items, so the state is refused naming the cause (no worker and one make
    one stream alike: that resume goes on), and a state taken between epochs still starts the
    next one."""
    make = lambda n: ThreadDataLoader(Shards(stateful=False), batch_size=3, num_workers=n)
    loader = make(saved)
    it = iter(loader)
    seen = [next(it).tolist()]
    mid = loader.state_dict()
    del it
    if max(saved, 1) == max(loaded, 1):
        resumed = make(loaded)
        resumed.load_state_dict(mid)
        with pytest.warns(UserWarning, match="fetching and dropping"):
            seen += [b.tolist() for b in resumed]
        assert seen == [b.tolist() for b in make(saved)]
        return
    with pytest.raises(ValueError, match=f"saved with num_workers={saved}.*same number of workers"):
        make(loaded).load_state_dict(mid)
    list(loader)
    resumed = make(loaded)
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == [b.tolist() for b in make(loaded)]


def _rank_loader(n: int, world: int, rank: int, drop_last: bool) -> ThreadDataLoader[Any]:
    sampler = DistributedShuffleSampler(
        Ids(n), num_replicas=world, rank=rank, seed=9, drop_last=drop_last
    )
    return ThreadDataLoader(Ids(n), batch_size=4, sampler=sampler, num_workers=2)


@pytest.mark.parametrize(("old", "new"), [(4, 3), (4, 6), (2, 5)])
@pytest.mark.parametrize("n", [96, 100])
def test_resume_on_another_world_size_sees_each_sample_once(old: int, new: int, n: int) -> None:
    """Saved on W ranks after k batches each, resumed on W' ranks: the epoch, each id once."""
    seen: Counter[int] = Counter()
    states = []
    for rank in range(old):
        loader = _rank_loader(n, old, rank, drop_last=True)
        it = iter(loader)
        for batch in itertools.islice(it, 3):
            seen.update(batch.tolist())
        states.append(loader.state_dict())
        del it
    assert all(s["sampler"] == states[0]["sampler"] for s in states)  # lockstep: same state
    for rank in range(new):
        loader = _rank_loader(n, new, rank, drop_last=True)
        loader.load_state_dict(states[rank % old])
        for batch in loader:
            seen.update(batch.tolist())
    assert max(seen.values()) == 1
    assert len(seen) >= n - new - old * 4  # only tails shorter than a batch or a rank are dropped


@pytest.mark.parametrize("sampler", ["shuffle", "mixture", "torch_distributed"])
@pytest.mark.parametrize("batch_size", [None, 1, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_finished_epochs_state_with_set_epoch_of_that_epoch_has_an_empty_rest(
    sampler: str, batch_size: int | None, num_workers: int
) -> None:
    """Saved after the epoch's last batch, loaded, set_epoch of that epoch (a loop that stored
    the epoch it was in): the rest is empty, then the next epoch is read in full. With
    ``batch_size=None`` and workers the sampler itself is the index sampler, whose pass torch's
    iterator begins twice; the second began the epoch over (11 samples read again). torch's
    ``DistributedSampler`` read the whole epoch again (``StatefulDataLoader`` gives the empty
    rest)."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        dataset: Any = list(range(11))
        if sampler == "shuffle":
            sampler_: Any = ShuffleSampler(11, seed=0)
        elif sampler == "torch_distributed":
            sampler_ = DistributedSampler(dataset, num_replicas=1, rank=0, seed=3)
        else:
            dataset = Mixture({"a": range(6), "b": range(6, 11)}, {"a": 0.5, "b": 0.5})
            sampler_ = MixtureSampler(dataset, samples_per_epoch=11)
        loader = ThreadDataLoader(
            dataset, batch_size=batch_size, sampler=sampler_, num_workers=num_workers
        )
        return loader, sampler_

    saving, saving_sampler = make()
    saving_sampler.set_epoch(1)
    it = iter(saving)
    _ = [next(it) for _ in range(len(saving))]  # every batch; StopIteration not yet raised
    state = saving.state_dict()
    assert next(it, None) is None
    saving_sampler.set_epoch(2)
    expected = [torch.as_tensor(b).tolist() for b in saving]
    loaded, loaded_sampler = make()
    loaded.load_state_dict(state)
    loaded_sampler.set_epoch(1)
    assert list(loaded) == []
    loaded_sampler.set_epoch(2)
    assert [torch.as_tensor(b).tolist() for b in loaded] == expected


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_after_a_distributed_samplers_epoch_starts_the_next_in_full_without_set_epoch(
    num_workers: int,
) -> None:
    """A loop that never calls set_epoch (the order stays; shuffle=False): a state taken after
    the epoch's StopIteration starts the next epoch in full, though the sampler stands at the
    epoch the state ended (an earlier version made it empty)."""

    def make() -> ThreadDataLoader[Any]:
        data = list(range(12))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
        return ThreadDataLoader(data, batch_size=2, sampler=sampler, num_workers=num_workers)

    loader = make()
    first = [b.tolist() for b in loader]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == first == [b.tolist() for b in loader]


@pytest.mark.parametrize("sampler", ["distributed", "mixture"])
@pytest.mark.parametrize(("old", "new"), [(4, 1), (4, 2), (4, 3), (2, 1)])
@pytest.mark.parametrize("length", [30, 10])
def test_a_finished_epoch_resumed_on_another_world_size_has_an_empty_rest(
    sampler: str, old: int, new: int, length: int
) -> None:
    """Saved at an epoch's last step with the loader's drop_last, whose ranks left a partial
    batch each unread: that epoch is over on any world size. A loop that starts again at it gets
    an empty rest, not the left-out indices as one more batch; then the next epoch, in full.
    Also for an epoch of no batch on the saving ranks (2 samples a rank of 4, batch 3), whose
    sampler pass a loader without workers never began."""

    def make(world: int, rank: int) -> tuple[ThreadDataLoader[Any], Any]:
        dataset: Any = range(length)
        if sampler == "distributed":
            sampler_: Any = DistributedShuffleSampler(
                dataset, num_replicas=world, rank=rank, drop_last=length < 30
            )
        else:
            dataset = Mixture({"a": range(20), "b": range(20, 30)}, {"a": 0.5, "b": 0.5})
            sampler_ = MixtureSampler(dataset, world, rank, samples_per_epoch=length)
        loader = ThreadDataLoader(dataset, batch_size=3, sampler=sampler_, drop_last=True)
        return loader, sampler_

    states = []
    for rank in range(old):
        loader, sampler_ = make(old, rank)
        sampler_.set_epoch(0)
        it = iter(loader)
        _ = [next(it) for _ in range(len(loader))]  # the epoch's last batch; no StopIteration
        del it  # a checkpoint taken outside the loop
        states.append(loader.state_dict())
    for rank in range(new):
        loader, sampler_ = make(new, rank)
        loader.load_state_dict(states[rank % old])
        sampler_.set_epoch(0)
        assert list(loader) == []
        if sampler == "distributed":  # a mixture's next epoch starts where this one ended
            sampler_.set_epoch(1)
            fresh, fresh_sampler = make(new, rank)
            fresh_sampler.set_epoch(1)
            assert [b.tolist() for b in loader] == [b.tolist() for b in fresh]


def _twelve_in_threes(sampler: str, num_workers: int) -> tuple[ThreadDataLoader[Any], Any]:
    """A loader of 12 samples in batches of 3 on one rank, and its sampler: ``shuffle``,
    ``distributed`` (ours), ``torch`` (``DistributedSampler``) or ``mixture``."""
    dataset: Any = range(12)
    if sampler == "shuffle":
        sampler_: Any = ShuffleSampler(dataset, seed=1)
    elif sampler == "distributed":
        sampler_ = DistributedShuffleSampler(dataset, num_replicas=1, rank=0, seed=1)
    elif sampler == "torch":
        sampler_ = DistributedSampler(dataset, num_replicas=1, rank=0, seed=1)
    else:
        dataset = Mixture({"a": range(8), "b": range(8, 12)}, {"a": 0.5, "b": 0.5})
        sampler_ = MixtureSampler(dataset, 1, 0, samples_per_epoch=12)
    loader = ThreadDataLoader(dataset, batch_size=3, sampler=sampler_, num_workers=num_workers)
    return loader, sampler_


@pytest.mark.parametrize("left_after", [None, 2])
@pytest.mark.parametrize("sampler", ["shuffle", "distributed", "mixture", "torch"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_after_set_epoch_of_the_next_epoch_resumes_it_in_full(
    sampler: str, num_workers: int, left_after: int | None
) -> None:
    """A loop that checkpoints at the top of an epoch, after set_epoch and before iter(): the
    resumed run reads that whole epoch, as the uninterrupted one does; also when the loop left
    the epoch before with ``break`` (Lightning's ``limit_train_batches``)."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        return _twelve_in_threes(sampler, num_workers)

    loader, sampler_ = make()
    if left_after is None:
        assert len(list(loader)) == 4
    else:
        it = iter(loader)
        _ = [next(it) for _ in range(left_after)]
        del it  # break
    sampler_.set_epoch(1)
    state = loader.state_dict()
    expected = [b.tolist() for b in loader]
    resumed, resumed_sampler = make()
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(1)
    assert len(expected) == 4
    assert [b.tolist() for b in resumed] == expected


class SelfAdvancingOrder(torch.utils.data.Sampler[int]):
    """A sampler that moves its own epoch on as its pass ends, as Accelerate's
    ``SeedableRandomSampler`` does; no state of its own."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        __import__("random").Random(self.epoch).shuffle(order)
        yield from order
        self.epoch += 1

    def __len__(self) -> int:
        return self.n


def test_a_sampler_moving_its_own_epoch_on_as_workers_draw_its_end_keeps_the_epoch() -> None:
    """Workers draw the pass to its end ahead of the loop, and the sampler's epoch moves on then:
    the loop has not left the epoch, and a state taken after its first batch resumes its rest."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            list(range(7)), batch_size=2, sampler=SelfAdvancingOrder(7), num_workers=2
        )

    loader = make()
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 10
    while loader.sampler.epoch == 0 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    assert loader.sampler.epoch == 1  # type: ignore[attr-defined]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest


def _resumed_mid_epoch(
    sampler: str,
    num_workers: int,
    saved_on: int,
    world: int,
    length: int,
    drop_last: bool,
    device: str | None = None,
) -> Any:
    """A loader on rank 0 of ``world`` that loaded a state saved one batch into epoch 0 on
    ``saved_on`` ranks (a resumed pass starting past the epoch's start), and a maker of fresh
    loaders of the same kind."""

    def make(ranks: int) -> tuple[ThreadDataLoader[Any], Any]:
        dataset: Any = range(length)
        if sampler == "shuffle":
            sampler_: Any = ShuffleSampler(dataset, seed=1)
        elif sampler == "distributed":
            sampler_ = DistributedShuffleSampler(dataset, ranks, 0, seed=1, drop_last=drop_last)
        else:
            half = length // 2
            dataset = Mixture({"a": range(half), "b": range(half, length)}, {"a": 0.5, "b": 0.5})
            sampler_ = MixtureSampler(dataset, ranks, 0, samples_per_epoch=length)
        loader = ThreadDataLoader(
            dataset,
            batch_size=2,
            sampler=sampler_,
            num_workers=num_workers,
            drop_last=drop_last,
            device=device,
        )
        return loader, sampler_

    saving, _ = make(saved_on)
    it = iter(saving)
    next(it)
    state = saving.state_dict()
    del it
    loader, _ = make(world)
    loader.load_state_dict(state)
    return loader, make


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("sampler", ["shuffle", "distributed", "mixture"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_before_the_first_batch_of_an_epochs_second_pass_resumes_that_pass(
    sampler: str, num_workers: int, device: str | None
) -> None:
    """After a resumed pass, iter() again without set_epoch reads the epoch from its start (as
    torch's samplers do); a state taken before that pass's first batch resumes it in full, not
    at the resumed pass's start (device=: the transfer thread may have begun that pass)."""
    loader, make = _resumed_mid_epoch(sampler, num_workers, 2, 1, 13, False, device)
    list(loader)  # the resumed rest of epoch 0
    it = iter(loader)
    state = loader.state_dict()
    expected = [b.tolist() for b in it]
    assert expected  # a whole pass
    resumed, _ = make(1)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == expected


@pytest.mark.parametrize("sampler", ["shuffle", "distributed", "mixture"])
def test_a_resumed_iterator_dropped_before_its_first_batch_uses_the_resume_up(
    sampler: str,
) -> None:
    """load_state_dict(), iter() dropped before its first batch, iter() again: the resume was
    the first iterator's, and the second reads the whole epoch from its start, whether workers
    drew ahead or not (a mixture's epoch ends where the saving world size ended it: 12)."""
    passes = []
    for num_workers in (0, 2):
        loader, _ = _resumed_mid_epoch(sampler, num_workers, 2, 1, length=13, drop_last=False)
        it = iter(loader)
        del it
        passes.append([b.tolist() for b in loader])
    assert passes[0] == passes[1]
    assert sum(map(len, passes[0])) == (12 if sampler == "mixture" else 13)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_finished_epochs_state_used_up_by_an_iterator_dropped_unstarted_resumes_as_the_original(
    num_workers: int,
) -> None:
    """A state taken at an epoch's end; the loader that saved it and one that loaded it each
    make an iterator and drop it before its first batch, set the same epoch, and iterate: both
    read the epoch again in full (the dropped iterator used the loaded state up)."""

    def make() -> tuple[ThreadDataLoader[Any], ShuffleSampler]:
        sampler = ShuffleSampler(range(6), seed=1)
        loader = ThreadDataLoader(range(6), batch_size=2, sampler=sampler, num_workers=num_workers)
        return loader, sampler

    saving, saving_sampler = make()
    list(saving)
    resumed, resumed_sampler = make()
    resumed.load_state_dict(saving.state_dict())
    runs = []
    for loader, sampler in ((saving, saving_sampler), (resumed, resumed_sampler)):
        it = iter(loader)
        del it
        sampler.set_epoch(0)
        runs.append([b.tolist() for b in loader])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_weight_change_before_the_first_batch_of_an_epochs_second_pass_applies_to_all_of_it(
    num_workers: int,
) -> None:
    """After a resumed pass, iter() again reads the epoch from its start; a weight change before
    its first batch applies from that start, as to a mixture that had those weights all along."""
    loader, _ = _resumed_mid_epoch("mixture", num_workers, 2, 1, length=13, drop_last=False)
    list(loader)  # the resumed rest of epoch 0: positions 4 to 11
    weights = {"a": 0.9, "b": 0.1}
    it = iter(loader)
    assert loader.set_mixture_weights(weights) == 0
    mixture = Mixture({"a": range(6), "b": range(6, 13)}, {"a": 0.5, "b": 0.5})
    mixture.set_weights(weights)
    reference = ThreadDataLoader(
        mixture, batch_size=2, sampler=MixtureSampler(mixture, 1, 0, samples_per_epoch=12)
    )
    assert [b.tolist() for b in it] == [b.tolist() for b in reference]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_of_no_batch_after_a_resumed_pass_saves_its_own_end(num_workers: int) -> None:
    """A second pass of the epoch with no batch on this rank (drop_last) saves where that pass
    ends, as a loader that never resumed saves after the same whole epoch."""
    loader, make = _resumed_mid_epoch("distributed", num_workers, 1, 4, length=6, drop_last=True)
    assert list(loader) == []  # positions 2-5 of the epoch on 4 ranks: 1 index each
    assert list(loader) == []  # the epoch again from its start: 1 index each
    fresh, _ = make(4)
    assert list(fresh) == []
    assert loader.state_dict()["sampler"] == fresh.state_dict()["sampler"]


def _loaded_at_epoch(
    make: Callable[[], tuple[Any, Any]], state: dict[str, Any], epoch: int, again: bool
) -> Any:
    """A loader ``make()`` gives, loaded with ``state``, then ``set_epoch(epoch)`` (a loop that
    goes on at that epoch); with ``again``, the state that one gives before ``iter()``, loaded
    into another the same way."""
    loaded, sampler = make()
    loaded.load_state_dict(state)
    sampler.set_epoch(epoch)
    if again:
        return _loaded_at_epoch(make, loaded.state_dict(), epoch, again=False)
    return loaded


@pytest.mark.parametrize("sampler", ["torch", "shuffle", "mixture"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_of_another_epoch_after_loading_a_mid_epoch_state_starts_that_epoch(
    sampler: str, num_workers: int
) -> None:
    """A mid-epoch state loaded, then set_epoch(next epoch) before iter() (a loop that goes on
    at the next epoch): the loaded epoch is left, and that epoch is read in full, as without
    the load; a state taken before iter() says so too."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        return _twelve_in_threes(sampler, num_workers)

    saving, _ = make()
    it = iter(saving)
    next(it)
    state = saving.state_dict()
    del it
    uninterrupted, uninterrupted_sampler = make()
    list(uninterrupted)
    uninterrupted_sampler.set_epoch(1)
    expected = [b.tolist() for b in uninterrupted]
    assert len(expected) == 4
    for take_state in (False, True):
        loaded = _loaded_at_epoch(make, state, 1, again=take_state)
        assert [b.tolist() for b in loaded] == expected


class SeedsAndDraws(Dataset[tuple[int, int, float]]):
    """Item ``i`` with its worker's seed and a draw from the worker's global RNG."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, float]:
        info = get_worker_info()
        return i, info.seed if info is not None else -1, torch.rand(1).item()


def test_after_loading_a_left_epochs_state_the_next_epoch_draws_as_the_saving_loops() -> None:
    """A state taken after a break, loaded, then set_epoch of the next epoch: that epoch's
    iterator draws its base seed from the loader's generator as the left epoch left it, as the
    saving loop's next iter() did (it drew the left epoch's seed again: same worker seeds and
    draws); a state taken before that iter() says so too."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        dataset = SeedsAndDraws()
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
        generator = torch.Generator().manual_seed(46)
        loader = ThreadDataLoader(
            dataset,
            batch_size=2,
            sampler=sampler,
            num_workers=1,
            collate_fn=list,
            generator=generator,
        )
        return loader, sampler

    saving, sampler = make()
    sampler.set_epoch(1)
    it = iter(saving)
    next(it)
    del it  # break
    state = saving.state_dict()
    sampler.set_epoch(2)
    expected = list(saving)
    for take_state in (False, True):
        assert list(_loaded_at_epoch(make, state, 2, again=take_state)) == expected, take_state


def test_bad_states_raise_naming_the_mismatch() -> None:
    """Malformed, foreign or mismatched states raise ValueError naming the problem."""
    loader = ThreadDataLoader(Ids(20), batch_size=4)
    good = loader.state_dict()
    with pytest.raises(ValueError, match="must be a dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):
        loader.load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="format version 99"):
        loader.load_state_dict({**good, "version": 99})
    with pytest.raises(ValueError, match="length 20, this dataset has length 21"):
        ThreadDataLoader(Ids(21), batch_size=4).load_state_dict(good)
    with pytest.raises(ValueError, match="is for a map dataset, this is iterable"):
        ThreadDataLoader(StatefulShards(), batch_size=4).load_state_dict(good)
    with pytest.raises(ValueError, match="generator"):
        ThreadDataLoader(
            Ids(20), batch_size=4, generator=torch.Generator().manual_seed(1)
        ).load_state_dict(good)
    stateful = ThreadDataLoader(StatefulShards(), batch_size=2, num_workers=2)
    it = iter(stateful)
    next(it)
    mid = stateful.state_dict()
    del it
    with pytest.raises(ValueError, match="same number of workers"):
        ThreadDataLoader(StatefulShards(), batch_size=2, num_workers=3).load_state_dict(mid)
    with pytest.raises(ValueError, match="2 IterableDataset worker states, this loader has num_wo"):
        ThreadDataLoader(StatefulShards(), batch_size=2, num_workers=0).load_state_dict(mid)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("in_progress", "no", "in_progress must be a bool"),
        ("epoch", -5, "epoch must be an int >= 0"),
        ("epoch", torch.tensor(3), "epoch must be an int"),
        ("next_worker", -1, "next_worker must be an int >= 0"),
        ("batches_yielded", True, "batches_yielded must be an int"),
        ("position", True, "position must be an int"),
        ("delivered_ahead", [True], "not a position and the sorted positions"),
        ("base_seed", None, "base_seed must be an int"),
        ("rng_state", torch.zeros(3, dtype=torch.uint8), "not a global RNG state"),
        ("global_rng_state", torch.zeros(3, dtype=torch.uint8), "not a torch global RNG state"),
        ("worker_states", 5, "worker_states must be a list"),
        ("worker_states", [3], r"entries must be None or \{'dataset'"),
        ("workers_status", "x", "workers_status must be a list of bools"),
        ("worker_rng_states", 5, "worker_rng_states must be a list of worker generator"),
        ("worker_rng_states", [1, 2], "worker_rng_states must be a list of worker generator"),
        ("worker_rng_states_at_start", "ab", "worker_rng_states_at_start must be a list"),
    ],
)
def test_malformed_fields_raise_before_anything_changes(key: str, value: Any, match: str) -> None:
    """A field of the wrong type or range raises ValueError naming it, before the sampler's
    epoch or state is touched (a TypeError used to come after set_epoch had run)."""
    source = ThreadDataLoader(Ids(20), batch_size=4, sampler=ShuffleSampler(20, seed=1))
    it = iter(source)
    next(it)
    state = {**source.state_dict(), key: value}
    del it
    target = ThreadDataLoader(Ids(20), batch_size=4, sampler=ShuffleSampler(20, seed=1))
    target.sampler.set_epoch(7)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert target.sampler.epoch == 7 and target.sampler.state_dict()["cursor"] == 0


def test_a_mid_epoch_state_needs_the_same_batches_to_resume_a_torch_sampler() -> None:
    """A torch sampler's position counts batches: another batch size (or sampler type) would
    resume elsewhere, silently; it raises. ShuffleSampler keeps a cursor in samples and
    resumes across the change."""
    loader = ThreadDataLoader(Ids(40), batch_size=4, shuffle=True)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    del it
    with pytest.raises(ValueError, match="batch_size=4, this loader has batch_size=8"):
        ThreadDataLoader(Ids(40), batch_size=8, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="RandomSampler sampler, this loader samples with"):
        ThreadDataLoader(Ids(40), batch_size=4).load_state_dict(state)
    source = ThreadDataLoader(Ids(40), batch_size=4, sampler=ShuffleSampler(40, seed=2))
    it = iter(source)
    seen = [x for _ in range(2) for x in next(it).tolist()]
    state = source.state_dict()
    del it
    wider = ThreadDataLoader(Ids(40), batch_size=8, sampler=ShuffleSampler(40, seed=2))
    wider.load_state_dict(state)
    rest = [x for b in wider for x in b.tolist()]
    assert sorted(seen + rest) == list(range(40))


def test_replayed_sampler_refuses_another_world_size(monkeypatch) -> None:
    """A torch sampler cannot resume on another world size; the error says why."""
    loader = ThreadDataLoader(Ids(40), batch_size=4, shuffle=True)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), "world_size": 8, "sampler_ranks": 8}
    with pytest.raises(ValueError, match="over 8 ranks, this loader's shares it over 1 ranks"):
        ThreadDataLoader(Ids(40), batch_size=4, shuffle=True).load_state_dict(state)


def _mid_epoch_state(loader: ThreadDataLoader[Any], batches: int = 2) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    del it
    return state


def test_a_torch_distributed_sampler_refuses_another_num_replicas() -> None:
    """A data-parallel group smaller than the world: the sampler's num_replicas, given apart
    from torch.distributed, is what the state's position counts in (2 -> 4 lost 8 of 20)."""

    def make(replicas: int) -> ThreadDataLoader[Any]:
        sampler = DistributedSampler(Ids(20), num_replicas=replicas, rank=0, seed=1)
        return ThreadDataLoader(Ids(20), batch_size=2, sampler=sampler)

    state = _mid_epoch_state(make(2))
    with pytest.raises(ValueError, match="over 2 ranks, this loader's shares it over 4 ranks"):
        make(4).load_state_dict(state)
    rest = list(DistributedSampler(Ids(20), num_replicas=2, rank=0, seed=1))[4:]
    same = make(2)
    same.load_state_dict(state)
    assert [x for b in same for x in b.tolist()] == rest
    # A state saved before sampler_ranks existed, on the same sampler: it resumes as before.
    old = make(2)
    old.load_state_dict({k: v for k, v in state.items() if k != "sampler_ranks"})
    assert [x for b in old for x in b.tolist()] == rest


def test_a_shuffle_sampler_inside_a_batch_sampler_refuses_another_num_replicas() -> None:
    """Only a sampler passed as sampler= resumes elastically: inside a user's BatchSampler it is
    replayed, which is right on the same number of ranks only."""

    def make(replicas: int) -> ThreadDataLoader[Any]:
        sampler = DistributedShuffleSampler(20, num_replicas=replicas, rank=0, seed=0)
        return ThreadDataLoader(Ids(20), batch_sampler=BatchSampler(sampler, 2, False))

    state = _mid_epoch_state(make(2))
    with pytest.raises(ValueError, match="one inside a batch_sampler too"):
        make(4).load_state_dict(state)


def test_a_replayed_iterable_refuses_another_batch_size_or_world_size() -> None:
    def make(batch_size: int) -> ThreadDataLoader[Any]:
        return ThreadDataLoader(Shards(stateful=False), batch_size=batch_size, num_workers=2)

    state = _mid_epoch_state(make(3), batches=3)
    with pytest.raises(ValueError, match="batch_size=3, this loader has batch_size=4"):
        make(4).load_state_dict(state)
    with pytest.raises(ValueError, match="saved mid-epoch on 2 ranks, this run has 1"):
        make(3).load_state_dict({**state, "world_size": 2})


@pytest.mark.parametrize(
    ("saved", "loaded", "batch_size"), [((1, True), (0, False), 2), ((0, False), (1, True), None)]
)
def test_an_iterable_state_between_epochs_with_and_without_workers_starts_the_dataset_afresh(
    saved: tuple[int, bool], loaded: tuple[int, bool], batch_size: int | None
) -> None:
    """A worker copy's state at its epoch's end is not the dataset's own: 1 worker -> 0 read an
    empty next epoch, 0 -> 1 persistent worker lost the next epoch's first item."""

    def make(workers: int, persistent: bool) -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            StatefulShards(10),
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=persistent,
        )

    saving = make(*saved)
    list(saving)
    state = saving.state_dict()
    loader = make(*loaded)
    with pytest.warns(UserWarning, match="saved between epochs with num_workers"):
        loader.load_state_dict(state)
    expected = [b for b in make(*loaded)]
    assert [torch.as_tensor(b).tolist() for b in loader] == [
        torch.as_tensor(b).tolist() for b in expected
    ]


def test_a_state_with_a_sampler_epoch_that_is_no_int_is_refused_at_load() -> None:
    loader = ThreadDataLoader(Ids(20), batch_size=2, sampler=DistributedSampler(Ids(20), 1, 0))
    state = _mid_epoch_state(loader)
    with pytest.raises(ValueError, match=r"sampler_epoch must be an int or None, got 1\.5"):
        ThreadDataLoader(
            Ids(20), batch_size=2, sampler=DistributedSampler(Ids(20), 1, 0)
        ).load_state_dict({**state, "sampler_epoch": 1.5})


def test_state_is_plain_data() -> None:
    """The state holds only Python scalars, lists, dicts, None and tensors."""

    def plain(x: object) -> bool:
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (bool, int, float, str, torch.Tensor))

    loader = ThreadDataLoader(StatefulShards(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    assert plain(loader.state_dict())
    del it


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler_kind", ["shuffle", "distributed", "torch"])
def test_a_resumed_epoch_can_be_saved_and_resumed_again(
    num_workers: int, sampler_kind: str
) -> None:
    """Save after 3 batches, resume, save again after 2 more, resume: the epoch, exactly."""

    def make() -> ThreadDataLoader[Any]:
        if sampler_kind == "torch":
            return ThreadDataLoader(
                Ids(80),
                batch_size=4,
                shuffle=True,
                num_workers=num_workers,
                generator=torch.Generator().manual_seed(3),
            )
        sampler = (
            ShuffleSampler(80, seed=2)
            if sampler_kind == "shuffle"
            else DistributedShuffleSampler(Ids(80), num_replicas=1, rank=0, seed=2)
        )
        return ThreadDataLoader(Ids(80), batch_size=4, sampler=sampler, num_workers=num_workers)

    reference = torch.cat(list(make())).tolist()
    first = make()
    it = iter(first)
    got = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    it = iter(second)
    got += [next(it) for _ in range(2)]
    state = second.state_dict()
    assert state["batches_yielded"] == 5
    del it
    third = make()
    third.load_state_dict(state)
    got += list(third)
    assert torch.cat(got).tolist() == reference


def test_state_round_trips_through_torch_distributed_checkpoint(tmp_path) -> None:
    """dcp.save / dcp.load of the state (no process group) resumes exactly."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(100), batch_size=4, sampler=ShuffleSampler(100, seed=1), num_workers=2
        )

    reference = torch.cat(list(make())).tolist()
    loader = make()
    it = iter(loader)
    seen = [next(it) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp warns that it runs without a process group
        dcp.save({"loader": loader.state_dict()}, checkpoint_id=str(tmp_path))
        resumed = make()
        target = {"loader": resumed.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(target["loader"])
    assert torch.cat(seen + list(resumed)).tolist() == reference


class SlowItems(Dataset[int]):
    """Item i is i; the items in ``slow`` take 0.5 s, so later batches overtake theirs (also
    when a helper process's threads start late on a loaded machine: at 0.2 s they did not,
    once in three full runs of this file beside another)."""

    def __init__(self, slow: frozenset[int] = frozenset(), n: int = 24) -> None:
        self.n, self.slow = n, slow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.slow:
            time.sleep(0.5)
        return i


def _items(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in (b if isinstance(b, torch.Tensor) else [b])]


class ResumableOrder(torch.utils.data.Sampler[int]):
    """A user's sampler as StatefulDataLoader's contract has it: its order comes from Python's
    random, a new one each pass, and ``state_dict`` says where in the pass it is, which
    ``load_state_dict`` and the next ``__iter__`` resume."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.rng = n, __import__("random").Random(seed)
        self.yielded, self.pass_rng = 0, self.rng.getstate()
        self.resume_at: int | None = None

    def __iter__(self) -> Iterator[int]:
        start, self.resume_at = self.resume_at or 0, None
        if start:
            self.rng.setstate(self.pass_rng)
        self.pass_rng = self.rng.getstate()
        order = list(range(self.n))
        self.rng.shuffle(order)
        self.yielded = start
        for i in order[start:]:
            self.yielded += 1
            yield i

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded, "pass_rng": self.pass_rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_at, self.pass_rng = state["yielded"], state["pass_rng"]


def _sampler(kind: str, dataset: Any, seed: int) -> Any:
    """None (sequential), our positional ShuffleSampler, torch's replayed RandomSampler, or a
    user's sampler that keeps its own state."""
    if kind == "sequential":
        return None
    if kind == "shuffle":
        return ShuffleSampler(dataset, seed=seed)
    if kind == "own":
        return ResumableOrder(len(dataset), seed=seed)
    return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))


def _out_of_order_loader(sampler_kind: str, num_workers: int, **kwargs: Any) -> Any:
    """Batches of 2 of 24 items; the epoch's first batch is slow when ``slow_first``."""
    slow_first = kwargs.pop("slow_first", False)

    def make(dataset: SlowItems, **extra: Any) -> Any:
        sampler = _sampler(sampler_kind, dataset, seed=3)
        return ThreadDataLoader(dataset, batch_size=2, sampler=sampler, **extra)

    slow = frozenset(_items([next(iter(make(SlowItems())))])) if slow_first else frozenset()
    return make(SlowItems(slow), num_workers=num_workers, **kwargs)


@pytest.mark.parametrize("isolation", [None, "process"])
@pytest.mark.parametrize("resume_workers", [0, 2, 3])
@pytest.mark.parametrize("sampler_kind", ["sequential", "shuffle", "torch", "own"])
def test_resume_after_out_of_order_delivery_loses_and_repeats_nothing(
    sampler_kind: str, resume_workers: int, isolation: str | None
) -> None:
    """in_order=False delivers later batches before slow earlier ones: the state remembers
    which were delivered, and the resumed epoch delivers exactly the others (_state point 7)."""
    # A timeout keeps the training thread from making batches itself: workers make them all.
    # On a loaded machine a helper process's second thread may start after the slow batch is
    # made: the scenario is set up again then (the resume is what is tested).
    for _ in range(3):
        loader = _out_of_order_loader(
            sampler_kind, 2, in_order=False, isolation=isolation, timeout=30, slow_first=True
        )
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        state = loader.state_dict()
        del it
        if state["delivered_ahead"]:
            break
    assert state["delivered_ahead"], "nothing was delivered out of order: the scenario is wrong"
    resumed = _out_of_order_loader(sampler_kind, resume_workers, in_order=False)
    resumed.load_state_dict(state)
    rest = list(resumed)
    seen = _items(first) + _items(rest)
    assert sorted(seen) == list(range(24))


@pytest.mark.parametrize(
    ("sampler_kind", "second_batches"),
    [("sequential", 4), ("shuffle", 4), ("torch", 4), ("own", 4), ("own", 1)],
)
def test_an_out_of_order_state_resumed_then_saved_again_resumes_exactly(
    sampler_kind: str, second_batches: int
) -> None:
    """A resumed pass skips the positions delivered before the save; a state taken in it
    counts past them, so a second resume neither repeats nor loses a batch. One batch into
    the second pass, a sampler with its own state was last saved before the skipped
    positions: the state says so (``_state`` point 11)."""
    loader = _out_of_order_loader(sampler_kind, 2, in_order=False, timeout=30, slow_first=True)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    assert state["delivered_ahead"], "nothing was delivered out of order: the scenario is wrong"
    second_loader = _out_of_order_loader(sampler_kind, 0)
    second_loader.load_state_dict(state)
    it = iter(second_loader)
    second = [next(it) for _ in range(second_batches)]
    state = second_loader.state_dict()
    del it
    third_loader = _out_of_order_loader(sampler_kind, 2)
    third_loader.load_state_dict(state)
    seen = _items(first) + _items(second) + _items(list(third_loader))
    assert sorted(seen) == list(range(24))


class FailsAt(Dataset[int]):
    """Item i is i; item ``bad`` raises ValueError."""

    def __init__(self, n: int = 16, bad: int = 5) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise ValueError(f"item {i} is corrupt")
        return i


@pytest.mark.parametrize("sampler_kind", ["sequential", "shuffle", "torch"])
@pytest.mark.parametrize(("num_workers", "isolation"), [(0, None), (2, None), (2, "process")])
def test_a_caught_worker_error_counts_as_a_used_batch_in_the_state(
    num_workers: int, sampler_kind: str, isolation: str | None
) -> None:
    """The loop catches a batch's error and goes on, as torch allows: that batch's indices were
    used, so a resume neither repeats the batch after it nor loses one (_state point 7)."""

    def make(workers: int, **kwargs: Any) -> Any:
        dataset = FailsAt()
        sampler = _sampler(sampler_kind, dataset, seed=1)
        return ThreadDataLoader(
            dataset, batch_size=1, sampler=sampler, num_workers=workers, **kwargs
        )

    loader = make(num_workers, isolation=isolation)
    it = iter(loader)
    seen, errors = [], 0
    while errors == 0 or len(seen) < 8:
        try:
            seen.append(int(next(it)))
        except ValueError:
            errors += 1
    state = loader.state_dict()
    del it
    assert state["batches_yielded"] == len(seen)  # torch's count: returned batches only
    resumed = make(2 - num_workers)
    resumed.load_state_dict(state)
    rest = [int(b) for b in resumed]
    assert sorted(seen + rest) == [i for i in range(16) if i != 5]


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_right_after_an_error_resumes_after_the_failed_batch(
    num_workers: int, device: str | None
) -> None:
    """The error was the last thing the loop received: the state counts its batch as used, also
    with device=, where the error rides the transfer stage in its batch's place."""

    def make() -> Any:
        return ThreadDataLoader(FailsAt(), batch_size=1, num_workers=num_workers, device=device)

    loader = make()
    it = iter(loader)
    seen = [int(next(it)) for _ in range(5)]
    with pytest.raises(ValueError, match="item 5"):
        next(it)
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert seen + [int(b) for b in resumed] == [i for i in range(16) if i != 5]


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 0},
        {"num_workers": 2},
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 1, "persistent_workers": True, "isolation": "process"},
    ],
    ids=["inline", "threads", "persistent", "persistent-isolation"],
)
@pytest.mark.parametrize("sampler_kind", ["torch", "shuffle"])
def test_a_state_taken_after_the_last_batch_starts_the_next_epoch(
    options: dict[str, Any], sampler_kind: str
) -> None:
    """Lightning checkpoints at the epoch's last step, before next() raises StopIteration: the
    state must start the next epoch (it resumed the finished one, empty, and the next epoch
    was lost), whose batches equal an uninterrupted run's second epoch. With persistent
    workers the uninterrupted run draws no new base seed for its second epoch: the resumed
    run's new iterator must not shift the generator by its own (it did)."""

    def make() -> ThreadDataLoader[Any]:
        dataset = Ids(24)
        if sampler_kind == "shuffle":
            return ThreadDataLoader(
                dataset, batch_size=4, sampler=ShuffleSampler(dataset, seed=5), **options
            )
        generator = torch.Generator().manual_seed(5)
        return ThreadDataLoader(dataset, batch_size=4, shuffle=True, generator=generator, **options)

    def epoch(loader: Any, number: int) -> list[list[int]]:
        if sampler_kind == "shuffle":
            loader.sampler.set_epoch(number)  # as a trainer does
        return [b.tolist() for b in loader]

    reference = make()
    epochs = [epoch(reference, 0), epoch(reference, 1)]
    loader = make()
    it = iter(loader)
    first = [next(it).tolist() for _ in range(6)]  # every batch; StopIteration not yet raised
    state = loader.state_dict()
    assert state["in_progress"] is False
    assert first == epochs[0]
    with pytest.raises(StopIteration):
        next(it)  # the peek at the end kept the stream as it was: nothing more, nothing lost
    resumed = make()
    resumed.load_state_dict(state)
    assert epoch(resumed, 1) == epochs[1]


class _NoLenBatches:
    """A batch sampler with no ``len()``: the loader learns its end only by running it out."""

    def __iter__(self) -> Iterator[list[int]]:
        yield from ([0, 1], [2, 3], [4, 5])


@pytest.mark.parametrize(
    "options",
    [{"num_workers": 2}, {"num_workers": 2, "persistent_workers": True, "isolation": "process"}],
    ids=["threads", "persistent-isolation"],
)
def test_a_state_after_the_last_batch_of_a_sampler_without_len_starts_the_next_epoch(
    options: dict[str, Any],
) -> None:
    """Workers draw ahead of the loop, so the sampler's end is known by the epoch's last batch,
    without a ``len()``: the state starts the next epoch (it resumed the finished one: the
    resumed ``iter()`` yielded nothing). Without workers nothing is drawn ahead, and the state
    stays at the epoch's end, as ``StatefulDataLoader``'s."""

    def make(workers: bool) -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(6), batch_sampler=_NoLenBatches(), **(options if workers else {})
        )

    for workers, expected in ((True, [[0, 1], [2, 3], [4, 5]]), (False, [])):
        loader = make(workers)
        it = iter(loader)
        assert [next(it).tolist() for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
        state = loader.state_dict()
        resumed = make(workers)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == expected
        assert [b.tolist() for b in resumed] == [[0, 1], [2, 3], [4, 5]]
        del it


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_loaded_and_not_yet_started_is_what_state_dict_returns(num_workers: int) -> None:
    """Saved again before the first batch of the resumed epoch (a preemption right after a
    restart), the state is the loaded one, and resuming from it resumes the same epoch."""

    def make() -> ThreadDataLoader[Any]:
        generator = torch.Generator().manual_seed(9)
        return ThreadDataLoader(
            Ids(40), batch_size=4, shuffle=True, generator=generator, num_workers=num_workers
        )

    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    restarted = make()
    restarted.load_state_dict(state)
    again = restarted.state_dict()
    assert again["position"] == 3 and again["in_progress"] is True
    assert again["rng_state"] == state["rng_state"]
    final = make()
    final.load_state_dict(again)
    assert head + [b.tolist() for b in final] == head + rest


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_reads_nothing_ahead(num_workers: int) -> None:
    """state_dict() after every batch changes neither the batches (the global RNG a sampler
    seeds from is not drawn earlier) nor the cost of next() (nothing piles up per call)."""

    def batches(save_each: bool) -> list[list[int]]:
        torch.manual_seed(0)
        loader = ThreadDataLoader(
            list(range(3000)), batch_size=2, shuffle=True, num_workers=num_workers
        )
        it = iter(loader)
        out = []
        for _ in range(1500):
            if save_each:
                loader.state_dict()
            torch.rand(1)  # the training step's own use of the global RNG
            out.append(next(it).tolist())
        return out

    assert batches(save_each=True) == batches(save_each=False)


class ResumesWhereLoaded(torch.utils.data.Sampler[int]):
    """A user's sampler under StatefulDataLoader's protocol: ``load_state_dict`` means "the next
    ``__iter__`` starts here"; an order per epoch, moved on at its end."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.yielded, self._resume = n, 0, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        start, self._resume = self._resume, 0
        self.yielded = start
        for i in order[start:].tolist():
            self.yielded += 1
            yield i
        self.epoch, self.yielded = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume = state["epoch"], state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_state_taken_at_the_last_batch_leaves_the_next_epoch_of_a_loop_that_breaks_as_torchs(
    num_workers: int, drop_last: bool
) -> None:
    """``state_dict()`` after the epoch's last batch ends the sampler's pass, and torch's
    ``RandomSampler`` draws from the loader's generator as it ends; a loop that then leaves the
    epoch with ``break`` never made that draw in torch, so its next epoch must not see it
    (without workers it did: another order). A loop that goes on to ``StopIteration`` does,
    also when it draws from that generator itself before (the end's draw was lost then)."""

    def run(cls: Any, take_state: bool, leave: bool, draw: bool) -> list[list[list[int]]]:
        generator = torch.Generator().manual_seed(631)
        loader = cls(
            list(range(9)),
            batch_size=4,
            drop_last=drop_last,
            num_workers=num_workers,
            shuffle=True,
            generator=generator,
        )
        epochs = []
        for _ in range(2):
            it = iter(loader)
            epochs.append([next(it).tolist() for _ in range(len(loader))])
            if take_state:
                loader.state_dict()
            if draw:
                torch.rand(1, generator=generator)  # the loop's own draw, before the end
            if not leave:
                assert next(it, None) is None
            del it
        return [*epochs, [b.tolist() for b in loader]]

    for leave, draw in ((True, False), (False, False), (False, True)):
        got = run(ThreadDataLoader, True, leave, draw)
        assert got == run(DataLoader, False, leave, draw), (leave, draw)


@pytest.mark.parametrize("leave", [False, True])
def test_a_state_at_the_last_batch_leaves_a_users_sampler_as_it_stands(leave: bool) -> None:
    """A sampler whose ``load_state_dict`` means "the next ``iter()`` starts here": taking the
    state must not load anything into it, or the next epoch starts at the loaded end (empty).
    A loop that goes on reads torch's next epoch; one that leaves sees the end's effect on the
    sampler (``docs/torch-differences.md``): its next epoch is the one after."""

    def run(cls: Any, take_state: bool, leave: bool) -> list[list[int]]:
        loader = cls(list(range(8)), batch_size=4, sampler=ResumesWhereLoaded(8))
        it = iter(loader)
        out = [next(it).tolist() for _ in range(len(loader))]
        if take_state:
            loader.state_dict()
        if not leave:
            assert next(it, None) is None
        del it
        return out + [b.tolist() for b in loader]

    got = run(ThreadDataLoader, True, leave)
    assert len(got) == 4
    assert got == run(DataLoader, False, False)  # as a loop that went on, in both cases


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_after_the_last_batch_starts_the_next_epoch_with_device_too(
    num_workers: int,
) -> None:
    """device= (cpu here: the same transfer stage): the last-step state starts a whole next
    epoch, not an empty one. Its order may differ from an uninterrupted run's: the transfer
    thread may not have run the sampler to its end (RandomSampler's last draw) yet."""

    def make() -> ThreadDataLoader[Any]:
        generator = torch.Generator().manual_seed(3)
        return ThreadDataLoader(
            Ids(12),
            batch_size=2,
            shuffle=True,
            generator=generator,
            num_workers=num_workers,
            device="cpu",
        )

    reference = make()
    epochs = [[b.tolist() for b in reference] for _ in range(2)]
    loader = make()
    it = iter(loader)
    assert [next(it).tolist() for _ in range(6)] == epochs[0]
    state = loader.state_dict()
    assert state["in_progress"] is False
    resumed = make()
    resumed.load_state_dict(state)
    assert sorted(x for b in resumed for x in b.tolist()) == sorted(x for b in epochs[1] for x in b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_seeded_from_the_global_rng_resumes_under_a_loader_generator(
    num_workers: int,
) -> None:
    """RandomSampler(replacement=True) without a generator seeds its epoch from the global RNG
    even when the loader has a generator; the state replayed only the loader's generator, so
    the resumed batches differed (found by a resume fuzzer). The user's global RNG is theirs."""

    def make() -> ThreadDataLoader[Any]:
        dataset = Ids(18)
        return ThreadDataLoader(
            dataset,
            batch_size=4,
            sampler=torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=17),
            generator=torch.Generator().manual_seed(56),
            num_workers=num_workers,
        )

    torch.manual_seed(3)
    reference = [b.tolist() for b in make()]
    torch.manual_seed(3)
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    torch.manual_seed(11)  # the resumed run's global RNG is elsewhere
    mine = torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(state)
    resumed_it = iter(resumed)
    first = next(resumed_it).tolist()
    assert torch.equal(torch.get_rng_state(), mine)  # drawn under the saved state, given back
    assert head + [first] + [b.tolist() for b in resumed_it] == reference


@pytest.mark.parametrize(("num_workers", "save_worker_rng"), [(0, False), (2, False), (2, True)])
def test_a_state_round_trips_through_json_and_resumes_exactly(
    num_workers: int, save_worker_rng: bool
) -> None:
    """A state is plain data: json.dumps takes it, and the loaded copy resumes exactly."""
    import json

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(), batch_size=7, shuffle=True, num_workers=num_workers,
            generator=torch.Generator().manual_seed(4), save_worker_rng=save_worker_rng,
        )  # fmt: skip

    full = [b.tolist() for b in make()]
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(5)]
    text = json.dumps(loader.state_dict())
    del it
    resumed = make()
    resumed.load_state_dict(json.loads(text))
    assert head + [b.tolist() for b in resumed] == full


def test_a_state_saved_with_rng_tensors_still_loads() -> None:
    """States written when RNG states were tensors resume as before."""
    from threadloader._engine.state_codec import decode_rng

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(Ids(), batch_size=7, shuffle=True)

    torch.manual_seed(8)
    full = [b.tolist() for b in make()]
    torch.manual_seed(8)
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    state["rng_state"] = decode_rng(state["rng_state"])
    assert isinstance(state["rng_state"], torch.Tensor)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == full


def test_a_state_saves_and_loads_through_torch_distributed_checkpoint(tmp_path: Any) -> None:
    """torch.distributed.checkpoint (one process, no process group) saves and loads it."""
    import torch.distributed.checkpoint as dcp

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Ids(), batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(2)
        )

    full = [b.tolist() for b in make()]
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(4)]
    dcp.save({"loader": loader.state_dict()}, checkpoint_id=str(tmp_path))
    del it
    resumed = make()
    target = {"loader": resumed.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(target["loader"])
    assert head + [b.tolist() for b in resumed] == full


class ServedCount(Dataset[torch.Tensor]):
    """Map-style, stateful: item i is ``[i, items this copy served, a draw from the worker's
    global torch RNG]``."""

    def __init__(self) -> None:
        self.served = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        self.served += 1
        return torch.tensor([i, self.served, int(torch.randint(0, 1000, ()))])

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.served = state["served"]


class EpochCount(IterableDataset[torch.Tensor]):
    """Iterable, its own iterator, stateful: item ``[i, iter() calls on this copy, a draw]``."""

    def __init__(self) -> None:
        self.pos, self.epoch = 0, -1

    def __iter__(self) -> EpochCount:
        self.pos, self.epoch = 0, self.epoch + 1
        return self

    def __next__(self) -> torch.Tensor:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        i = wid + self.pos * nw
        if i >= 8:
            raise StopIteration
        self.pos += 1
        return torch.tensor([i, self.epoch, int(torch.randint(0, 1000, ()))])

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


class StartsAtLoaded(IterableDataset[torch.Tensor]):
    """Hugging Face's streams' pattern: ``__iter__`` is a generator, and a loaded state says
    where the *next* ``iter()`` starts; the state counts items handed out this epoch."""

    def __init__(self) -> None:
        self.start, self.consumed = 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker()
        start, self.start = self.start, 0
        self.consumed = start
        for j, i in enumerate(range(wid, 8, nw)):
            if j >= start:
                self.consumed = j + 1
                yield torch.tensor([i, 0, int(torch.randint(0, 1000, ()))])

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["consumed"]


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


_PERSISTENT = {"num_workers": 2, "persistent_workers": True, "save_worker_rng": True}
BETWEEN_EPOCHS = {
    "no workers": {"num_workers": 0},
    "persistent threads": {**_PERSISTENT, "isolation": "threads"},
    "persistent helpers": {**_PERSISTENT, "isolation": "process"},
}


@pytest.mark.parametrize("stop_seen", [False, True], ids=["after last batch", "after the end"])
@pytest.mark.parametrize("dataset", [ServedCount, EpochCount, StartsAtLoaded])
@pytest.mark.parametrize("options", BETWEEN_EPOCHS.values(), ids=BETWEEN_EPOCHS.keys())
def test_a_state_taken_between_epochs_carries_what_the_next_epoch_inherits(
    options: dict[str, Any], dataset: type, stop_seen: bool
) -> None:
    """Between epochs, a loader without workers carries its dataset into the next epoch, and
    persistent workers their dataset copies, generators and seeds: a state taken then (after
    the last batch, or after StopIteration) resumes the next epoch as the uninterrupted run's,
    with a global-RNG shuffle restored by the checkpoint too. States were dropped (no workers:
    before StopIteration; persistent workers: always) and the global RNG drew a new base seed.
    An IterableDataset's end is known only at StopIteration: before it, the state is mid-epoch.
    A generator ``__iter__`` that starts where a loaded state says (StartsAtLoaded) gave an
    empty next epoch: the loaded end of the epoch was never run through.
    """
    map_style = dataset is ServedCount
    if dataset is StartsAtLoaded and options["num_workers"] == 0 and stop_seen:
        pytest.skip("as StatefulDataLoader, num_workers=0 loads the state without running it out")

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(dataset(), batch_size=2, shuffle=map_style, **options)

    torch.manual_seed(3)
    reference = make()
    expected = [[b.tolist() for b in reference] for _ in range(2)]
    torch.manual_seed(3)
    loader = make()
    it = iter(loader)
    first = [next(it).tolist() for _ in range(4)]
    if stop_seen:
        assert next(it, None) is None
    state, global_rng = loader.state_dict(), torch.get_rng_state()  # a checkpoint
    assert state["in_progress"] is not (map_style or stop_seen)
    del it, loader
    torch.manual_seed(99)  # the process restarts...
    torch.set_rng_state(global_rng)  # ...and restores the checkpoint
    resumed = make()
    resumed.load_state_dict(state)
    if state["in_progress"]:
        first += [b.tolist() for b in resumed]  # the rest of the epoch: nothing
    assert [first, [b.tolist() for b in resumed]] == expected


@pytest.mark.parametrize("resumed_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["shuffle", "with replacement"])
def test_a_state_taken_before_the_first_index_was_drawn_resumes_every_later_epoch(
    sampler: str, resumed_workers: int
) -> None:
    """Without workers the sampler draws its epoch's seed from the global RNG at the first
    next(): a checkpoint taken after iter() and before it holds a global RNG that never saw the
    draw. The resume draws it under the saved RNG and must leave the global RNG advanced, as the
    uninterrupted run's was (it gave back the undrawn one: the next epoch repeated this one)."""
    data = list(range(12))

    def make(num_workers: int) -> ThreadDataLoader[Any]:
        if sampler == "shuffle":
            return ThreadDataLoader(data, batch_size=4, shuffle=True, num_workers=num_workers)
        replacement = torch.utils.data.RandomSampler(data, replacement=True)
        return ThreadDataLoader(data, batch_size=4, sampler=replacement, num_workers=num_workers)

    torch.manual_seed(0)
    reference = make(0)
    expected = [[b.tolist() for b in reference] for _ in range(3)]
    torch.manual_seed(0)
    loader = make(0)
    it = iter(loader)
    state, global_rng = loader.state_dict(), torch.get_rng_state()
    del it, loader
    torch.manual_seed(99)
    torch.set_rng_state(global_rng)
    resumed = make(resumed_workers)
    resumed.load_state_dict(state)
    assert [[b.tolist() for b in resumed] for _ in range(3)] == expected


def _first_batch_and_state_ahead(loader: ThreadDataLoader[Any]) -> tuple[list[Any], Any]:
    """The first batch of a loader delivering as completed, and its state then, which must
    hold a batch delivered ahead of a slow first one."""
    it = iter(loader)
    first = [next(it)]
    state = loader.state_dict()
    del it
    assert state["delivered_ahead"], "nothing was delivered out of order: the scenario is wrong"
    return first, state


def test_an_out_of_order_state_refuses_another_number_of_ranks() -> None:
    """Positions delivered ahead (in_order=False) count batches of the saving rank's share: on
    another number of ranks they name other samples (samples were read twice and others never).
    The same number of ranks resumes; another is refused, naming why."""

    def make(world: int, rank: int, slow: frozenset[int] = frozenset()) -> Any:
        dataset = SlowItems(slow, n=12)
        sampler = DistributedShuffleSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        return ThreadDataLoader(
            dataset, batch_size=2, sampler=sampler, num_workers=2, in_order=False, timeout=30
        )

    first, state = _first_batch_and_state_ahead(make(1, 0, slow=frozenset({0})))
    with pytest.raises(ValueError, match=r"saved on 1 ranks .*in_order=False.* this run has 2"):
        make(2, 0).load_state_dict(state)
    same = make(1, 0)
    same.load_state_dict(state)
    assert sorted(_items(first) + _items(list(same))) == list(range(12))


class SlowWorkerShards(IterableDataset[int]):
    """No state: worker w yields w, w + N, ... below 8; worker ``slow`` waits 0.3 s first."""

    def __init__(self, slow: int) -> None:
        self.slow = slow

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        if info.id == self.slow:
            time.sleep(0.3)
        yield from range(info.id, 8, info.num_workers)


@pytest.mark.filterwarnings("ignore:SlowWorkerShards has no state_dict")
@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_replay_after_delivery_as_completed_drops_what_each_worker_delivered(
    isolation: str,
) -> None:
    """An IterableDataset without state is replayed; with in_order=False the batches the loop
    received came as workers finished them, so the replay drops as many of *each worker's*
    batches as the loop had from it. It dropped the first k of the new run, which came from
    another worker: samples were read twice and others never."""

    def make(slow: int) -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            SlowWorkerShards(slow), batch_size=2, num_workers=2, in_order=False,
            isolation=isolation,
        )  # fmt: skip

    loader = make(slow=0)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    assert first == [[1, 3], [5, 7]], "worker 1 did not finish first: the scenario is wrong"
    resumed = make(slow=1)  # after the restart, the other worker is the slow one
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert sorted(x for b in first + rest for x in b) == list(range(8))


@pytest.mark.filterwarnings("ignore:SlowWorkerShards has no state_dict")
@pytest.mark.parametrize(("in_order", "second_batches"), [(True, 0), (False, 0), (False, 1)])
def test_a_replayed_resume_saved_again_before_its_replay_ends_resumes_exactly(
    in_order: bool, second_batches: int
) -> None:
    """An IterableDataset without state resumes by fetching and dropping the batches the loop
    had; a state taken before that replay is done (at ``iter()``, or one batch in with
    ``in_order=False``, where the other worker's drops are still to come) counts the batches
    still to drop as received. It counted them as never received: the state did not load
    (``worker_batches [0, 0] ... adding up to batches_yielded (2)``)."""

    def make(slow: int) -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            SlowWorkerShards(slow), batch_size=2, num_workers=2, in_order=in_order, timeout=30
        )

    loader = make(slow=1)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    second_loader = make(slow=0)
    second_loader.load_state_dict(state)
    it = iter(second_loader)
    second = [next(it).tolist() for _ in range(second_batches)]
    state = second_loader.state_dict()
    del it
    assert sum(state["worker_batches"]) == state["batches_yielded"] == 2 + second_batches
    third_loader = make(slow=1)
    third_loader.load_state_dict(state)
    rest = [b.tolist() for b in third_loader]
    assert sorted(x for b in first + second + rest for x in b) == list(range(8))


class RaisesAtTwo(IterableDataset[int]):
    """No state: worker w yields w, w + N, ... below 16; the record 2 is corrupt (raises), and
    worker 1 starts late, so that the error comes first also as completed."""

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        if info.id == 1:
            time.sleep(0.2)
        for i in range(info.id, 16, info.num_workers):
            if i == 2:
                raise ValueError("record 2 is corrupt")
            yield i


def _caught(it: Iterator[Any], count: int | None = None) -> list[Any]:
    """``count`` results of ``it`` (all, for None), each a batch's list or "error"."""
    out: list[Any] = []
    while count is None or len(out) < count:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            break
        except ValueError:
            out.append("error")
    return out


@pytest.mark.filterwarnings("ignore:RaisesAtTwo has no state_dict")
@pytest.mark.parametrize("in_order", [True, False])
def test_a_replay_drops_the_errors_the_loop_caught_as_it_drops_the_batches(
    in_order: bool,
) -> None:
    """The loop caught a batch's error and went on, then saved: the state counts that error
    among the worker's results, loads, and the replay drops it with the batches, raising it no
    more. The state did not load (``worker_batches [1, 3]`` against 3 batches)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            RaisesAtTwo(), batch_size=2, num_workers=2, in_order=in_order, timeout=30
        )

    reference = _caught(iter(make()))
    loader = make()
    first = _caught(iter(loader), 4)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = _caught(iter(resumed))
    assert "error" in first and "error" not in rest
    assert sorted(map(str, first + rest)) == sorted(map(str, reference))


@pytest.mark.filterwarnings("ignore:RaisesAtTwo has no state_dict")
def test_an_older_state_replays_a_caught_error_again_and_repeats_no_batch() -> None:
    """A state saved without ``worker_batches`` (an older version's) counts the batches alone:
    the replay raises the caught error again, as it did, and repeats no batch (counting the
    error off, it dropped one batch too few)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(RaisesAtTwo(), batch_size=2, num_workers=2, timeout=30)

    loader = make()
    first = _caught(iter(loader), 4)
    state = {**loader.state_dict(), "worker_batches": None}
    resumed = make()
    resumed.load_state_dict(state)
    rest = _caught(iter(resumed))
    assert "error" in first and rest == ["error", [13, 15]]


def test_a_replayed_position_past_the_end_of_the_epoch_is_refused() -> None:
    """A mid-epoch position beyond the epoch's batches names no batch to resume at: refused
    (it was accepted, and the resumed epoch silently yielded nothing)."""
    source = ThreadDataLoader(Ids(10), batch_size=2)
    it = iter(source)
    next(it)
    state = {**source.state_dict(), "position": 9, "batches_yielded": 9}
    del it
    with pytest.raises(ValueError, match="position 9 is past the end of this loader's epoch"):
        ThreadDataLoader(Ids(10), batch_size=2).load_state_dict(state)


def test_an_out_of_order_state_without_batches_ahead_refuses_another_number_of_ranks() -> None:
    """A rank whose own state holds no batch delivered ahead still cannot stand for its
    siblings on another number of ranks: theirs may (a torchrun script loads rank r % W's
    state; samples of the other rank were lost and others read twice)."""

    def make(world: int, rank: int) -> Any:
        dataset = SlowItems(n=12)
        sampler = DistributedShuffleSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        return ThreadDataLoader(
            dataset, batch_size=2, sampler=sampler, num_workers=2, in_order=False, timeout=30
        )

    loader = make(2, 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    assert state["in_progress"] and state["in_order"] is False
    with pytest.raises(ValueError, match=r"saved on 2 ranks .*in_order=False.* this run has 1"):
        make(1, 0).load_state_dict(state)
    make(2, 0).load_state_dict(state)  # the same number of ranks resumes


@pytest.mark.parametrize("sampler_kind", ["ours", "torch", "batch_sampler"])
def test_an_out_of_order_state_is_loaded_by_its_own_rank_only(sampler_kind: str) -> None:
    """Rank 0 delivered batch 1 before batch 0 (in_order=False); rank 1, loading rank 0's state
    (a checkpoint written by rank 0 alone), would skip its own batch 1 and read its batch 0
    again. It is refused, naming why; rank 0 resumes its rest, and a state saved in order
    resumes any rank of the same world. The rank is the sampler's, also inside a batch sampler
    the user built, whose own ``rank`` means something else."""

    def batching(dataset: Any, rank: int) -> dict[str, Any]:
        ranks = DistributedShuffleSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        if sampler_kind == "batch_sampler":
            bucketed = BatchSampler(ranks, batch_size=2, drop_last=False)
            bucketed.rank = 0  # type: ignore[attr-defined]  # a length bucket, not a process
            return {"batch_sampler": bucketed}
        if sampler_kind == "torch":
            return {"batch_size": 2, "sampler": DistributedSampler(dataset, 2, rank, shuffle=False)}
        return {"batch_size": 2, "sampler": ranks}

    def make(rank: int, slow: frozenset[int] = frozenset(), in_order: bool = False) -> Any:
        dataset = SlowItems(slow, n=12)
        return ThreadDataLoader(
            dataset, num_workers=2, in_order=in_order, timeout=30, **batching(dataset, rank)
        )

    # Rank 0's first batch is items 0 and 2.
    first, state = _first_batch_and_state_ahead(make(0, slow=frozenset({0})))
    with pytest.raises(ValueError, match=r"saved by rank 0 .*in_order=False.* this is rank 1"):
        make(1).load_state_dict(state)
    own = make(0)
    own.load_state_dict(state)
    assert sorted(_items(first) + _items(list(own))) == list(range(0, 12, 2))
    in_order = make(0, in_order=True)
    it = iter(in_order)
    next(it)
    state = in_order.state_dict()
    del it
    other = make(1, in_order=True)
    other.load_state_dict(state)
    assert _items(list(other)) == list(range(5, 12, 2))


def test_an_out_of_order_state_without_a_batch_or_a_sampler_rank_loads_on_any_rank() -> None:
    """Refused only where ranks can differ: a state taken before any batch was delivered (ranks
    in lockstep delivered none) loads on any rank; a state that names torch.distributed's rank
    only (no sampler_rank) is compared with torch.distributed's."""

    def make(rank: int, slow: frozenset[int] = frozenset()) -> Any:
        dataset = SlowItems(slow, n=12)
        sampler = DistributedShuffleSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        return ThreadDataLoader(
            dataset, batch_size=2, sampler=sampler, num_workers=2, in_order=False, timeout=30
        )

    loader = make(0)
    it = iter(loader)
    unstarted = loader.state_dict()
    del it
    assert unstarted["in_progress"] and unstarted["batches_yielded"] == 0
    other = make(1)
    other.load_state_dict(unstarted)
    assert sorted(_items(list(other))) == list(range(1, 12, 2))
    _, ahead = _first_batch_and_state_ahead(make(0, slow=frozenset({0})))
    del ahead["sampler_rank"]
    make(1).load_state_dict(ahead)  # torch.distributed's rank: 0 here as there


class UnevenStartsAtLoaded(StartsAtLoaded):
    """Worker 0 yields 0, 2; worker 1 yields 1, 3, 5, 7, 9."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, _ = _worker()
        start, self.start = self.start, 0
        self.consumed = start
        for j, i in enumerate([[0, 2], [1, 3, 5, 7, 9]][wid]):
            if j >= start:
                self.consumed = j + 1
                yield torch.tensor(i)


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_worker_ended_at_the_save_starts_the_following_epoch_in_full(isolation: str) -> None:
    """A persistent worker whose IterableDataset had ended when a mid-epoch state was taken is
    not asked again in the resumed epoch; its copy is run to the loaded end all the same, so
    the following epoch starts at its beginning (it started at the loaded end: its items were
    lost). Worker 0's end is the epoch's third result: the loop has passed it, in order, by
    the time it returns the third batch."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            UnevenStartsAtLoaded(), batch_size=2, num_workers=2, persistent_workers=True,
            isolation=isolation,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    del it, loader
    assert first == [[0, 2], [1, 3], [5, 7]] and state["workers_status"] == [False, True]
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[9]]
    assert [b.tolist() for b in resumed] == [[0, 2], [1, 3], [5, 7], [9]]


class CountsEpochs(IterableDataset[list[int]]):
    """Its own iterator: item ``[i, iter() calls on this copy]``; the state holds both."""

    def __init__(self) -> None:
        self.epoch, self.pos = -1, 0

    def __iter__(self) -> CountsEpochs:
        self.epoch, self.pos = self.epoch + 1, 0
        return self

    def __next__(self) -> list[int]:
        wid, nw = _worker()
        i = wid + self.pos * nw
        if i >= 8:
            raise StopIteration
        self.pos += 1
        return [i, self.epoch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


@pytest.mark.parametrize("taken", [0, 1])
@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_persistent_worker_that_has_not_delivered_in_this_epoch_resumes_its_kept_copy(
    isolation: str, taken: int
) -> None:
    """In a later epoch of persistent workers, a worker that has delivered nothing yet still has
    the copy the last epoch left it: a state taken then resumes that copy (it resumed a fresh
    one, whose items carried epoch 0 instead of 1)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            CountsEpochs(), batch_size=None, num_workers=2, persistent_workers=True,
            isolation=isolation,
        )  # fmt: skip

    reference = make()
    expected = [[list(x) for x in reference] for _ in range(2)][1]
    loader = make()
    list(loader)
    it = iter(loader)
    got = [list(next(it)) for _ in range(taken)]
    state = loader.state_dict()
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [list(x) for x in resumed] == expected


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_state_after_a_break_holds_what_the_finished_batches_did_to_the_copies(
    isolation: str,
) -> None:
    """Persistent workers make the batches given to them before the next epoch (as torch's):
    a state taken in that epoch before a worker delivers holds what those batches did to its
    dataset copy (it held the state of the worker's last delivered batch: the resumed copy
    counted fewer items than the uninterrupted one)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            ServedCount(), batch_size=1, num_workers=2, persistent_workers=True,
            prefetch_factor=2, isolation=isolation,
        )  # fmt: skip

    def run(cut: int | None) -> list[list[int]]:
        loader = make()
        for i, _ in enumerate(loader):
            if i == 3:
                break
        it = iter(loader)
        if cut is None:
            return [b[0, :2].tolist() for b in it]
        out = [next(it)[0, :2].tolist() for _ in range(cut)]
        state = loader.state_dict()
        del it, loader
        resumed = make()
        resumed.load_state_dict(state)
        return out + [b[0, :2].tolist() for b in resumed]

    expected = run(None)
    assert run(0) == expected
    assert run(1) == expected


class MadeBy(Dataset[tuple[int, int, int]]):
    """Item i, the worker that made it, and that worker's seed."""

    def __len__(self) -> int:
        return 15

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        info = get_worker_info()
        return i, info.id, int(info.seed % 1000)


def _made_by(loader_type: Any, cut: int, **options: Any) -> list[list[int]]:
    """An epoch of MadeBy saved after ``cut`` batches and resumed by a new loader."""
    torch.manual_seed(5)
    batches, _ = cut_and_resume(
        lambda: loader_type(MadeBy(), batch_size=2, num_workers=3, **options), cut
    )
    return [torch.stack(b).T.flatten().tolist() for b in batches]


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_a_resumed_map_style_epoch_continues_the_round_robin_as_stateful_dataloader(
    cut: int,
) -> None:
    """StatefulDataLoader's resumed batches come from the worker after the one that made the
    last delivered batch, with that worker's seed; so do ours, with or without saved
    generators, and as in the uninterrupted run."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    theirs = _made_by(StatefulDataLoader, cut)
    torch.manual_seed(5)
    uninterrupted = [
        torch.stack(b).T.flatten().tolist()
        for b in ThreadDataLoader(MadeBy(), batch_size=2, num_workers=3)
    ]
    assert [b[1::3] for b in theirs] == [b[1::3] for b in uninterrupted]  # the worker ids
    for options in ({}, {"save_worker_rng": True}, {"isolation": "process"}):
        assert _made_by(ThreadDataLoader, cut, **options) == theirs, options


class GrowingBatches(torch.utils.data.BatchSampler):
    """Batches of 1, 2, 3, 1, 2, 3, ... indices: more batches than ``len()`` (BatchSampler's)
    counts, as a bucketing batch sampler whose length is an estimate."""

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        size = 1
        for index in self.sampler:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch, size = [], size % self.batch_size + 1
        if batch:
            yield batch


class ShortLength(torch.utils.data.Sampler[int]):
    """Yields 10 indices and says 2."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))

    def __len__(self) -> int:
        return 2


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["batch sampler", "sampler"])
def test_a_sampler_yielding_more_than_its_len_resumes_the_rest_of_the_epoch(
    sampler: str, num_workers: int
) -> None:
    """Batches past ``len()`` are not the end: a state taken there resumes the rest."""
    data = list(range(10))

    def make() -> ThreadDataLoader[Any]:
        if sampler == "batch sampler":
            batches = GrowingBatches(torch.utils.data.SequentialSampler(data), 3, False)
            return ThreadDataLoader(data, batch_sampler=batches, num_workers=num_workers)
        return ThreadDataLoader(data, sampler=ShortLength(), batch_size=2, num_workers=num_workers)

    cut = len(make())  # the state is taken once len() batches were delivered
    assert_resumes_exactly(make, cut)


class ResumableBatches(torch.utils.data.Sampler[list[int]]):
    """A user's batch sampler keeping its own state: pairs of a ``ResumableOrder``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.order = ResumableOrder(n, seed)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(torch.utils.data.BatchSampler(self.order, 2, drop_last=False))

    def __len__(self) -> int:
        return (len(self.order) + 1) // 2

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)


def _second_pass_cut(
    cls: Any, cut: int, sampling: Callable[[], dict[str, Any]], **kwargs: Any
) -> tuple[list[Any], list[Any]]:
    """Two epochs uninterrupted, and the same with a save ``cut`` batches into the second and
    a resume; each loader with new samplers from ``sampling`` (a resume: a new process)."""

    def make() -> Any:
        return cls(list(range(12)), **sampling(), **kwargs)

    loader = make()
    uninterrupted = [b.tolist() for _ in range(2) for b in loader]
    loader = make()
    seen = [b.tolist() for b in loader]
    it = iter(loader)
    seen += [next(it).tolist() for _ in range(cut)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    return uninterrupted, seen + [b.tolist() for b in resumed]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [1, 3, 5])
@pytest.mark.parametrize("which", ["sampler", "batch_sampler"])
def test_a_sampler_keeping_its_own_state_resumes_as_with_stateful_dataloader(
    which: str, cut: int, num_workers: int
) -> None:
    """A user's sampler (or batch sampler) with state_dict()/load_state_dict(), its order drawn
    from Python's random anew each pass, cut in its second pass while workers prefetch ahead:
    the resume gives the uninterrupted run's batches, as StatefulDataLoader's does, since the
    state holds the sampler's own state as of the last delivered batch (``_state`` point 11)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def sampling() -> dict[str, Any]:
        if which == "sampler":
            return {"sampler": ResumableOrder(12, seed=5), "batch_size": 2}
        return {"batch_sampler": ResumableBatches(12, seed=5)}

    ours_full, ours = _second_pass_cut(ThreadDataLoader, cut, sampling, num_workers=num_workers)
    copied_full, copied = _second_pass_cut(  # the transfer thread draws: tagged progress
        ThreadDataLoader, cut, sampling, num_workers=num_workers, device="cpu"
    )
    theirs_full, theirs = _second_pass_cut(
        StatefulDataLoader, cut, sampling, num_workers=num_workers
    )
    assert ours_full == copied_full == theirs_full
    assert ours == copied == ours_full
    assert theirs == theirs_full


def test_a_state_without_the_samplers_own_state_replays_it_and_says_so() -> None:
    """A mid-epoch state holding no state of a sampler that keeps one (saved by a loader whose
    sampler had none) replays the sampler from the saved RNG states, with a warning."""
    loader = ThreadDataLoader(list(range(12)), batch_size=2, sampler=ResumableOrder(12))
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(2)]
    state = {**loader.state_dict(), "sampler": None}
    resumed = ThreadDataLoader(list(range(12)), batch_size=2, sampler=ResumableOrder(12))
    with pytest.warns(UserWarning, match="no state of this loader's ResumableOrder"):
        resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert sorted(i for b in seen + rest for i in b) == list(range(12))  # a first pass: exact


class EpochCountingOrder(torch.utils.data.Sampler[int]):
    """A user's sampler whose pass, once over, counts the epoch up and starts its count over:
    its order is keyed by ``(seed, epoch)``, and its state is ``{epoch, yielded}``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch, self.yielded = n, seed, 0, 0
        self.resume_at: int | None = None

    def __iter__(self) -> Iterator[int]:
        start, self.resume_at = self.resume_at or 0, None
        order = list(range(self.n))
        __import__("random").Random(self.seed * 1000 + self.epoch).shuffle(order)
        self.yielded = start
        for i in order[start:]:
            self.yielded += 1
            yield i
        self.epoch, self.yielded = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.resume_at = state["epoch"], state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", ["after iter()", "at the last batch", "after StopIteration"])
@pytest.mark.parametrize("sampler_type", [ResumableOrder, EpochCountingOrder])
@pytest.mark.parametrize("n", [8, 7])
def test_a_sampler_keeping_its_own_state_resumes_from_an_epochs_edges(
    n: int, sampler_type: type, cut: str, num_workers: int
) -> None:
    """A state taken in a second pass before its first batch, or at its end (before and after
    StopIteration), resumes the same passes as the uninterrupted run: the state holds the
    sampler's state after its last index, which the resume runs out before the next pass
    (``_state`` point 11). Also where a partial last batch is drawn only once the sampler's
    pass has ended (7 samples in batches of 2): its state is the one before that end."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            list(range(n)), batch_size=2, sampler=sampler_type(n, seed=3), num_workers=num_workers
        )

    loader = make()
    uninterrupted = [b.tolist() for _ in range(3) for b in loader]
    loader = make()
    seen = [b.tolist() for b in loader]
    it = iter(loader)
    if cut == "at the last batch":
        seen += [next(it).tolist() for _ in range(4)]
    elif cut == "after StopIteration":
        seen += [b.tolist() for b in it]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    passes = 2 if cut == "after iter()" else 1
    assert seen + [b.tolist() for _ in range(passes) for b in resumed] == uninterrupted


class EmptySecondEpoch(EpochCountingOrder):
    """The same sampler, whose second pass yields nothing; its epoch count moves on all the same
    (a curriculum stage with no samples)."""

    def __iter__(self) -> Iterator[int]:
        if self.epoch != 1:
            yield from super().__iter__()
            return
        self.resume_at = None
        self.epoch, self.yielded = self.epoch + 1, 0


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize(
    "cut", ["after the empty pass", "after the next pass's iter()", "leaving the empty pass"]
)
def test_a_pass_that_drew_nothing_is_run_out_from_where_it_began(
    cut: str, num_workers: int, persistent: bool
) -> None:
    """A state taken after a pass that drew no index (or before the next pass's first batch)
    resumes the pass after it: the resume runs the empty pass out from the state it began with,
    which moves the sampler's epoch on as the uninterrupted run's did, instead of running out
    the pass before it (then the empty pass came again). Also when the loop left the empty pass
    before its first next(), after workers had drawn ahead to its end; and with persistent
    workers, whose epochs share one progress record."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            list(range(8)), batch_size=2, sampler=EmptySecondEpoch(8, seed=3),
            num_workers=num_workers, persistent_workers=persistent,
        )  # fmt: skip

    def passes(loader: ThreadDataLoader[Any], count: int) -> list[list[Any]]:
        return [[b.tolist() for b in loader] for _ in range(count)]

    loader = make()
    list(loader)
    if cut == "leaving the empty pass":
        it = iter(loader)
        time.sleep(0.1)  # workers draw ahead, to the pass's end
        del it
        state = loader.state_dict()
        following = passes(loader, 2)
    else:
        list(loader)
        it = iter(loader) if cut == "after the next pass's iter()" else None
        state = loader.state_dict()
        del it
        following = passes(make(), 4)[2:]
        assert following[0] and following[0] != passes(make(), 1)[0]
    resumed = make()
    resumed.load_state_dict(state)
    assert passes(resumed, 2) == following


def test_an_out_of_order_state_before_a_second_passs_first_batch_resumes_that_pass() -> None:
    """in_order=False in a sampler's second pass: later batches arrive before the slow first,
    and a state then has no position of the pass behind the loop. It holds the sampler's state
    after its first pass, which the resume runs out: the second pass's rest comes, each sample
    once (the first pass's order would lose and repeat samples)."""
    probe = ResumableOrder(12)
    list(probe)
    slow = frozenset(list(probe)[:2])  # the second pass's first batch

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            SlowItems(slow, n=12), batch_size=2, sampler=ResumableOrder(12), num_workers=2,
            in_order=False, timeout=30,
        )  # fmt: skip

    loader = make()
    list(loader)
    it = iter(loader)
    got = [next(it), next(it)]
    state = loader.state_dict()
    del it
    assert state["position"] == 0 and state["delivered_ahead"], "the scenario is wrong"
    resumed = make()
    resumed.load_state_dict(state)
    assert sorted(_items(got + list(resumed))) == list(range(12))


class LiveStateOrder(EpochCountingOrder):
    """The same sampler, handing out its live state dict, which it changes as it draws; with
    ``unpicklable``, that dict also holds a lambda."""

    def __init__(self, n: int, seed: int = 0, unpicklable: bool = False) -> None:
        super().__init__(n, seed)
        self.live: dict[str, Any] = {"hook": lambda: None} if unpicklable else {}

    def __iter__(self) -> Iterator[int]:
        for i in super().__iter__():
            self.live.update(epoch=self.epoch, yielded=self.yielded)
            yield i
        self.live.update(epoch=self.epoch, yielded=self.yielded)

    def state_dict(self) -> dict[str, Any]:
        return self.live


def _resumed_after(
    make: Callable[[], ThreadDataLoader[Any]], cut: int
) -> tuple[list[Any], ThreadDataLoader[Any]]:
    """The first ``cut`` batches of an epoch (as lists), and a new loader holding the state
    saved after them (not through ``torch.save``: some samplers' states here do not pickle)."""
    loader = make()
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(cut)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    return seen, resumed


@pytest.mark.parametrize("unpicklable", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [3, 8])
def test_a_sampler_handing_out_its_live_state_resumes_from_the_last_batch_received(
    cut: int, num_workers: int, unpicklable: bool
) -> None:
    """A state_dict() that returns the sampler's own dict, changed in place as it draws on
    (workers draw ahead): the saved state is as of the last batch the loop received, mid-epoch
    and at an epoch's end; also for a state that does not pickle (it is copied instead)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            list(range(16)), batch_size=2, sampler=LiveStateOrder(16, 4, unpicklable),
            num_workers=num_workers,
        )  # fmt: skip

    loader = make()
    uninterrupted = [b.tolist() for _ in range(2) for b in loader]
    seen, resumed = _resumed_after(make, cut)
    rest = [b.tolist() for _ in range(1 if cut < 8 else 0) for b in resumed]
    assert seen + rest + [b.tolist() for b in resumed] == uninterrupted


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [7, 8, 9])
def test_a_sampler_keeping_its_own_state_gives_dataloaders_batches(
    n: int, drop_last: bool, num_workers: int
) -> None:
    """Batching such a sampler ourselves (to keep its state before a partial last batch) gives
    torch's batches, epoch after epoch, with and without drop_last."""

    def batches(cls: Any) -> list[list[int]]:
        loader = cls(
            list(range(n)), batch_size=3, sampler=EpochCountingOrder(n, seed=6),
            drop_last=drop_last, num_workers=num_workers,
        )  # fmt: skip
        return [b.tolist() for _ in range(3) for b in loader]

    assert batches(ThreadDataLoader) == batches(torch.utils.data.DataLoader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_pass_of_a_sampler_keeping_its_own_state_ends_where_it_should(
    num_workers: int,
) -> None:
    """A pass resumed mid-way from the sampler's own state yields only its rest; its partial
    last batch still keeps the state from before the pass ended, so a state taken after it
    starts the next pass, not the one after (7 samples in batches of 2)."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            list(range(7)), batch_size=2, sampler=EpochCountingOrder(7, seed=3),
            num_workers=num_workers,
        )  # fmt: skip

    loader = make()
    uninterrupted = [b.tolist() for _ in range(2) for b in loader]
    seen, resumed = _resumed_after(make, 2)
    seen += [b.tolist() for b in resumed]
    again = make()
    again.load_state_dict(resumed.state_dict())
    assert seen + [b.tolist() for b in again] == uninterrupted
