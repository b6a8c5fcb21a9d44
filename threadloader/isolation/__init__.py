"""``isolation="process"``: the worker threads run in a helper process.

The training process keeps the sampler, dispatch, order, seeds and state (``parent``, its
handle on the helper in ``link``); the helper (``helper``), forked from a forkserver that has
already imported torch, runs the same worker threads on the tasks it is sent (``task_board``)
and packs each batch into a slot of a shared-memory ring (``shm_ring``, ``packing``) that the
training process maps and reads without a copy (``ring_reader``).
"""
