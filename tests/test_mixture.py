"""threadloader.streams.Mixture and MixtureSampler: low-discrepancy mixing, live weights, resume.

Sources are ``range(n)`` datasets, so a sampled concatenated index decodes to (source, sample) with
``Mixture.source_of``. A "stream" is the dict global position -> concatenated index; the
reference is always one rank reading the same positions without interruption.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import outcomes
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from threadloader import ThreadDataLoader
from threadloader.streams import Mixture, MixtureSampler, TokenWindows

SIZES = {"books": 40, "code": 25, "web": 90}
WEIGHTS = {"books": 0.2, "code": 0.3, "web": 0.5}
LATER = {"books": 0.6, "code": 0.0, "web": 0.4}


def _mixture(weights: dict[str, float] = WEIGHTS, seed: int = 0, **sizes: int) -> Mixture:
    return Mixture({name: range(n) for name, n in (sizes or SIZES).items()}, weights, seed=seed)


def _take(sampler: MixtureSampler, it: Iterator[int], count: int, into: dict[int, int]) -> None:
    """Take ``count`` indices from a rank's iterator, recording each at its global position."""
    start, stride = sampler.position_after(0), sampler.num_replicas
    first = (sampler.next_position - start) // stride
    for j, index in enumerate(itertools.islice(it, count), start=first):
        position = start + sampler.rank + j * stride
        assert position not in into, f"position {position} read twice"
        into[position] = index


def _reference(length: int, changes: list[tuple[int, dict[str, float]]]) -> list[int]:
    """One rank, no interruption: the stream's first ``length`` indices with ``changes`` applied."""
    mixture = _mixture()
    for position, weights in changes:
        mixture.set_weights(weights, at_position=position)
    return mixture.indices_at(np.arange(length)).tolist()


def _by_source(mixture: Mixture, indices: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {name: [] for name in mixture.names}
    for index in indices:
        name, local = mixture.source_of(index)
        out[name].append(local)
    return out


def test_proportions_over_every_window_of_10000_samples_are_within_1_percent() -> None:
    """Sliding windows of 10,000 positions match the weights within 1%, before and after a change."""
    mixture = _mixture(
        {"books": 0.07, "code": 0.23, "web": 0.7}, seed=9, a=10**6, books=300, code=500, web=700
    )
    mixture.set_weights({"a": 0.5, "books": 0.25, "code": 0.25}, at_position=40_000)
    index = mixture.indices_at(np.arange(80_000))
    source = (
        np.searchsorted(np.array([0, 10**6, 10**6 + 300, 10**6 + 800]), index, side="right") - 1
    )
    for lo, hi, weights in [
        (0, 40_000, [0, 0.07, 0.23, 0.7]),
        (40_000, 80_000, [0.5, 0.25, 0.25, 0]),
    ]:
        for s, w in enumerate(weights):
            counts = np.concatenate([[0], np.cumsum(source[lo:hi] == s)])
            share = (counts[10_000:] - counts[:-10_000]) / 10_000
            assert np.abs(share - w).max() < 0.01, (s, w, np.abs(share - w).max())


def test_each_source_runs_through_its_own_shuffled_epochs() -> None:
    """In stream order, every source gives permutations of its samples, a new one each epoch."""
    mixture = _mixture()
    per_source = _by_source(mixture, mixture.indices_at(np.arange(2000)).tolist())
    for name, n in SIZES.items():
        drawn = per_source[name]
        epochs = [drawn[e * n : (e + 1) * n] for e in range(len(drawn) // n)]
        assert len(epochs) >= 3
        for epoch in epochs:
            assert sorted(epoch) == list(range(n))
        assert epochs[0] != epochs[1] and epochs[0] != list(range(n))


def test_the_global_order_does_not_depend_on_the_world_size() -> None:
    """Three ranks reading positions r, r+3, ... together read the one-rank stream."""
    seen: dict[int, int] = {}
    for rank in range(3):
        sampler = MixtureSampler(_mixture(), num_replicas=3, rank=rank, samples_per_epoch=300)
        assert len(sampler) == 100
        _take(sampler, iter(sampler), 100, seen)
    assert [seen[p] for p in range(300)] == _reference(300, [])


def test_each_epoch_is_the_next_stretch_of_the_stream_and_iter_alone_repeats_it() -> None:
    """set_epoch(e + 1) continues the stream; iter() without it reads the epoch again, as torch's
    DistributedSampler does; going back raises."""
    sampler = MixtureSampler(_mixture(), samples_per_epoch=70)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert first + list(sampler) == _reference(140, [])
    sampler.set_epoch(3)  # epoch 2 skipped: positions 140..209
    assert list(sampler) == _reference(280, [])[210:]
    with pytest.raises(ValueError, match="cannot go back to epoch 1"):
        sampler.set_epoch(1)


def test_a_live_change_takes_effect_at_the_next_position_not_yet_handed_out() -> None:
    """set_weights() mid-pass changes the stream from the sampler's next position on, no earlier."""
    mixture = _mixture()
    sampler = MixtureSampler(mixture, samples_per_epoch=400)
    it = iter(sampler)
    head = list(itertools.islice(it, 37))
    assert mixture.set_weights(LATER) == 37
    assert head + list(it) == _reference(400, [(37, LATER)])
    assert mixture.schedule == [(0, WEIGHTS), (37, LATER)]


def test_a_change_at_an_earlier_position_rewinds_the_iterator_to_it() -> None:
    """A change keyed at a position already handed out makes the iterator yield from there again."""
    mixture = _mixture()
    sampler = MixtureSampler(mixture, num_replicas=2, rank=1, samples_per_epoch=400)
    it = iter(sampler)
    list(itertools.islice(it, 60))  # positions 1, 3, ..., 119; say the loop consumed 20
    position = sampler.position_after(20)
    assert position == 40
    mixture.set_weights(LATER, at_position=position)
    assert sampler.next_position == 40
    assert list(it) == _reference(400, [(40, LATER)])[41:400:2]


def test_a_rewind_through_torchs_batch_sampler_restarts_at_the_consumed_batch() -> None:
    """The loader's hook: 6 batches handed out, 2 consumed, change at the consumer's position; the
    same BatchSampler iterator then yields batch 3 of the changed stream."""
    mixture = _mixture()
    sampler = MixtureSampler(mixture, num_replicas=2, rank=1, samples_per_epoch=400)
    batches = iter(BatchSampler(sampler, batch_size=8, drop_last=False))
    handed = [next(batches) for _ in range(6)]
    at = mixture.set_weights(LATER, at_position=sampler.position_after(2 * 8))
    assert at == 32
    expected = _reference(400, [(32, LATER)])[1:400:2]
    assert handed[:2] == [expected[:8], expected[8:16]]
    assert [next(batches) for _ in range(3)] == [expected[16:24], expected[24:32], expected[32:40]]


def test_every_sample_of_each_source_epoch_is_seen_once_across_a_2_to_3_rank_resume() -> None:
    """2 ranks change weights live and checkpoint; 3 ranks resume and change weights again at
    restart: positions are read once each, every source epoch is a permutation, and the stream
    equals the uninterrupted one-rank stream with the same changes."""
    seen: dict[int, int] = {}
    two = [
        MixtureSampler(_mixture(), num_replicas=2, rank=r, samples_per_epoch=160) for r in range(2)
    ]
    iters = [iter(s) for s in two]
    for sampler, it in zip(two, iters, strict=True):
        _take(sampler, it, 21, seen)
    for sampler in two:
        assert sampler.mixture.set_weights(LATER) == 42  # every rank: the same next position
    for sampler, it in zip(two, iters, strict=True):
        _take(sampler, it, 30, seen)
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert (state["start"], state["cursor"], state["end"]) == (0, 102, 160)
    state = json.loads(json.dumps(state))  # plain data: survives any serialiser

    restart = {"books": 1.0, "code": 1.0, "web": 1.0}
    three = [
        MixtureSampler(_mixture(), num_replicas=3, rank=r, samples_per_epoch=160) for r in range(3)
    ]
    for sampler in three:
        sampler.load_state_dict(state)
        assert sampler.mixture.set_weights(restart) == 102
        assert len(sampler) == 19  # (160 - 102) // 3; position 159 starts epoch 1
    for epoch in range(4):
        for sampler in three:
            sampler.set_epoch(epoch)
            _take(sampler, iter(sampler), len(sampler), seen)
    end = max(seen) + 1
    assert sorted(seen) == list(range(end)) and end == 102 + 3 * 19 + 3 * 3 * 53
    stream = [seen[p] for p in range(end)]
    assert stream == _reference(end, [(42, LATER), (102, restart)])
    for name, drawn in _by_source(three[0].mixture, stream).items():
        n = SIZES[name]
        for e in range(len(drawn) // n):
            assert sorted(drawn[e * n : (e + 1) * n]) == list(range(n)), (name, e)


def test_the_state_stays_o_of_the_number_of_sources_over_many_changes() -> None:
    """After 30 passes with a weight change in each, the state holds at most two regimes."""
    mixture = _mixture()
    sampler = MixtureSampler(mixture, samples_per_epoch=50)
    rng = np.random.default_rng(0)
    for epoch in range(30):
        sampler.set_epoch(epoch)
        it = iter(sampler)
        list(itertools.islice(it, 20))
        mixture.set_weights(dict(zip(SIZES, rng.random(3).tolist(), strict=True)))
        list(it)
    state = sampler.state_dict()
    assert len(state["schedule"]) <= 2
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert len(buffer.getvalue()) < 4000


def test_resume_reproduces_the_stream_whatever_the_new_mixture_was_built_with() -> None:
    """The saved schedule and seed win over the weights and seed given to the new Mixture."""
    mixture = _mixture(seed=3)
    sampler = MixtureSampler(mixture, samples_per_epoch=200)
    it = iter(sampler)
    list(itertools.islice(it, 50))
    mixture.set_weights(LATER)
    list(itertools.islice(it, 50))
    state = sampler.state_dict()
    rest = list(it)
    other = MixtureSampler(_mixture({"web": 1.0}, seed=8), samples_per_epoch=200)
    other.load_state_dict(state)
    assert list(other) == rest


def test_a_source_added_at_restart_joins_with_weight_zero_until_given_one() -> None:
    """A state saved without a source loads; the new source appears only after set_weights."""
    old = MixtureSampler(
        _mixture({"books": 1, "code": 1}, books=40, code=25), samples_per_epoch=100
    )
    list(old)
    new_mixture = _mixture(books=40, code=25, web=90)
    new = MixtureSampler(new_mixture, samples_per_epoch=100)
    new.load_state_dict(old.state_dict())
    new.set_epoch(1)
    assert set(_by_source(new_mixture, list(new))["web"]) == set()
    new_mixture.set_weights({"books": 1, "code": 1, "web": 2})  # from epoch 2's first position
    new.set_epoch(2)
    assert len(_by_source(new_mixture, list(new))["web"]) > 30


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"books": 1.0, "wbe": 1.0}, r"unknown source name\(s\) \['wbe'\]"),
        ({"books": 1.0, "code": -0.5}, "weight of source 'code' must be finite and >= 0"),
        ({"web": float("nan")}, "weight of source 'web'"),
        ({"web": "lots"}, "weight of source 'web' must be a number"),
        ({"books": 0, "code": 0.0}, "all weights are zero"),
        ({}, "all weights are zero"),
    ],
    ids=["unknown", "negative", "nan", "not-a-number", "all-zero", "none"],
)
def test_bad_weights_raise_value_error_naming_the_source(
    weights: dict[str, float], match: str
) -> None:
    """Bad weights are rejected by the constructor and by set_weights, naming the culprit."""
    with pytest.raises(ValueError, match=match):
        _mixture(weights)
    mixture = _mixture()
    with pytest.raises(ValueError, match=match):
        mixture.set_weights(weights)
    assert mixture.weights == WEIGHTS


def test_huge_finite_weights_are_normalised_without_overflow() -> None:
    """Weights are relative: 1e308 and 1e308 mean half and half (their sum overflows a float)."""
    weights = _mixture({"books": 1e308, "code": 1e308}).weights
    assert weights == {"books": 0.5, "code": 0.5, "web": 0.0}


def test_bad_sources_raise_naming_the_source() -> None:
    """An empty source, a source without len() and no sources at all are rejected."""
    with pytest.raises(ValueError, match="source 'code' is empty"):
        Mixture({"web": range(5), "code": range(0)}, {"web": 1})
    with pytest.raises(TypeError, match="source 'web' has no len"):
        Mixture({"web": iter(range(5))}, {"web": 1})
    with pytest.raises(ValueError, match="non-empty"):
        Mixture({}, {})


def test_changes_before_the_current_pass_are_rejected() -> None:
    """A position before the pass being read, or before the recorded schedule, raises ValueError."""
    mixture = _mixture()
    sampler = MixtureSampler(mixture, samples_per_epoch=50)
    list(sampler)
    sampler.set_epoch(1)
    it = iter(sampler)
    next(it)
    with pytest.raises(ValueError, match="cannot change the weights at position 10"):
        mixture.set_weights(LATER, at_position=10)


def _regime_changed(state: dict[str, Any], **change: Any) -> dict[str, Any]:
    """``state`` with its first weight regime's position, or one of its weights, changed."""
    regime = dict(state["schedule"][0])
    if "position" in change:
        regime["position"] = change["position"]
    if "weight" in change:
        name = next(iter(regime["weights"]))
        regime["weights"] = {**regime["weights"], name: change["weight"]}
    return {**state, "schedule": [regime, *state["schedule"][1:]]}


def test_counts_before_the_schedule_start_are_refused_like_indices() -> None:
    """A position before the recorded schedule has no counts, as it has no index."""
    mixture = _mixture()
    with pytest.raises(ValueError, match="before this schedule's start"):
        mixture.indices_at([-5])
    with pytest.raises(ValueError, match="before this schedule's start"):
        mixture.counts_at(-5)


def test_bad_states_raise_value_error_naming_the_mismatch() -> None:
    """Wrong version, another source length, an unknown source or a corrupted entry are named."""
    sampler = MixtureSampler(_mixture(), samples_per_epoch=50)
    list(itertools.islice(iter(sampler), 10))
    good = sampler.state_dict()
    cases = [
        ({**good, "version": 99}, "format version 99"),
        ({**good, "sources": {**good["sources"], "web": 91}}, "'web' of length 91"),
        (
            {**good, "sources": {**good["sources"], "wiki": 5}},
            "source 'wiki', which this mixture lacks",
        ),
        ({**good, "cursor": "ten"}, r"state\['cursor'\] must be an int"),
        ({k: v for k, v in good.items() if k != "schedule"}, "lacks \\['schedule'\\]"),
        ({**good, "schedule": []}, "non-empty list"),
        ({**good, "start": 60, "end": 50}, "expected 0 <= start <= start \\+ cursor <= end"),
        ({**good, "cursor": 10**6}, "cursor 1000000"),
        ({**good, "end": 2**64}, "end 18446744073709551616: expected .* < 2\\*\\*62"),
        (_regime_changed(good, position=-5), "position -5 is negative"),
        (_regime_changed(good, weight=float("nan")), "non-finite weight"),
        (_regime_changed(good, weight=-1.0), "negative or non-finite weight"),
        (_regime_changed(good, weight="heavy"), "not a number"),
        ("not a dict", "must be a dict"),
    ]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            MixtureSampler(_mixture(), samples_per_epoch=50).load_state_dict(state)  # type: ignore[arg-type]


def test_thread_loader_over_a_mixture_of_token_windows_gives_dataloaders_batches(
    tmp_path: Path,
) -> None:
    """ThreadDataLoader(num_workers=2) reads the same mixed batches as DataLoader(num_workers=0)."""
    np.arange(0, 3000, dtype=np.uint16).tofile(tmp_path / "web.bin")
    np.save(tmp_path / "code.npy", np.arange(5000, 6000, dtype=np.uint16))

    def make() -> tuple[Mixture, MixtureSampler]:
        sources = {
            "web": TokenWindows(tmp_path / "web.bin", seq_len=16),
            "code": TokenWindows(tmp_path / "code.npy", seq_len=16),
        }
        mixture = Mixture(sources, {"web": 0.7, "code": 0.3}, seed=1)
        return mixture, MixtureSampler(mixture, samples_per_epoch=400)

    mixture, sampler = make()
    theirs = list(DataLoader(mixture, batch_size=8, sampler=sampler))
    mixture, sampler = make()
    ours = list(ThreadDataLoader(mixture, batch_size=8, sampler=sampler, num_workers=2))
    assert len(ours) == len(theirs) == 50
    for (ax, ay), (bx, by) in zip(ours, theirs, strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
    code = sum(int((x[:, 0] >= 5000).sum()) for x, _ in ours)
    assert Counter(web=400 - code, code=code) == Counter(web=280, code=120)


def test_state_dict_at_describes_the_consumed_indices_not_the_prefetched_ones() -> None:
    """A loader that prefetched 60 indices of which its loop used 20 resumes at the 21st."""
    sampler = MixtureSampler(_mixture(), num_replicas=2, rank=0, samples_per_epoch=200)
    it = iter(sampler)
    list(itertools.islice(it, 60))
    state = sampler.state_dict_at(20)
    assert state["cursor"] == 40 and sampler.state_dict()["cursor"] == 120
    resumed = MixtureSampler(_mixture(), num_replicas=2, rank=0, samples_per_epoch=200)
    resumed.load_state_dict(state)
    assert list(resumed) == _reference(200, [])[40:200:2]


def test_thread_loader_resumes_a_mixture_with_a_live_change_exactly(tmp_path: Path) -> None:
    """Through ThreadDataLoader(num_workers=2): change weights live, save mid-epoch, resume in a
    new loader: the batches after the save are those of an uninterrupted run."""

    def make() -> tuple[Mixture, ThreadDataLoader[Any]]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=400)
        return mixture, ThreadDataLoader(mixture, batch_size=8, sampler=sampler, num_workers=2)

    mixture, loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(10)]
    at = mixture.set_weights({"a": 0.1, "b": 0.9})
    head += [next(it) for _ in range(10)]
    state = loader.state_dict()
    rest = list(it)
    assert len(head) + len(rest) == 50

    mixture2, loader2 = make()
    loader2.load_state_dict(state)
    assert [b.tolist() for b in loader2] == [b.tolist() for b in rest]
    reference = _mixture_reference(at)
    assert [int(v) for batch in head + rest for v in batch] == reference
    assert mixture2.schedule == [(0, {"a": 0.7, "b": 0.3}), (at, {"a": 0.1, "b": 0.9})]


def _resumed_rest(make: Callable[[], ThreadDataLoader[Any]], state: dict[str, Any]) -> list[Any]:
    """The batches a new loader from ``make`` gives once it loaded ``state``."""
    resumed = make()
    resumed.load_state_dict(state)
    return list(resumed)


def _mixture_reference(at: int) -> list[int]:
    mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    mixture.set_weights({"a": 0.1, "b": 0.9}, at_position=at)
    return [mixture[i] for i in mixture.indices_at(np.arange(400)).tolist()]


@pytest.mark.parametrize(
    ("num_workers", "isolation"), [(0, "threads"), (2, "threads"), (2, "process")]
)
@pytest.mark.parametrize("cut", [3, 10])
def test_loader_set_mixture_weights_applies_from_the_next_batch(
    num_workers: int, isolation: str, cut: int
) -> None:
    """loader.set_mixture_weights() after k batches: batch k+1 on is drawn with the new weights,
    whatever the workers had prefetched; the stream equals a schedule changed at k * batch_size.
    In helper processes too (the batches they had prefetched were delivered as well)."""
    mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    sampler = MixtureSampler(mixture, samples_per_epoch=400)
    loader = ThreadDataLoader(
        mixture, batch_size=8, sampler=sampler, num_workers=num_workers, isolation=isolation
    )
    it = iter(loader)
    got = [next(it) for _ in range(cut)]
    position = loader.set_mixture_weights({"a": 0.1, "b": 0.9})
    got += list(it)
    assert position == cut * 8
    assert torch.cat(got).tolist() == _mixture_reference(cut * 8)


class Augmented(Dataset[torch.Tensor]):
    """Item i: ``base + i`` and draws from the worker's torch, ``random`` and ``numpy.random``
    globals (random augmentations); with ``pause_s``, a random pause (timing only)."""

    def __init__(self, base: int, n: int, pause_s: float = 0.0) -> None:
        self.base, self.n, self.pause_s = base, n, pause_s
        self.timing = random.Random()  # not a worker's generator: moves no draw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.pause_s:
            time.sleep(self.timing.random() * self.pause_s)
        drawn = [int(torch.randint(0, 1000, ())), random.randrange(1000), np.random.randint(1000)]
        return torch.tensor([self.base + i, *drawn])


def _augmented_epoch(
    at: int | None, change_at: int | None, pause_s: float, **kwargs: Any
) -> list[list[int]]:
    """An epoch of 50 batches of 4 over two ``Augmented`` sources, the weights changed for the
    positions from ``at`` on: up front (``change_at`` None) or live after ``change_at`` batches."""
    torch.manual_seed(0)
    sources = {"a": Augmented(1000, 97, pause_s), "b": Augmented(2000, 61, pause_s)}
    mixture = Mixture(sources, {"a": 0.7, "b": 0.3})
    if change_at is None and at is not None:
        mixture.set_weights({"a": 0.1, "b": 0.9}, at_position=at)
    sampler = MixtureSampler(mixture, samples_per_epoch=200)
    loader = ThreadDataLoader(mixture, batch_size=4, sampler=sampler, **kwargs)
    it = iter(loader)
    got = [next(it) for _ in range(change_at or 0)]
    if change_at is not None:
        time.sleep(pause_s * 5)  # the workers run ahead into batches the change drops
        assert loader.set_mixture_weights({"a": 0.1, "b": 0.9}) == at
    got += list(it)
    return torch.cat(got).tolist()


@pytest.mark.parametrize(
    ("num_workers", "isolation"), [(2, "threads"), (3, "threads"), (2, "process")]
)
@pytest.mark.parametrize("cut", [0, 3, 47])
@pytest.mark.parametrize("pause_s", [0.0, 0.004])
def test_a_live_change_draws_the_augmentations_of_the_stream_set_up_front(
    num_workers: int, isolation: str, cut: int, pause_s: float
) -> None:
    """Workers had begun batches the change drops, drawing from their generators: those go back
    to their state after each worker's last delivered batch, and each batch goes to the worker
    it had from the start. The samples, augmentations included, are those of the schedule set
    before the epoch, however far the workers had run ahead (which the pauses vary)."""
    kwargs = {"num_workers": num_workers, "isolation": isolation}
    expected = _augmented_epoch(cut * 4, None, 0.0, **kwargs)
    assert _augmented_epoch(cut * 4, cut, pause_s, **kwargs) == expected
    assert expected != _augmented_epoch(None, None, 0.0, **kwargs)  # the change changed it


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [0, 3])
def test_a_change_right_after_a_resume_applies_from_the_next_batch(
    num_workers: int, cut: int
) -> None:
    """Resume (global RNG: the first batch's indices are drawn early, under the saved RNG state),
    then change the weights before any next(): that early draw is stale and must be dropped, so
    the stream equals one changed at that position without an interruption."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=400)
        return ThreadDataLoader(mixture, batch_size=8, sampler=sampler, num_workers=num_workers)

    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(cut)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert resumed.set_mixture_weights({"a": 0.1, "b": 0.9}) == cut * 8
    got += list(it)
    assert torch.cat(got).tolist() == _mixture_reference(cut * 8)


def test_a_change_right_after_resuming_a_rest_shorter_than_a_batch_applies() -> None:
    """An epoch of 12 samples in batches of 8, resumed after its first batch without workers:
    the change before any next() applies to the last 4 (iter() did not run the sampler's pass
    out early; workers' prefetch does, and a change then is refused, as without a resume)."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=12)
        return ThreadDataLoader(mixture, batch_size=8, sampler=sampler)

    loader = make()
    it = iter(loader)
    got = [next(it)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert resumed.set_mixture_weights({"a": 0.1, "b": 0.9}) == 8
    got += list(it)
    assert torch.cat(got).tolist() == _mixture_reference(8)[:12]


@pytest.mark.parametrize(
    ("num_workers", "isolation"), [(2, "threads"), (3, "threads"), (2, "process")]
)
def test_a_change_after_prefetch_drew_the_epochs_last_index_applies(
    num_workers: int, isolation: str
) -> None:
    """An epoch of 5 batches, all drawn by the workers' prefetch after the second: the change
    there still applies from the third batch (a new pass of the sampler reads the rest), the
    epoch keeps its length, a state taken after the change resumes it, and the next epoch
    starts where this one ended."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=40)
        return ThreadDataLoader(
            mixture, batch_size=8, sampler=sampler, num_workers=num_workers,
            isolation=isolation, prefetch_factor=2,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    got = [next(it), next(it)]
    assert loader.set_mixture_weights({"a": 0.1, "b": 0.9}) == 16
    got.append(next(it))
    state = loader.state_dict()
    got += list(it)
    reference = _mixture_reference(16)
    assert torch.cat(got).tolist() == reference[:40]
    loader.sampler.set_epoch(1)
    assert torch.cat(list(loader)).tolist() == reference[40:80]
    resumed = make()
    resumed.load_state_dict(state)
    assert torch.cat(got[:3] + list(resumed)).tolist() == reference[:40]


def test_a_change_refused_for_in_order_false_leaves_the_stream_as_it_was() -> None:
    """With workers and in_order=False a live change is refused before anything changes: the
    epoch, and the next, keep the old weights and their lengths, also once the prefetch drew
    the epoch's last index."""
    mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    sampler = MixtureSampler(mixture, samples_per_epoch=40)
    loader = ThreadDataLoader(
        mixture, batch_size=8, sampler=sampler, num_workers=2, in_order=False, prefetch_factor=2
    )
    it = iter(loader)
    got = [next(it), next(it)]
    with pytest.raises(ValueError, match="needs in_order=True"):
        loader.set_mixture_weights({"a": 0.1, "b": 0.9})
    got += list(it)
    sampler.set_epoch(1)
    got += list(loader)
    unchanged = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    reference = [unchanged[i] for i in unchanged.indices_at(np.arange(80)).tolist()]
    assert sorted(torch.cat(got).tolist()) == sorted(reference)
    assert mixture.schedule == [(0, {"a": 0.7, "b": 0.3})]


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_the_mixtures_own_change_works_with_in_order_false(isolation: str) -> None:
    """Where the loader refuses a live change (in_order=False), ``Mixture.set_weights`` applies
    it from the first position not handed out: the batches in flight keep the old weights, the
    epoch holds the changed stream's samples, and a state taken later resumes its rest."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=160)
        return ThreadDataLoader(
            mixture, batch_size=8, sampler=sampler, num_workers=2, in_order=False,
            prefetch_factor=2, isolation=isolation,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    position = loader.dataset.set_weights({"a": 0.1, "b": 0.9})
    assert 3 * 8 <= position <= (3 + 2 * 2) * 8
    got += [next(it) for _ in range(6)]
    state = loader.state_dict()
    del it
    got += _resumed_rest(make, state)
    assert sorted(torch.cat(got).tolist()) == sorted(_mixture_reference(position)[:160])


def test_set_mixture_weights_needs_a_mixture_sampler() -> None:
    """Without a MixtureSampler the loader says what is missing."""
    with pytest.raises(TypeError, match="MixtureSampler"):
        ThreadDataLoader(range(10), batch_size=2).set_mixture_weights({"a": 1.0})


@pytest.mark.parametrize(
    ("num_workers", "isolation", "persistent"),
    [(2, "threads", False), (3, "threads", True), (2, "process", False)],
)
@pytest.mark.parametrize("cut", [0, 3, 48])
def test_a_live_change_with_device_drops_the_transfer_stage(
    num_workers: int, isolation: str, persistent: bool, cut: int
) -> None:
    """With device=, the transfer thread has pulled batches the loop has not received, drawn
    from the sampler under the old weights: they are dropped and the host epoch goes back to
    the loop's position, so the samples, augmentations included, are those of the schedule set
    before the epoch (the last cut changes the weights while the stage holds the epoch's end)."""
    kwargs = {
        "num_workers": num_workers, "isolation": isolation, "device": "cpu",
        "persistent_workers": persistent, "device_prefetch": 3,
    }  # fmt: skip
    expected = _augmented_epoch(cut * 4, None, 0.0, **kwargs)
    assert _augmented_epoch(cut * 4, cut, 0.004, **kwargs) == expected
    assert expected == _augmented_epoch(cut * 4, None, 0.0, num_workers=num_workers)


class FailsAt(Dataset[int]):
    """Items ``base + i``; reading one in ``bad`` raises."""

    def __init__(self, base: int, n: int, bad: frozenset[int]) -> None:
        self.base, self.n, self.bad = base, n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.base + i in self.bad:
            raise ValueError(f"item {self.base + i} is corrupt")
        return self.base + i


def _outcomes(it: Iterator[torch.Tensor], limit: int) -> list[Any]:
    """The next ``limit`` batches at most, each as a list, or its error's type name."""
    return [
        type(o.error).__name__ if o.error is not None else o.batch.tolist()
        for o in outcomes(it, limit)
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("resume", [False, True])
def test_a_live_change_right_after_an_error_applies_after_the_failed_batch(
    num_workers: int, resume: bool
) -> None:
    """The loop received batch 5 as its error (its positions are used, as in torch), then
    changed the weights: with device= as without, they apply from position 48, and a state taken
    then resumes the same stream; the error rides the transfer stage in its batch's place."""
    bad = frozenset({_mixture_reference(10**6)[8 * 5 + 3]})

    def make(device: str | None) -> ThreadDataLoader[Any]:
        sources = {"a": FailsAt(1000, 97, bad), "b": FailsAt(2000, 61, bad)}
        mixture = Mixture(sources, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=400)
        return ThreadDataLoader(
            mixture, batch_size=8, sampler=sampler, num_workers=num_workers, device=device
        )

    def run(device: str | None) -> tuple[int, list[Any]]:
        loader = make(device)
        it = iter(loader)
        got = _outcomes(it, 6)
        time.sleep(0.05)  # the transfer stage fills
        position = loader.set_mixture_weights({"a": 0.1, "b": 0.9})
        if resume:
            state = loader.state_dict()
            del it
            loader = make(device)
            loader.load_state_dict(state)
            it = iter(loader)
        return position, got + _outcomes(it, 100)

    expected = run(None)
    assert expected[0] == 48 and expected[1][5] == "ValueError" and len(expected[1]) == 50
    assert run("cpu") == expected


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_invalid_weights_during_an_epoch_change_nothing(
    device: str | None, num_workers: int
) -> None:
    """Refused weights raise before anything stops: with device= too, the epoch goes on with
    the old weights (the transfer thread keeps its batches)."""
    mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    sampler = MixtureSampler(mixture, samples_per_epoch=400)
    loader = ThreadDataLoader(
        mixture, batch_size=8, sampler=sampler, num_workers=num_workers, device=device
    )
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    with pytest.raises(ValueError, match="'a'"):
        loader.set_mixture_weights({"a": -1.0, "b": 1.0})
    got += list(it)
    assert torch.cat(got).tolist() == _mixture_reference(10**6)


def test_a_live_change_before_the_first_batch_with_device_resumes_the_augmentations() -> None:
    """A change before the first next() with device=, one batch, a state with the workers'
    generators: the resume gives the rest of the run, augmentations included. The loop's
    progress is its own copy from the start, never the host epoch's lists, which the transfer
    thread moves on for batches the change drops."""

    def make() -> ThreadDataLoader[Any]:
        sources = {"a": Augmented(1000, 97), "b": Augmented(2000, 61)}
        mixture = Mixture(sources, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=80)
        return ThreadDataLoader(
            mixture, batch_size=4, sampler=sampler, num_workers=2, device="cpu",
            save_worker_rng=True,
        )  # fmt: skip

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    time.sleep(0.1)  # the transfer thread pulls batches
    loader.set_mixture_weights({"a": 0.1, "b": 0.9})
    next(it)
    state = loader.state_dict()
    rest = torch.cat(list(it)).tolist()
    resumed = make()
    resumed.load_state_dict(state)
    assert torch.cat(list(resumed)).tolist() == rest


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_live_change_with_device_resumes_as_the_changed_stream(num_workers: int) -> None:
    """A live change with device= applies from the loop's next batch, whatever the transfer
    stage held, and a state taken after it holds the change: a resumed loader gives the rest
    of the changed stream."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=400)
        return ThreadDataLoader(
            mixture, batch_size=8, sampler=sampler, num_workers=num_workers, device="cpu"
        )

    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    time.sleep(0.05)  # the transfer stage fills with batches drawn under the old weights
    assert loader.set_mixture_weights({"a": 0.1, "b": 0.9}) == 24
    got += [next(it) for _ in range(2)]
    state = loader.state_dict()
    del it
    got += _resumed_rest(make, state)
    assert torch.cat(got).tolist() == _mixture_reference(24)


@pytest.mark.parametrize(
    "how",
    ["default", "shuffle", "random_sampler", "batch_sampler", "another_mixtures_sampler"],
)
def test_a_mixture_not_sampled_by_its_mixture_sampler_is_refused(how: str) -> None:
    """Any sampler but the mixture's own MixtureSampler would read the sources one after
    another and silently ignore the weights: the loader refuses it, naming MixtureSampler."""
    mixture = _mixture()
    kwargs: dict[str, Any] = {
        "default": {},
        "shuffle": {"shuffle": True},
        "random_sampler": {"sampler": torch.utils.data.RandomSampler(mixture)},
        "batch_sampler": {
            "batch_size": None,
            "batch_sampler": BatchSampler(torch.utils.data.SequentialSampler(mixture), 8, False),
        },
        "another_mixtures_sampler": {"sampler": MixtureSampler(_mixture(seed=1))},
    }[how]
    kwargs.setdefault("batch_size", 8)
    if kwargs["batch_size"] is None:
        del kwargs["batch_size"]
    with pytest.raises(ValueError, match=r"MixtureSampler.*ignore the weights"):
        ThreadDataLoader(mixture, num_workers=2, **kwargs)


def test_a_mixture_sampler_inside_a_batch_sampler_is_accepted() -> None:
    """The mixture's own MixtureSampler mixes, also wrapped in torch's BatchSampler."""
    mixture = _mixture()
    batches = BatchSampler(MixtureSampler(mixture, samples_per_epoch=80), 8, drop_last=False)
    loader = ThreadDataLoader(mixture, batch_sampler=batches, num_workers=2)
    assert sum(len(b) for b in loader) == 80


class ChangesItsOwnWeights(Dataset[int]):
    """Items ``i``; reading item 11 asks ``loader`` for new mixture weights."""

    def __init__(self) -> None:
        self.loader: ThreadDataLoader[Any] | None = None

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        if i == 11 and self.loader is not None:
            self.loader.set_mixture_weights({"a": 0.5, "b": 0.5})
        return i


def test_a_change_from_the_transfer_thread_is_refused_not_a_hang() -> None:
    """With device= and num_workers=0 the dataset runs in the transfer thread: a change made
    there would wait for that thread's own pull. It raises instead, in the batch's place, and
    the epoch goes on under the old weights."""
    source = ChangesItsOwnWeights()
    mixture = Mixture({"a": source, "b": range(100, 150)}, {"a": 0.9, "b": 0.1})
    sampler = MixtureSampler(mixture, samples_per_epoch=60)
    loader = ThreadDataLoader(mixture, batch_size=4, sampler=sampler, device="cpu")
    source.loader = loader
    it = iter(loader)
    got = [str(o.error) if o.error is not None else o.batch.tolist() for o in outcomes(it, 100)]
    errors = [o for o in got if isinstance(o, str)]
    assert len(errors) == 1 and "from its own thread" in errors[0]
    assert len(got) == 15
    source.loader = None
    expected = torch.cat(list(ThreadDataLoader(mixture, batch_size=4, sampler=sampler)))
    failed = got.index(errors[0])
    assert [x for b in got[:failed] + got[failed + 1 :] for x in b] == (
        expected[: 4 * failed].tolist() + expected[4 * failed + 4 :].tolist()
    )


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_change_from_a_worker_is_refused(device: str | None) -> None:
    """The dataset's code in a worker thread draws from the stream a change rewinds: a change
    made there lost or repeated batches (and with device= closed the transfer). It raises in
    that batch's place, and every other batch is the old weights' stream."""
    source = ChangesItsOwnWeights()
    mixture = Mixture({"a": source, "b": range(100, 150)}, {"a": 0.9, "b": 0.1})
    sampler = MixtureSampler(mixture, samples_per_epoch=60)
    loader = ThreadDataLoader(
        mixture, batch_size=4, sampler=sampler, num_workers=2, device=device, timeout=30
    )
    source.loader = loader
    it = iter(loader)
    got = [str(o.error) if o.error is not None else o.batch.tolist() for o in outcomes(it, 100)]
    errors = [o for o in got if isinstance(o, str)]
    assert len(errors) == 1 and "one of this loader's workers" in errors[0]
    source.loader = None
    expected = torch.cat(list(ThreadDataLoader(mixture, batch_size=4, sampler=sampler)))
    failed = got.index(errors[0])
    assert len(got) == 15
    assert [x for b in got[:failed] + got[failed + 1 :] for x in b] == (
        expected[: 4 * failed].tolist() + expected[4 * failed + 4 :].tolist()
    )


class IteratesAnotherLoader(IterableDataset[Any]):
    """Iterates a mixture loader of its own, changing its weights after the first batch."""

    def __iter__(self) -> Iterator[Any]:
        mixture = Mixture({"a": range(100), "b": range(100, 200)}, {"a": 0.5, "b": 0.5})
        sampler = MixtureSampler(mixture, samples_per_epoch=40)
        inner = ThreadDataLoader(mixture, batch_size=4, sampler=sampler)
        it = iter(inner)
        yield next(it).tolist()
        yield inner.set_mixture_weights({"a": 1.0, "b": 0.0})
        yield from (b.tolist() for b in it)


def test_a_worker_changes_the_weights_of_a_loader_it_iterates() -> None:
    """Only a loader's own workers are refused: a worker of another loader that iterates this
    one changes its weights from the thread that iterates it, from the next batch."""
    got = list(ThreadDataLoader(IteratesAnotherLoader(), batch_size=None, num_workers=1))
    assert got[1] == 4
    assert all(x < 100 for b in got[2:] for x in b) and len(got) == 2 + 9


def _small_mixture() -> Mixture:
    return Mixture({"a": range(1000, 1007), "b": range(2000, 2012)}, {"a": 0.5, "b": 2.0}, seed=1)


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [2, 3])
def test_two_live_changes_in_a_row_apply_at_the_loops_position(
    device: str | None, num_workers: int, cut: int
) -> None:
    """Two changes with no batch between, once the prefetch drew the epoch's end: both apply
    from the loop's position (the first began a new pass of the sampler there, which the
    second counts from), and the epoch keeps every sample."""
    first, second = {"a": 0.5, "b": 0.0}, {"a": 0.5, "b": 2.0}
    mixture = _small_mixture()
    loader = ThreadDataLoader(
        mixture, batch_size=4, sampler=MixtureSampler(mixture, samples_per_epoch=19),
        num_workers=num_workers, device=device,
    )  # fmt: skip
    it = iter(loader)
    got = [next(it).tolist() for _ in range(cut)]
    time.sleep(0.1)  # the workers and the transfer stage draw the epoch to its end
    positions = [loader.set_mixture_weights(first), loader.set_mixture_weights(second)]
    got += [b.tolist() for b in it]
    reference = _small_mixture()
    reference.set_weights(first, at_position=cut * 4)
    reference.set_weights(second, at_position=cut * 4)
    flat = [int(reference[i]) for i in reference.indices_at(np.arange(19)).tolist()]
    assert positions == [cut * 4, cut * 4]
    assert got == [flat[i : i + 4] for i in range(0, 19, 4)]


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_state_right_after_a_live_change_resumes_the_rest(
    device: str | None, num_workers: int, cut: int
) -> None:
    """state_dict() right after a change, before the next batch: a loader rebuilt with the old
    weights resumes the rest of the changed epoch, nothing repeated or skipped."""

    def make() -> tuple[ThreadDataLoader[Any], MixtureSampler]:
        mixture = Mixture(
            {"a": range(1000, 1013), "b": range(2000, 2015)}, {"a": 0.5, "b": 0.5}, seed=3
        )
        sampler = MixtureSampler(mixture, samples_per_epoch=12)
        loader = ThreadDataLoader(
            mixture, batch_size=3, sampler=sampler, num_workers=num_workers, device=device
        )
        return loader, sampler

    loader, sampler = make()
    sampler.set_epoch(0)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(cut)]
    time.sleep(0.1)  # the workers and the transfer stage draw the epoch to its end
    loader.set_mixture_weights({"a": 0.1, "b": 0.9})
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    assert len(head + rest) == 4
    resumed, resumed_sampler = make()
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(0)
    assert [b.tolist() for b in resumed] == rest


def _two_augmented_epochs(live: bool) -> list[list[int]]:
    """Two epochs of 6 batches on 3 persistent workers; the weights change at epoch 1's start:
    up front, or live right after ``iter()`` began epoch 1."""
    torch.manual_seed(0)
    mixture = Mixture({"a": Augmented(1000, 97), "b": Augmented(2000, 61)}, {"a": 0.7, "b": 0.3})
    if not live:
        mixture.set_weights({"a": 0.1, "b": 0.9}, at_position=24)
    sampler = MixtureSampler(mixture, samples_per_epoch=24)
    loader = ThreadDataLoader(
        mixture, batch_size=4, sampler=sampler, num_workers=3, persistent_workers=True
    )
    got = list(loader)
    sampler.set_epoch(1)
    it = iter(loader)
    if live:
        assert loader.set_mixture_weights({"a": 0.1, "b": 0.9}) == 24
    got += list(it)
    return torch.cat(got).tolist()


def test_a_live_change_before_a_worker_read_its_new_epoch_keeps_its_augmentations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A change right after iter() began a persistent epoch, while worker 2 has not read that
    epoch's start yet (held here): its generators start the epoch where its last batch left
    them, not where the previous epoch began (two batches a worker: that start is still in
    its history), and the change has nothing of the new epoch to go back past. The batches,
    augmentations included, are those of the schedule set up front."""
    from threadloader._engine.tasks import NewEpoch
    from threadloader._primitives.queues import BoundedQueue

    peek = BoundedQueue.peek

    def held_peek(queue: BoundedQueue[Any]) -> Any:
        item = peek(queue)
        if queue._name == "worker2" and isinstance(item, NewEpoch) and item.generation > 0:
            time.sleep(0.3)
        return item

    expected = _two_augmented_epochs(live=False)
    monkeypatch.setattr(BoundedQueue, "peek", held_peek)
    assert _two_augmented_epochs(live=True) == expected


def test_unread_epoch_messages_merge_keeping_their_earliest_rewind() -> None:
    """A worker that has not read its messages gets them merged into one: a live change at
    batch 5, the next epoch, then a live change at that epoch's start. The merged message
    (rewind to 5, then begin) keeps its rewind when the third is merged into it: the worker
    made nothing in the new epoch to rewind, but its generators still stand past batch 5."""
    from threadloader._engine.tasks import WorkerSpec
    from threadloader._engine.workers import WorkerPool
    from threadloader._primitives.timing import StageRecorder

    spec = WorkerSpec(
        dataset_kind=0, dataset=list(range(8)), auto_collation=True, collate_fn=list,
        drop_last=False, worker_init_fn=None, num_workers=1, rng_history=8,
    )  # fmt: skip
    pool = WorkerPool(spec, 0, 2, "merge-test", [StageRecorder("w0")], start=False)
    try:
        pool.new_epoch(rewind=5)
        pool.new_epoch(seed=7)
        pool.new_epoch(rewind=0)
        merged = pool.workers[0].tasks.head()
        assert merged is not None
        assert (merged.rewind, merged.begins, merged.seed) == (5, True, 7)  # type: ignore[union-attr]
    finally:
        pool.close()


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("resumed_at", [None, 2])
def test_a_change_after_an_epochs_last_batch_applies_from_the_next_epoch(
    device: str | None, num_workers: int, resumed_at: int | None
) -> None:
    """With drop_last, an epoch's last batch leaves a position unread. A change made once the
    loop has every batch (before StopIteration) applies from where the next epoch starts, the
    pass's end past that position, as a state taken then says: the live run, the schedule set
    up front and a resumed run give the same next epoch. Also in an epoch that was itself
    resumed mid-way (``resumed_at`` batches), whose pass counts only the rest."""
    later = {"a": 0.1, "b": 0.9}

    def make() -> tuple[ThreadDataLoader[Any], MixtureSampler]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        sampler = MixtureSampler(mixture, samples_per_epoch=21)
        loader = ThreadDataLoader(
            mixture, batch_size=4, sampler=sampler, drop_last=True, num_workers=num_workers,
            device=device,
        )  # fmt: skip
        return loader, sampler

    loader, sampler = make()
    it = iter(loader)
    first = [next(it).tolist() for _ in range(resumed_at or 0)]
    if resumed_at is not None:
        cut = loader.state_dict()
        del it
        loader, sampler = make()
        loader.load_state_dict(cut)
        it = iter(loader)
    first += [next(it).tolist() for _ in range(5 - len(first))]
    assert loader.set_mixture_weights(later) == 21
    state = loader.state_dict()
    assert list(it) == []
    sampler.set_epoch(1)
    live = [b.tolist() for b in loader]

    upfront, upfront_sampler = make()
    upfront.dataset.set_weights(later, at_position=21)
    assert [b.tolist() for b in upfront] == first
    upfront_sampler.set_epoch(1)
    assert [b.tolist() for b in upfront] == live

    resumed, resumed_sampler = make()
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(1)
    assert [b.tolist() for b in resumed] == live


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_change_in_an_epoch_of_no_batch_applies_from_the_next_epoch(num_workers: int) -> None:
    """An epoch shorter than a batch (drop_last) has every batch delivered at once: a change
    made in it applies from where the next epoch starts, also before the sampler began the
    pass (without workers, torch's batch sampler starts it at the first next())."""
    later = {"a": 0.05, "b": 0.95}

    def next_epoch(at: int | None) -> tuple[int | None, list[Any]]:
        mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
        if at is not None:
            mixture.set_weights(later, at_position=at)
        sampler = MixtureSampler(mixture, samples_per_epoch=6)
        loader = ThreadDataLoader(
            mixture, batch_size=8, sampler=sampler, drop_last=True, num_workers=num_workers
        )
        it = iter(loader)
        position = loader.set_mixture_weights(later) if at is None else None
        assert list(it) == []
        sampler.set_epoch(1)
        return position, list(sampler)

    position, live = next_epoch(None)
    assert position == 6
    assert live == next_epoch(6)[1]


def test_a_finished_epochs_state_not_named_again_counts_a_whole_epoch() -> None:
    """A state saved at its epoch's end starts that epoch over unless set_epoch names it
    (point 3): len() and remaining() count what iter() then yields."""
    mixture = Mixture({"a": range(1000, 1097), "b": range(2000, 2061)}, {"a": 0.7, "b": 0.3})
    sampler = MixtureSampler(mixture, samples_per_epoch=20)
    assert len(list(sampler)) == 20
    state = sampler.state_dict()
    again = MixtureSampler(mixture, samples_per_epoch=20)
    again.load_state_dict(state)
    assert len(again) == again.remaining() == 20 == len(list(again))
    rest = MixtureSampler(mixture, samples_per_epoch=20)
    rest.load_state_dict(state)
    rest.set_epoch(state["epoch"])
    assert len(rest) == rest.remaining() == 0 == len(list(rest))


@pytest.mark.parametrize("taken", [None, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_change_after_set_epoch_of_the_next_epoch_applies_from_its_start(
    num_workers: int, taken: int | None
) -> None:
    """The loop took the epoch's last batch (no StopIteration), or left the epoch after
    ``taken`` batches, moved the sampler on with set_epoch, then changed the weights: the next
    epoch is drawn with them from its start, every batch of it."""
    mixture = Mixture({"a": range(100), "b": range(1000, 1100)}, {"a": 0.5, "b": 0.5})
    sampler = MixtureSampler(mixture, samples_per_epoch=12)
    loader = ThreadDataLoader(mixture, batch_size=3, sampler=sampler, num_workers=num_workers)
    it = iter(loader)
    _ = [next(it) for _ in range(len(loader) if taken is None else taken)]
    sampler.set_epoch(1)
    assert loader.set_mixture_weights({"a": 1.0, "b": 0.0}) == 12
    del it
    batches = list(loader)
    assert len(batches) == 4
    assert all(int(x) < 100 for b in batches for x in b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_change_before_the_first_batch_after_a_finished_epochs_state_applies_from_its_start(
    num_workers: int,
) -> None:
    """A state taken at an epoch's last batch, loaded without set_epoch: iter() reads the epoch
    again from its start, as the loader that saved it does; a weight change before its first
    batch applies from that start in both, and both read the same batches."""
    weights = {"a": 0.0, "b": 1.0}

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(6), "b": range(100, 106)}, {"a": 1.0, "b": 0.5})
        sampler = MixtureSampler(mixture, 1, 0, samples_per_epoch=6)
        return ThreadDataLoader(mixture, batch_size=2, sampler=sampler, num_workers=num_workers)

    saving = make()
    it = iter(saving)
    _ = [next(it) for _ in range(len(saving))]  # the last batch; no StopIteration
    state = saving.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    runs = []
    for loader in (saving, resumed):
        it = iter(loader)
        runs.append((loader.set_mixture_weights(weights), [b.tolist() for b in it]))
    assert runs[0] == runs[1]
    assert runs[0][0] == 0
    assert all(x >= 100 for batch in runs[0][1] for x in batch)


@pytest.mark.parametrize(("num_workers", "device"), [(0, None), (0, "cpu"), (1, None), (2, None)])
def test_a_change_after_the_loop_left_an_epoch_applies_from_the_next_passs_start(
    num_workers: int, device: str | None
) -> None:
    """iter(), then break before the first batch (workers or the transfer thread drew ahead),
    then a weight change: the next iter() reads the epoch from its start with the new weights,
    whatever was drawn ahead, as a mixture that had them from the start."""
    weights = {"a": 1.0, "b": 0.0}

    def make(start: dict[str, float]) -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(6), "b": range(100, 106)}, start)
        sampler = MixtureSampler(mixture, 1, 0, samples_per_epoch=8)
        return ThreadDataLoader(
            mixture, batch_size=2, sampler=sampler, num_workers=num_workers, device=device
        )

    loader = make({"a": 0.5, "b": 0.5})
    it = iter(loader)
    time.sleep(0.05)  # the workers draw ahead
    del it  # break
    assert loader.set_mixture_weights(weights) == 0
    assert [b.tolist() for b in loader] == [b.tolist() for b in make(weights)]


def test_a_change_between_a_load_and_iter_is_in_the_state_taken_then() -> None:
    """load_state_dict(), then a weight change before iter(), then state_dict(): the state holds
    the change, so a loader resumed from it reads what the first one reads."""

    def make() -> ThreadDataLoader[Any]:
        mixture = Mixture({"a": range(4), "b": range(100, 104)}, {"a": 0.5, "b": 0.5})
        sampler = MixtureSampler(mixture, 1, 0, samples_per_epoch=6)
        return ThreadDataLoader(mixture, batch_size=2, sampler=sampler)

    loaded = make()
    loaded.load_state_dict(make().state_dict())
    loaded.set_mixture_weights({"a": 1.0, "b": 0.0})
    state = loaded.state_dict()
    expected = [b.tolist() for b in loaded]
    assert all(x < 100 for batch in expected for x in batch)
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == expected
