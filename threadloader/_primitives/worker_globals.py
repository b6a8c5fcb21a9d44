"""A worker thread's own process-global RNGs: torch's default generator, ``random``, ``numpy.random``.

A torch worker *process* has process-global RNGs of its own, which torch reseeds from the
worker's seed (``random.seed(seed)``, ``torch.manual_seed(seed)``,
``np.random.seed(_generate_state(base_seed, worker_id))``). Datasets and transforms rely on it:
torchvision's transforms call ``torch.rand`` without a generator, ``FakeData`` seeds torch's
global generator per item and restores it, albumentations and timm draw from ``random`` and
``numpy.random``. Worker threads share the process, so this module makes those globals
dispatch on the calling thread:

1. While a thread runs as a worker (``swap(rngs)``; a worker thread for its whole life, the
   training thread or an isolation runner for one task at a time), the module-level functions of
   ``random`` and ``numpy.random``'s legacy ``RandomState`` (``get_bit_generator`` and
   ``set_bit_generator`` included), and torch's ``manual_seed``,
   ``seed``, ``initial_seed``, ``get_rng_state`` and ``set_rng_state``, act on that worker's
   ``WorkerRNGs``. On any other thread they are the original functions' behaviour, unchanged.
2. Random torch ops called without a generator (``torch.rand``, ``Tensor.uniform_``,
   ``torch.randperm``, ...) get the worker's ``torch.Generator``, through a
   ``TorchFunctionMode`` pushed on the running thread's mode stack (torch keeps that stack per
   thread) for as long as it runs as a worker. Only CPU draws are redirected.
3. The worker's torch generator and ``random.Random`` are the very objects of its
   ``WorkerInfo.rng``: a draw through ``torch.random.thread_safe_generator()`` and one through the
   global functions come from one stream, as both come from the one global in a worker process.
   numpy's legacy global gets a ``RandomState`` of its own, seeded as torch seeds a process's
   (made when first used).
4. ``torch.default_generator`` passed explicitly to a CPU random op (``random_split``'s default)
   is the worker's generator too, as in a worker process. Where a draw cannot be redirected it
   goes to the process-global generator, with a ``RuntimeWarning`` the first time each kind
   happens: random ops that take no generator (the dropout family) and random ops on a non-CPU
   device. ``torch.default_generator``'s own methods (``.manual_seed()``, ``.get_state()``)
   act on the process's generator.
5. The patches go in once, when the first worker is made (``install``), and stay: removing them
   while another loader's workers run would race. torch's seeding functions get a new body, so
   every reference to them dispatches. ``random``'s and ``numpy.random``'s module functions are
   replaced by name: one bound before that (``from random import random``) keeps the original.
6. A process forked from a worker thread (a dataset that starts torch's DataLoader workers or a
   multiprocessing pool) is no worker: its only thread stops acting as one, and its global
   RNGs are the process's own, as in a process forked from any other thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import random
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.random
import numpy.random.mtrand
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data._utils import worker as _torch_worker


@dataclasses.dataclass(frozen=True, slots=True)
class _OwnRNG:
    """A thread worker's generators, with the fields of torch's ``_RNG``, for a torch that
    lacks it (before 2.13): ``WorkerInfo.rng`` then holds one of these."""

    random_generator: random.Random
    torch_generator: torch.Generator
    numpy_generator: object | None = None


#: The type of ``WorkerInfo.rng``: torch's own container where torch has one.
RNG: Any = getattr(_torch_worker, "_RNG", _OwnRNG)


class WorkerRNGs:
    """One worker's process-global RNGs, as the patched functions see them on its threads.

    Args:
        rng: the worker's ``WorkerInfo.rng``; its ``random.Random`` and ``torch.Generator``
            are the worker's ``random`` and torch globals.
        numpy_seed: the seed of the worker's ``numpy.random`` global (legacy ``RandomState``),
            which is made on first use: seeding a ``RandomState`` from a seed sequence costs
            ~0.1-0.3 ms, 4-11 ms for 32 workers on 2 cores before the first batch, and most
            datasets never touch it.
    """

    __slots__ = ("_numpy_legacy", "_numpy_seed", "random", "rng", "torch")

    def __init__(self, rng: Any, numpy_seed: Any) -> None:
        self.rng = rng
        self.random = rng.random_generator
        self.torch = rng.torch_generator
        self._numpy_seed = numpy_seed
        self._numpy_legacy: np.random.RandomState | None = None

    def get_bit_generator(self) -> Any:
        """``numpy.random.get_bit_generator()`` in this worker: its global's bit generator."""
        return self.numpy_legacy._bit_generator

    def set_bit_generator(self, bitgen: Any) -> None:
        """``numpy.random.set_bit_generator(bitgen)`` in this worker: its global draws from
        ``bitgen`` from now on."""
        self._numpy_legacy = np.random.RandomState(bitgen)

    @property
    def numpy_legacy_made(self) -> bool:
        """Whether the worker's ``numpy.random`` global was made (used, or its state asked for)."""
        return self._numpy_legacy is not None

    def forget_numpy_legacy(self) -> None:
        """Put the worker's ``numpy.random`` global back as it was before its first use."""
        self._numpy_legacy = None

    @property
    def numpy_legacy(self) -> np.random.RandomState:
        """The worker's ``numpy.random`` global, seeded with ``numpy_seed`` when first used."""
        legacy = self._numpy_legacy
        if legacy is None:
            # Threads the worker started share it (``_engine.worker_threads``): made once.
            with _numpy_lock:
                legacy = self._numpy_legacy
                if legacy is None:
                    legacy = self._numpy_legacy = np.random.RandomState(self._numpy_seed)
        return legacy


_numpy_lock = threading.Lock()  # makes a worker's numpy.random global once


class _Local(threading.local):
    current: WorkerRNGs | None = None


_local = _Local()
_install_lock = threading.Lock()
_installed = False
_warned: set[str] = set()
_warned_lock = threading.Lock()


def current() -> WorkerRNGs | None:
    """The RNGs the calling thread's global RNG functions act on now; None outside a worker."""
    return _local.current


def swap(rngs: WorkerRNGs | None) -> WorkerRNGs | None:
    """Make ``rngs`` the calling thread's global RNGs; return what they were (for ``swap`` back).

    Pushes the torch mode when the thread starts acting as a worker and removes it when it
    stops, so a thread outside any worker pays nothing per torch op.
    """
    previous = _local.current
    if rngs is previous:
        if rngs is None and torch._C._len_torch_function_stack() > 0:
            _remove_mode()  # left by an interrupted swap: not a worker, so not ours to keep
        return previous
    if previous is None:
        torch.overrides._push_mode(_MODE)
    elif rngs is None:
        _remove_mode()
    _local.current = rngs  # after the stack changed: a Ctrl-C between leaves it consistent
    return previous


def _after_fork_in_child() -> None:
    # Point 6: a process forked from a worker thread is no worker of ours; its global RNGs are
    # the process's own again.
    if _local.current is not None:
        swap(None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def clear_modes() -> None:
    """Empty the calling thread's torch mode stack: a worker thread's last act."""
    while torch._C._len_torch_function_stack() > 0:
        torch.overrides._pop_mode()


@contextlib.contextmanager
def library_code() -> Iterator[None]:
    """Run threadloader's own tensor code (its default collate) without the torch mode.

    It draws nothing at random, and under the mode every torch call and tensor attribute it
    makes would pass through Python (~50 us a batch of 16 token windows).
    """
    if _local.current is None or not _remove_mode():
        yield
        return
    try:
        yield
    finally:
        torch.overrides._push_mode(_MODE)


def _remove_mode() -> bool:
    """Take ``_MODE`` off this thread's mode stack, keeping any mode user code left above it.

    Returns:
        Whether it was there.
    """
    above = []
    found = False
    try:
        while torch._C._len_torch_function_stack() > 0:
            mode = torch.overrides._pop_mode()
            if mode is _MODE:
                found = True
                break
            above.append(mode)
    finally:
        for mode in reversed(above):
            torch.overrides._push_mode(mode)
    return found


def _warn_once(kind: str, message: str) -> None:
    with _warned_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(f"threadloader: {message}", RuntimeWarning, stacklevel=3)


# --- torch ops (point 2) ---------------------------------------------------------------------


def _torch_random_ops() -> frozenset[Any]:
    ops: list[Any] = [
        torch.rand, torch.randn, torch.randint, torch.randperm,
        torch.rand_like, torch.randn_like, torch.randint_like,
        torch.normal, torch.bernoulli, torch.multinomial, torch.poisson, torch.binomial,
        torch._standard_gamma, torch._sample_dirichlet, torch.rrelu, torch.rrelu_,
        torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
        torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
        torch.Tensor.geometric_, torch.Tensor.bernoulli_, torch.Tensor.bernoulli,
        torch.Tensor.multinomial,
    ]  # fmt: skip
    for name in ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_"):  # fmt: skip
        fn = getattr(torch.nn.init, name, None)
        code = getattr(fn, "__code__", None)
        if code is not None and "generator" in code.co_varnames:
            ops.append(fn)
    return frozenset(ops)


def _torch_ops_without_generator() -> frozenset[Any]:
    f = torch.nn.functional
    names: tuple[str, ...] = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
             "feature_alpha_dropout", "rrelu")  # fmt: skip
    ops: list[Any] = [getattr(f, n) for n in names if hasattr(f, n)]
    names = ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
             "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
             "native_dropout")  # fmt: skip
    ops += [getattr(torch, n) for n in names if hasattr(torch, n)]
    return frozenset(ops)


_RANDOM_OPS = _torch_random_ops()
_UNREDIRECTED_OPS = _torch_ops_without_generator()


def _op_name(func: Any) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))


def _draws_on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for arg in itertools.chain(args, kwargs.values()):
        if isinstance(arg, torch.Tensor):
            return arg.device.type == "cpu"
    device = kwargs.get("device")
    if device is None:
        return torch.get_default_device().type == "cpu"
    return torch.device(device).type == "cpu"


class _WorkerGeneratorMode(TorchFunctionMode):
    """Gives random torch ops called without a generator the running worker's generator."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if func in _RANDOM_OPS:
            rngs = _local.current
            given = kwargs.get("generator")
            if rngs is not None and given is None and any(a is _DEFAULT for a in args):
                if _draws_on_cpu(args, kwargs):  # torch.default_generator passed positionally
                    args = tuple(rngs.torch if a is _DEFAULT else a for a in args)
            elif (
                rngs is not None
                and (given is None or given is _DEFAULT)
                and not any(isinstance(a, torch.Generator) for a in args)
            ):
                if _draws_on_cpu(args, kwargs):
                    kwargs = {**kwargs, "generator": rngs.torch}
                else:
                    _warn_once(
                        "device",
                        f"{_op_name(func)} on a non-CPU device in a worker thread draws from "
                        "that device's process-global generator, shared with the training "
                        "thread and the other workers",
                    )
        elif func in _UNREDIRECTED_OPS and _local.current is not None:
            _warn_once(
                _op_name(func),
                f"{_op_name(func)} in a worker thread draws from torch's process-global "
                "generator (it takes no generator argument), shared with the training thread "
                "and the other workers: its draws are not the worker's own",
            )
        return func(*args, **kwargs)


_MODE = _WorkerGeneratorMode()
#: In a worker process ``torch.default_generator`` is that worker's: passed explicitly (as
#: ``random_split`` does by default), a CPU draw gets the worker's generator too.
_DEFAULT = torch.default_generator


# --- the patched module functions (point 1) --------------------------------------------------


def _dispatcher(
    default: Callable[..., Any],
    pick: Callable[[WorkerRNGs], Any],
    module_name: str,
    name_in_module: str,
    name: str | None = None,
) -> Any:
    """A stand-in for ``default``, module ``module_name``'s ``name_in_module``: it calls method
    ``name`` (by default, ``default``'s name) of the running worker's generator that ``pick``
    chooses, and ``default`` outside a worker."""
    name = name or default.__name__

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        rngs = _local.current
        if rngs is None:
            return default(*args, **kwargs)
        return getattr(pick(rngs), name)(*args, **kwargs)

    functools.update_wrapper(dispatch, default)
    # Pickled by reference to the module attribute it replaces (``random.shuffle``), which is
    # this function: the bound method's qualname (``Random.shuffle``) would not find it.
    dispatch.__qualname__ = dispatch.__name__ = name_in_module
    dispatch.__module__ = module_name
    dispatch.__threadloader_dispatch__ = True  # type: ignore[attr-defined]
    return dispatch


def _worker_generator() -> torch.Generator | None:
    rngs = _local.current
    return None if rngs is None else rngs.torch


# torch's seeding functions get these bodies (``install``), run with ``torch.random``'s globals,
# where the names below are injected: every reference to the functions dispatches, including
# ``from torch import manual_seed`` done earlier and the wrapper ``torch._dynamo`` puts around
# ``torch.manual_seed``. Each keeps its original's signature.
# ruff: noqa: F821
def _manual_seed(seed: Any) -> torch.Generator:
    generator = _threadloader_worker_generator()  # type: ignore[name-defined]
    if generator is None:
        return _threadloader_original_manual_seed(seed)  # type: ignore[name-defined]
    return generator.manual_seed(int(seed))


def _seed() -> int:
    generator = _threadloader_worker_generator()  # type: ignore[name-defined]
    if generator is None:
        return _threadloader_original_seed()  # type: ignore[name-defined]
    return generator.seed()


def _initial_seed() -> int:
    generator = _threadloader_worker_generator()  # type: ignore[name-defined]
    if generator is None:
        return _threadloader_original_initial_seed()  # type: ignore[name-defined]
    return generator.initial_seed()


def _get_rng_state() -> torch.Tensor:
    generator = _threadloader_worker_generator()  # type: ignore[name-defined]
    if generator is None:
        return _threadloader_original_get_rng_state()  # type: ignore[name-defined]
    return generator.get_state()


def _set_rng_state(new_state: torch.Tensor) -> None:
    generator = _threadloader_worker_generator()  # type: ignore[name-defined]
    if generator is None:
        _threadloader_original_set_rng_state(new_state)  # type: ignore[name-defined]
    else:
        generator.set_state(new_state)


_TORCH_SEEDING = {
    "manual_seed": _manual_seed,
    "seed": _seed,
    "initial_seed": _initial_seed,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
}


def _patch_torch_seeding() -> None:
    """Give torch's seeding functions the bodies above (their original code kept aside)."""
    module_globals = vars(torch.random)
    module_globals["_threadloader_worker_generator"] = _worker_generator
    for name, replacement in _TORCH_SEEDING.items():
        fn = module_globals[name]
        code = fn.__code__
        if code.co_freevars or code.co_argcount != replacement.__code__.co_argcount:
            raise RuntimeError(
                f"threadloader cannot give worker threads their own torch.{name}: its "
                "implementation changed in this torch version"
            )
        original = types.FunctionType(code, fn.__globals__, name, fn.__defaults__)
        module_globals[f"_threadloader_original_{name}"] = original
        fn.__code__ = replacement.__code__


#: ``numpy.random`` functions that are plain functions calling the legacy global, and the
#: ``RandomState`` method each stands for.
_NUMPY_FUNCTIONS = {"seed": "seed", "ranf": "random_sample", "sample": "random_sample"}
#: ``numpy.random`` functions on the legacy global's bit generator, which ``WorkerRNGs`` provides.
_BIT_GENERATOR_FUNCTIONS = ("get_bit_generator", "set_bit_generator")


def _bound_to(module: Any, instance: object) -> dict[str, Any]:
    """The names in ``module`` that are methods bound to ``instance`` (its module functions)."""
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__self__", None) is instance
    }


def _legacy(rngs: WorkerRNGs) -> np.random.RandomState:
    return rngs.numpy_legacy


def _itself(rngs: WorkerRNGs) -> WorkerRNGs:
    return rngs


def _replace(mtrand: Any, name: str, fn: Any, patched: Any) -> None:
    """Put ``patched`` in ``fn``'s place in ``numpy.random.mtrand``, and in ``numpy.random``."""
    setattr(mtrand, name, patched)
    if getattr(numpy.random, name, None) is fn:
        setattr(numpy.random, name, patched)


def install() -> None:
    """Patch the global RNG functions to dispatch on the calling thread (point 5). Idempotent."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for name, fn in _bound_to(random, random._inst).items():
            setattr(random, name, _dispatcher(fn, lambda r: r.random, "random", name))
        mtrand: Any = numpy.random.mtrand
        functions = {name: (fn, name) for name, fn in _bound_to(mtrand, mtrand._rand).items()}
        for name, method in _NUMPY_FUNCTIONS.items():  # module functions, not bound methods
            if hasattr(mtrand, name) and hasattr(np.random.RandomState, method):
                functions[name] = (getattr(mtrand, name), method)
        for name, (fn, method) in functions.items():
            _replace(mtrand, name, fn, _dispatcher(fn, _legacy, "numpy.random", name, method))
        for name in _BIT_GENERATOR_FUNCTIONS:  # the legacy global's bit generator itself
            fn = getattr(mtrand, name, None)
            if fn is not None:
                _replace(mtrand, name, fn, _dispatcher(fn, _itself, "numpy.random", name))
        _patch_torch_seeding()
        _installed = True
