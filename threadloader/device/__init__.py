"""The host-to-device path: pinned memory, a staging pool, and a CUDA-stream transfer thread.

A batch is collated straight into page-locked memory (``pinned``; datasets that gather a whole
batch at once hand their buffers over through ``gathered``), staged in buffers recycled from a
pool once their copy finished (``buffer_pool``, ``recycle``), and copied to the GPU on a side
stream by one thread (``transfer``; ``copier`` issues the copies, ``handoff`` bounds what is
ahead) while the training loop computes.
"""
