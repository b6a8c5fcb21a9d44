"""The forkserver's import of the main script, as each of its helpers would import it.

multiprocessing's forkserver imports the main script itself when ``"__main__"`` is among its
preloads and it is given the script's path. Python 3.11 to 3.13 never give it (the preparation
data names it ``init_main_from_path``; the server reads ``main_path``), and the server's
``sys.path`` is not the training process's (``python scripts/train.py`` puts ``scripts`` first),
so each helper imports the script again, its imports included: seconds per helper for a script
that imports a large library. ``helper_source`` preloads this module in place of ``"__main__"``
and passes the path as ``main_path`` (beside ``sys_path``, which the server receives too).

Imported in the forkserver, it imports the script (or the module run with ``python -m``) as
``__mp_main__`` as a helper's start would: with the training process's ``sys.path`` and
``sys.argv`` (``helper_source`` passes them with the path or name) and a process name other than
``"MainProcess"``. Helpers forked from the server then find
it imported. If the import fails (whatever it raises, ``SystemExit`` included), ``sys.path`` is
put back and each helper imports the script itself, as without this module. What the script's
top level does outside its ``if __name__ == "__main__":`` block runs in the server, once: a
thread started there would be copied, stopped, into every helper forked from it. Imported in any
other process, it does nothing.

Nothing else in threadloader imports this module (``forkserver_ready`` says why).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.spawn
import sys

from threadloader.isolation.forkserver_process import in_forkserver, server_arguments

#: The process name the script sees while the forkserver imports it.
SERVER_NAME = "threadloader-forkserver"


def _import_main() -> None:
    given = server_arguments(list(getattr(sys, "orig_argv", ())))
    script, sys_path = given.get("main_path"), given.get("sys_path")
    if not isinstance(script, dict):
        return  # not from helper_source (no arguments to run the script with): import nothing
    main_path, name, argv = script.get("path"), script.get("name"), script.get("argv")
    if not isinstance(argv, list):
        return
    main = sys.modules.get("__main__")
    if isinstance(main_path, str):
        if getattr(main, "__file__", None) == main_path:
            return  # imported already
        run = functools.partial(multiprocessing.spawn.import_main_path, main_path)
    elif isinstance(name, str):
        if getattr(getattr(main, "__spec__", None), "name", None) == name:
            return  # imported already
        # What a helper's start runs for it (and skips once the server has run it).
        fixup = multiprocessing.spawn._fixup_main_from_name  # type: ignore[attr-defined]
        run = functools.partial(fixup, name)
    else:
        return
    process = multiprocessing.current_process()
    saved = list(sys.path), list(sys.argv), process.name
    if isinstance(sys_path, list):
        sys.path[:] = [entry for entry in sys_path if isinstance(entry, str)]
    # As a helper's start sets them before it imports the script: the training process's
    # arguments (a script may parse them at its top level) and a name that is not the main
    # process's (a script may guard its work with it).
    sys.argv[:] = [str(arg) for arg in argv]
    process.name = SERVER_NAME
    process._inheriting = True  # type: ignore[attr-defined]  # as multiprocessing marks it
    try:
        run()
    except BaseException:  # noqa: BLE001  # even SystemExit: each helper imports the script
        sys.path[:] = saved[0]
    finally:
        del process._inheriting  # type: ignore[attr-defined]
        sys.argv[:], process.name = saved[1], saved[2]


if in_forkserver():
    _import_main()
