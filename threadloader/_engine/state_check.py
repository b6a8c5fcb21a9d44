"""How a saved state is checked against the loader it is loaded into, and turned into a ``Resume``.

Every mismatch that would resume at the wrong place (another dataset length, batch size, sampler,
world size without a positional sampler, format version) raises ``ValueError`` naming it;
nothing resumes silently at the wrong place.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data.dataloader import _get_distributed_settings

from threadloader._engine import dataset_state
from threadloader._engine.state import (
    KINDS,
    STATE_VERSION,
    Resume,
    SamplerSnapshot,
    length_of,
    mixture_sampled,
    own_state_sampler,
    positional_sampler,
    rng_source,
    run_out,
    sampler_generator,
    sampler_rank,
    sampler_ranks,
    snapshot_rng,
    type_name,
)


def _check_int(state: Mapping[str, Any], key: str, minimum: int | None = 0) -> None:
    value = state[key]
    if type(value) is not int or (minimum is not None and value < minimum):
        wanted = "an int" if minimum is None else f"an int >= {minimum}"
        raise ValueError(f"loader state {key} must be {wanted}, got {value!r}")


def _check_worker_fields(state: Mapping[str, Any]) -> None:
    """``worker_states``: None or a list of per-worker states, each None or (point 3 of
    ``dataset_state``) ``{"dataset": ..., "iterator": ...}``; the workers' generator states
    (optional): None or a list of ``worker_rng.rng_state`` dicts or None; ``workers_status``:
    None or a list of bools. What a dataset's own ``load_state_dict`` makes of its part is its own."""
    states = state["worker_states"]
    if states is not None and not isinstance(states, list):
        raise ValueError(
            f"loader state worker_states must be a list (a state per worker) or None, got "
            f"{type(states).__name__}"
        )
    if states is not None and state.get("worker_state_form", 1) >= dataset_state.FORM:
        for entry in states:
            if entry is not None and not (
                isinstance(entry, Mapping)
                and set(entry) <= {"dataset", "iterator", "finished", "left", "ended"}
            ):
                raise ValueError(
                    "loader state worker_states entries must be None or "
                    f"{{'dataset': ..., 'iterator': ...}}, got {entry!r}"
                )
    for key in ("worker_rng_states", "worker_rng_states_at_start"):  # optional
        rngs = state.get(key)
        if rngs is not None and (
            not isinstance(rngs, list)
            or not all(
                entry is None or (isinstance(entry, Mapping) and {"random", "torch"} <= set(entry))
                for entry in rngs
            )
        ):
            raise ValueError(
                f"loader state {key} must be a list of worker generator states (each None or "
                f"a dict with 'random' and 'torch') or None, got {_short(rngs)}"
            )
    status = state["workers_status"]
    if status is not None and (
        not isinstance(status, list) or not all(type(alive) is bool for alive in status)
    ):
        raise ValueError(
            f"loader state workers_status must be a list of bools or None, got {status!r}"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _exact_len(loader: Any) -> bool:
    """Whether the loader's index sampler counts its batches exactly: torch's own samplers.
    Others' ``len()`` may be an estimate (bucketing batch samplers), so a position past it may
    still name a batch."""
    samplers = [loader._index_sampler, loader.sampler]
    return all(type(s).__module__ == "torch.utils.data.sampler" for s in samplers)


_REQUIRED = (
    "version",
    "epoch",
    "in_progress",
    "batches_yielded",
    "base_seed",
    "rng_source",
    "rng_state",
    "sampler",
    "sampler_epoch",
    "dataset_kind",
    "dataset_length",
    "num_workers",
    "world_size",
    "worker_states",
    "next_worker",
    "workers_status",
)


def _check_same_batches(loader: Any, state: Mapping[str, Any], positional: bool) -> None:
    """A mid-epoch position counts batches of the saving loader's sampler and batch size.

    ``threadloader.samplers`` save a cursor in samples, so they resume across a change of
    batch size; any other sampler resumes at ``position`` batches of *this* loader, which is the
    same place only with the same batch size. States saved before these keys existed pass.
    """
    saved_type = state.get("sampler_type")
    if saved_type is not None and saved_type != type_name(loader.sampler):
        raise ValueError(
            f"loader state was saved mid-epoch with a {saved_type} sampler, this loader samples "
            f"with {type_name(loader.sampler)}: it would resume somewhere else"
        )
    saved_size = state.get("batch_size", loader.batch_size)
    if saved_size != loader.batch_size and (not positional or state.get("delivered_ahead")):
        raise ValueError(
            f"loader state was saved mid-epoch with batch_size={saved_size}, this loader has "
            f"batch_size={loader.batch_size}: its position counts batches of the other size "
            "(threadloader.samplers resume across a batch size change, unless batches were "
            "delivered out of order before the save)"
        )


def _check_same_replay(loader: Any, state: Mapping[str, Any], world_size: int) -> None:
    """An IterableDataset without ``state_dict`` resumes by replaying each worker's delivered
    batches: they are the same batches only with the same number of workers (0 and 1 count as
    one), batch size and world size (a rank's share of a stream, an ``IterDataPipe`` the loader
    shards by rank).

    Raises:
        ValueError: naming what differs.
    """
    if max(state["num_workers"], 1) != max(loader.num_workers, 1):
        raise ValueError(
            f"loader state was saved with num_workers={state['num_workers']}, this loader has "
            f"num_workers={loader.num_workers}: an IterableDataset without state_dict resumes "
            "by replaying the batches each worker had delivered, and its workers shard it by "
            "their number, so it resumes on the same number of workers"
        )
    saved_size = state.get("batch_size", loader.batch_size)
    if saved_size != loader.batch_size:
        raise ValueError(
            f"loader state was saved mid-epoch with batch_size={saved_size}, this loader has "
            f"batch_size={loader.batch_size}: an IterableDataset without state_dict resumes by "
            "replaying the batches each worker had delivered, which are batches of the other size"
        )
    if state["world_size"] != world_size:
        raise ValueError(
            f"loader state was saved mid-epoch on {state['world_size']} ranks, this run has "
            f"{world_size}: an IterableDataset without state_dict resumes by replaying the "
            "batches each worker had delivered from its rank's share, which another world size "
            "divides differently"
        )


def _ranks(loader: Any, state: Mapping[str, Any], world_size: int) -> tuple[int, int]:
    """How many ranks the saving loader's sampler shared its epoch over, and this loader's:
    the samplers' ``num_replicas`` where they have one (a data-parallel group smaller than the
    world), else torch.distributed's world sizes. A state saved before ``sampler_ranks``
    existed holds a positional sampler's in that sampler's own state."""
    saved = state.get("sampler_ranks")
    if saved is None:
        saved = _sampler_ranks(state.get("sampler"))
        if saved is None:
            return state["world_size"], world_size
    return saved, sampler_ranks(loader, world_size)


def _sampler_ranks(sampler_state: Any) -> int | None:
    """The number of ranks a positional sampler's saved state shares its epoch over, if any."""
    ranks = sampler_state.get("num_replicas") if isinstance(sampler_state, Mapping) else None
    return ranks if type(ranks) is int else None


def _batches_per_epoch(loader: Any) -> float:
    """Batches a replayed map-style epoch holds; infinity where its sampler has no length."""
    try:
        return len(loader._index_sampler)
    except TypeError:
        return float("inf")


def parse_state(loader: Any, state: Mapping[str, Any]) -> Resume:
    """Check ``state`` against ``loader`` and turn it into a pending resume.

    Raises:
        ValueError: the state is not a loader state of this format, or was saved for another
            dataset kind or length, or for a world size / worker count it cannot resume on.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"loader state must be a dict, got {type(state).__name__}")  # noqa: TRY004
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"loader state is missing {missing}: not a ThreadDataLoader state")
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"loader state has format version {state['version']!r}; this threadloader reads "
            f"version {STATE_VERSION}"
        )
    # Types first: nothing (a sampler's epoch, its state) is changed by a state that fails.
    for key in ("epoch", "batches_yielded", "num_workers", "next_worker"):
        _check_int(state, key)
    _check_int(state, "base_seed", minimum=None)
    for key in ("sampler_epoch", "ended_sampler_epoch"):  # ints as the sampler holds them
        epoch = state.get(key)  # ended_sampler_epoch is optional (older states lack it)
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise ValueError(f"loader state {key} must be an int or None, got {epoch!r}")
    _check_worker_fields(state)
    if type(state["in_progress"]) is not bool:
        raise ValueError(f"loader state in_progress must be a bool, got {state['in_progress']!r}")
    kind = KINDS[loader._dataset_kind]
    if state["dataset_kind"] != kind:
        raise ValueError(f"loader state is for a {state['dataset_kind']} dataset, this is {kind}")
    length = length_of(loader.dataset) if kind == "map" else None
    # A MixtureSampler checks each source's length by name; sources may be added at restart.
    if state["dataset_length"] != length and not mixture_sampled(loader):
        raise ValueError(
            f"loader state is for a dataset of length {state['dataset_length']}, "
            f"this dataset has length {length}"
        )
    batches = state["batches_yielded"]  # an int >= 0: checked with the other fields above
    if state["rng_source"] not in ("generator", "global"):
        raise ValueError(f"loader state rng_source {state['rng_source']!r} is not understood")
    if state["rng_source"] != rng_source(loader):
        raise ValueError(
            f"loader state drew its order from the {state['rng_source']} RNG, this loader from "
            f"the {rng_source(loader)} one: pass the same `generator=` (or none) to resume"
        )
    if not isinstance(state["rng_state"], torch.Tensor):
        raise ValueError(  # noqa: TRY004
            "loader state rng_state must be an RNG state (base64 text, or a uint8 tensor)"
        )
    expected_rng = snapshot_rng(loader)[1]
    if state["rng_state"].dtype != expected_rng.dtype or state["rng_state"].shape != (
        expected_rng.shape
    ):
        raise ValueError(
            f"loader state rng_state is a {state['rng_state'].dtype} tensor of shape "
            f"{tuple(state['rng_state'].shape)}, not a {state['rng_source']} RNG state "
            f"({expected_rng.dtype}, {tuple(expected_rng.shape)})"
        )
    # Point 7; states saved before these keys existed resume at their batch count.
    if "position" in state:
        _check_int(state, "position")
    position = state.get("position", batches)
    skips = state.get("delivered_ahead") or []
    if (
        not isinstance(skips, list)
        or not all(type(p) is int for p in skips)
        or skips != sorted(set(skips))
        or (skips and skips[0] < position)
    ):
        raise ValueError(
            f"loader state position {position!r} / delivered_ahead {skips!r} are not a position "
            "and the sorted positions from it on"
        )
    positional = positional_sampler(loader)
    world_size, dist_rank = _get_distributed_settings()
    stateful_sampler = own_state_sampler(loader) if kind == "map" else None
    # _state point 11: a sampler with its own state resumes itself at the saved position, or
    # after running out the pass its state is of (before a pass's first batch, between epochs).
    own_state = state.get("sampler") if stateful_sampler is not None else None
    own_ended = own_state is not None and state.get("sampler_ended") is True
    if not state["in_progress"] and not own_ended:
        own_state = None
    # A map-style sampler replayed from RNG states (_state point 3), with positions to replay.
    replayed = kind == "map" and positional is None and own_state is None
    replay_indices = replayed and (position > 0 or bool(skips))
    if stateful_sampler is not None and replay_indices and position > 0:
        warnings.warn(
            f"loader state holds no state of this loader's {type(stateful_sampler).__name__}, "
            "which has state_dict()/load_state_dict(): the resumed order is the sampler's "
            "replayed from the saved torch RNG states, which differs from an uninterrupted "
            "run's where the sampler draws from another source (Python's random, numpy)",
            stacklevel=3,
        )
    if state["in_progress"] and kind == "map":
        _check_same_batches(loader, state, positional is not None)
        if positional is None and _exact_len(loader) and position > _batches_per_epoch(loader):
            raise ValueError(
                f"loader state position {position} is past the end of this loader's epoch "
                f"({_batches_per_epoch(loader)} batches)"
            )
    out_of_order = bool(skips) or state.get("in_order") is False  # optional: older states
    if out_of_order and state["in_progress"] and positional is not None:
        # Any rank's state may hold batches delivered ahead, this one's or its siblings': the
        # ranks' cursors differ, and no one rank's state says where the others got to.
        saved_ranks, ranks = _ranks(loader, state, world_size)
        if saved_ranks != ranks:
            raise ValueError(
                f"loader state was saved on {saved_ranks} ranks from a loader delivering batches "
                f"as completed (in_order=False), this run has {ranks}: each rank's batches "
                "delivered ahead belong to its share of the epoch, and its state does not say "
                "where the other ranks got to. Resume on the same number of ranks, or save from "
                "a loader with in_order=True to resume on another"
            )
    # The rank whose share the state's positions are in: its sampler's where it has one (a
    # state without that key holds torch.distributed's only).
    if "sampler_rank" in state:
        saved_rank, rank = state["sampler_rank"], sampler_rank(loader, dist_rank)
    else:
        saved_rank, rank = state.get("rank"), dist_rank
    delivered = batches > 0 or bool(skips)  # ranks in lockstep: none delivered any before
    if (
        out_of_order
        and state["in_progress"]
        and delivered
        and type(saved_rank) is int
        and saved_rank != rank
    ):
        # Ranks in lockstep reach the same position, so in order any rank's state resumes any
        # rank; as completed, each rank's delivered batches (and position) are its own.
        raise ValueError(
            f"loader state was saved by rank {saved_rank} from a loader delivering batches as "
            f"completed (in_order=False), this is rank {rank}: the batches it delivered ahead "
            f"are in rank {saved_rank}'s share of the epoch, and its state does not say where "
            f"rank {rank} got to. Load each rank's own state, or save from a loader with "
            "in_order=True to resume from any rank's"
        )
    saved_ranks, ranks = _ranks(loader, state, world_size)
    if replay_indices and saved_ranks != ranks:
        raise ValueError(
            f"loader state was saved with its sampler sharing the epoch over {saved_ranks} "
            f"ranks, this loader's shares it over {ranks} ranks: only threadloader.samplers "
            "passed as sampler= resume on another world size; a replayed sampler (one inside a "
            "batch_sampler too) would resume at the wrong place"
        )
    if positional is not None and state["sampler"] is None:
        raise ValueError("loader state has no sampler state, but this loader's sampler needs one")
    worker_states = state["worker_states"]
    form = state.get("worker_state_form", 1)  # optional: older states held raw dataset states
    if form == 1 and not (kind == "iterable" and dataset_state.is_stateful(loader.dataset)):
        worker_states = None
    stateful_iterable = kind == "iterable" and worker_states is not None
    replay_data = kind == "iterable" and not stateful_iterable and batches > 0
    expected = max(loader.num_workers, 1)
    if replay_data and state["in_progress"]:
        _check_same_replay(loader, state, world_size)
    workers_or_none = (state["num_workers"] > 0) != (loader.num_workers > 0)
    if stateful_iterable and not state["in_progress"] and workers_or_none:
        # A worker's copy ends its epoch where its last batch left it, the training process's
        # dataset rewinds as its iterator ends: the one state means something else in each.
        warnings.warn(
            f"loader state was saved between epochs with num_workers={state['num_workers']}, "
            f"this loader has num_workers={loader.num_workers}: the IterableDataset's state at "
            "an epoch's end is a worker copy's in one and the dataset's own in the other, so "
            "the dataset starts from its own state",
            stacklevel=3,
        )
        worker_states = None
    if worker_states is not None and len(worker_states) != expected:
        if stateful_iterable and state["in_progress"]:
            raise ValueError(
                f"loader state holds {len(worker_states)} IterableDataset worker states, this "
                f"loader has num_workers={loader.num_workers}: an IterableDataset resumes on "
                "the same number of workers"
            )
        warnings.warn(
            f"loader state holds the dataset states of {len(worker_states)} workers, this "
            f"loader has num_workers={loader.num_workers}: each worker's copy of the dataset "
            "keeps its own state",
            stacklevel=3,
        )
        worker_states = None
    global_rng_state = _global_rng(state, "global_rng_state")
    _global_rng(state, "global_rng_at_save")
    digest = state.get("global_rng_mark")  # optional, as global_rng_at_save
    if digest is not None and not (
        isinstance(digest, str) and len(digest) == 32 and all(c in _HEX for c in digest)
    ):
        raise ValueError(f"loader state global_rng_mark {digest!r} is not a 32-digit hex digest")
    iter_rng_state = _global_rng(state, "iter_rng_state")
    sampler_rng_state = state.get("sampler_rng_state")  # optional, as global_rng_state
    own = sampler_generator(loader)
    if sampler_rng_state is not None and (
        not isinstance(sampler_rng_state, torch.Tensor) or sampler_rng_state.dtype != torch.uint8
    ):
        raise ValueError("loader state sampler_rng_state is not a generator state")
    if sampler_rng_state is not None and own is None:
        warnings.warn(
            "loader state holds the state of its sampler's own generator, and this loader's "
            "sampler has none: the resumed order follows this loader's sampler (pass the same "
            "sampler, e.g. a RandomSampler with generator=, to resume the saved order)",
            stacklevel=3,
        )
        sampler_rng_state = None
    if own is not None and sampler_rng_state is not None and not state["in_progress"]:
        own.set_state(sampler_rng_state)  # the next epoch draws from it, as it would have
    rng_states = state.get("worker_rng_states")  # optional: states saved without it resume
    if replay_data:
        # The replayed batches draw again from the generators the epoch began with, which
        # brings them to the saved states by themselves: restoring those first would advance
        # them twice (_state point 10). Freshly seeded ones, unless the state says otherwise.
        rng_states = state.get("worker_rng_states_at_start")  # optional, as worker_rng_states
        if rng_states is not None and (
            not isinstance(rng_states, list) or len(rng_states) != loader.num_workers
        ):
            rng_states = None
    elif rng_states is not None and len(rng_states) != loader.num_workers:
        warnings.warn(
            f"loader state holds the generators of {len(rng_states)} workers, this loader has "
            f"{loader.num_workers}: the workers' own generators start fresh (seeded), so random "
            "draws from them differ from an uninterrupted run",
            stacklevel=3,
        )
        rng_states = None
    epoch = state["sampler_epoch"]
    if epoch is not None and callable(getattr(loader.sampler, "set_epoch", None)):
        # Trainers (Lightning) may call iter() before set_epoch() on resume, and the workers'
        # first indices are drawn at iter(): the sampler must already be in the saved epoch.
        loader.sampler.set_epoch(epoch)
    if positional is not None:
        positional[0].load_state_dict(state["sampler"])
    own_snapshot = None
    if stateful_sampler is not None and own_state is not None:
        own_snapshot = SamplerSnapshot.of(own_state)  # before the sampler holds the dict
        stateful_sampler.load_state_dict(own_state)
        if own_ended:
            run_out(stateful_sampler)
    return Resume(
        batches=batches,
        base_seed=int(state["base_seed"]),
        rng_source=state["rng_source"],
        rng_state=state["rng_state"],
        replay_indices=replay_indices,
        replay_data=replay_data,
        worker_states=worker_states,
        worker_state_form=form,
        # The round robin resumes only on as many workers as the state's (_state point 9).
        next_worker=int(state["next_worker"]) if state["num_workers"] == loader.num_workers else 0,
        workers_status=state["workers_status"] if stateful_iterable else None,
        rng_states=list(rng_states) if rng_states is not None else None,
        position=position if kind == "map" else batches,
        skips=tuple(skips) if kind == "map" else (),
        global_rng_state=global_rng_state if state["rng_source"] == "generator" else None,
        sampler_rng_state=sampler_rng_state if state["in_progress"] else None,
        # Also before its first index is behind (_state point 2).
        iter_rng_state=iter_rng_state if state["in_progress"] and replayed else None,
        indices_drawn=state.get("indices_drawn") is not False,  # optional: older states drew
        worker_batches=_worker_batches(state, batches) if replay_data else None,
        own_sampler_state=own_snapshot,
        own_sampler_ended=own_ended,
    )


_HEX = frozenset("0123456789abcdef")


def _global_rng(state: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """A saved state of torch's global RNG (optional, as ``worker_rng_states``).

    Raises:
        ValueError: it is not one.
    """
    saved = state.get(key)
    if saved is not None and (
        not isinstance(saved, torch.Tensor)
        or saved.dtype != torch.uint8
        or saved.shape != torch.get_rng_state().shape
    ):
        raise ValueError(f"loader state {key} is not a torch global RNG state")
    return saved


def _worker_batches(state: Mapping[str, Any], batches: int) -> list[int] | None:
    """The results received from each worker: batches, and the errors the loop was raised
    (optional: older states replay in order).

    Raises:
        ValueError: not a list of counts >= 0 adding up to ``batches_yielded`` at least.
    """
    counts = state.get("worker_batches")
    if counts is None:
        return None
    if (
        not isinstance(counts, list)
        or not all(type(n) is int and n >= 0 for n in counts)
        or sum(counts) < batches
    ):
        raise ValueError(
            f"loader state worker_batches {counts!r} is not a count per worker adding up to "
            f"batches_yielded ({batches}) at least"
        )
    return list(counts)
