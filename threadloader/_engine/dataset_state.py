"""A worker's dataset state, as torchdata's StatefulDataLoader saves and restores it.

torchdata's protocol (``Stateful``: an object with ``state_dict()`` and ``load_state_dict()``);
where the code disagrees with these points, the code is wrong:

1. After each batch a worker delivers, the loader keeps that worker's state: its dataset's
   ``state_dict()`` (map-style or iterable), and for an ``IterableDataset`` the state of the
   iterator its ``__iter__`` returned, when that iterator is stateful. A dataset whose
   ``__iter__`` returns itself is saved as the iterator.
2. On resume, in this order (StatefulDataLoader's): the dataset's state is loaded, then the
   epoch's ``iter(dataset)`` is called, then the iterator's state is loaded. So a dataset that
   resets its position inside ``__iter__`` gets it back afterwards.
3. A state is ``{"dataset": ..., "iterator": ...}`` per worker (either may be None), with
   ``"finished": True`` when it is where the last epoch left a persistent worker's copy (the
   worker has delivered nothing in the current epoch yet; ``"left": True`` too when the loop
   left that epoch before the worker's iterator ended), and ``"ended": True`` when the
   iterator raised ``StopIteration`` while its batch was filled (a last, partial batch): it
   already ran to its end, as StatefulDataLoader's ``fetcher_ended``. A loader state saved before this
   form held the dataset's raw state per worker, loaded before ``iter()``; ``restore_dataset``
   still takes it (``form`` 1).
4. A state taken between epochs without workers holds the loader's own dataset as the
   finished epoch left it; loading it puts the dataset there (``settle_dataset``: dataset
   state, ``iter()``, iterator state), and the next epoch calls ``iter()`` anew, as
   StatefulDataLoader starts a new epoch after resuming a finished one. So does each
   persistent worker's copy, from a state taken between epochs of persistent workers, whose
   restored iterator is then run to its end (``run_to_end``), as StatefulDataLoader's
   persistent workers do, unless the loop left that epoch first (``"left"``): the worker
   dropped that iterator where it stood, so it is only restored; and the copy of a worker whose
   IterableDataset had ended when a mid-epoch state was taken, whose next epoch must not start
   where the loaded state left it.
"""

from __future__ import annotations

import copy
from typing import Any

#: The form of the per-worker states a loader state holds (point 3); 1: raw dataset states.
FORM = 2


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows the ``Stateful`` protocol."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def tracked(dataset: Any, iterable: bool) -> bool:
    """Whether a loader snapshots ``dataset``'s state after each batch (point 1): a stateful
    dataset, and any IterableDataset (its iterator may be stateful, known only once iterated)."""
    return iterable or is_stateful(dataset)


def snapshot(dataset: Any, iterator: Any, ended: bool = False) -> dict[str, Any] | None:
    """A worker's state now (point 1): None when neither part is stateful.

    Args:
        dataset: the worker's dataset (its copy).
        iterator: the epoch's ``iter(dataset)`` for an IterableDataset, else None.
        ended: the iterator raised ``StopIteration`` (point 3).
    """
    dataset_state = iterator_state = None
    if iterator is not None and iterator is dataset:
        if is_stateful(dataset):
            iterator_state = copy.deepcopy(dataset.state_dict())
    else:
        if is_stateful(dataset):
            dataset_state = copy.deepcopy(dataset.state_dict())
        if iterator is not None and is_stateful(iterator):
            iterator_state = copy.deepcopy(iterator.state_dict())
    if dataset_state is None and iterator_state is None:
        return None
    if ended:
        return {"dataset": dataset_state, "iterator": iterator_state, "ended": True}
    return {"dataset": dataset_state, "iterator": iterator_state}


def restore_dataset(dataset: Any, state: Any, form: int) -> None:
    """Load a worker state's dataset part, before the epoch's ``iter(dataset)`` (point 2)."""
    if state is None:
        return
    if form < FORM:
        dataset.load_state_dict(state)
    elif state.get("dataset") is not None:
        dataset.load_state_dict(state["dataset"])


def settle_dataset(dataset: Any, state: Any, form: int, iterable: bool, run_out: int) -> None:
    """Put a dataset where a finished epoch left it (point 4).

    With ``run_out`` > 0 (persistent workers' copies, as StatefulDataLoader's persistent
    workers do), an IterableDataset's restored iterator is run to its end (``run_to_end``,
    asking ``run_out`` items at most). With 0 (the loader's own dataset, ``num_workers=0``)
    the iterator is only restored, as StatefulDataLoader does there.
    """
    restore_dataset(dataset, state, form)
    if not iterable or state is None:
        return
    iterator = iter(dataset)
    restore_iterator(iterator, state, form)
    if run_out and not ran_out(state):
        run_to_end(iterator, run_out)


def finished(state: Any, left: bool = False) -> Any:
    """``state``, marked as where the last epoch left the copy (point 3): a resume settles it
    (``settle_dataset``) instead of restoring an iterator of the current epoch.

    Args:
        state: the worker's last state in that epoch.
        left: the loop left that epoch before the worker's iterator ended (a ``break``): the
            worker dropped the iterator where it stood, so a resume must not run it to its end.
    """
    if state is None or not isinstance(state, dict):
        return state
    return {**state, "finished": True, "left": True} if left else {**state, "finished": True}


def was_left(state: Any) -> bool:
    """Whether ``state`` is marked by ``finished(left=True)``."""
    return isinstance(state, dict) and state.get("left") is True


def is_finished(state: Any) -> bool:
    """Whether ``state`` is marked by ``finished``."""
    return isinstance(state, dict) and state.get("finished") is True


def ran_out(state: Any) -> bool:
    """Whether ``state`` was taken once its iterator had raised ``StopIteration`` (point 3):
    no ``run_to_end`` then, which would take the next epoch's first item."""
    return isinstance(state, dict) and state.get("ended") is True


def run_to_end(iterator: Any, most: int = 1) -> None:
    """Ask a restored iterator at its epoch's end for items until it raises ``StopIteration``,
    ``most`` at the most: what its worker did after its last delivered batch.

    A ``__iter__`` written as a generator takes a loaded state in only once it runs (Hugging
    Face's streams: "start at this example at the next ``iter()``"); without the run, its next
    epoch would start at the end of this one, and be empty. The items it yields are dropped:
    with ``drop_last``, the worker's partial last batch (``most`` is then the batch size).
    """
    for _ in range(max(1, most)):
        if next(iterator, _END) is _END:
            return


_END = object()


def restore_iterator(iterator: Any, state: Any, form: int) -> None:
    """Load a worker state's iterator part, after the epoch's ``iter(dataset)`` (point 2)."""
    if state is None or form < FORM or state.get("iterator") is None or iterator is None:
        return
    iterator.load_state_dict(state["iterator"])
