"""Measuring one configuration: an instrumented training iteration (CUDA peaks per phase;
saved-for-backward bytes on any device) and a per-module memory log.

Example::

    >>> import shrinkwrap as sw
    >>> prof = sw.measure(model, batch)       # one configuration -> Profile
    >>> sw.saved_tensor_bytes(model, x)       # bytes saved for backward, any device
    >>> sw.estimate(make_model, batch, plan)   # the CUDA peak, predicted on the CPU
"""

from .estimate import Estimate, estimate
from .modules import Event, ModuleLog
from .saved import SavedTensors, saved_tensor_bytes
from .step import Options, Phase, Profile, Timing, default_loss, measure, time_interleaved

__all__ = ["Estimate", "estimate", "Event", "ModuleLog", "Options", "Phase", "Profile", "SavedTensors", "Timing", "default_loss", "measure",
           "saved_tensor_bytes", "time_interleaved"]
