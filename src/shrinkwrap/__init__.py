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
# --- end measure ---

__version__ = "0.1.0"

__all__ = [
    "CheckpointModule",
    "Plan",
    "PlanError",
    "SavedTensors",
    "SelectionError",
    "Step",
    "apply",
    "apply_checkpoint",
    "checkpoint",
    "records",
    "revert",
    "saved_tensor_bytes",
    "select",
]
