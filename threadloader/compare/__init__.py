"""``python -m threadloader compare``: ThreadDataLoader against other loaders, on your dataset.

``inputs`` parses the options and builds the dataset (a built-in one from ``workloads`` or
yours), ``runner`` runs every loader on it and measures (``results``), ``report`` prints the table, JSON and
plot, and ``memory_probe`` samples the PSS of the process tree while a loader runs.
"""
