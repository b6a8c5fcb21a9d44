"""The forkserver's import of the main script, as each of its helpers would import it.

multiprocessing's forkserver imports the main script itself when ``"__main__"`` is among its
preloads and it is given the script's path. Python 3.11 to 3.13 never give it (the preparation
data names it ``init_main_from_path``; the server reads ``main_path``), and the server's
``sys.path`` is not the training process's (``python scripts/train.py`` puts ``scripts`` first),
so each helper imports the script again, its imports included: seconds per helper for a script
that imports a large library. ``helper_source`` preloads this module in place of ``"__main__"``
and passes the path as ``main_path`` (beside ``sys_path``, which the server receives too).

Imported in the forkserver, it puts the training process's ``sys.path`` in place and imports
the script as ``__mp_main__``, as each helper would; helpers forked from the server then find
it imported. If that import fails, nothing is left half-done and each helper imports the script
itself, as without this module. Imported in any other process, it does nothing.

Nothing else in threadloader imports this module (``forkserver_ready`` says why).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import sys

from threadloader.isolation.forkserver_process import in_forkserver, server_arguments


def _import_main() -> None:
    given = server_arguments(list(getattr(sys, "orig_argv", ())))
    main_path, sys_path = given.get("main_path"), given.get("sys_path")
    if not isinstance(main_path, str):
        return
    if getattr(sys.modules.get("__main__"), "__file__", None) == main_path:
        return  # imported already (the server did, with "__main__" among its preloads)
    if isinstance(sys_path, list):
        sys.path[:] = [entry for entry in sys_path if isinstance(entry, str)]
    process = multiprocessing.current_process()
    process._inheriting = True  # type: ignore[attr-defined]  # as multiprocessing marks it
    try:
        multiprocessing.spawn.import_main_path(main_path)
    except Exception:  # noqa: BLE001, S110  # each helper imports the script, and says why
        pass
    finally:
        del process._inheriting  # type: ignore[attr-defined]


if in_forkserver():
    _import_main()
