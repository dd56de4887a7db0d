"""shrinkwrap: cut the GPU memory a PyTorch model needs to train, without editing its source.

Example::

    import shrinkwrap as sw
    plan = sw.Plan([sw.checkpoint(r"layer[12]")])
    model = sw.apply(model, plan)   # in place; returns the same model
    sw.revert(model)                # the original modules again
"""

from ._rewrite import records, revert
from .measure import SavedTensors, saved_tensor_bytes
from .plan import Plan, PlanError, Step, apply
from .select import SelectionError, select
from .transforms.checkpoint import Checkpoint, CheckpointModule, apply_checkpoint

checkpoint = Checkpoint

# --- activations (issue 3) ---
from .transforms.activations import (
    BnAct,
    FusedBatchNormAct,
    MemoryEfficientSwish,
    Swish,
    apply_bn_act,
    apply_swish,
)

swish = Swish
bn_act = BnAct
# --- end activations ---

# --- precision (issue 4) ---
from .transforms.precision import Autocast, Half, apply_autocast, apply_half

autocast = Autocast
half = Half
# --- end precision ---

# --- measure, report, cli (issue 5) ---
# The function shadows the subpackage's name here, as the API reads `shrinkwrap.measure(model, batch)`;
# `import shrinkwrap.measure.saved` and `from shrinkwrap.measure import ...` still reach the package.
from .measure import Event, ModuleLog, Phase, Profile, measure, plan_report  # noqa: E402
from .report import Report, Row  # noqa: E402
# --- end measure ---

from .autoplan import autoplan  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # plans and selection
    "Plan", "PlanError", "Step", "apply", "revert", "records", "select", "SelectionError",
    # transforms: steps, functions, building blocks
    "checkpoint", "Checkpoint", "apply_checkpoint", "CheckpointModule",
    "swish", "Swish", "apply_swish", "MemoryEfficientSwish",
    "bn_act", "BnAct", "apply_bn_act", "FusedBatchNormAct",
    "autocast", "Autocast", "apply_autocast",
    "half", "Half", "apply_half",
    # measuring and reports
    "measure", "plan_report", "Profile", "Phase", "Event", "ModuleLog", "Report", "Row",
    "saved_tensor_bytes", "SavedTensors", "autoplan",
]
