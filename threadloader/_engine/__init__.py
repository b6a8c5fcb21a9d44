"""One epoch: from the sampler's indices to the batches the training loop receives.

Data flow::

    sampler / batch_sampler -> dispatch -> worker threads -> in-order delivery -> training loop
                               (dispatch)  (workers, fetch)   (dispatch)
                                                                  \\-> device_epoch (device=)

- ``threaded`` is the iterator with worker threads, ``inline`` the one for ``num_workers=0``;
  both deliver through ``dispatch`` (torch's round-robin and reorder rules).
- ``workers`` owns the worker threads and ``tasks`` is what they are sent and return. Each
  ``worker`` enters its own ``worker_info`` (what torch's ``get_worker_info()`` answers),
  ``worker_rng`` seeds and ``dataset_copy``, and ``fetch`` makes and collates a batch;
  ``worker_threads`` makes threads its items start part of it; ``worker_handles`` are what
  ``iter(loader)._workers`` shows of them. ``options`` holds the loader's own options.
- ``state``, ``state_codec`` and ``dataset_state`` are what ``state_dict()`` holds and how an
  epoch resumes from it, ``state_check`` how a loaded state is checked; ``stats`` is what
  ``stats()`` reports.
- ``device_epoch`` hands an epoch's host batches to ``threadloader.device``'s transfer stage.
"""
