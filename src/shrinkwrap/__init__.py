"""shrinkwrap: cut the GPU memory a PyTorch model needs to train, without editing its source.

Example::

    import shrinkwrap as sw
    plan = sw.Plan([sw.checkpoint(r"layer[12]")])
    model = sw.apply(model, plan)   # in place; returns the same model
    sw.revert(model)                # the original modules again
"""

# The package's face: everything public, imported from the layers below (select -> _rewrite ->
# step -> transforms -> plan -> measure -> report -> processes -> fit -> compare -> autoplan -> cli); no module of
# the package imports this one.
from . import transforms
from ._rewrite import records, revert
from .autoplan import autoplan
from .compare import ProgressBar, plan_report
from .fit import Fit, Probe, fit, trains_under
from .measure import (Estimate, Event, ModuleLog, Options, Phase, Profile, SavedTensors, Timing, estimate, measure,
                      saved_tensor_bytes, time_interleaved)
from .plan import Plan, PlanError, apply
from .report import Report, Row
from .select import SelectionError, select
from .step import Step, registered
from .transforms import *  # noqa: F403  (each family's __all__: steps, apply_* functions, modules)

# Each step also reads as the call its text form writes: sw.checkpoint(...), sw.bn_act().
globals().update({_cls.name: _cls for _cls in registered()})

from ._version import __version__  # noqa: E402

__all__ = [
    "Plan", "PlanError", "Step", "apply", "revert", "records", "select", "SelectionError",
    "measure", "estimate", "Estimate", "Options", "plan_report", "ProgressBar", "Profile", "Phase", "Event", "ModuleLog",
    "Report", "Row", "saved_tensor_bytes", "SavedTensors", "Timing", "time_interleaved", "autoplan", "fit",
    "trains_under", "Fit", "Probe",
    *transforms.__all__,
    *(_cls.name for _cls in registered()),
]
