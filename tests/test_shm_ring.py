"""The isolation helper's slot ring: which slot a batch goes into."""

from __future__ import annotations

import os

from threadloader.isolation.shm_ring import RECORD, RingWriter


def test_a_slot_the_training_process_returned_is_reused_before_untouched_ones() -> None:
    """Reusing the slot just given back keeps the shared memory the helper touches to the
    batches in flight. Taking untouched slots first (returns read only once none was free) cost
    +50% peak PSS on 48 MiB tensor batches (664 -> 1,048 MiB, bench_noisy_neighbour)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        ring = RingWriter(lambda segment, fd: None, slots_per_segment=8, mailbox=read_end)
        first = ring.acquire(4096)
        assert first is not None
        for _ in range(3):
            os.write(write_end, RECORD.pack(*first.key))  # the training loop dropped the batch
            again = ring.acquire(4096)
            assert again is not None and again.key == first.key
            first = again
    finally:
        os.close(read_end)
        os.close(write_end)
