"""Primitives every layer uses; they import nothing else from threadloader.

- ``gate`` limits how many threads fetch at once; ``concurrency`` sets that limit from the
  measured throughput.
- ``queues``: the bounded hand-offs between threads.
- ``finalizers`` and ``exit_hook``: owners that join their threads on collection and before the
  interpreter exits, without ever losing a Ctrl-C.
- ``timing``: per-thread stage recorders behind ``stats()``.
- ``worker_globals``: torch's, ``random``'s and ``numpy.random``'s global RNGs, answered per
  thread, so a worker thread draws from its own generators as a worker process would.
"""
