"""``save_worker_rng=True``: random draws from the workers' own generators survive a resume.

A dataset that augments with ``thread_safe_generator()`` and the worker's ``random`` and numpy
generators: an epoch cut, saved (through ``torch.save``), loaded into a new loader and finished
gives exactly the batches of an uninterrupted epoch, whichever thread made each batch (worker
threads, the training thread on the lean path, the isolation helper's runners).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_batches_equal, cut_and_resume, roundtrip
from torch.random import thread_safe_generator
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from threadloader import DistributedShuffleSampler, ThreadDataLoader
from threadloader._engine import threaded
from threadloader._primitives.concurrency import ConcurrencyController


class Augmented(Dataset[torch.Tensor]):
    """Item ``i``: ``[i, torch draw, random draw, numpy draw]``, from the worker's generators."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        assert info is not None and info.rng is not None, "fetched outside a worker"
        noise = torch.rand((), generator=thread_safe_generator()).item()
        py = info.rng.random_generator.random()
        np_draw = float(info.rng.numpy_generator.random())  # type: ignore[attr-defined]
        return torch.tensor([float(index), noise, py, np_draw], dtype=torch.float64)


def _init_draws(worker_id: int) -> None:
    """A worker_init_fn that draws: the saved state must already include what it drew."""
    info = get_worker_info()
    assert info is not None and info.rng is not None
    for _ in range(worker_id + 1):
        info.rng.random_generator.random()
        torch.rand((), generator=info.rng.torch_generator)


class _AlwaysZero(ConcurrencyController):
    """Keeps the training thread making every batch (the lean path)."""

    def __init__(self, maximum: int, minimum: int, **kwargs: object) -> None:
        super().__init__(maximum, minimum, initial=minimum)

    def on_batch(self, *args: float | None) -> int | None:
        return None


class _AlwaysMax(ConcurrencyController):
    """Keeps every worker thread fetching."""

    def on_batch(self, *args: float | None) -> int | None:
        return None


def _loader(num_workers: int = 2, **kwargs: Any) -> ThreadDataLoader[Any]:
    options: dict[str, Any] = {
        "batch_size": 4,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(7),
        "num_workers": num_workers,
        "worker_init_fn": _init_draws,
        "save_worker_rng": True,
    }
    options.update(kwargs)
    return ThreadDataLoader(Augmented(), **options)


@pytest.mark.parametrize("cut", [1, 3, 6])
@pytest.mark.parametrize(
    "who",
    ["workers", "training-thread", "helper-process", "workers-device-stage"],
    ids=lambda w: f"made-by-{w}",
)
def test_resumed_epoch_draws_exactly_what_an_uninterrupted_one_draws(
    monkeypatch: pytest.MonkeyPatch, who: str, cut: int
) -> None:
    kwargs: dict[str, Any] = {}
    if who == "workers":
        monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysMax)
    elif who == "training-thread":
        monkeypatch.setattr(threaded, "ConcurrencyController", _AlwaysZero)
    elif who == "helper-process":
        kwargs["isolation"] = "process"
    else:  # batches pass a transfer thread that runs ahead: the state is the loop's batch's
        kwargs["device"] = "cpu"
    reference = list(_loader(**kwargs))
    got, state = cut_and_resume(lambda: _loader(**kwargs), cut)
    assert state["worker_rng_states"] is not None
    assert len(got) == len(reference)
    for mine, want in zip(got, reference, strict=True):
        assert_batches_equal(mine, want)


def test_without_the_option_a_resume_reseeds_the_generators() -> None:
    """What the option buys: by default the indices resume exactly, the draws do not."""
    reference = torch.cat(list(_loader(save_worker_rng=False)))
    got, state = cut_and_resume(lambda: _loader(save_worker_rng=False), 3)
    resumed = torch.cat(got)
    assert state["worker_rng_states"] is None
    assert torch.equal(resumed[:, 0], reference[:, 0])  # same samples, same order
    assert not torch.equal(resumed[12:, 1:], reference[12:, 1:])  # other draws after the cut


def test_persistent_workers_resume_their_generators_in_a_later_epoch() -> None:
    """Persistent workers' generators run on across epochs; a mid-epoch-2 resume continues them."""

    def make() -> ThreadDataLoader[Any]:
        return _loader(persistent_workers=True)

    reference = make()
    list(reference)
    second = list(reference)
    loader = make()
    list(loader)
    seen = list(itertools.islice(iter(loader), 1))  # before worker 1 delivers in epoch 2
    state = roundtrip(loader.state_dict())
    assert state["worker_rng_states"][1] is not None  # carried from epoch 1
    resumed = make()
    resumed.load_state_dict(state)
    for mine, want in zip(seen + list(resumed), second, strict=True):
        assert_batches_equal(mine, want)


def test_another_number_of_workers_warns_and_starts_the_generators_fresh() -> None:
    loader = _loader(num_workers=2)
    it = iter(loader)
    seen = list(itertools.islice(it, 3))
    state = roundtrip(loader.state_dict())
    del it
    resumed = _loader(num_workers=3)
    with pytest.warns(UserWarning, match="generators of 2 workers, this loader has 3"):
        resumed.load_state_dict(state)
    rest = list(resumed)
    indices = torch.cat(seen + rest)[:, 0].tolist()
    assert sorted(indices) == [float(i) for i in range(48)]  # the index stream still resumes


def test_saved_generator_state_is_plain_data() -> None:
    """Lists, ints and str (the torch state as base64): a checkpoint loads it with
    weights_only=True, and JSON takes it."""
    import io

    loader = _loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    saved = [s for s in loaded["worker_rng_states"] if s is not None]
    assert saved and isinstance(saved[0]["random"], list)
    assert isinstance(saved[0]["torch"], str)
    assert json.loads(json.dumps(state)) == json.loads(json.dumps(loaded))


def test_option_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="save_worker_rng must be a bool"):
        ThreadDataLoader(Augmented(), save_worker_rng="yes")  # type: ignore[arg-type]


class AugmentedStream(IterableDataset[torch.Tensor]):
    """An IterableDataset without state_dict (a resume replays its first batches) whose items
    draw from the worker's generator."""

    def __init__(self) -> None:
        self.position = 0  # items this worker's copy has yielded

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        assert info is not None
        mine = range(info.id, 40, info.num_workers)
        for i in mine[self.position :]:  # skipped items draw nothing, as a real resume would
            self.position += 1
            noise = torch.rand((), generator=thread_safe_generator()).item()
            yield torch.tensor([float(i), noise], dtype=torch.float64)


class StatefulAugmentedStream(AugmentedStream):
    """The same stream with state_dict: a resume skips to each worker's position, no replay."""

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _stream_loader(dataset: AugmentedStream) -> ThreadDataLoader[Any]:
    return ThreadDataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        generator=torch.Generator().manual_seed(3),
        save_worker_rng=True,
    )


@pytest.mark.parametrize("cut", [1, 3])
def test_a_replayed_iterable_dataset_draws_as_an_uninterrupted_one(cut: int) -> None:
    """Replaying re-draws the first batches from the seeds: restoring the saved generators on
    top would advance them twice."""
    reference = list(_stream_loader(AugmentedStream()))
    with pytest.warns(UserWarning, match="resuming by fetching and dropping"):
        got, _ = cut_and_resume(lambda: _stream_loader(AugmentedStream()), cut)
    for mine, want in zip(got, reference, strict=True):
        assert_batches_equal(mine, want)


class EveryEpochStream(IterableDataset[torch.Tensor]):
    """Each epoch the same items, each with a draw from the worker's torch generator, and no
    state_dict: a resume replays the epoch's first batches."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        assert info is not None
        for i in range(info.id, 24, info.num_workers):
            noise = torch.rand((), generator=thread_safe_generator()).item()
            yield torch.tensor([float(i), noise], dtype=torch.float64)


@pytest.mark.parametrize("isolation", ["threads", "process"])
@pytest.mark.parametrize("cut", [1, 3])
def test_a_replayed_later_epoch_of_persistent_workers_draws_as_an_uninterrupted_one(
    cut: int, isolation: str
) -> None:
    """Persistent workers carry their generators into the next epoch; a resume that replays
    that epoch's first batches replays them from the carried generators, not from the seeds."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            EveryEpochStream(),
            batch_size=4,
            num_workers=2,
            persistent_workers=True,
            save_worker_rng=True,
            isolation=isolation,
        )

    torch.manual_seed(11)
    reference = make()
    list(reference)
    second = list(reference)
    torch.manual_seed(11)
    loader = make()
    list(loader)
    it = iter(loader)
    seen = [next(it) for _ in range(cut)]
    state = roundtrip(loader.state_dict())
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="resuming by fetching and dropping"):
        rest = list(resumed)
    for mine, want in zip(seen + rest, second, strict=True):
        assert_batches_equal(mine, want)


@pytest.mark.parametrize("cut", [1, 3])
def test_a_stateful_iterable_dataset_resumes_its_state_and_its_draws(cut: int) -> None:
    reference = list(_stream_loader(StatefulAugmentedStream()))
    got, state = cut_and_resume(lambda: _stream_loader(StatefulAugmentedStream()), cut)
    assert state["worker_states"] is not None and state["worker_rng_states"] is not None
    for mine, want in zip(got, reference, strict=True):
        assert_batches_equal(mine, want)


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_resumed_state_saved_again_before_every_worker_delivered_resumes_exactly(
    isolation: str,
) -> None:
    """A resumed worker that has delivered nothing since still holds the generator state it was
    resumed from, already in its saved (plain) form: saving again must keep it as it is (it
    raised AttributeError), and resuming from that second state draws what an uninterrupted
    run draws."""
    make = lambda: _loader(num_workers=3, isolation=isolation)
    reference = list(make())
    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    first = loader.state_dict()
    del it
    loader = make()
    loader.load_state_dict(first)
    it = iter(loader)
    got.append(next(it))  # one worker of three delivered since the resume
    second = loader.state_dict()
    del it
    loader = make()
    loader.load_state_dict(second)
    got += list(loader)
    assert len(got) == len(reference)
    for mine, want in zip(got, reference, strict=True):
        assert_batches_equal(mine, want)


class DrawsThenFails(Dataset[torch.Tensor]):
    """Item i: ``[i, a draw from the worker's random]``; item 2 draws, then raises."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        import random

        drawn = random.random()
        if index == 2:
            raise ValueError("bad index 2")
        return torch.tensor([float(index), drawn], dtype=torch.float64)


def _batches_and_errors(it: Iterator[Any], count: int | None = None) -> list[Any]:
    out: list[Any] = []
    while count is None or len(out) < count:
        try:
            out.append(next(it))
        except StopIteration:
            break
        except ValueError:
            out.append("error")
    return out


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_state_saved_after_a_failed_batch_keeps_what_it_drew(isolation: str) -> None:
    """Item 2 drew from its worker's generator before it raised: a state saved just after that
    batch resumes the generator past the draw, as an uninterrupted epoch goes on."""

    def loader() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            DrawsThenFails(),
            batch_size=1,
            num_workers=2,
            isolation=isolation,
            save_worker_rng=True,
            generator=torch.Generator().manual_seed(0),
        )

    whole = _batches_and_errors(iter(loader()))
    cut = loader()
    head = _batches_and_errors(iter(cut), 3)
    assert head[2] == "error"
    resumed = loader()
    resumed.load_state_dict(roundtrip(cut.state_dict()))
    rest = _batches_and_errors(iter(resumed))
    got = head + rest
    assert len(got) == len(whole)
    for i, (a, b) in enumerate(zip(got, whole, strict=True)):
        if isinstance(b, str):
            assert a == b, f"batch {i}"
        else:
            assert_batches_equal(a, b, f"batch {i}")


class DrawsPerItem(Dataset[torch.Tensor]):
    """Item i: ``[i, a draw from the worker's torch RNG]``."""

    def __len__(self) -> int:
        return 15

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 10**6, ()))])


def _epoch_keyed_sampler(kind: str) -> Any:
    from threadloader import DistributedShuffleSampler, ShuffleSampler
    from threadloader.streams import Mixture, MixtureSampler

    if kind == "shuffle":
        return ShuffleSampler(15, seed=1)
    if kind == "distributed":
        return DistributedShuffleSampler(range(15), num_replicas=1, rank=0, seed=1)
    mixture = Mixture({"a": range(9), "b": range(9, 15)}, {"a": 0.5, "b": 0.5}, seed=1)
    return MixtureSampler(mixture, samples_per_epoch=15)


@pytest.mark.parametrize("kind", ["shuffle", "distributed", "mixture"])
@pytest.mark.parametrize(
    ("isolation", "persistent", "device"),
    [("threads", False, None), ("process", False, None), ("threads", True, None),
     ("threads", False, "cpu")],
)  # fmt: skip
def test_the_empty_rest_of_a_finished_epoch_draws_no_base_seed(
    kind: str, isolation: str, persistent: bool, device: str | None
) -> None:
    """A state taken at an epoch's last step, resumed by a loop that starts again at the
    checkpoint's epoch: that epoch's empty rest comes first. The uninterrupted run made no such
    iterator, so it draws no base seed from the generator, and the next epoch's workers draw
    the augmentations that run's did. Persistent workers are reset for the next epoch, from
    their saved generators."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        sampler = _epoch_keyed_sampler(kind)
        loader = ThreadDataLoader(
            DrawsPerItem(), batch_size=5, sampler=sampler, num_workers=2,
            generator=torch.Generator().manual_seed(2), isolation=isolation,
            persistent_workers=persistent, device=device, save_worker_rng=True,
        )  # fmt: skip
        return loader, sampler

    loader, sampler = make()
    sampler.set_epoch(0)
    it = iter(loader)
    _ = [next(it) for _ in range(3)]  # the epoch's last batch; no StopIteration yet
    state = roundtrip(loader.state_dict())
    assert list(it) == []
    sampler.set_epoch(1)
    expected = [b.tolist() for b in loader]

    resumed, resumed_sampler = make()
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(0)
    assert list(resumed) == []
    resumed_sampler.set_epoch(1)
    assert [b.tolist() for b in resumed] == expected


@pytest.mark.parametrize("kind", ["shuffle", "distributed", "mixture"])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_at_the_last_step_of_a_resumed_epoch_starts_the_next(
    kind: str, persistent: bool
) -> None:
    """An epoch resumed after its first batch, checkpointed again at its last step: that state
    is a finished epoch's, as it is for an epoch that was not resumed, so the run resumed from
    it gives the next epochs the uninterrupted run gave, their augmentations included."""

    def make() -> tuple[ThreadDataLoader[Any], Any]:
        sampler = _epoch_keyed_sampler(kind)
        loader = ThreadDataLoader(
            DrawsPerItem(), batch_size=5, sampler=sampler, num_workers=2,
            generator=torch.Generator().manual_seed(2), persistent_workers=persistent,
            save_worker_rng=True,
        )  # fmt: skip
        return loader, sampler

    def epochs(loader: ThreadDataLoader[Any], sampler: Any, first: int) -> list[Any]:
        out = []
        for epoch in range(first, 3):
            sampler.set_epoch(epoch)
            out.append([b.tolist() for b in loader])
        return out

    expected = epochs(*make(), 0)[1:]
    loader, sampler = make()
    sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    cut = roundtrip(loader.state_dict())
    del it
    loader, sampler = make()
    loader.load_state_dict(cut)
    sampler.set_epoch(0)
    it = iter(loader)
    _ = [next(it) for _ in range(2)]  # the epoch's last batch; no StopIteration yet
    state = roundtrip(loader.state_dict())
    assert state["in_progress"] is False
    resumed, resumed_sampler = make()
    resumed.load_state_dict(state)
    assert epochs(resumed, resumed_sampler, 0) == [[], *expected]


class DrawingStream(IterableDataset[tuple[int, float]]):
    """Items ``pos`` to ``n - 1``, each with a draw from the worker's global RNG; the position is
    the dataset's state, back to 0 at its end."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self) -> Iterator[tuple[int, float]]:
        for k in range(self.pos, self.n):
            self.pos = k + 1
            yield k, torch.rand(1).item()
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class StatelessDrawingStream(IterableDataset[tuple[int, float]]):
    """Items 0 to ``n - 1`` each epoch, each with a draw from the worker's global RNG; no state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[int, float]]:
        for k in range(self.n):
            yield k, torch.rand(1).item()


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_state_between_epochs_replays_the_draws_of_a_dropped_last_batch(
    num_workers: int, stateful: bool
) -> None:
    """With ``drop_last`` the worker drew for items 4 and 5, then dropped their partial batch:
    the next epoch's draws follow those, in a resumed run too, or every later item draws other
    numbers. The state keeps each worker as its end left it."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            DrawingStream(6) if stateful else StatelessDrawingStream(6),
            batch_size=4,
            drop_last=True,
            num_workers=num_workers,
            persistent_workers=True,
            save_worker_rng=True,
            collate_fn=list,
        )

    torch.manual_seed(0)
    loader = make()
    list(loader)
    it = iter(loader)
    state = loader.state_dict()
    original = [list(it), list(loader)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [list(resumed), list(resumed)] == original


class DrawingItems(Dataset[tuple[int, float]]):
    """Item ``i`` with a draw from the worker's global RNG."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, torch.rand(1).item()


def _persistent_with_sampler(sampler_kind: str) -> ThreadDataLoader[Any]:
    dataset = DrawingItems()
    if sampler_kind == "torch":
        sampler: Any = torch.utils.data.DistributedSampler(dataset, 1, 0, shuffle=False)
    else:
        sampler = DistributedShuffleSampler(dataset, num_replicas=1, rank=0, seed=3)
    return ThreadDataLoader(
        dataset,
        batch_size=2,
        sampler=sampler,
        num_workers=2,
        persistent_workers=True,
        save_worker_rng=True,
        collate_fn=list,
    )


@pytest.mark.parametrize("sampler_kind", ["torch", "threadloader"])
def test_a_state_after_a_break_and_set_epoch_carries_the_draws_of_the_batches_in_flight(
    sampler_kind: str,
) -> None:
    """Persistent workers made the batches in flight at the break, and drew for them; the next
    epoch continues from there. A state taken after ``set_epoch`` of that epoch starts it with
    the generators after those draws, as the workers have them (it had them as of the last
    delivered batch: every later draw differed)."""
    torch.manual_seed(0)
    loader = _persistent_with_sampler(sampler_kind)
    it = iter(loader)
    next(it)
    del it  # break
    loader.sampler.set_epoch(1)
    state = loader.state_dict()
    original = list(loader)
    torch.manual_seed(1)  # another process
    resumed = _persistent_with_sampler(sampler_kind)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    assert list(resumed) == original


def test_a_loop_that_goes_on_after_such_a_state_still_receives_every_batch() -> None:
    """``state_dict()`` waits for the batches in flight to take their states, and keeps them
    for the loop: one that goes on in the epoch after all receives each batch once."""
    torch.manual_seed(0)
    loader = _persistent_with_sampler("torch")
    it = iter(loader)
    head = [next(it)]
    loader.sampler.set_epoch(1)
    loader.state_dict()
    rest = list(it)
    assert [i for batch in head + rest for i, _ in batch] == list(range(8))
