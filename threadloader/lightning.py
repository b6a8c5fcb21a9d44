"""PyTorch Lightning: worker seeding, a callback that logs the loader's stats, Fabric state helpers.

Imported only where Lightning is installed; ``import threadloader`` never imports it.
"""

from threadloader.integrations.lightning import (
    ThreadLoaderMonitor,
    fabric_load_state_dict,
    fabric_state_dict,
)

__all__ = ["ThreadLoaderMonitor", "fabric_load_state_dict", "fabric_state_dict"]
