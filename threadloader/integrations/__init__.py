"""Integrations with training frameworks; each is imported only where its framework is.

- ``lightning``: PyTorch Lightning's worker seeding, a stats-logging callback, Fabric state
  helpers (public as ``threadloader.lightning``).
"""
