"""Memory-efficient SwiGLU: a gated MLP's ``act(gate) * up`` that keeps two tensors, not three.

The MLP of Llama-style language models (Hugging Face's ``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``
and their kin) computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with ``act_fn`` SiLU.
Autograd keeps, for that product, the gate, SiLU of it and the up projection: three tensors of
tokens x intermediate size per layer (8192 x 8192 in bfloat16 is 128 MiB each at 4 x 2048 tokens
of a 1B model); at the peak of its backward six such tensors are alive (those three, the product's
gradient, and mul's two gradients). :class:`MemoryEfficientSwiGLU` runs the same ops through one
autograd function that keeps the gate and the up projection only, recomputes SiLU in backward, and
writes the gate's gradient over the tensor it is computed from: one tensor fewer kept, and five
alive at the backward's peak, not six. The numbers are the same ops in the same order
(``silu``, ``mul``, ``silu_backward``): outputs and gradients equal the plain MLP's bit for bit.

Where it matters most: inside a checkpoint region, a block's recompute and backward working set
is what sets the peak once the tensors held between forward and backward are gone (offloaded, say),
and the MLP's product is the largest part of it.
"""

from __future__ import annotations

__all__ = ['SwiGLU', 'MemoryEfficientSwiGLU', 'apply_swiglu']

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _rewrite
from .._wrapper import TransparentWrapper, functorch_level, has_hooks
from ..select import Pattern, SelectionError, require_module, select
from ..step import Candidate, Context, Step, Targets
from .activations.recognise import _activation_kind

aten = torch.ops.aten
_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): differentiable ops, as autograd would run them.
            sig = torch.sigmoid(gate)
            grad_gate = grad * up * sig * (1 + gate * (1 - sig)) if need_gate else None
            return grad_gate, (grad * (gate * sig) if need_up else None)
        grad_up = F.silu(gate).mul_(grad) if need_up else None
        grad_gate = None
        if need_gate:
            # autograd's two ops (mul's backward, then silu's), the second written over the first's
            # output: the same numbers, one tensor fewer alive.
            grad_gate = grad * up
            aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


class MemoryEfficientSwiGLU(TransparentWrapper):
    """A gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, SiLU gate) whose product keeps
    the gate and the up projection for backward, not SiLU of the gate as well.

    Wraps the MLP (names, parameters, buffers and its projections unchanged: a LoRA or quantized
    projection still runs, since the wrapper calls the MLP's own submodules). In training with
    gradients the product runs through one autograd function: outputs and gradients equal the
    plain MLP's bit for bit. In eval, under ``no_grad`` and under ``torch.compile`` (whose
    partitioner recomputes SiLU of its own accord) the MLP's own forward runs.

    Example::

        >>> mlp = model.model.layers[0].mlp
        >>> model.model.layers[0].mlp = MemoryEfficientSwiGLU(mlp)   # or apply_swiglu(model)
    """

    label = "MemoryEfficientSwiGLU"

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mlp = self.wrapped
        # torch.func takes no autograd Function without setup_context; hooks registered on the MLP
        # after the plan run with its own call.
        if args or kwargs or not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() \
                or functorch_level() or has_hooks(mlp):
            return mlp(x, *args, **kwargs)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        if not (gate.requires_grad or up.requires_grad):
            return mlp.down_proj(mlp.act_fn(gate) * up)
        return mlp.down_proj(_SwiGLUFunction.apply(gate, up))


def _gated_mlp(module: nn.Module) -> str:
    """Why ``module`` cannot be wrapped ("" if it can): it must compute
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU ``act_fn``, checked on a probe input
    in training mode (dropout inside would make it differ), and have no hooks of its own."""
    if has_hooks(module):
        return "has hooks, which the wrapper would not run"
    weight = next((p for p in module.gate_proj.parameters() if p.is_floating_point()), None)
    features = getattr(module.gate_proj, "in_features", None)
    if weight is None or features is None or weight.device.type == "meta":
        return "its gate_proj has no floating-point weight with in_features to probe it with"
    act = module.act_fn
    if _activation_kind(act, weight.dtype, weight.device)[0] != "swish" or has_hooks(act):
        return f"its act_fn is {type(act).__name__}, not SiLU: only SiLU-gated MLPs are fused"
    # Rows at growing scales: a clamp of the gate or the product (DeepseekV4's swiglu_limit) is
    # reached by the large ones, where freshly initialised weights keep small inputs far below it.
    x = torch.linspace(-2.0, 2.0, 3 * features, dtype=torch.float64).reshape(1, 3, features)
    x = (x * torch.tensor([1.0, 10.0, 1e2, 1e3], dtype=torch.float64).reshape(4, 1, 1))
    x = x.to(device=weight.device, dtype=weight.dtype)
    training = module.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
            module.train()
            got = module(x)
            want = module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))
    except Exception:  # noqa: BLE001 - a module that cannot run on the probe is not a gated MLP we know
        return "does not run on a probe input as down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    finally:
        module.train(training)
    # Rounded to finite values first: a half-precision model overflows on the largest rows alike.
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.equal(got.nan_to_num(), want.nan_to_num())):
        return "does not compute down_proj(act_fn(gate_proj(x)) * up_proj(x)) (dropout, a clamp or more inside?)"
    return ""


@dataclasses.dataclass(frozen=True)
class SwiGLU(Step):
    """Step: make each SiLU-gated MLP keep two tensors for its product instead of three.

    Args:
        pattern: which modules to look at (see :func:`shrinkwrap.select`); default: every module
            with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` children (Hugging Face's
            Llama, Mistral, Qwen2 and kin). A module is wrapped only where a probe shows it
            computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``; what is passed over, and why,
            is in ``shrinkwrap.records(model)``.

    Saves one tokens x intermediate-size tensor per MLP from what backward keeps, and one from the
    peak of the MLP's backward; exact (bit for bit). ``candidates``: the step itself, where it
    finds an MLP to wrap.

    Example::

        >>> sw.apply(llama, sw.Plan([sw.checkpoint(r"model\\.layers\\.\\d+"), sw.swiglu()]))
    """

    name = "swiglu"
    order = 25
    recomputes = True

    pattern: Pattern | None = None

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        return cls.itself(model)

    def targets(self, model: nn.Module) -> Targets:
        explicit = self.pattern is not None
        has_parts = lambda m, n: all(isinstance(getattr(m, p, None), nn.Module) for p in _PARTS)  # noqa: E731
        names = select(model, self.pattern if explicit else has_parts, outermost=True, allow_empty=not explicit)
        wrap, done, skipped = [], [], []
        for name in names:
            module = model.get_submodule(name)
            if isinstance(module, MemoryEfficientSwiGLU):
                done.append(name)
                continue
            why = _gated_mlp(module) if has_parts(module, name) else \
                "has no gate_proj, up_proj, down_proj and act_fn to fuse"
            (skipped.append((name, why)) if why else wrap.append(name))
        if not (wrap or done):
            detail = "; ".join(f"{n} {w}" for n, w in skipped[:3]) or "no module has gate_proj, up_proj, " \
                                                                      "down_proj and act_fn children"
            raise SelectionError(
                f"shrinkwrap: swiglu() found no SiLU-gated MLP in {type(model).__name__} ({detail}). "
                "Leave swiglu() out of the plan, or name the MLPs with pattern=...")
        return Targets([*done, *wrap], skipped, wrap)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        return _rewrite.replace(model, targets.payload, lambda n, m: MemoryEfficientSwiGLU(m))


def apply_swiglu(model: nn.Module, pattern: Pattern | None = None) -> nn.Module:
    """Wrap each SiLU-gated MLP of ``model`` in :class:`MemoryEfficientSwiGLU`, in place; return it.

    ``state_dict()`` keys do not change; ``shrinkwrap.revert(model)`` puts the MLPs back. Raises
    ``SelectionError`` if no module qualifies.

    Example::

        >>> apply_swiglu(transformers.LlamaForCausalLM(config))
    """
    return SwiGLU(pattern).apply(require_module(model, "apply_swiglu()"))
