"""``MemoryEfficientSwish``: Swish that keeps only its input for backward and runs PyTorch's fused
SiLU kernels (a hand-written ``x * torch.sigmoid(x)`` keeps two tensors)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._wrapper import functorch_level

aten = torch.ops.aten


class _SwishFunction(torch.autograd.Function):
    """SiLU that saves only its input and runs the fused ``silu`` / ``silu_backward`` kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (gradient penalties): aten.silu_backward has no derivative, so
            # write the gradient with differentiable ops; training without it takes the fused kernel.
            sig = torch.sigmoid(x)
            return grad * sig * (1 + x * (1 - sig))
        return aten.silu_backward(grad, x)


class MemoryEfficientSwish(nn.Module):
    """Swish ``x * sigmoid(x)`` that keeps only ``x`` for backward and runs PyTorch's fused kernels.

    A hand-written ``x * torch.sigmoid(x)`` keeps two tensors (``x`` and ``sigmoid(x)``); this keeps
    one, at the speed of ``nn.SiLU``. Its outputs and gradients are ``nn.SiLU``'s exactly; against
    the hand-written form they differ only by rounding (the last bit of some elements).

    Example::

        >>> act = MemoryEfficientSwish()
        >>> act(torch.randn(8, 16, requires_grad=True)).sum().backward()
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled, plain SiLU is what the compiler fuses best, and it saves only x already.
        # torch.func transforms take no autograd Function without setup_context: plain SiLU there.
        if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling() and not functorch_level():
            return _SwishFunction.apply(x)
        return F.silu(x)
