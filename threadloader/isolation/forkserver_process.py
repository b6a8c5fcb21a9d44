"""What tells the forkserver process apart, and what it was started with.

Shared by the modules ``helper_source`` preloads into the forkserver (``forkserver_main``,
``forkserver_exit``, ``forkserver_ready``); importing this one does nothing.
"""

from __future__ import annotations

import ast
import os
import sys
from typing import Any

#: The code ``multiprocessing.forkserver`` starts its server with (``python -c CODE``).
_SERVER_CODE = "from multiprocessing.forkserver import main"


def ready_mark(folder: str, pid: int) -> str:
    """The file the forkserver with this pid creates in ``folder`` once it is ready."""
    return os.path.join(folder, f"forkserver-{pid}.ready")


def in_forkserver() -> bool:
    """Whether this process is a multiprocessing forkserver."""
    return any(_SERVER_CODE in arg for arg in getattr(sys, "orig_argv", ()))


def server_arguments(argv: list[str]) -> dict[str, Any]:
    """The keyword arguments of the ``main(...)`` call in the forkserver's ``-c`` code."""
    if "-c" not in argv[:-1]:
        return {}
    try:
        tree = ast.parse(argv[argv.index("-c") + 1])
    except SyntaxError:
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main":
            found: dict[str, Any] = {}
            for keyword in node.keywords:
                try:
                    value = ast.literal_eval(keyword.value)
                except ValueError:
                    continue
                if keyword.arg is None and isinstance(value, dict):
                    found.update(value)
                elif keyword.arg is not None:
                    found[keyword.arg] = value
            return found
    return {}
