"""Integrations with training frameworks; each is imported only where its framework is.

- ``lightning``: PyTorch Lightning's worker seeding, a stats-logging callback, Fabric state
  helpers (public as ``threadloader.lightning``).
- ``patch``: ``threadloader.patch()``: code that builds torch's DataLoader, directly or inside a
  library, builds a ThreadDataLoader (always imported: ``threadloader.patch`` is public).
- ``run``: ``python -m threadloader run SCRIPT``: a script run as python runs it, patched.
- ``accelerate``: ``Accelerator.prepare`` / ``skip_first_batches`` keep a ThreadDataLoader's
  threads, and ``save_state`` / ``load_state`` its state.
"""
