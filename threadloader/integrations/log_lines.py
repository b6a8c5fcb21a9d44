"""The ``threadloader`` logger's lines on stderr, for ``run --log-every`` and its children."""

from __future__ import annotations

import logging
import sys

__all__ = ["log_to_stderr"]


def log_to_stderr() -> None:
    """Show the ``threadloader`` logger's INFO lines (``log_every_s``) unless the script set it up."""
    logger = logging.getLogger("threadloader")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
