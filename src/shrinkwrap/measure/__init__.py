"""Measuring: saved-for-backward bytes on any device; CUDA peaks per phase."""

from .saved import SavedTensors, saved_tensor_bytes

__all__ = ["SavedTensors", "saved_tensor_bytes"]
