"""Measuring: one instrumented training step (CUDA peaks per phase; saved-for-backward bytes on
any device), a plan's baseline and steps side by side, and a per-module memory log.

Example::

    >>> import shrinkwrap as sw
    >>> prof = sw.measure(model, batch)                      # one configuration -> Profile
    >>> report = sw.Plan([sw.checkpoint("layer1")]).measure(make_model, batch)   # -> Report
"""

from .compare import plan_report
from .modules import Event, ModuleLog
from .saved import SavedTensors, saved_tensor_bytes
from .step import Phase, Profile, default_loss, measure

__all__ = [
    "Event",
    "ModuleLog",
    "Phase",
    "Profile",
    "SavedTensors",
    "default_loss",
    "measure",
    "plan_report",
    "saved_tensor_bytes",
]
