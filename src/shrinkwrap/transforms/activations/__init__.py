"""Activation transforms: memory-efficient Swish, Mish, Hard-Swish and tanh-GELU, and BatchNorm +
activation recompute.

``swish`` finds Swish written by hand (``x * torch.sigmoid(x)``, which keeps two tensors for
backward) and swaps in :class:`MemoryEfficientSwish`, which keeps one and runs PyTorch's fused SiLU
kernels. Hand-written Mish (``x * tanh(softplus(x))``), Hard-Swish (``x * relu6(x + 3) / 6``) and
the tanh approximation of GELU (GPT-2's ``gelu_new``: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x +
0.044715 * x**3)))``, eight elementwise operations that keep four tensors, in float32 under
bfloat16 autocast since ``pow`` runs in float32 there) are swapped for ``nn.Mish`` /
``nn.Hardswish`` / ``nn.GELU(approximate="tanh")``: the native ops already keep only their input
and run one kernel each way, so a shrinkwrap variant of them would save nothing more. Modules are
recognised by what they compute, never by their class name.

``bn_act`` fuses a BatchNorm with the elementwise activation that directly follows it into one op
that keeps only the BatchNorm input (and the per-channel batch statistics) and recomputes
normalisation and activation in backward: one activation-sized tensor fewer per pair.

The files, one concern each:

- ``efficient_swish.py``: ``MemoryEfficientSwish`` and its autograd function.
- ``recognise.py``: what a module computes, found by probing it.
- ``base.py``: what the two steps share.
- ``swish.py``: the ``swish`` step.
- ``bn_act.py``: the ``bn_act`` step and its fused op.
"""

from .bn_act import BnAct, FusedActivation, FusedBatchNormAct, apply_bn_act
from .efficient_swish import MemoryEfficientSwish
from .swish import Swish, apply_swish

__all__ = ['Swish', 'BnAct', 'MemoryEfficientSwish', 'FusedBatchNormAct', 'FusedActivation', 'apply_swish',
           'apply_bn_act']
