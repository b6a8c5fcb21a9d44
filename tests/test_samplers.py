"""threadloader.samplers: the O(1)-memory shuffle is a good permutation, resumes exactly, and rescales.

Quality: every index once, no position/index correlation, no adjacent-pair bias, new orders per
epoch and seed. Parity: DistributedShuffleSampler has torch's DistributedSampler lengths, padding
and (with shuffle=False) indices. Resume: any cut, any new world size, no sample repeated or lost.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import re
import sys
import tracemalloc
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from threadloader import ThreadDataLoader
from threadloader.samplers import feistel
from threadloader.samplers.distributed import DistributedShuffleSampler
from threadloader.samplers.shuffle import BLOCK_SIZE, ShuffleSampler
from threadloader.streams import BlockShuffleSampler, Mixture, MixtureSampler


def _take(sampler: ShuffleSampler | DistributedShuffleSampler, k: int) -> list[int]:
    return list(itertools.islice(iter(sampler), k))


def _multiplicities(indices: list[int], length: int) -> Counter[int]:
    """How many indices of [0, length) appear 0, 1, 2, ... times."""
    counts = Counter(indices)
    return Counter(counts[i] for i in range(length))


# --- ShuffleSampler: quality -------------------------------------------------------------------


@pytest.mark.parametrize(
    "length", [0, 1, 2, 3, 4, 5, 7, 8, 13, 16, 97, 1009, 1024, 4**5 + 1, 65537, 10**6]
)
def test_every_index_appears_exactly_once(length: int) -> None:
    """Each epoch is a permutation of range(N), for tiny, prime, power-of-two and large N."""
    order = np.fromiter(ShuffleSampler(length, seed=3), dtype=np.int64, count=length)
    assert np.array_equal(np.sort(order), np.arange(length))


def test_same_seed_and_epoch_give_the_same_order() -> None:
    """The order is a function of (seed, epoch, N) only: two samplers agree, and so do two passes."""
    a, b = ShuffleSampler(5000, seed=11), ShuffleSampler(range(5000), seed=11)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b) == list(a)


def test_epochs_and_seeds_give_different_orders() -> None:
    """Ten (seed, epoch) pairs give ten orders of 1000 items, none close to another or to identity."""
    orders = []
    for seed, epoch in itertools.product([0, 1], [0, 1, 2, 3, 4]):
        sampler = ShuffleSampler(1000, seed=seed)
        sampler.set_epoch(epoch)
        orders.append(np.array(list(sampler)))
    orders.append(np.arange(1000))
    for x, y in itertools.combinations(orders, 2):
        assert np.count_nonzero(x == y) < 20  # a random pair agrees at ~1 position


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 0), (0, 7), (123456789, 2**40)])
def test_position_and_index_are_uncorrelated(seed: int, epoch: int) -> None:
    """|Pearson r| between position and index is below 0.02 at N = 10**5."""
    sampler = ShuffleSampler(10**5, seed=seed)
    sampler.set_epoch(epoch)
    order = np.array(list(sampler), dtype=np.float64)
    r = np.corrcoef(np.arange(10**5, dtype=np.float64), order)[0, 1]
    assert abs(r) < 0.02


@pytest.mark.parametrize("length", [10**5, 2**17 + 1, 3 * 10**5])
def test_adjacent_pairs_rise_half_the_time(length: int) -> None:
    """perm[i + 1] > perm[i] for a fraction of i within 0.01 of 1/2 (no local runs)."""
    order = np.array(list(ShuffleSampler(length, seed=5)))
    assert abs(np.mean(order[1:] > order[:-1]) - 0.5) < 0.01


def test_first_position_is_uniform_over_epochs() -> None:
    """Over 2000 epochs, the index at position 0 of N = 10 is close to uniform (chi-square)."""
    sampler = ShuffleSampler(10)
    firsts = [int(sampler.index_at(0, epoch=e)) for e in range(2000)]
    counts = np.bincount(firsts, minlength=10)
    chi2 = float(((counts - 200) ** 2 / 200).sum())
    assert chi2 < 27.9  # p = 0.001 at 9 degrees of freedom


def test_a_trillion_indices_in_constant_memory() -> None:
    """N = 10**12: the first 10**5 positions are valid, distinct, and cost a few MB, not 8 TB."""
    sampler = ShuffleSampler(10**12, seed=1)
    tracemalloc.start()
    try:
        first = _take(sampler, 10**5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20
    assert len(set(first)) == 10**5
    assert all(0 <= i < 10**12 for i in first)
    assert sampler.index_at(np.arange(10**5)).tolist() == first
    last = sampler.index_at([10**12 - 1, 999_999_999_999 // 2])
    assert last.dtype == np.int64 and ((last >= 0) & (last < 10**12)).all()


def test_the_order_is_pinned_across_versions() -> None:
    """Saved cursors index into these exact orders: changing them needs a new state version."""
    assert _take(ShuffleSampler(10**6), 6) == [32822, 283715, 301689, 680437, 710519, 253155]
    sampler = ShuffleSampler(10**12, seed=42)
    assert sampler.index_at([0, 1, 10**12 - 1], epoch=3).tolist() == [
        270467463587,
        734036121504,
        407186890767,
    ]


def test_keys_of_many_epochs_at_once_are_each_epochs_own() -> None:
    """The vectorised key derivation gives ``round_keys``'s bits, and ``of_epochs`` maps each
    position as the permutation of its own epoch does, for lengths that cycle-walk or not."""
    epochs = np.array([0, 1, 2, 3, 10**9, 2**62, 2**63 - 1], dtype=np.int64)
    for seed in (0, 42, 2**64 - 1, 2**70 + 5):
        table = feistel.round_keys_of_epochs(seed, epochs, 16)
        for column, epoch in enumerate(epochs.tolist()):
            assert table[:, column].tolist() == feistel.round_keys(seed, epoch, 16)
    rng = np.random.default_rng(3)
    for length in (1, 2, 3, 5, 64, 65, 1000, 10**9 + 7):
        positions = rng.integers(0, length, 3000, dtype=np.int64).astype(np.uint64)
        for epochs_of in (rng.integers(0, 700, 3000), np.full(3000, 5)):
            mapped = feistel.FeistelPermutation(length, 9, 0).of_epochs(positions, epochs_of)
            for epoch in np.unique(epochs_of).tolist():
                at = epochs_of == epoch
                expected = feistel.FeistelPermutation(length, 9, epoch)(positions[at])
                assert mapped[at].tolist() == expected.tolist()


def test_a_mixtures_order_is_pinned_across_versions_with_sources_of_one_and_three() -> None:
    """Sources of 1 and 3 samples go through hundreds of epochs per block of the stream."""
    weights = {"big": 0.2, "one": 0.3, "three": 0.5}
    mixture = Mixture({"big": range(5000), "one": [0], "three": range(3)}, weights, seed=11)
    assert mixture.indices_at(np.arange(12)).tolist() == [
        5003, 4156, 5000, 5002, 5001, 5000, 2712, 5003, 5002, 5000, 5001, 4979,
    ]  # fmt: skip
    assert mixture.indices_at([10**9, 10**9 + 1, 10**9 + 2]).tolist() == [4220, 5002, 5001]


def test_the_largest_length_and_any_int_seed_work() -> None:
    """N = 2**63 - 1 (what len() can return) with a negative seed maps its last positions in
    range, and the sampler has a length a loader can read."""
    sampler = ShuffleSampler(2**63 - 1, seed=-1)
    sampler.set_epoch(-5)
    last = sampler.index_at(np.array([2**63 - 2, 2**63 - 3], dtype=np.uint64))
    assert last.dtype == np.int64 and (last >= 0).all() and last[0] != last[1]
    assert len(sampler) == 2**63 - 1
    assert len(DistributedShuffleSampler(2**63 - 1, num_replicas=1, rank=0)) == 2**63 - 1


def test_every_small_length_is_a_permutation_for_many_keys() -> None:
    """Exhaustive over N < 300 and 3 keys: cycle walking never loses or repeats a value."""
    for length, seed in itertools.product(range(300), range(3)):
        order = ShuffleSampler(length, seed=seed).index_at(np.arange(length))
        assert np.array_equal(np.sort(order), np.arange(length)), (length, seed)


def test_index_at_matches_iteration_for_any_shape_and_epoch() -> None:
    """index_at(positions) is the epoch's order at those positions, keeping their shape."""
    sampler = ShuffleSampler(70_000, seed=2)
    sampler.set_epoch(1)
    order = np.array(list(sampler))
    positions = np.array([[69_999, 0, 5], [BLOCK_SIZE, BLOCK_SIZE - 1, 12345]])
    assert np.array_equal(sampler.index_at(positions), order[positions])
    assert np.array_equal(sampler.index_at(np.arange(70_000)), order)
    sampler.set_epoch(0)
    assert np.array_equal(sampler.index_at(positions, epoch=1), order[positions])
    assert not np.array_equal(sampler.index_at(positions), order[positions])


def test_index_at_rejects_bad_positions() -> None:
    """Positions outside [0, N) raise IndexError; non-integers raise TypeError."""
    sampler = ShuffleSampler(10)
    with pytest.raises(IndexError, match="10"):
        sampler.index_at([3, 10])
    with pytest.raises(IndexError, match="-1"):
        sampler.index_at([-1])
    with pytest.raises(TypeError, match="float"):
        sampler.index_at(np.array([1.0]))


def test_bad_lengths_are_rejected() -> None:
    """Lengths must be in [0, 2**63 - 1] (``len()`` of the sampler could not be more); a length
    can be given as an int or a sized dataset."""
    with pytest.raises(ValueError, match="length"):
        ShuffleSampler(-1)
    for length in (2**63, 2**63 + 1):
        with pytest.raises(ValueError, match="length"):
            ShuffleSampler(length)
        with pytest.raises(ValueError, match="length"):
            DistributedShuffleSampler(length, num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="float"):
        ShuffleSampler(2.5)  # type: ignore[arg-type]
    assert len(ShuffleSampler(list("abc"))) == len(ShuffleSampler(np.int64(3))) == 3


def test_works_as_a_dataloader_sampler() -> None:
    """torch's DataLoader batches a ShuffleSampler's order unchanged."""
    sampler = ShuffleSampler(100, seed=9)
    batches = list(DataLoader(range(100), sampler=sampler, batch_size=16))
    assert torch.cat(batches).tolist() == list(sampler)


# --- ShuffleSampler: state -----------------------------------------------------------------------


def test_state_is_plain_ints_and_the_cursor_counts_handed_out_indices() -> None:
    """The cursor is exactly the number of indices received from the latest iterator."""
    sampler = ShuffleSampler(70_000, seed=4)
    assert sampler.state_dict() == {
        "version": 1,
        "seed": 4,
        "epoch": 0,
        "cursor": 0,
        "length": 70_000,
    }
    it = iter(sampler)
    assert sampler.state_dict()["cursor"] == 0
    for handed_out in range(1, 70_001):
        next(it)
        if handed_out in (1, 2, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 69_999, 70_000):
            assert sampler.state_dict()["cursor"] == handed_out
    assert next(it, None) is None
    state = sampler.state_dict()
    assert state["cursor"] == 70_000
    assert all(type(v) is int for v in state.values())
    assert pickle.loads(pickle.dumps(state)) == state


@pytest.mark.parametrize(
    "cut", [0, 1, 17, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 69_999, 70_000]
)
def test_resume_yields_exactly_the_rest_of_the_epoch(cut: int) -> None:
    """A state saved after `cut` indices resumes on a fresh sampler with the indices not yet seen."""
    sampler = ShuffleSampler(70_000, seed=8)
    sampler.set_epoch(3)
    full = list(sampler)
    before = _take(sampler, cut)
    assert before == full[:cut]
    fresh = ShuffleSampler(70_000, seed=999)  # the saved seed wins: the cursor is in its order
    fresh.load_state_dict(sampler.state_dict())
    assert fresh.state_dict() == sampler.state_dict()
    fresh.set_epoch(3)  # what a training loop does at the top of the resumed epoch
    assert list(fresh) == full[cut:]
    assert list(fresh) == full  # the resume happens once; then the epoch restarts from 0


def test_iter_after_a_full_epoch_restarts_the_same_epoch() -> None:
    """As with torch's DistributedSampler, only set_epoch changes the order."""
    sampler = ShuffleSampler(300, seed=1)
    first = list(sampler)
    assert sampler.state_dict()["cursor"] == 300
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert sampler.state_dict()["cursor"] == 0
    assert list(sampler) != first


def test_set_epoch_to_another_epoch_drops_a_loaded_resume() -> None:
    """A loaded (epoch 2, cursor 5) resumes only if the next iter() is for epoch 2."""
    source = ShuffleSampler(50)
    source.set_epoch(2)
    _take(source, 5)
    sampler = ShuffleSampler(50)
    sampler.load_state_dict(source.state_dict())
    sampler.set_epoch(3)
    assert sampler.state_dict()["cursor"] == 0
    assert len(list(sampler)) == 50
    sampler.load_state_dict(source.state_dict())
    assert len(list(sampler)) == 45


@pytest.mark.parametrize("kind", ["shuffle", "distributed"])
def test_setting_another_epoch_and_back_still_drops_the_resume(kind: str) -> None:
    """Point 3: any other epoch drops a loaded resume, even if the saved one is set again."""

    def make() -> Any:
        if kind == "shuffle":
            return ShuffleSampler(50)
        return DistributedShuffleSampler(50, num_replicas=1, rank=0)

    source = make()
    source.set_epoch(2)
    _take(source, 5)
    sampler = make()
    sampler.load_state_dict(source.state_dict())
    sampler.set_epoch(3)
    sampler.set_epoch(2)
    assert len(list(sampler)) == 50


def test_the_cursor_follows_the_latest_iterator() -> None:
    """Two live iterators: the state describes the one created last."""
    sampler = ShuffleSampler(100)
    old = iter(sampler)
    _ = [next(old) for _ in range(30)]
    new = iter(sampler)
    _ = [next(new) for _ in range(3)]
    _ = [next(old) for _ in range(30)]
    assert sampler.state_dict()["cursor"] == 3


def _state(**changes: object) -> dict[str, object]:
    state: dict[str, object] = {"version": 1, "seed": 0, "epoch": 0, "cursor": 3, "length": 10}
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "state, message",
    [
        (_state(version=2), "format version 2"),
        (_state(length=11), "length 11"),
        (_state(cursor=11), "cursor 11"),
        (_state(cursor=-1), "cursor -1"),
        (_state(cursor="3"), "'cursor'.*int"),
        (_state(cursor=True), "'cursor'.*int, got bool"),  # operator.index(True) is 1
        (_state(epoch=False), "'epoch'.*int, got bool"),
        ({"version": 1, "length": 10}, "no 'cursor'"),
        ([1, 2], "dict"),
    ],
)
def test_bad_state_raises_value_error_naming_the_mismatch(state: object, message: str) -> None:
    """Version, length, range and type errors are ValueErrors, and the sampler is left unchanged."""
    sampler = ShuffleSampler(10)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)  # type: ignore[arg-type]
    assert sampler.state_dict()["cursor"] == 0


def test_state_survives_torch_save(tmp_path: Path) -> None:
    """The state is torch.save-able and loads back with weights_only=True."""
    sampler = ShuffleSampler(100)
    _take(sampler, 7)
    path = f"{tmp_path}/state.pt"
    torch.save(sampler.state_dict(), path)
    fresh = ShuffleSampler(100)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert list(fresh) == list(sampler)[7:]


# --- DistributedShuffleSampler: parity with torch ------------------------------------------------

_LENGTHS = [0, 1, 2, 3, 7, 10, 12, 13, 100]
_WORLDS = [1, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_lengths_and_padding_match_torch(drop_last: bool, shuffle: bool) -> None:
    """len, num_samples, total_size and the multiplicity of each index per epoch match torch.

    With shuffle=False every rank's indices equal torch's. With shuffle=True the permutation is
    another one, so which indices are padded or dropped differs; how many appear 0, 1, 2... times
    is the same, and the multiset of the epoch is torch's whenever no padding or dropping happens.
    """
    for length, world in itertools.product(_LENGTHS, _WORLDS):
        ours_all: list[int] = []
        theirs_all: list[int] = []
        for rank in range(world):
            kwargs = {"num_replicas": world, "rank": rank, "shuffle": shuffle, "seed": 3}
            ours = DistributedShuffleSampler(range(length), drop_last=drop_last, **kwargs)  # type: ignore[arg-type]
            theirs = DistributedSampler(range(length), drop_last=drop_last, **kwargs)  # type: ignore[arg-type]
            ours.set_epoch(1)
            theirs.set_epoch(1)
            assert (len(ours), ours.num_samples, ours.total_size) == (
                len(theirs),
                theirs.num_samples,
                theirs.total_size,
            ), (length, world, rank)
            mine, torchs = list(ours), list(theirs)
            if not shuffle:
                assert mine == torchs, (length, world, rank)
            assert len(mine) == len(torchs)
            ours_all += mine
            theirs_all += torchs
        assert _multiplicities(ours_all, length) == _multiplicities(theirs_all, length)
        if length % world == 0:
            assert Counter(ours_all) == Counter(theirs_all)


def test_the_global_order_does_not_depend_on_the_world_size() -> None:
    """Interleaving the ranks of any world size gives the ShuffleSampler order of the same seed."""
    reference = list(ShuffleSampler(60, seed=4))
    for world in [1, 2, 3, 4, 5, 6]:
        ranks = [
            list(DistributedShuffleSampler(range(60), num_replicas=world, rank=r, seed=4))
            for r in range(world)
        ]
        interleaved = [i for round_ in itertools.zip_longest(*ranks) for i in round_]
        assert interleaved == reference, world


def test_invalid_rank_raises_torchs_error() -> None:
    """A rank outside [0, num_replicas) raises torch's ValueError, word for word."""
    for rank, world in [(4, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError) as theirs:
            DistributedSampler(range(10), num_replicas=world, rank=rank)
        with pytest.raises(ValueError, match=f"^{re.escape(str(theirs.value))}$"):
            DistributedShuffleSampler(range(10), num_replicas=world, rank=rank)


def test_without_a_process_group_the_error_is_torchs() -> None:
    """num_replicas=None outside torch.distributed raises what DistributedSampler raises."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(Exception) as theirs:
        DistributedSampler(range(10))
    with pytest.raises(type(theirs.value), match="initialized"):
        DistributedShuffleSampler(range(10))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_rank_and_world_size_come_from_the_process_group(tmp_path: Path) -> None:
    """Inside a (one-process gloo) group, rank and num_replicas default to the group's."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        sampler = DistributedShuffleSampler(range(10))
        assert (sampler.rank, sampler.num_replicas) == (0, 1)
    finally:
        dist.destroy_process_group()


# --- DistributedShuffleSampler: state and rescaling ----------------------------------------------


def _ranks(
    length: int, world: int, drop_last: bool, seed: int = 7, shuffle: bool = True
) -> list[DistributedShuffleSampler]:
    return [
        DistributedShuffleSampler(
            range(length),
            num_replicas=world,
            rank=r,
            seed=seed,
            drop_last=drop_last,
            shuffle=shuffle,
        )
        for r in range(world)
    ]


def _run_in_lockstep(
    samplers: list[DistributedShuffleSampler], steps: int | None, epoch: int
) -> tuple[list[int], dict[str, object]]:
    """Each rank reads `steps` indices (all if None); return them and the one state all ranks save."""
    for s in samplers:
        s.set_epoch(epoch)
    (share,) = {s.remaining() for s in samplers}  # every rank gets the same share: DDP needs it
    read: list[int] = []
    for s in samplers:
        mine = list(itertools.islice(iter(s), steps))
        assert len(mine) == (share if steps is None else min(steps, share))
        read += mine
    states = [s.state_dict() for s in samplers]
    assert all(state == states[0] for state in states), "ranks in lockstep save the same state"
    return read, states[0]


def _expected_epoch(length: int, start: int, world: int, drop_last: bool) -> int:
    """Where an epoch resumed at global position `start` on `world` ranks ends (the rule we document)."""
    remaining = max(length - start, 0)
    per_rank = remaining // world if drop_last else math.ceil(remaining / world)
    return start + per_rank * world


@pytest.mark.parametrize("length", [48, 50, 13, 3, 1])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("new_world", [3, 6, 4, 1])
def test_resume_on_another_world_size_reads_every_sample_once(
    length: int, drop_last: bool, new_world: int
) -> None:
    """Saved after k steps on 4 ranks, resumed on W' ranks: before + after is the whole epoch.

    Precisely: every index exactly once, plus (drop_last=False) the padding wrapped from the start
    of the stream to make W' equal shares, or minus (drop_last=True) a tail shorter than W'.
    """
    num_samples = _ranks(length, 4, drop_last)[0].num_samples
    cuts = {0, 1, num_samples // 2, num_samples - 1, num_samples}
    for steps in sorted(c for c in cuts if 0 <= c <= num_samples):
        before, state = _run_in_lockstep(_ranks(length, 4, drop_last), steps, epoch=2)
        assert state["cursor"] == 4 * steps and state["num_replicas"] == 4
        resumed = _ranks(length, new_world, drop_last, seed=0)  # the saved seed wins
        for s in resumed:
            s.load_state_dict(state)
        after, end_state = _run_in_lockstep(resumed, None, epoch=2)

        seen = Counter(before + after)
        end = _expected_epoch(length, 4 * steps, new_world, drop_last)
        # An epoch that had ended on 4 ranks (padding included) is kept at its end, the length.
        assert end_state["cursor"] == (min(end, length) if 4 * steps >= length else end)
        stream = resumed[0].index_at(np.arange(end), epoch=2).tolist()
        assert seen == Counter(stream), (steps, new_world)
        if drop_last:
            assert max(seen.values(), default=1) == 1
            assert 0 <= length - len(seen) < max(new_world, 4)  # whichever world finished
        else:
            assert set(seen) == set(range(length))
            assert sum(seen.values()) - length == end - length < max(new_world, 4)

        for s in resumed:  # the next epoch is a normal one
            s.set_epoch(3)
            assert len(s) == s.num_samples


@pytest.mark.parametrize("drop_last", [False, True])
def test_chained_resumes_compose(drop_last: bool) -> None:
    """4 ranks -> 3 ranks -> 6 ranks -> 2 ranks within one epoch still read each sample once."""
    length = 101
    read, state = _run_in_lockstep(_ranks(length, 4, drop_last), 5, epoch=1)
    start = 20
    for world, steps in [(3, 7), (6, 4), (2, None)]:
        ranks = _ranks(length, world, drop_last)
        for s in ranks:
            s.load_state_dict(state)
        assert (
            ranks[0].remaining() * world == _expected_epoch(length, start, world, drop_last) - start
        )
        more, state = _run_in_lockstep(ranks, steps, epoch=1)
        read += more
        start = int(state["cursor"])  # type: ignore[call-overload]
    seen = Counter(read)
    if drop_last:
        assert max(seen.values()) == 1 and length - len(seen) < 2
    else:
        assert set(seen) == set(range(length)) and sum(seen.values()) - length < 2


def test_remaining_is_the_resumed_share_and_len_the_whole_epochs() -> None:
    """remaining() after load_state_dict is what the resumed pass yields, then num_samples
    again; len() is num_samples throughout, as trainers that count batches expect."""
    _, state = _run_in_lockstep(_ranks(50, 4, False), 5, epoch=0)  # 20 of 50 consumed
    sampler = DistributedShuffleSampler(range(50), num_replicas=3, rank=1)
    sampler.load_state_dict(state)
    assert sampler.remaining() == 10 and len(sampler) == sampler.num_samples == 17
    it = iter(sampler)
    next(it)
    assert sampler.remaining() == 10 and len(sampler) == 17
    assert len(list(it)) == 9
    assert sampler.remaining() == 17
    assert len(list(sampler)) == 17


def test_a_shuffle_samplers_remaining_is_its_resumed_rest() -> None:
    """ShuffleSampler.remaining() counts what the pending or running pass yields, as the
    distributed one's: the rest after a resume, else the epoch; a finished epoch's state that
    set_epoch does not name starts over, and counts a whole epoch."""
    sampler = ShuffleSampler(30, seed=4)
    it = iter(sampler)
    _ = [next(it) for _ in range(12)]
    state = sampler.state_dict()
    resumed = ShuffleSampler(30, seed=4)
    resumed.load_state_dict(state)
    assert resumed.remaining() == 18 and len(resumed) == 30
    rest = iter(resumed)
    assert resumed.remaining() == 18
    assert len(list(rest)) == 18
    assert resumed.remaining() == 30
    ended = ShuffleSampler(30, seed=4)
    ended.load_state_dict({**state, "cursor": 30})
    assert ended.remaining() == 30 == len(list(ended))
    ended.load_state_dict({**state, "cursor": 30})
    ended.set_epoch(state["epoch"])
    assert ended.remaining() == 0 == len(list(ended))


def test_state_dict_at_before_a_pass_counts_in_the_pass_iter_will_make() -> None:
    """Before its pass began (a loader without workers starts it at the first next()), a
    sampler's state_dict_at(n) is the state n indices into the pass iter() will make: from the
    epoch's start, or from a loaded cursor; 0 is state_dict()."""
    fresh = ShuffleSampler(30, seed=4)
    assert fresh.state_dict_at(0) == fresh.state_dict()
    assert fresh.state_dict_at(2**62)["cursor"] == 30
    loaded = ShuffleSampler(30, seed=4)
    loaded.load_state_dict({**fresh.state_dict(), "cursor": 12})
    assert loaded.state_dict_at(5)["cursor"] == 17
    ranks = DistributedShuffleSampler(range(10), num_replicas=4, rank=1, drop_last=True)
    assert ranks.state_dict_at(2**62)["cursor"] == 8  # 2 a rank; the 2 left over dropped
    assert ranks.state_dict_at(1)["cursor"] == 4


@pytest.mark.parametrize("world", [None, 3])
def test_state_dict_at_since_counts_in_the_pass_a_later_iter_begins(world: int | None) -> None:
    """With ``since`` (``passes_begun`` read before a loader made its iterator), a pass begun
    no later is an earlier one of the epoch: the indices count in the pass that iterator will
    begin, from the epoch's start, not in the resumed pass before it."""
    sampler: Any = (
        ShuffleSampler(30, seed=4)
        if world is None
        else DistributedShuffleSampler(range(30), num_replicas=world, rank=0, seed=4)
    )
    stride = world or 1
    sampler.load_state_dict({**sampler.state_dict(), "cursor": 12})
    list(sampler)  # the resumed rest of the epoch
    since = sampler.passes_begun
    assert sampler.state_dict_at(0)["cursor"] == 12  # the latest pass: the resumed one
    assert sampler.state_dict_at(0, since=since)["cursor"] == 0
    assert sampler.state_dict_at(2, since=since)["cursor"] == 2 * stride
    it = iter(sampler)  # the iterator's pass begins
    next(it)
    assert sampler.passes_begun == since + 1
    assert sampler.state_dict_at(1, since=since)["cursor"] == stride


def _with_a_pass_begun_after_the_snapshot(sampler: Any, lines: int, action: Any) -> Any:
    """Run ``action()``; ``lines`` lines after the sampler's snapshot of its pass and pending
    resume was read, begin a pass and draw 6 indices (as a loader's transfer thread may, in
    between), via a line trace: a thread switch at a chosen moment, deterministic."""
    snapshots = {"_counted", "_snapshot"}
    state = {"read": False, "done": False, "lines": lines}

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "return" and frame.f_code.co_name in snapshots:
            state["read"] = True
        elif event == "line" and state["read"] and not state["done"]:
            state["lines"] -= 1
            if state["lines"] >= 0:
                return local
            state["done"] = True
            other = iter(sampler)
            _ = [next(other) for _ in range(6)]
        return local

    def calls(frame: Any, event: str, _arg: Any) -> Any:
        owner = frame.f_locals.get("self")
        return local if owner is sampler and not state["done"] else None

    sys.settrace(calls)
    try:
        result = action()
    finally:
        sys.settrace(None)
    assert state["done"]
    return result


@pytest.mark.parametrize("lines", [0, 1, 2])
@pytest.mark.parametrize("kind", ["shuffle", "distributed", "mixture"])
def test_state_dict_at_is_not_mixed_up_by_a_pass_begun_while_it_runs(kind: str, lines: int) -> None:
    """A loaded state waits for its pass; another thread begins that pass and draws ahead right
    after state_dict_at(0) read where the sampler stands: the state is still the loaded one,
    not the position of the indices drawn ahead."""

    def make() -> Any:
        if kind == "shuffle":
            return ShuffleSampler(12, seed=2)
        if kind == "distributed":
            return DistributedShuffleSampler(range(12), num_replicas=1, rank=0, seed=2)
        mixture = Mixture({"a": range(6), "b": range(6, 13)}, {"a": 0.5, "b": 0.5})
        return MixtureSampler(mixture, 1, 0, samples_per_epoch=12)

    source = make()
    it = iter(source)
    _ = [next(it) for _ in range(4)]
    saved = source.state_dict_at(4)
    sampler = make()
    sampler.load_state_dict(saved)
    since = sampler.passes_begun
    state = _with_a_pass_begun_after_the_snapshot(
        sampler, lines, lambda: sampler.state_dict_at(0, since=since)
    )
    assert state["cursor"] == saved["cursor"] == 4


def test_a_mid_epoch_state_with_no_rest_on_more_ranks_is_not_an_ended_epoch() -> None:
    """Saved on 1 rank after 9 of 10 samples (drop_last): on 2 ranks nothing is left for either,
    yet the epoch had not ended where it was saved. The resume yields that empty rest (nothing
    read twice), also without set_epoch; an ended epoch's state starts over without it."""
    source = DistributedShuffleSampler(range(10), num_replicas=1, rank=0, drop_last=True)
    it = iter(source)
    _ = [next(it) for _ in range(9)]
    state = source.state_dict()
    for rank in range(2):
        sampler = DistributedShuffleSampler(range(10), num_replicas=2, rank=rank, drop_last=True)
        sampler.load_state_dict(state)
        assert sampler.remaining() == 0 == len(list(sampler))
    ended = DistributedShuffleSampler(range(10), num_replicas=2, rank=0, drop_last=True)
    ended.load_state_dict({**state, "cursor": 10})
    assert ended.remaining() == 5 == len(list(ended))


def test_shuffle_false_resumes_in_dataset_order() -> None:
    """Without shuffling the global stream is 0..N-1 and a resume continues it on the new ranks."""
    before, state = _run_in_lockstep(_ranks(10, 2, False, shuffle=False), 2, epoch=0)
    assert sorted(before) == [0, 1, 2, 3]
    resumed = _ranks(10, 3, False, shuffle=False)
    for s in resumed:
        s.load_state_dict(state)
    assert [list(s) for s in resumed] == [[4, 7], [5, 8], [6, 9]]


def test_distributed_bad_state_raises_value_error() -> None:
    """Another length, another shuffle setting or an impossible cursor is refused by name."""
    _, state = _run_in_lockstep(_ranks(10, 2, False), 1, epoch=0)
    with pytest.raises(ValueError, match="length 10"):
        DistributedShuffleSampler(range(11), num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True"):
        _ranks(10, 2, False, shuffle=False)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="cursor 12"):
        _ranks(10, 2, False)[0].load_state_dict({**state, "cursor": 12})
    with pytest.raises(ValueError, match="num_replicas"):
        _ranks(10, 2, False)[0].load_state_dict({**state, "num_replicas": 0})
    with pytest.raises(ValueError, match="format version"):
        _ranks(10, 2, False)[0].load_state_dict({**state, "version": 0})


def test_a_state_saved_again_after_a_padded_end_loads_on_any_world_size() -> None:
    """10 samples on 4 ranks end their epoch at global position 12 (2 of padding). Loaded on
    2 ranks, the rest is empty, and the state those ranks save again loads on any world size,
    with an empty rest there too."""
    ranks = _ranks(10, 4, False)
    for sampler in ranks:
        sampler.set_epoch(0)
        assert len(list(sampler)) == 3
    ended = ranks[0].state_dict()
    assert ended["cursor"] == 12
    fewer = _ranks(10, 2, False)
    for sampler in fewer:
        sampler.load_state_dict(ended)
        sampler.set_epoch(0)
        assert list(sampler) == []
    again = fewer[0].state_dict()
    for world in (1, 2, 3, 5):
        for sampler in _ranks(10, world, False):
            sampler.load_state_dict(again)
            sampler.set_epoch(0)
            assert list(sampler) == []


def test_a_shuffle_sampler_refuses_an_unshuffled_state() -> None:
    """A DistributedShuffleSampler(shuffle=False) state counts positions in dataset order: in a
    ShuffleSampler's order they would be other samples."""
    _, state = _run_in_lockstep(_ranks(10, 1, False, shuffle=False), 5, epoch=0)
    with pytest.raises(ValueError, match="shuffle=False"):
        ShuffleSampler(10).load_state_dict(state)


def _last_step_checkpoint_then_resume(
    make: Any, epochs: int = 2
) -> tuple[list[int], list[list[int]]]:
    """A loop that saves ``{"epoch": epoch, "loader": ...}`` at the first epoch's last step
    (the torchrun guide's checkpoint), then resumes with ``set_epoch(epoch)`` from the saved
    epoch on: what the first run read, and each resumed epoch."""
    sampler, loader = make()
    sampler.set_epoch(0)
    read: list[int] = []
    for step, batch in enumerate(loader):
        read += batch.tolist()
        if step == len(loader) - 1:
            checkpoint = json.loads(json.dumps({"epoch": 0, "loader": loader.state_dict()}))
            break
    sampler, loader = make()
    loader.load_state_dict(checkpoint["loader"])
    resumed = []
    for epoch in range(checkpoint["epoch"], epochs):
        sampler.set_epoch(epoch)
        resumed.append([i for batch in loader for i in batch.tolist()])
    return read, resumed


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffle", "distributed", "block", "mixture"])
def test_a_checkpoint_at_an_epochs_last_step_resumes_nothing_more_of_that_epoch(
    kind: str, num_workers: int
) -> None:
    """set_epoch(saved epoch) keeps the resume at the epoch's end: the epoch's rest is empty,
    and the next epoch is read in full, as an uninterrupted run reads it."""
    from threadloader import BlockShuffleSampler, Mixture, MixtureSampler

    def make() -> Any:
        if kind == "mixture":
            data: Any = Mixture({"a": range(12)}, {"a": 1.0})
            sampler: Any = MixtureSampler(data, samples_per_epoch=12)
        else:
            data = list(range(12))
            sampler = {
                "shuffle": lambda: ShuffleSampler(data, seed=3),
                "distributed": lambda: DistributedShuffleSampler(data, num_replicas=1, rank=0),
                "block": lambda: BlockShuffleSampler(data, block_size=4, num_replicas=1, rank=0),
            }[kind]()
        loader = ThreadDataLoader(data, batch_size=4, sampler=sampler, num_workers=num_workers)
        return sampler, loader

    read, resumed = _last_step_checkpoint_then_resume(make)
    sampler, loader = make()
    uninterrupted = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        uninterrupted.append([i for batch in loader for i in batch.tolist()])
    assert read == uninterrupted[0]
    assert resumed == [[], uninterrupted[1]]


def test_a_finished_epochs_state_without_set_epoch_starts_the_epoch_over() -> None:
    """No set_epoch after the load: as torch's samplers, the next iter() repeats the order."""
    sampler = ShuffleSampler(12, seed=3)
    loader = ThreadDataLoader(list(range(12)), batch_size=4, sampler=sampler)
    first = [i for batch in loader for i in batch.tolist()]
    state = loader.state_dict()
    resumed_sampler = ShuffleSampler(12, seed=3)
    resumed = ThreadDataLoader(list(range(12)), batch_size=4, sampler=resumed_sampler)
    resumed.load_state_dict(state)
    assert [i for batch in resumed for i in batch.tolist()] == first


def test_a_mid_epoch_state_of_our_samplers_loads_without_a_warning() -> None:
    """Positional samplers resume at their own cursor: nothing is replayed, nothing to say."""
    ours = ThreadDataLoader(list(range(8)), batch_size=2, sampler=ShuffleSampler(8))
    next(iter(ours))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ThreadDataLoader(list(range(8)), batch_size=2, sampler=ShuffleSampler(8)).load_state_dict(
            ours.state_dict()
        )


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: DistributedShuffleSampler(range(10), num_replicas=2, rank=0.5), "rank"),
        (lambda: DistributedShuffleSampler(range(10), num_replicas=2.0, rank=0), "num_replicas"),
        (lambda: DistributedShuffleSampler(range(10), num_replicas=1, rank=0, seed=1.5), "seed"),
        (lambda: ShuffleSampler(10, seed=1.5), "seed"),
        (lambda: BlockShuffleSampler(range(10), 2.5, num_replicas=1, rank=0), "block_size"),
        (
            lambda: MixtureSampler(Mixture({"a": [0, 1]}, {"a": 1}), samples_per_epoch=2.5),
            "samples",
        ),
        (
            lambda: MixtureSampler(Mixture({"a": [0, 1]}, {"a": 1}), num_replicas=2.0),
            "num_replicas",
        ),
        (lambda: MixtureSampler(list(range(10))), "Mixture, got list"),  # type: ignore[arg-type]
        (lambda: Mixture({"a": [0, 1, 2]}, {"a": 1}).indices_at([1.5]), "positions"),
    ],
)
def test_a_number_that_is_no_int_is_refused_by_name(make: Any, name: str) -> None:
    """A float rank, seed or size would truncate (rank 0.5 read rank 0's indices) or fail later
    with an error naming nothing: TypeError naming the argument, at once."""
    with pytest.raises(TypeError, match=name):
        make()
