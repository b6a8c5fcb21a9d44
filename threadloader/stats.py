"""Where the time goes: ``LoaderStats``, what ``ThreadDataLoader.stats()`` returns."""

from threadloader._engine.stats import LoaderStats, StageStats

__all__ = ["LoaderStats", "StageStats"]
