"""shrinkwrap: cut the GPU memory a PyTorch model needs to train, without editing its source.

Example::

    import shrinkwrap as sw
    plan = sw.Plan([sw.checkpoint(r"layer[12]")])
    model = sw.apply(model, plan)   # in place; returns the same model
    sw.revert(model)                # the original modules again
"""

# The package's face: everything public, imported from the layers below (select -> _rewrite ->
# step -> transforms -> plan -> measuring -> report -> processes -> fit -> compare -> autoplan -> cli); no module of
# the package imports this one.
import builtins as _builtins

from . import transforms
from ._rewrite import records, revert
from .autoplan import autoplan
from .compare import ProgressBar, plan_report
from .fit import Fit, Probe, fit, trains_under
from .measuring import (Estimate, Event, ModuleLog, Options, Phase, Profile, SavedTensors, Timing, estimate, measure,
                      saved_tensor_bytes, time_interleaved)
from .plan import Plan, PlanError, apply
from .report import Report, Row
from .select import SelectionError, select
from .step import Step, registered

# One public name a step: the call its text form writes, sw.checkpoint(...), sw.bn_act(). The class
# (Checkpoint, BnAct) is imported from its family module: shrinkwrap.transforms.checkpoint.Checkpoint.
_CALLS = {_cls.name: _cls for _cls in registered()}
_EXPORTS = [_name for _name in transforms.__all__ if getattr(transforms, _name) not in _CALLS.values()]
globals().update({_name: getattr(transforms, _name) for _name in _EXPORTS})  # apply_* functions, modules
globals().update(_CALLS)

from ._version import __version__  # noqa: E402

__all__ = [
    "Plan", "PlanError", "Step", "apply", "revert", "records", "select", "SelectionError",
    "measure", "estimate", "Estimate", "Options", "plan_report", "ProgressBar", "Profile", "Phase", "Event", "ModuleLog",
    "Report", "Row", "saved_tensor_bytes", "SavedTensors", "Timing", "time_interleaved", "autoplan", "fit",
    "trains_under", "Fit", "Probe",
    *_EXPORTS,
    # A call name that is also one of Python's builtins (compile) stays out: `from shrinkwrap import *`
    # would rebind it. It is written shrinkwrap.compile(...), as in a plan's text.
    *(_name for _name in _CALLS if not hasattr(_builtins, _name)),
]

_CLASS_NAMES = {_cls.__name__: _cls for _cls in registered()}


def __getattr__(name: str):
    # A step's class name (sw.Checkpoint) is not a second public name; say which one is.
    if name in _CLASS_NAMES:
        cls = _CLASS_NAMES[name]
        raise AttributeError(f"shrinkwrap: a step has one public name, its call: sw.{cls.name}(...). The class is "
                             f"{cls.__module__}.{name}.")
    raise AttributeError(f"module 'shrinkwrap' has no attribute {name!r}")
