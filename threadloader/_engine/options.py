"""ThreadDataLoader's own constructor options, kept apart from the attributes of the same names.

torch keeps a loader's arguments as attributes, and so does ``ThreadDataLoader``
(``loader.device``, ``loader.isolation``, ...), for reading. The library reads its options from
``loader._options`` only: a subclass may use one of those names for its own purposes (a
``self.device`` it moves batches to itself), before or after ``super().__init__()``, without
turning the option on or having its value overwritten.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Options", "check_helpers_type", "check_log_every", "options_of"]


@dataclasses.dataclass(frozen=True)
class Options:
    """The options as given to ``ThreadDataLoader(...)`` (see its docstring)."""

    device: Any = None
    device_prefetch: int | None = None
    isolation: str | None = "auto"
    helpers: int | None = None
    log_every_s: float | None = None
    save_worker_rng: bool = False
    snapshot_every_n_steps: int | None = 1

    def mirror_on(self, loader: Any) -> None:
        """Set each option as an attribute of ``loader``, unless the loader has one of that
        name already (a subclass's own, set before ``super().__init__()``)."""
        for field in dataclasses.fields(self):
            if field.name not in vars(loader):
                setattr(loader, field.name, getattr(self, field.name))


def check_log_every(log_every_s: object) -> None:
    """Refuse a ``log_every_s`` that is not None or a positive number of seconds.

    Raises:
        ValueError: zero, a negative, nan, text or a bool.
    """
    if log_every_s is None:
        return
    if (
        isinstance(log_every_s, bool)
        or not isinstance(log_every_s, (int, float))
        or not log_every_s > 0  # nan too
    ):
        raise ValueError(f"log_every_s must be a positive number of seconds, got {log_every_s!r}")


def check_helpers_type(helpers: object) -> None:
    """Refuse a ``helpers`` that is not None or an int (its range depends on the loader).

    Raises:
        TypeError: a float, text or a bool.
    """
    if helpers is not None and (isinstance(helpers, bool) or not isinstance(helpers, int)):
        raise TypeError(f"helpers must be an int, got {type(helpers).__name__}")


#: What a loader without options of its own (torch's) runs with.
DEFAULTS = Options(isolation=None)


def options_of(loader: Any) -> Options:
    """``loader``'s options; the defaults of in-process threads for a loader of torch's."""
    options = getattr(loader, "_options", None)
    return options if isinstance(options, Options) else DEFAULTS
