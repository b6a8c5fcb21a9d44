"""A resumed epoch draws nothing from the global RNG, so a checkpoint that restores the global
RNG (Accelerate's ``save_state``/``load_state``, Trainer's ``rng_state.pth``) seeds the epochs
after the resumed one as the uninterrupted run did, as torchdata's StatefulDataLoader does. A
script that restores none (it seeds at its top, as Lightning's ``ckpt_path=`` resumes) gets the
global RNG the state saved (``_engine.global_rng``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import RandomSampler, Sampler

from threadloader import ThreadDataLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_after_a_resume_with_the_global_rng_restored(num_workers: int) -> None:
    def make() -> ThreadDataLoader[int]:
        return ThreadDataLoader(
            list(range(24)), batch_size=4, shuffle=True, num_workers=num_workers
        )

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state, global_rng = loader.state_dict(), torch.get_rng_state()
    rest = [b.tolist() for b in it]
    following = [[b.tolist() for b in loader] for _ in range(2)]

    torch.manual_seed(1)
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(global_rng)  # what the checkpointing framework restores
    assert [b.tolist() for b in resumed] == rest
    assert [[b.tolist() for b in resumed] for _ in range(2)] == following
    assert sorted(i for b in head + rest for i in b) == list(range(24))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [2, 6])  # mid-epoch, and after the epoch's last batch
def test_a_script_seeding_at_its_top_resumes_into_the_uninterrupted_epochs(
    num_workers: int, cut: int
) -> None:
    """The script seeds the global RNG at its top and restores no RNG when it resumes: the
    epochs after the resumed one are the uninterrupted run's (they drew the first epoch's
    order again, at every resume), as with StatefulDataLoader, and so is what the training
    draws from the global RNG after the resume."""

    def make() -> ThreadDataLoader[int]:
        return ThreadDataLoader(
            list(range(24)), batch_size=4, shuffle=True, num_workers=num_workers
        )

    def run(state: dict[str, Any] | None) -> tuple[list[list[list[int]]], Any, float]:
        torch.manual_seed(0)
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        epochs, saved = [], None
        for epoch in range(3):
            epochs.append([])
            for k, batch in enumerate(loader):
                epochs[-1].append(batch.tolist())
                torch.rand(1)  # the training step draws from the global RNG too
                if state is None and epoch == 0 and k + 1 == cut:
                    saved = loader.state_dict()
        return epochs, saved, torch.rand(1).item()

    full, state, full_draw = run(None)
    resumed, _, resumed_draw = run(state)
    if cut < len(full[0]):
        assert resumed[0] == full[0][cut:]
        assert resumed[1:] == full[1:] != [full[0]] * 2
        assert resumed_draw == full_draw  # the steps after the resume drew as uninterrupted
    else:  # a state after the epoch's last batch starts the next epoch
        assert resumed[:2] == full[1:] != [full[0]] * 2


def test_a_global_rng_standing_elsewhere_is_left_alone() -> None:
    """A resumed process whose global RNG stands elsewhere than the saving run's did at its
    first ``iter()`` (seeded otherwise, or restored by a framework): the resumed epoch leaves
    it as it found it."""

    def make() -> ThreadDataLoader[int]:
        return ThreadDataLoader(list(range(24)), batch_size=4, shuffle=True, num_workers=2)

    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    torch.manual_seed(1)
    resumed = make()
    resumed.load_state_dict(state)
    before = torch.get_rng_state()
    assert len(list(resumed)) == 5
    assert torch.equal(torch.get_rng_state(), before)


def test_a_malformed_global_rng_digest_is_named() -> None:
    torch.manual_seed(0)
    loader = ThreadDataLoader(list(range(8)), batch_size=4, shuffle=True)
    next(iter(loader))
    state = loader.state_dict()
    assert len(state["global_rng_mark"]) == 32
    with pytest.raises(ValueError, match="global_rng_mark 'x' is not a 32-digit hex digest"):
        ThreadDataLoader(list(range(8)), batch_size=4, shuffle=True).load_state_dict(
            {**state, "global_rng_mark": "x"}
        )


@pytest.mark.parametrize("cut_epoch", [0, 1])
def test_a_samplers_own_generator_resumes_with_the_epoch(cut_epoch: int) -> None:
    """``RandomSampler(generator=g)`` (Accelerate gives a sharded sampler one): a new loader
    with a freshly seeded g resumes the saved epoch's order, and the epochs after it."""

    def make() -> ThreadDataLoader[int]:
        data = list(range(24))
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3))
        return ThreadDataLoader(data, batch_size=4, sampler=sampler, num_workers=2)

    loader = make()
    for _ in range(cut_epoch):
        list(loader)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    following = [b.tolist() for b in loader]

    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert [b.tolist() for b in resumed] == following
    assert sorted(i for b in head + rest for i in b) == list(range(24))


class EagerPermutation(Sampler[int]):
    """Draws its whole order from the global RNG in ``__iter__`` itself, not in a generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class EagerBatches(Sampler[list[int]]):
    """A batch sampler that draws its batches from the global RNG in ``__iter__`` itself."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter(torch.randperm(21).view(7, 3).tolist())

    def __len__(self) -> int:
        return 7


@pytest.mark.parametrize("cut", [0, 3])
@pytest.mark.parametrize(
    ("kind", "saved_workers", "loaded_workers", "persistent"),
    [
        ("sampler", 0, 0, False),
        ("sampler", 2, 2, False),
        ("sampler", 2, 3, False),
        ("sampler", 0, 2, False),
        ("sampler", 2, 2, True),
        ("batch_sampler", 0, 0, False),
        ("batch_sampler", 2, 2, False),
    ],
)
def test_a_sampler_drawing_in_iter_itself_resumes_its_own_order(
    kind: str, saved_workers: int, loaded_workers: int, persistent: bool, cut: int
) -> None:
    """A sampler whose ``__iter__`` returns an iterator over an order it drew from the global RNG
    there and then (no generator function): torch's iterator calls ``iter()`` before the epoch's
    first index is drawn, so the resumed epoch makes its iterator again under the RNG as it was
    then, and goes on with the saved order (not one drawn from the resumed process's RNG), also
    in a later epoch of persistent workers, and before the first batch reached the loop."""

    def make(num_workers: int) -> ThreadDataLoader[Any]:
        options: dict[str, Any] = (
            {"sampler": EagerPermutation(21), "batch_size": None}  # the sampler, not batched
            if kind == "sampler"
            else {"batch_sampler": EagerBatches()}
        )
        return ThreadDataLoader(
            list(range(21)), num_workers=num_workers,
            persistent_workers=persistent and num_workers > 0, **options,
        )  # fmt: skip

    torch.manual_seed(5)
    loader = make(saved_workers)
    if persistent:
        list(loader)
    it = iter(loader)
    head = [_flat(next(it)) for _ in range(cut)]
    state = loader.state_dict()
    rest = [_flat(b) for b in it]
    torch.manual_seed(6)  # the resumed process's RNG is elsewhere
    resumed = make(loaded_workers)
    resumed.load_state_dict(state)
    assert [_flat(b) for b in resumed] == rest
    assert sorted(i for b in head + rest for i in b) == list(range(21))


def _flat(batch: Any) -> list[int]:
    return torch.as_tensor(batch).reshape(-1).tolist()
