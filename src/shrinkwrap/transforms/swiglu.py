"""Memory-efficient gated MLPs: ``act(gate) * up`` that keeps two tensors, not three.

The MLP of most language models computes ``down_proj(act(gate) * up)`` with the gate and the up
projection of one input: SiLU-gated in Hugging Face's ``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``
and their kin, tanh-GELU-gated in ``GemmaMLP``, ``Gemma2MLP`` and ``Gemma3MLP``, and with both
projections fused into one ``gate_up_proj`` whose output is cut in halves in ``Phi3MLP`` (and
``GlmMLP``). Autograd keeps, for the product, the gate, its activation and the up projection: three
tensors of tokens x intermediate size per layer (8192 x 8192 in bfloat16 is 128 MiB each at
4 x 2048 tokens of a 1B model); at the peak of its backward six such tensors are alive (those
three, the product's gradient, and mul's two gradients). :class:`MemoryEfficientSwiGLU` runs the
same ops through one autograd function that keeps the gate and the up projection only (a fused
projection's output whole, as autograd keeps it), recomputes the activation in backward, and
writes the gate's gradient over the tensor it is computed from (a fused projection's gradient is
written in its halves, with no concatenation): one tensor fewer kept, and fewer alive at the
backward's peak. The numbers are the same ops in the same order (``silu`` or ``gelu``, ``mul``,
``silu_backward`` or ``gelu_backward``), on tensors laid out as autograd's are: outputs and
gradients equal the plain MLP's bit for bit.

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

from .. import _rewrite
from .._wrapper import TransparentWrapper, functorch_level, has_hooks
from ..select import Pattern, SelectionError, require_module, select
from ..step import Candidate, Context, Step, Targets
from .activations.recognise import _activation_kind, _has_state, _probe_input

aten = torch.ops.aten
# A gate's activation, by the kind recognise.py names it ("gelu", the exact GELU, is no kind it
# knows): the op autograd runs, the backward autograd runs for it, and their arguments.
_GATES = {"swish": (aten.silu, aten.silu_backward, {}),
          "gelu_tanh": (aten.gelu, aten.gelu_backward, {"approximate": "tanh"}),
          "gelu": (aten.gelu, aten.gelu_backward, {})}
# The projections of each form, and the names an MLP's activation goes by (Phi-3's activation_fn).
_FORMS = {"separate": ("gate_proj", "up_proj", "down_proj"), "fused": ("gate_up_proj", "down_proj")}
_ACTS = ("act_fn", "activation_fn")


def _act(kind: str, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    op, _, kwargs = _GATES[kind]
    return op(x, **kwargs) if out is None else op.out(x, **kwargs, out=out)


class _GatedProduct(torch.autograd.Function):
    """``act(gate) * up``, keeping ``gate`` and ``up`` only. Fused (``up`` None): ``gate`` is a
    projection's output whose halves are the gate and the up projection, kept whole, and its
    gradient is one tensor, as ``chunk``'s backward makes it."""

    @staticmethod
    def forward(ctx: Any, kind: str, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        ctx.kind, ctx.fused = kind, up is None
        ctx.save_for_backward(gate, up)
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        return _act(kind, gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, up = ctx.saved_tensors
        gate, up = saved.chunk(2, dim=-1) if ctx.fused else (saved, up)
        needs = ctx.needs_input_grad[1:]
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): autograd's own, differentiable backward of the product.
            inputs = [t for t, need in zip((saved, up), needs) if need]
            grads = iter(torch.autograd.grad(_act(ctx.kind, gate) * up, inputs, grad, create_graph=True))
            return None, *(next(grads) if need else None for need in needs)
        # Fused: both halves of one gradient, written in place of the concatenation autograd makes.
        whole = saved.new_empty(saved.shape) if ctx.fused else None
        grad_gate, grad_up = whole.chunk(2, dim=-1) if ctx.fused else (None, None)
        need_gate, need_up = (needs[0], needs[0]) if ctx.fused else needs
        if need_up:
            grad_up = _act(ctx.kind, gate, out=grad_up).mul_(grad)
        if need_gate:
            # autograd's two ops (mul's backward, then the activation's), the second written over the
            # first's output: the same numbers, one tensor fewer alive.
            _, backward, kwargs = _GATES[ctx.kind]
            grad_gate = torch.mul(grad, up, out=grad_gate)
            backward.grad_input(grad_gate, gate, **kwargs, grad_input=grad_gate)
        return (None, whole, None) if ctx.fused else (None, grad_gate, grad_up)


def _parts(module: nn.Module) -> tuple[str, str] | None:
    """A gated MLP's form ("separate" or "fused" projections) and its activation's name, by its
    children; None if it has neither form's children."""
    act = next((name for name in _ACTS if isinstance(getattr(module, name, None), nn.Module)), None)
    for form, names in _FORMS.items():
        if act is not None and all(isinstance(getattr(module, n, None), nn.Module) for n in names):
            return form, act
    return None


def _product(mlp: nn.Module, form: str, kind: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward through :class:`_GatedProduct`, its projections its own modules."""
    if form == "fused":
        return mlp.down_proj(_GatedProduct.apply(kind, mlp.gate_up_proj(x), None))
    gate = mlp.gate_proj(x)  # first, as the MLP calls it: a LoRA projection's dropout draws in that order
    return mlp.down_proj(_GatedProduct.apply(kind, gate, mlp.up_proj(x)))


class MemoryEfficientSwiGLU(TransparentWrapper):
    """A gated MLP (``down_proj(act(gate_proj(x)) * up_proj(x))``, or its gate and up projection
    the halves of one ``gate_up_proj``; SiLU or GELU gate) whose product keeps the gate and the up
    projection for backward, not the gate's activation as well.

    Wraps the MLP (names, parameters, buffers and its projections unchanged: a LoRA or quantized
    projection still runs, since the wrapper calls the MLP's own submodules). In training with
    gradients the product runs through one autograd function: outputs and gradients equal the
    plain MLP's bit for bit. In eval, under ``no_grad`` and under ``torch.compile`` (whose
    partitioner recomputes the activation of its own accord), or once its activation module is
    replaced, the MLP's own forward runs.

    Args:
        module: the MLP; probed as :func:`swiglu` probes it, and refused (``ValueError``) if it is
            not a gated MLP this wrapper computes exactly.

    Example::

        >>> mlp = model.model.layers[0].mlp
        >>> model.model.layers[0].mlp = MemoryEfficientSwiGLU(mlp)   # or apply_swiglu(model)
    """

    label = "MemoryEfficientSwiGLU"

    def __init__(self, module: nn.Module, _probed: tuple[str, str] | None = None) -> None:
        super().__init__(module)
        kind, why = _probed or _gated_mlp(module)
        if why:
            name = type(module).__name__
            raise ValueError(f"shrinkwrap: MemoryEfficientSwiGLU cannot wrap {name} ({name} {why}). Leave this "
                             "module unwrapped (swiglu() passes over it).")
        form, act = _parts(module)
        # The activation module probed, kept to tell whether it is still the MLP's own.
        object.__setattr__(self, "_sw_gate", (form, act, getattr(module, act), kind))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mlp = self.wrapped
        form, act, module, kind = self._sw_gate
        # torch.func takes no autograd Function without setup_context; hooks registered on the MLP
        # after the plan run with its own call.
        if args or kwargs or not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() \
                or functorch_level() or has_hooks(mlp) or mlp._modules.get(act) is not module:
            return mlp(x, *args, **kwargs)
        return _product(mlp, form, kind, x)


def _equal(a: Any, b: torch.Tensor) -> bool:
    # Rounded to finite values first: a half-precision model overflows on the largest rows alike.
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())


def _gated_mlp(module: nn.Module) -> tuple[str, str]:
    """``(kind, why)``: the kind of the MLP's gate (see ``_GATES``), and why it cannot be wrapped
    ("" if it can). It must have the children of a form (``_FORMS``), a stateless, hook-free SiLU or
    GELU activation that computes what torch's op does bit for bit, no hooks of its own, and give
    on a probe input in training mode (dropout inside would make it differ) the wrapper's output
    and input gradient bit for bit."""
    parts = _parts(module)
    if parts is None:
        return "", "has no gate_proj and up_proj (or gate_up_proj), down_proj and act_fn to fuse"
    form, act_name = parts
    if has_hooks(module):
        return "", "has hooks, which the wrapper would not run"
    first = getattr(module, _FORMS[form][0])
    weight = next((p for p in first.parameters() if p.is_floating_point()), None)
    features = getattr(first, "in_features", None)
    if weight is None or features is None or weight.device.type == "meta":
        return "", f"its {_FORMS[form][0]} has no floating-point weight with in_features to probe it with"
    act = getattr(module, act_name)
    if any(has_hooks(m) for m in act.modules()):
        return "", f"its {act_name} has hooks, which the wrapper would not run"
    not_taken = f"its {act_name} is {type(act).__name__}, not SiLU or GELU (exact or tanh) as torch computes them"
    kind = _activation_kind(act, weight.dtype, weight.device)[0]
    if kind not in _GATES:
        if kind is not None or _has_state(act):
            return "", not_taken
        kind = "gelu"  # the exact GELU, which recognise.py does not name, or another activation: the probe tells
    devices = [weight.device] if weight.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices):
            t = _probe_input(weight.dtype, weight.device)
            if not _equal(act(t), _act(kind, t)):
                return "", not_taken
    except Exception:  # noqa: BLE001 - an activation that cannot run on the probe is not one we take
        return "", not_taken
    # Rows at growing scales: a clamp of the gate or the product (DeepseekV4's swiglu_limit) is
    # reached by the large ones, where freshly initialised weights keep small inputs far below it.
    x = torch.linspace(-2.0, 2.0, 3 * features, dtype=torch.float64).reshape(1, 3, features)
    x = (x * torch.tensor([1.0, 10.0, 1e2, 1e3], dtype=torch.float64).reshape(4, 1, 1))
    x = x.to(device=weight.device, dtype=weight.dtype).requires_grad_()
    training = module.training
    outputs = []
    try:
        module.train()
        with torch.enable_grad():
            for run in (module, lambda x: _product(module, form, kind, x)):
                with torch.random.fork_rng(devices):  # both from the same RNG state, which stays the user's
                    y = run(x)
                    if not isinstance(y, torch.Tensor):
                        break
                    w = torch.linspace(-1.0, 1.0, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
                    outputs += [y.detach(), *torch.autograd.grad(y, x, w)]
    except Exception:  # noqa: BLE001 - a module that cannot run on the probe is not a gated MLP we know
        return "", "does not run on a probe input as a gated MLP"
    finally:
        module.train(training)
    if len(outputs) < 4 or not all(_equal(a, b) for a, b in zip(outputs[:2], outputs[2:])):
        return "", "does not compute down_proj(act_fn(gate) * up), forward and backward, as its projections and " \
                   "act_fn do (dropout, a clamp or more inside?)"
    return kind, ""


@dataclasses.dataclass(frozen=True)
class SwiGLU(Step):
    """Step: make each SiLU- or GELU-gated MLP keep two tensors for its product instead of three.

    Args:
        pattern: which modules to look at (see :func:`shrinkwrap.select`); default: every module
            with ``gate_proj``, ``up_proj`` and ``down_proj`` children (Hugging Face's Llama,
            Mistral, Qwen2, Gemma and kin) or ``gate_up_proj`` and ``down_proj`` (Phi-3), and an
            ``act_fn`` (or ``activation_fn``). A module is wrapped only where a probe shows it
            computes ``down_proj(act(gate) * up)`` with ``act`` SiLU, tanh-GELU or GELU, forward and
            backward, as the wrapper does; what is passed over, and why, is in ``shrinkwrap.records(model)``.

    Saves one tokens x intermediate-size tensor per MLP from what backward keeps, and at least one
    from the peak of the MLP's backward; exact (bit for bit). ``candidates``: the step itself, where
    it finds an MLP to wrap.

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
        names = select(model, self.pattern if explicit else lambda m, n: _parts(m) is not None, outermost=True,
                       allow_empty=not explicit)
        kinds, done, skipped = {}, [], []
        for name in names:
            module = model.get_submodule(name)
            if isinstance(module, MemoryEfficientSwiGLU):
                done.append(name)
                continue
            kind, why = _gated_mlp(module)
            (skipped.append((name, why)) if why else kinds.update({name: kind}))
        if not (kinds or done):
            detail = "; ".join(f"{n} {w}" for n, w in skipped[:3]) or "no module has gate_proj and up_proj (or " \
                                                                      "gate_up_proj), down_proj and act_fn children"
            raise SelectionError(
                f"shrinkwrap: swiglu() found no SiLU- or GELU-gated MLP (gate_proj and up_proj, or gate_up_proj) in "
                f"{type(model).__name__} ({detail}). Leave swiglu() out of the plan, or name the MLPs with pattern=...")
        return Targets([*done, *kinds], skipped, kinds)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        kinds = targets.payload
        return _rewrite.replace(model, kinds, lambda n, m: MemoryEfficientSwiGLU(m, _probed=(kinds[n], "")))


def apply_swiglu(model: nn.Module, pattern: Pattern | None = None) -> nn.Module:
    """Wrap each SiLU- or GELU-gated MLP of ``model`` in :class:`MemoryEfficientSwiGLU`, in place;
    return it.

    ``state_dict()`` keys do not change; ``shrinkwrap.revert(model)`` puts the MLPs back. Raises
    ``SelectionError`` if no module qualifies.

    Example::

        >>> apply_swiglu(transformers.LlamaForCausalLM(config))
    """
    return SwiGLU(pattern).apply(require_module(model, "apply_swiglu()"))
