"""A resumed epoch draws nothing from the global RNG, so a checkpoint that restores the global
RNG (Accelerate's ``save_state``/``load_state``, Trainer's ``rng_state.pth``) seeds the epochs
after the resumed one as the uninterrupted run did, as torchdata's StatefulDataLoader does."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import RandomSampler

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
