"""Close every live thread owner before the interpreter joins its threads.

``threading._register_atexit`` runs its callbacks inside ``threading._shutdown()``, *before*
the interpreter joins non-daemon threads; a plain ``atexit`` hook runs after that join, i.e. too
late to matter. Private API (bpo-39812), pinned by tests/test_shutdown.py. One hook serves every
owner: worker pools, transfer stages, remote read pools.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def _close_all() -> None:
    for owner in list(_live):
        owner.close()


def track(owner: Closable) -> None:
    """Close ``owner`` at interpreter exit unless it was closed (or collected) before."""
    global _registered
    with _lock:
        if not _registered:
            threading._register_atexit(_close_all)  # type: ignore[attr-defined]
            _registered = True
        _live.add(owner)


def untrack(owner: Closable) -> None:
    """``owner`` closed itself: nothing to do for it at exit."""
    _live.discard(owner)
