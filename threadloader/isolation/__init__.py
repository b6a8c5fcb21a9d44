"""``isolation="process"``: the worker threads run in helper processes (``helpers=P``).

The training process keeps the sampler, dispatch, order, seeds and state (``parent``, its
handles on the helpers in ``link``); each helper (``helper``), forked from the training process
when it runs one Python thread, else from the zygote (``zygote``) or a forkserver, runs its share of the worker threads on the tasks it is sent (``task_board``)
and packs each batch into a slot of a shared-memory ring (``shm_ring``, ``packing``) that the
training process maps and reads without a copy (``ring_reader``).
"""
