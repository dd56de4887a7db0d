"""Measuring one configuration: an instrumented training iteration (CUDA peaks per phase;
saved-for-backward bytes on any device) and a per-module memory log.

The files, one concern each:

- ``step.py``: the instrumented iteration and :func:`measure`.
- ``profile.py``: what it takes and gives: ``Options``, ``Profile``, ``Phase``, ``Timing``.
- ``restore.py``: the model given back as it was after measuring in place.
- ``sizes.py``: the bytes a model's tensors hold.
- ``graphs.py``: a compiled model's CUDA graphs and dynamo's counters.
- ``turns.py``: several models timed in turns, and each module's forward time.
- ``ratios.py``: step-time ratios of plans timed in turns, and when they decide a limit.
- ``modules.py``, ``saved.py``: the per-module log, the bytes saved for backward.
- ``estimate.py``: the CUDA peak predicted on the CPU, ``indices.py`` the index ranges it checks; ``ranks.py``: profiles across ranks.
- ``progress.py``: work in stages counted as each item ends, with the time left.

Example::

    >>> import shrinkwrap as sw
    >>> prof = sw.measure(model, batch)       # one configuration -> Profile
    >>> sw.saved_tensor_bytes(model, x)       # bytes saved for backward, any device
    >>> sw.estimate(make_model, batch, plan)   # the CUDA peak, predicted on the CPU
"""

from .estimate import Estimate, estimate
from .modules import Event, ModuleLog
from .profile import Options, Phase, Profile, Timing
from .saved import SavedTensors, saved_tensor_bytes
from .step import default_loss, measure
from .turns import time_interleaved

__all__ = ["Estimate", "estimate", "Event", "ModuleLog", "Options", "Phase", "Profile", "SavedTensors", "Timing", "default_loss", "measure",
           "saved_tensor_bytes", "time_interleaved"]
