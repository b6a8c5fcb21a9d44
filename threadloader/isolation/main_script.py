"""Whether a helper started without ``fork`` would run the training script again.

A process started by ``multiprocessing``'s ``forkserver`` or ``spawn`` imports the parent's
main module as ``__mp_main__`` before it unpickles anything, so that classes defined in the
script can be found. A script without an ``if __name__ == "__main__":`` guard then runs again,
top to bottom, in every such process: it builds its model and loader again and trains a second
time, or fails as it starts processes of its own. torch's workers on Linux are forked by
default, so such scripts are common and work with ``DataLoader``; threadloader only starts
helpers this way where it may not fork (another Python thread runs), and must not then run
the script again.

Only what ``multiprocessing`` itself re-runs counts: a script given by path, or a module run
with ``python -m`` (not a package's ``__main__``), with its source readable. An interactive
session (a notebook), ``python -c``, IPython and a package's ``__main__`` leave nothing to
re-run, and then nothing they define (a dataset class written in a notebook cell) can be
unpickled in such a process either.
"""

from __future__ import annotations

import ast
import functools
import os
import sys

__all__ = ["main_reimported", "unguarded_main_script"]


def unguarded_main_script() -> str | None:
    """The main script, if a helper started with ``forkserver`` or ``spawn`` would run it again.

    Returns:
        The script's path when ``multiprocessing`` would import it in a new process and its
        top level has no ``if __name__ == "__main__":`` block; else None.
    """
    path = main_reimported()
    return None if path is None or _has_main_guard(path) else path


def main_reimported() -> str | None:
    """The file ``multiprocessing`` imports as ``__main__`` in a process it starts with
    ``forkserver`` or ``spawn``; None where it imports none, so that nothing defined in this
    process's ``__main__`` can be unpickled there.

    Returns:
        The absolute path of the main script or ``python -m`` module; None for an interactive
        session, ``python -c``, IPython's launcher or a package's ``__main__``.
    """
    main = sys.modules.get("__main__")
    if main is None:
        return None
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        # ``multiprocessing`` leaves a package's ``__main__`` alone and re-imports a module.
        if name == "__main__" or name.endswith(".__main__"):
            return None
        path = getattr(spec, "origin", None)
    else:
        path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None
    path = os.path.abspath(path)
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None  # multiprocessing skips IPython's launcher, which has no guard
    return path


@functools.cache
def _has_main_guard(path: str) -> bool:
    """Whether the file at ``path`` has an ``if`` testing ``__name__`` against ``"__main__"``
    outside any function or class (also inside a top-level ``try``/``with``, or as one part of
    an ``and``); True where it cannot be read or parsed (then ``multiprocessing`` cannot run it
    either, and says so)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return True
    return any(_guards(node) for node in tree.body)


def _guards(node: ast.stmt) -> bool:
    """``node``, or a statement nested in it outside functions and classes, is a guard."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    if isinstance(node, ast.If) and any(_tests_main(part) for part in ast.walk(node.test)):
        return True
    return any(
        _guards(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)
    )


def _tests_main(test: ast.AST) -> bool:
    """``__name__ == "__main__"`` either way round, or ``__name__ in ("__main__", ...)``."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    left, right = test.left, test.comparators[0]
    if isinstance(test.ops[0], ast.Eq):
        sides = [left, right]
        names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
        constants = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
        return len(names) == 1 and len(constants) == 1
    if isinstance(test.ops[0], ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
        return (
            isinstance(left, ast.Name)
            and left.id == "__name__"
            and any(isinstance(e, ast.Constant) and e.value == "__main__" for e in right.elts)
        )
    return False
