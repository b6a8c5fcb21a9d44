"""Warnings that name the user's line: the first frame outside threadloader and torch's loader.

A warning raised while ``iter()`` or ``next()`` runs inside the loader would otherwise be printed
with one of our modules' lines (or torch's ``dataloader.py``), and filters by module would have
to name ours: ``warn_user`` attributes it to the line of the loop that called into the loader.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch.utils.data

#: Folders whose frames are the loader's own: threadloader's and torch's ``utils/data``.
_LOADER_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (os.path.dirname(os.path.abspath(__file__)), torch.utils.data.__file__)
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first caller outside the loader's code.

    Args:
        message: the warning's text.
        category: its class.
    """
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of warn_user's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LOADER_DIRS):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
