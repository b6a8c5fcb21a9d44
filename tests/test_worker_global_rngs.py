"""Worker threads' process-global RNGs behave as a worker process's: compared with DataLoader.

In a torch worker process, ``torch``'s default generator, ``random`` and ``numpy.random`` are the
worker's own, seeded from its seed. Every expected value here comes from torch's DataLoader with
worker processes on the same dataset; items sleep between draws so that worker threads interleave.
"""

from __future__ import annotations

import functools
import io
import random
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_batches_equal, assert_resumes_exactly, collect
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data._utils.worker import _generate_state

from threadloader import ThreadDataLoader


class FakeImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """torchvision's FakeData pattern: seed torch's global generator with the index, draw the
    image and target, put the generator back."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 4, 4), pause_s: float = 0.0) -> None:
        self.n, self.shape, self.pause_s = n, shape, pause_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng_state = torch.get_rng_state()
        torch.manual_seed(index + 7)
        image = torch.randn(*self.shape)
        if self.pause_s:
            time.sleep(self.pause_s)
        else:
            time.sleep(0)  # let another worker thread run between the draws
        target = torch.randint(0, 10, size=(1,), dtype=torch.long)[0]
        torch.set_rng_state(rng_state)
        return image, target


@functools.cache
def _fake_images_read_one_by_one(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``FakeImages(n)``'s items, stacked: what every loader must give.

    Each is drawn from a generator seeded as the item seeds the global one (``torch.manual_seed``
    takes ~1 ms here: 5,000 calls would take seconds); every 100th is read from the dataset in
    this thread and must be the same.
    """
    dataset = FakeImages(n)
    images, targets = [], []
    for i in range(n):
        generator = torch.Generator().manual_seed(i + 7)
        images.append(torch.randn(*dataset.shape, generator=generator))
        targets.append(torch.randint(0, 10, size=(1,), dtype=torch.long, generator=generator)[0])
        if i % 100 == 0:
            image, target = dataset[i]
            assert torch.equal(image, images[-1]) and torch.equal(target, targets[-1])
    return torch.stack(images), torch.stack(targets)


@pytest.mark.parametrize("num_workers", [1, 3, 8])
def test_a_dataset_that_seeds_per_item_returns_exactly_its_items(num_workers: int) -> None:
    """FakeData through worker threads: every sample equals dataset[i] (5,000 of them), and the
    training thread's own draws between batches are those of a loop without workers."""
    dataset = FakeImages(5_000)
    torch.manual_seed(0)
    expected_noise = [torch.randn(4) for _ in range(5_000 // 100)]
    expected_images, expected_targets = _fake_images_read_one_by_one(len(dataset))
    torch.manual_seed(0)
    loader = ThreadDataLoader(
        dataset, batch_size=100, num_workers=num_workers, generator=torch.Generator()
    )
    wrong = 0
    for b, (images, targets) in enumerate(loader):
        noise = torch.randn(4)  # a GAN's noise vector, drawn while the workers run
        assert torch.equal(noise, expected_noise[b])
        rows = slice(b * 100, b * 100 + len(images))
        same_image = (images == expected_images[rows]).flatten(1).all(1)
        wrong += int((~(same_image & (targets == expected_targets[rows]))).sum())
    assert wrong == 0


class Augmented(Dataset[torch.Tensor]):
    """Item i: i, then draws from the global torch, random and numpy RNGs, as augmentations do,
    with the GIL released in between."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        a = float(torch.rand(()))
        time.sleep(0.0005)
        b = random.random()
        c = float(np.random.rand())
        time.sleep(0.0005)
        d = float(torch.randint(0, 1000, ()))
        e = float(torch.empty(1).uniform_(0.5, 1.5))
        return torch.tensor([i, a, b, c, d, e], dtype=torch.float64)


def _seeded_epoch(loader_class: Any, **kwargs: Any) -> tuple[list[Any], list[float]]:
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    batches = list(loader_class(Augmented(), batch_size=4, **kwargs))
    return batches, [float(torch.rand(())), random.random(), float(np.random.rand())]


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 2},
        {"num_workers": 3, "shuffle": True},
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 2, "isolation": "process"},
    ],
    ids=["2", "3-shuffled", "persistent", "isolation"],
)
def test_global_rng_augmentations_are_torchs_and_leave_the_training_rngs_alone(
    options: dict[str, Any],
) -> None:
    """Draws from the global torch/random/numpy RNGs in items equal DataLoader's, run after run,
    and the training thread's RNGs afterwards are where DataLoader leaves them."""
    torch_options = {k: v for k, v in options.items() if k != "isolation"}
    theirs, their_after = _seeded_epoch(DataLoader, **torch_options)
    ours, our_after = _seeded_epoch(ThreadDataLoader, **options)
    again, _ = _seeded_epoch(ThreadDataLoader, **options)
    assert_batches_equal(ours, theirs)
    assert_batches_equal(again, theirs)
    assert our_after == their_after


class Seeding(Dataset[torch.Tensor]):
    """Item i reseeds every global RNG with i and reads its state back through each API."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        torch.manual_seed(i)
        random.seed(i)
        np.random.seed(i)
        time.sleep(0.0005)
        state = torch.get_rng_state()
        first = torch.rand(2)
        torch.set_rng_state(state)
        again = torch.rand(2)
        with torch.random.fork_rng(devices=[]):
            forked = torch.rand(1)
        after_fork = torch.rand(1)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        p, n = random.random(), np.random.rand()
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        p2, n2 = random.random(), np.random.rand()
        return torch.tensor(
            [i, self.seeded_as_torch_does, torch.initial_seed(), *first, *again,
             *forked, *after_fork, p, n, p2, n2, np.random.randint(1 << 30)],
            dtype=torch.float64,
        )  # fmt: skip


def _check_worker_seeds(worker_id: int) -> None:
    """Whether the worker's global RNGs start as torch seeds a worker process's."""
    info = get_worker_info()
    info.dataset.seeded_as_torch_does = (
        torch.initial_seed() == info.seed
        and random.getstate() == random.Random(info.seed).getstate()
        and np.random.rand() == np.random.RandomState(_generate_state(info.seed - worker_id,
                                                                      worker_id)).rand()
    )  # fmt: skip


@pytest.mark.parametrize("num_workers", [1, 3])
def test_seeding_functions_act_on_the_workers_own_rngs(num_workers: int) -> None:
    """A worker's global RNGs start seeded as torch seeds a worker process's; manual_seed/
    initial_seed/get_rng_state/set_rng_state/fork_rng, random.seed/getstate/setstate and
    np.random.seed/get_state/set_state in an item act on its worker's RNGs."""
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers}
    theirs = collect(DataLoader(Seeding(), worker_init_fn=_check_worker_seeds, **kwargs))
    ours = collect(ThreadDataLoader(Seeding(), worker_init_fn=_check_worker_seeds, **kwargs))
    assert_batches_equal(ours, theirs)
    assert all(bool(row[1]) for batch in ours for row in batch)


class TorchvisionLike(Dataset[torch.Tensor]):
    """The random ops torchvision's v1 and v2 transforms call without a generator."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        image = torch.full((3, 8, 8), float(i))
        scale = torch.empty(1).uniform_(0.08, 1.0)  # RandomResizedCrop
        log_ratio = torch.empty(1).uniform_(-0.3, 0.3).exp_()
        top = torch.randint(0, 4, size=(1,))
        flip = torch.rand(1) < 0.5  # RandomHorizontalFlip
        order = torch.randperm(4)  # ColorJitter
        time.sleep(0.0005)
        erase = torch.empty((3, 2, 2), dtype=torch.float32).normal_()  # RandomErasing
        noise = torch.randn_like(image) * 0.1  # v2.GaussianNoise
        like = torch.rand_like(image[0, 0]), torch.randint_like(image[0, 0], 0, 9)
        lam = torch.distributions.Beta(torch.tensor([0.4]), torch.tensor([0.4])).sample()  # MixUp
        weights = torch._sample_dirichlet(torch.tensor([1.0, 1.0, 1.0]))  # AugMix
        pick = torch.multinomial(torch.tensor([0.2, 0.3, 0.5]), 2)
        coin = torch.bernoulli(torch.full((4,), 0.5))
        noise2 = torch.normal(0.0, 1.0, size=(2,))
        return torch.cat(
            [scale, log_ratio, top.double(), flip.double(), order.double(), erase.flatten(),
             noise.flatten()[:5], like[0], like[1], lam, weights, pick.double(), coin, noise2]
        ).double()  # fmt: skip


@pytest.mark.parametrize("num_workers", [2, 4])
def test_torchvision_transform_ops_draw_from_the_worker_generator(num_workers: int) -> None:
    """Random ops without a generator (uniform_, randint, rand, randperm, normal_, *_like,
    Beta/Dirichlet sampling, multinomial, bernoulli, normal) give DataLoader's values."""
    torch.manual_seed(3)
    theirs = collect(DataLoader(TorchvisionLike(), batch_size=3, num_workers=num_workers))
    torch.manual_seed(3)
    ours = collect(ThreadDataLoader(TorchvisionLike(), batch_size=3, num_workers=num_workers))
    assert_batches_equal(ours, theirs)


class Dropping(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        torch.rand(4, device="meta")
        return torch.nn.functional.dropout(torch.ones(4), 0.5)


def test_a_draw_that_cannot_be_redirected_warns_once() -> None:
    """dropout takes no generator, and a meta-device draw is not a CPU one: each warns once and
    still runs."""
    from threadloader._primitives import worker_globals

    worker_globals._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = collect(ThreadDataLoader(Dropping(), batch_size=1, num_workers=2))
    assert len(batches) == 4
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sum("dropout" in m and "no generator argument" in m for m in messages) == 1
    assert sum("non-CPU device" in m for m in messages) == 1


def test_outside_worker_threads_nothing_changes() -> None:
    """On the training thread (and any thread not a worker), the global functions act on the
    process's RNGs, and no torch function mode is left on its stack."""
    collect(ThreadDataLoader(Augmented(), batch_size=4, num_workers=2))
    assert torch._C._len_torch_function_stack() == 0
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    assert torch.initial_seed() == 9
    assert torch.get_rng_state().equal(torch.default_generator.get_state())
    assert random.random() == random.Random(9).random()
    assert np.random.rand() == np.random.RandomState(9).rand()
    torch.manual_seed(9)
    seen: list[float] = []
    thread = threading.Thread(target=lambda: seen.append(float(torch.rand(()))))
    thread.start()
    thread.join()
    assert seen == [float(torch.rand((), generator=torch.Generator().manual_seed(9)))]


@pytest.mark.parametrize("cut", [1, 5, 11])
@pytest.mark.parametrize("isolation", [None, "process"])
def test_save_worker_rng_resumes_the_global_rngs_too(cut: int, isolation: str | None) -> None:
    """With save_worker_rng=True a resume continues each worker's global torch, random and numpy
    draws where the uninterrupted run was."""

    def make() -> ThreadDataLoader[Any]:
        return ThreadDataLoader(
            Augmented(), batch_size=2, num_workers=3, shuffle=True,
            generator=torch.Generator().manual_seed(1), save_worker_rng=True,
            isolation=isolation,
        )  # fmt: skip

    assert_resumes_exactly(make, cut)
    loader = make()
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    torch.save(loader.state_dict(), buffer := io.BytesIO())
    del iterator
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # plain data, numpy's state included


def test_worker_threads_end_with_nothing_on_their_torch_mode_stack(monkeypatch) -> None:
    """A mode left on a thread's stack is released by a C++ thread-local destructor after the
    thread ends, which aborted the interpreter at exit ('terminate called without an active
    exception'): each worker thread takes the worker's mode off before it ends."""
    from threadloader._engine import workers as _workers

    seen: dict[str, int] = {}
    real_leave = _workers.leave

    def recording_leave(previous: Any) -> None:
        real_leave(previous)
        name = threading.current_thread().name
        if "-worker" in name:
            seen[name] = torch._C._len_torch_function_stack()

    monkeypatch.setattr(_workers, "leave", recording_leave)
    collect(ThreadDataLoader(Augmented(), batch_size=4, num_workers=3))
    assert len(seen) == 3 and set(seen.values()) == {0}


def test_a_ctrl_c_while_the_training_thread_becomes_a_worker_leaves_it_itself(
    monkeypatch,
) -> None:
    """A KeyboardInterrupt right after Worker.enter() on the training thread: afterwards the
    thread is not a worker (no WorkerInfo, its own RNGs, no mode on its stack)."""
    from threadloader._engine import workers as _workers
    from threadloader._primitives import worker_globals

    real_enter = _workers.Worker.enter
    fired: list[bool] = []

    def interrupted_enter(self: Any) -> Any:
        previous = real_enter(self)
        if threading.current_thread() is threading.main_thread() and not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return previous

    monkeypatch.setattr(_workers.Worker, "enter", interrupted_enter)
    loader = ThreadDataLoader(Augmented(), batch_size=4, num_workers=2, worker_init_fn=None)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(6):
            collect(loader)  # the lean path or a not-yet-started task runs on this thread
    assert fired
    assert get_worker_info() is None and worker_globals.current() is None
    assert torch._C._len_torch_function_stack() == 0
    torch.manual_seed(0)
    assert torch.initial_seed() == 0 and torch.default_generator.initial_seed() == 0


class DefaultGenerator(Dataset[torch.Tensor]):
    """Draws through torch.default_generator passed explicitly, as random_split does."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.0005)
        perm = torch.randperm(6, generator=torch.default_generator)
        split = torch.utils.data.random_split(range(6), [3, 3])[0].indices
        return torch.cat([perm, torch.tensor(split)])


def test_an_explicit_default_generator_is_the_workers_own() -> None:
    """torch.default_generator passed to a CPU draw in a worker (random_split's default) is the
    worker's generator, as in a worker process: DataLoader's values, the training RNG unmoved."""
    torch.manual_seed(1)
    theirs = collect(DataLoader(DefaultGenerator(), batch_size=2, num_workers=2))
    their_next = float(torch.rand(()))
    torch.manual_seed(1)
    ours = collect(ThreadDataLoader(DefaultGenerator(), batch_size=2, num_workers=2))
    assert_batches_equal(ours, theirs)
    assert float(torch.rand(())) == their_next


def test_the_replaced_module_functions_still_pickle() -> None:
    """random.shuffle and np.random.randint pickle by reference once they dispatch."""
    import pickle

    collect(ThreadDataLoader(Augmented(), batch_size=4, num_workers=2))
    assert pickle.loads(pickle.dumps(random.shuffle)) is random.shuffle
    assert pickle.loads(pickle.dumps(np.random.randint)) is np.random.randint


class DrawsWhenUnpickled(torch.utils.data.IterableDataset[int]):
    def __init__(self) -> None:
        self.n = 8

    def __iter__(self) -> Any:
        info = get_worker_info()
        return iter(range(info.id, self.n, info.num_workers))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.tag = random.random()  # e.g. a temporary file's name


def test_making_a_workers_copy_does_not_move_the_training_rng() -> None:
    """A worker process unpickles its copy itself; a worker thread's copy is made as that
    worker, so what its __setstate__ draws comes from the worker's RNG."""
    random.seed(3)
    collect(DataLoader(DrawsWhenUnpickled(), batch_size=2, num_workers=2))
    theirs = random.random()
    random.seed(3)
    collect(ThreadDataLoader(DrawsWhenUnpickled(), batch_size=2, num_workers=2))
    assert random.random() == theirs


class _NoDraws(Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i


class _LegacyDraws(_NoDraws):
    def __getitem__(self, i: int) -> int:
        time.sleep(0.0005)
        return int(np.random.randint(1 << 30))


def test_a_worker_seeds_its_numpy_global_only_when_an_item_uses_it(monkeypatch) -> None:
    """Seeding a ``RandomState`` from a seed sequence costs ~0.1-0.3 ms a worker, before the
    first batch: a worker makes its own only on first use, and the draws are still torch's."""
    made: list[int] = []
    legacy = np.random.RandomState

    class Counting(legacy):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            made.append(1)
            super().__init__(*args)

    monkeypatch.setattr(np.random, "RandomState", Counting)
    loader = ThreadDataLoader(_NoDraws(), batch_size=4, num_workers=8, isolation="threads")
    assert [int(x) for b in loader for x in b] == list(range(64))
    assert made == []

    torch.manual_seed(3)
    theirs = collect(DataLoader(_LegacyDraws(), batch_size=4, num_workers=3))
    torch.manual_seed(3)
    ours = collect(ThreadDataLoader(_LegacyDraws(), batch_size=4, num_workers=3))
    assert_batches_equal(ours, theirs)
    assert len(made) == 3


class _BitGeneratorDraws(_NoDraws):
    """numpy's recommended bridge from the legacy global to a ``Generator``; item 5 replaces
    its worker's bit generator, which later items of that worker draw from."""

    def __getitem__(self, i: int) -> int:
        time.sleep(0.0005)
        if i == 5:
            np.random.set_bit_generator(np.random.PCG64(i))
        return int(np.random.Generator(np.random.get_bit_generator()).integers(1 << 30))


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_numpy_bit_generator_functions_act_on_the_workers_own_global(isolation: str) -> None:
    """``np.random.get_bit_generator``/``set_bit_generator`` reach the worker's global in a
    worker thread, as in a worker process, and leave the training thread's alone."""
    np.random.seed(9)
    mine = np.random.get_bit_generator()
    before = mine.state
    torch.manual_seed(3)
    theirs = collect(DataLoader(_BitGeneratorDraws(), batch_size=4, num_workers=2))
    torch.manual_seed(3)
    ours = collect(
        ThreadDataLoader(_BitGeneratorDraws(), batch_size=4, num_workers=2, isolation=isolation)
    )
    assert_batches_equal(ours, theirs)
    after = mine.state["state"]
    assert np.random.get_bit_generator() is mine and after["pos"] == before["state"]["pos"]
    assert np.array_equal(after["key"], before["state"]["key"])
