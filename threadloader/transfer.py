"""``DevicePrefetcher``: move batches to the GPU on a side CUDA stream while the loop computes."""

from threadloader.device.transfer import DevicePrefetcher, Tagged, TransferStats, device_from_arg

__all__ = ["DevicePrefetcher", "Tagged", "TransferStats", "device_from_arg"]
