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
"""

from __future__ import annotations

__all__ = ['Swish', 'BnAct', 'MemoryEfficientSwish', 'FusedBatchNormAct', 'FusedActivation', 'apply_swish',
           'apply_bn_act']

import dataclasses
import functools
from typing import Any, Callable

import regex
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import _rewrite
from .._wrapper import TRACED_REGIONS, TransparentWrapper, functorch_level, has_hooks, unwrap
from ..select import CONTAINERS, Pattern, SelectionError, require_module, select
from ..step import Candidate, Context, Step, Targets

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------
# Memory-efficient Swish
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Recognising Swish, Mish, Hard-Swish and tanh-GELU by behaviour
# --------------------------------------------------------------------------------------------

# The reference each candidate is compared against, and the module that replaces a hand-written
# form. Mish, Hard-Swish and tanh-GELU get the native module: it already keeps only its input.
_KINDS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], nn.Module]]] = {
    "swish": (F.silu, MemoryEfficientSwish),
    "mish": (F.mish, nn.Mish),
    "hardswish": (F.hardswish, nn.Hardswish),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), functools.partial(nn.GELU, approximate="tanh")),
}
_NATIVE: dict[type, str] = {nn.SiLU: "swish", nn.Mish: "mish", nn.Hardswish: "hardswish"}
# Only used to *report* stateful modules we will not run; replacement never depends on names.
_LOOKS_LIKE = regex.compile(r"swish|silu|mish", regex.IGNORECASE)
_REPLACED = "_sw_replacement"  # set on modules this transform put in place, so reapplying sees them


_NONE = "does not compute Swish, Mish, Hard-Swish or tanh-GELU"
# A tanh-GELU that already keeps only its input (nn.GELU('tanh') too, found by the probe like any
# other: HF's GELUTanh, BLOOM's own autograd Function): swish() leaves it be and says nothing, so
# that it is no candidate for nothing; bn_act() still fuses it after a BatchNorm.
_ONE_OP = "already keeps only its input"


def _probe_input(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # 240 points in [-6, 6] that miss the kinks of Hard-Swish (-3, 3) and 0, in a 4-d shape so
    # that modules written for feature maps run too.
    x = torch.linspace(-6.0, 6.0, 240, dtype=torch.float64).reshape(2, 3, 5, 8)
    return x.to(dtype=dtype, device=device)


# (rtol, atol) by dtype: what rounding alone can explain, torch.testing.assert_close's defaults but
# for float64, where a written-out activation's rounding (gradients of Swish against SiLU differ by
# 3e-14 relative near zero) is well under its default (1e-7), which took a constant cut to ten
# digits (Hugging Face's FastGELUActivation: 5e-9 relative) for the tanh GELU.
_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
              torch.float64: (1e-12, 1e-14)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """assert_close's test, without the message it builds from a mismatch: a module probed is
    compared with four references, most of them unlike it, and on maxvit_t's 490 stateless modules
    those messages took 0.55 of the 0.86 s a ``swish()`` check spent probing on a CPU. With
    :data:`_INERT` not probed, applying ``swish()`` to maxvit_t on an H200 took 0.16 s, not 0.80
    (autoplan applies a plan to each copy it measures)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype not in _TOLERANCE or a.layout != torch.strided or b.layout != torch.strided or a.is_meta:
        try:
            torch.testing.assert_close(a, b)
        except AssertionError:
            return False
        return True
    rtol, atol = _TOLERANCE[a.dtype]
    return bool(torch.isclose(a, b, rtol=rtol, atol=atol).all())


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _native_kind(module: nn.Module) -> str | None:
    for cls, kind in _NATIVE.items():
        if isinstance(module, cls) and type(module).forward is cls.forward:
            return kind
    return None


# torch's own stateless modules that compute none of the kinds whatever their arguments: not
# probed (a test probes each to be sure), their class exactly and its own forward (a subclass, or a
# forward set on the instance, may compute anything).
# nn.GELU is not among them: with approximate='tanh' it is the tanh GELU.
_INERT = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.ReLU, nn.ReLU6,
          nn.LeakyReLU, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Hardsigmoid, nn.Hardtanh, nn.Softmax, nn.LogSoftmax,
          nn.Flatten, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AvgPool1d, nn.AvgPool2d,
          nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)


def _probe(module: nn.Module, dtype: torch.dtype, device: torch.device,
           inplace_ok: bool = False) -> tuple[str | None, str]:
    """What a stateless, hook-free module computes: ``(kind, "")`` if it is Swish, Mish,
    Hard-Swish or tanh-GELU and safe to replace, ``(kind, why)`` if it computes one but must be left alone,
    ``(None, why)`` if it computes none of them. ``inplace_ok``: a module that overwrites its
    input is safe to replace (bn_act's fused op owns the tensor the module would overwrite).

    A half-precision model is probed in float32: in bfloat16 a written-out activation's rounding
    (eight operations for tanh-GELU) exceeds what the comparison allows for one rounding, and a
    stateless module computes in float32 what it computes in half precision, less rounded."""
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    base = _probe_input(dtype, device).requires_grad_()
    x = base.clone()  # not a leaf, so an in-place module runs and can be caught
    version = x._version
    attrs = dict(module.__dict__)  # identity, not ==, below: attributes may be tensors
    try:
        # fork_rng: probing a random module (dropout) must not move the user's RNG stream.
        saved: list[torch.Tensor] = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t) or t, lambda t: t):
                y = module(x)
    except Exception:  # noqa: BLE001 - a module that cannot run on the probe is not an activation
        return None, _NONE
    finally:
        now = module.__dict__
        side_effect = now.keys() != attrs.keys() or any(now[k] is not v for k, v in attrs.items())
        if side_effect:  # put its attributes back: a module we do not replace must stay untouched
            module.__dict__.clear()
            module.__dict__.update(attrs)
    if not (isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype):
        return None, _NONE
    ref_x = _probe_input(dtype, device)
    kind = next((k for k, (fn, _) in _KINDS.items() if _close(y.detach(), fn(ref_x))), None)
    if kind is None:
        return None, _NONE
    inplace = x._version != version or y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    if inplace and not inplace_ok:
        return kind, "modifies its input in place; the replacement would not"
    if side_effect:
        return kind, "changes its own attributes when called (a side effect the replacement would drop)"
    weight = torch.linspace(-1.0, 1.0, y.numel(), dtype=dtype, device=device).reshape(y.shape)
    try:
        (grad,) = torch.autograd.grad(y, base, weight)
    except RuntimeError:
        return kind, "its output does not carry a gradient"
    ref = ref_x.requires_grad_()
    (ref_grad,) = torch.autograd.grad(_KINDS[kind][0](ref), ref, weight)
    if not _close(grad, ref_grad):
        return kind, (f"returns {kind}'s values but not its gradient to rounding (a detach() inside, or a backward "
                      f"of lower precision: torch's hardsigmoid backward rounds 1/6 to float32)")
    if kind == "gelu_tanh" and len(saved) <= 1:
        return kind, _ONE_OP
    return kind, ""


def _probe_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype, t.device
    return torch.get_default_dtype(), torch.device("cpu")


def _activation_kind(module: nn.Module, dtype: torch.dtype, device: torch.device,
                     inplace_ok: bool = False) -> tuple[str | None, str]:
    """Swish, Mish, Hard-Swish or tanh-GELU in any form, native or hand-written: ``(kind, why_not)``."""
    if isinstance(module, MemoryEfficientSwish):
        return "swish", ""
    native = _native_kind(module)
    if native is not None:
        return native, ""
    if isinstance(module, (TransparentWrapper, *CONTAINERS)):
        return None, "is a container or a shrinkwrap wrapper"
    if _has_state(module):
        return None, "has parameters or buffers (state); shrinkwrap never replaces a module with state"
    if has_hooks(module):
        return None, "has hooks, which a replacement would drop"
    if type(module) in _INERT and "forward" not in module.__dict__:
        return None, _NONE
    return _probe(module, dtype, device, inplace_ok)


# --------------------------------------------------------------------------------------------
# The swish step
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _WholeModelStep(Step):
    """What the activation steps share: an optional pattern (default: the whole model), and one
    candidate for autoplan, the step itself, where it finds something to do."""

    pattern: Pattern | None = None

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        return cls.itself(model)


@dataclasses.dataclass(frozen=True)
class Swish(_WholeModelStep):
    """Step: replace hand-written Swish, Mish, Hard-Swish and tanh-GELU modules by memory-efficient ones.

    Args:
        pattern: which modules to look at (see :func:`shrinkwrap.select`); default: all of them.
        include_silu: also swap ``nn.SiLU`` (not in place) for :class:`MemoryEfficientSwish`. It
            saves no memory (``nn.SiLU`` keeps only its input already); it makes every Swish the
            same module.

    What is replaced, and what looks like Swish but is left alone (with why), is in
    ``shrinkwrap.records(model)``.

    Example::

        >>> sw.apply(model, sw.Plan([sw.swish()]))
    """

    name = "swish"
    order = 20
    recomputes = True

    include_silu: bool = False

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the modules to replace and those already replaced; payload: name -> kind."""
        explicit = self.pattern is not None
        names = select(model, self.pattern if explicit else (lambda m, n: True), allow_empty=not explicit)
        dtype, device = _probe_dtype_device(model)
        replace: dict[str, str] = {}
        done: list[str] = []
        skipped: list[tuple[str, str]] = []
        for name in names:
            if any(name.startswith(p + ".") for p in (*replace, *done)):
                continue  # inside a module already chosen
            module = model.get_submodule(name)
            if isinstance(module, MemoryEfficientSwish) or module.__dict__.get(_REPLACED):
                done.append(name)
                continue
            native = _native_kind(module)
            if native == "swish" and self.include_silu and not module.inplace:
                replace[name] = "swish"
            elif native == "swish" and self.include_silu:
                # Same memory either way (in-place SiLU saves a copy of its input), but the code
                # around an in-place module may read its input after the call.
                skipped.append((name, "in-place nn.SiLU: the code around it may rely on its input being overwritten"))
            elif native is not None:
                hint = " (pass include_silu=True to swap it anyway)" if native == "swish" else ""
                skipped.append((name, f"native {type(module).__name__} already saves only its input{hint}"))
            else:
                kind, why = _activation_kind(module, dtype, device)
                if why == _ONE_OP:
                    continue
                if kind is not None and not why:
                    replace[name] = kind
                elif kind is not None or explicit or (
                    _LOOKS_LIKE.search(type(module).__name__) and not isinstance(module, CONTAINERS)
                ):
                    skipped.append((name, why))
        if not (replace or done or skipped):
            raise SelectionError(
                f"shrinkwrap: swish() found no Swish, Mish, Hard-Swish or tanh-GELU in {type(model).__name__}: "
                "no stateless module computes x * sigmoid(x), x * tanh(softplus(x)), x * relu6(x + 3) / 6 or "
                "0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))). Leave swish() out of the plan, "
                "or name the modules with pattern=..."
            )
        return Targets([*done, *replace], skipped, replace)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        kinds = targets.payload

        def make(name: str, old: nn.Module) -> nn.Module:
            new = _KINDS[kinds[name]][1]()
            new.train(old.training)
            object.__setattr__(new, _REPLACED, True)
            return new

        return _rewrite.replace(model, list(kinds), make)


def apply_swish(model: nn.Module, pattern: Pattern | None = None, *, include_silu: bool = False) -> nn.Module:
    """Replace hand-written Swish, Mish, Hard-Swish and tanh-GELU modules of ``model`` in place;
    return it.

    A module is replaced when it has no parameters, buffers or hooks, and on probe inputs of the
    model's dtype (float32 for a half-precision model) and device returns what ``F.silu`` (``F.mish``, ``F.hardswish``, ``F.gelu(x,
    approximate="tanh")``) returns, with the same gradient, without modifying its input or itself.
    Swish becomes :class:`MemoryEfficientSwish`; Mish, Hard-Swish and tanh-GELU (Hugging Face's
    ``NewGELUActivation``, GPT-2's ``gelu_new``) become ``nn.Mish`` / ``nn.Hardswish`` /
    ``nn.GELU(approximate="tanh")``, which keep only their input. Applying it again changes nothing; ``shrinkwrap.revert(model)``
    puts the original modules back. Raises ``SelectionError`` if ``model`` has no Swish-like
    module at all (unless ``pattern`` names the modules to look at).

    Example::

        >>> apply_swish(efficientnet)               # every x * sigmoid(x) module
        >>> sw.records(efficientnet)[-1].skipped    # what looked like Swish but was left alone
    """
    return Swish(pattern, include_silu=include_silu).apply(require_module(model, "apply_swish()"))


# --------------------------------------------------------------------------------------------
# BatchNorm + activation recompute
# --------------------------------------------------------------------------------------------

# kind -> (the activation of z with its parameter, in place (over the BatchNorm output, which the
#          op owns) or not (differentiable, for a second backward);
#          backward from the recomputed BatchNorm output). Native kernels only: each is one pass.
_ACTS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "relu": (lambda z, p, i: F.relu(z, inplace=i), lambda g, z, p: aten.threshold_backward(g, z, 0)),
    "hardtanh": (lambda z, p, i: F.hardtanh(z, *p, inplace=i), lambda g, z, p: aten.hardtanh_backward(g, z, *p)),
    "leaky_relu": (
        lambda z, p, i: F.leaky_relu(z, p, inplace=i),
        lambda g, z, p: aten.leaky_relu_backward(g, z, p, False),
    ),
    "gelu": (lambda z, p, i: F.gelu(z, approximate=p), lambda g, z, p: aten.gelu_backward(g, z, approximate=p)),
    "swish": (lambda z, p, i: F.silu(z, inplace=i), lambda g, z, p: aten.silu_backward(g, z)),
    "mish": (lambda z, p, i: F.mish(z, inplace=i), lambda g, z, p: aten.mish_backward(g, z)),
    "hardswish": (lambda z, p, i: F.hardswish(z, inplace=i), lambda g, z, p: aten.hardswish_backward(g, z)),
}


def _act_spec(module: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[tuple | None, str]:
    """``((kind, param), "")`` for an elementwise activation :data:`_ACTS` can run, else ``(None, why)``."""
    t = type(module)
    if has_hooks(module):
        return None, f"is followed by {t.__name__}, which has hooks the fused op would not run"
    if t is nn.ReLU:
        return ("relu", None), ""
    if t in (nn.ReLU6, nn.Hardtanh):
        return ("hardtanh", (float(module.min_val), float(module.max_val))), ""
    if t is nn.LeakyReLU:
        return ("leaky_relu", float(module.negative_slope)), ""
    if t is nn.GELU:
        return ("gelu", module.approximate), ""
    kind, why = _activation_kind(module, dtype, device, inplace_ok=True)
    why = "" if why == _ONE_OP else why
    if kind is None:
        return None, f"is followed by {t.__name__}, not an elementwise activation shrinkwrap can fuse"
    if why:
        return None, f"is followed by {t.__name__}, which shrinkwrap cannot fuse: it {why}"
    return (("gelu", "tanh") if kind == "gelu_tanh" else (kind, None)), ""


class _BatchNormActFunction(torch.autograd.Function):
    """Training-mode BatchNorm then an activation, keeping only the BatchNorm input and the
    batch mean / inverse std; backward recomputes the BatchNorm output from them."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, running_mean, running_var, momentum, eps, act):  # type: ignore[override]
        if running_mean is not None:
            # The op F.batch_norm's own autograd path uses: cuDNN where it applies, same stats update.
            z, mean, invstd, reserve = aten._batch_norm_with_update(
                x, weight, bias, running_mean, running_var, momentum, eps
            )
        else:
            z, mean, invstd = aten.native_batch_norm(x, weight, bias, None, None, True, momentum, eps)
            reserve = x.new_empty(0, dtype=torch.uint8)
        ctx.save_for_backward(x, weight, bias, mean, invstd, reserve)
        # Plain attributes, not saved tensors: the running stats change in place at every forward.
        ctx.running = (running_mean, running_var)
        ctx.eps, ctx.act = eps, act
        return _ACTS[act[0]][0](z, act[1], True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        x, weight, bias, mean, invstd, reserve = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _BatchNormActFunction._differentiable(ctx, grad, x, weight, bias)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        # z = (x - mean) * invstd * weight + bias as one addcmul: z = x * scale + shift.
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        z = torch.addcmul(shift.to(x.dtype).view(shape), x, scale.to(x.dtype).view(shape))
        grad_z = _ACTS[ctx.act[0]][1](grad, z, ctx.act[1])
        del z
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        rm, rv = ctx.running
        if weight is not None:
            gx, gw, gb = aten.batch_norm_backward(grad_z, x, weight, rm, rv, mean, invstd, True, ctx.eps, mask, reserve)
        else:
            gx, gw, gb = aten.native_batch_norm_backward(grad_z, x, None, rm, rv, mean, invstd, True, ctx.eps, mask)
        return gx, gw, gb, None, None, None, None, None

    @staticmethod
    def _differentiable(ctx: Any, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None) -> tuple:
        """The backward under ``create_graph=True`` (a gradient penalty): the forward recomputed
        with differentiable ops (the batch statistics, no running-statistics update) and
        differentiated, so the gradients carry a graph of their own. Equal to the fused kernels'
        to rounding."""
        inputs = [(i, t) for i, t in enumerate((x, weight, bias)) if t is not None and ctx.needs_input_grad[i]]
        z = F.batch_norm(x, None, None, weight, bias, training=True, eps=ctx.eps)
        y = _ACTS[ctx.act[0]][0](z, ctx.act[1], False)
        grads = torch.autograd.grad(y, [t for _, t in inputs], grad, create_graph=True, allow_unused=True)
        out: list[torch.Tensor | None] = [None] * 8
        for (i, _), g in zip(inputs, grads):
            out[i] = g
        return tuple(out)


class _Pair:
    """What a fused BatchNorm and the activation after it share: where the activation stands (its
    parent's ``_modules`` and its key), the wrapper standing there, and the output the BatchNorm
    handed over (already activated), until the activation takes it."""

    def __init__(self, slot: dict, key: str, act: "FusedActivation") -> None:
        self.slot, self.key, self.act = slot, key, act
        self.out: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "out": None}  # a copy starts between forwards

    def intact(self) -> bool:
        """Whether the activation still stands where it was, hook-free: a tool that replaced it
        (with another activation, say) or hooked it gets the two run apart."""
        return self.slot.get(self.key) is self.act and not has_hooks(self.act.wrapped)


class FusedActivation(TransparentWrapper):
    """The activation after a fused BatchNorm (see :class:`FusedBatchNormAct`): it returns the
    BatchNorm's output unchanged where that output is the one the fused op handed over (already
    activated), and runs the activation on anything else (the output of a BatchNorm a tool put in
    place of the fused one, ``SyncBatchNorm.convert_sync_batchnorm`` say). Names, and
    ``isinstance`` of the activation's class, unchanged."""

    label = "FusedActivation"

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._sw_pair: _Pair | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self._sw_pair
        if pair is not None and not (torch.compiler.is_compiling() and TRACED_REGIONS[0]):
            given, pair.out = pair.out, None
            if given is not None and x is given:
                return x
        return self.wrapped(x)


class FusedBatchNormAct(TransparentWrapper):
    """A BatchNorm and the activation after it as one op that keeps only the BatchNorm input.

    Wraps the original BatchNorm (names, parameters and buffers unchanged). The activation that
    followed it in an ``nn.Sequential`` stays in its slot, wrapped in a :class:`FusedActivation`
    that passes the fused output through; for a timm-style ``BatchNormAct2d`` the activation is
    its own ``act`` child. In training mode with gradients, the output, the gradients and the
    running statistics (momentum, cumulative average for ``momentum=None``, unbiased running
    variance, ``num_batches_tracked``) are the unfused modules' up to rounding: the backward
    recomputes the BatchNorm output in a different order of operations, so it is not bit-for-bit.
    A second backward (``create_graph=True``) differentiates the recomputed forward, to rounding.

    The two run apart, each its own module, exactly: in eval mode, under ``no_grad``, when nothing
    needs a gradient, under a ``torch.func`` transform, where the BatchNorm or the activation has
    hooks, and where the activation's slot no longer holds its wrapper (a tool replaced it).

    Example::

        >>> seq = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU())
        >>> apply_bn_act(seq)   # seq[1] is FusedBatchNormAct[BatchNorm2d], seq[2] FusedActivation[SiLU]
        >>> isinstance(seq[1], nn.BatchNorm2d), isinstance(seq[2], nn.SiLU)
        (True, True)
    """

    label = "FusedBatchNormAct"

    def __init__(self, bn: nn.Module, pair: _Pair | None, spec: tuple) -> None:
        super().__init__(bn)
        # Outside the module tree, so no name changes; the activation is stateless (checked).
        object.__setattr__(self, "_sw_pair", pair)
        object.__setattr__(self, "_sw_spec", spec)

    def extra_repr(self) -> str:
        act = self._sw_pair.act.wrapped if self._sw_pair is not None else self.wrapped.act
        return f"{self.wrapped.extra_repr()}, act={act!r}"

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """BatchNorm and activation: the act wrapper's module, or a timm BatchNormAct2d's own."""
        y = self.wrapped(x)
        return self._sw_pair.act.wrapped(y) if self._sw_pair is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn, pair = self.wrapped, self._sw_pair
        batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p is not None and p.requires_grad for p in (bn.weight, bn.bias))
        )
        if not (batch_stats and needs_grad) or has_hooks(bn) or (pair is not None and not pair.intact()):
            return bn(x)  # apart: the activation's slot runs the activation on it
        if torch.compiler.is_compiling() and TRACED_REGIONS[0] and pair is not None:
            return bn(x)  # inside a checkpoint region, which recomputes both: no hand-over to trace
        if torch.compiler.is_compiling():
            # The compiler's form of the same saving: a recompute region it fuses into its backward
            # kernels (an opaque autograd.Function would keep it from fusing anything around it).
            y = checkpoint(self._fused, x, use_reentrant=False)
        elif functorch_level():
            return bn(x)  # torch.func takes no autograd Function without setup_context
        else:
            y = self._fused_op(x)
        if pair is not None:
            pair.out = y
        return y

    def _fused_op(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.wrapped
        if hasattr(bn, "_check_input_dim"):
            bn._check_input_dim(x)
        F._verify_batch_size(x.size())
        # nn.BatchNorm's bookkeeping, done here because the fused op stands in for its forward.
        momentum = 0.0 if bn.momentum is None else bn.momentum
        track = bn.training and bn.track_running_stats
        if track and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        running = (bn.running_mean, bn.running_var) if track or not bn.training else (None, None)
        return _BatchNormActFunction.apply(x, bn.weight, bn.bias, *running, momentum, bn.eps, self._sw_spec)


def _is_timm_bn_act(module: nn.Module) -> bool:
    # timm's BatchNormAct2d: a BatchNorm subclass with `drop` and `act` children, run bn -> drop -> act.
    return isinstance(getattr(module, "act", None), nn.Module) and isinstance(getattr(module, "drop", None), nn.Module)


@dataclasses.dataclass(frozen=True)
class BnAct(_WholeModelStep):
    """Step: fuse each BatchNorm with the elementwise activation that directly follows it.

    Found where the pair is visible as modules: a BatchNorm followed by an activation in an
    ``nn.Sequential`` (torchvision ``Conv2dNormActivation``), and timm's ``BatchNormAct2d``
    (recognised by its ``act`` and ``drop`` children; tested against a stand-in with timm's
    forward, timm itself is not a test dependency). Pairs wired in a ``forward`` (EfficientNet-
    PyTorch's ``self._swish(self._bn0(x))``) cannot be seen and are not fused. Activations:
    ReLU, ReLU6/Hardtanh, LeakyReLU, GELU, SiLU and Swish in any form, Mish, Hard-Swish, tanh-GELU
    in any form.

    Example::

        >>> sw.apply(model, sw.Plan([sw.bn_act()]))
    """

    name = "bn_act"
    order = 30
    recomputes = True

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the BatchNorms to fuse and those already fused; payload: bn name -> (act name
        or None, spec)."""
        explicit = self.pattern is not None
        is_bn = lambda m, n: isinstance(m, nn.modules.batchnorm._BatchNorm)  # noqa: E731
        names = select(model, self.pattern if explicit else is_bn, allow_empty=not explicit)
        dtype, device = _probe_dtype_device(model)
        fuse: dict[str, tuple] = {}
        done: list[str] = []
        skipped: list[tuple[str, str]] = []
        for name in names:
            module = model.get_submodule(name)
            if isinstance(module, FusedBatchNormAct):
                done.append(name)
                continue
            act_name, why = None, ""
            if not isinstance(module, nn.modules.batchnorm._BatchNorm):
                why = "is not a BatchNorm"
            elif has_hooks(module):
                why = "has hooks, which the fused op would not run"
            elif isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
                why = "is a lazy BatchNorm not yet initialised; run one forward first"
            elif _is_timm_bn_act(module):
                act = module.act
                if not isinstance(module.drop, nn.Identity):
                    why = "has dropout between BatchNorm and activation"
            elif type(module).forward is not nn.modules.batchnorm._BatchNorm.forward:
                why = f"{type(module).__name__} has a forward of its own"
            else:
                parent_name, _, attr = name.rpartition(".")
                parent = _rewrite.get_module(model, parent_name)
                keys = list(parent._modules)
                nxt = keys.index(attr) + 1
                if not isinstance(unwrap(parent), nn.Sequential):
                    why = "its output's consumer is not visible (not inside an nn.Sequential)"
                elif nxt == len(keys):
                    why = "is the last module of its nn.Sequential"
                else:
                    act_name = f"{parent_name}.{keys[nxt]}" if parent_name else keys[nxt]
                    act = parent._modules[keys[nxt]]
            if not why:
                spec, why = _act_spec(act, dtype, device)
            if why:
                skipped.append((name, why))
            else:
                fuse[name] = (act_name, spec)
        if not (fuse or done or explicit):
            detail = "; ".join(f"{n} {w}" for n, w in skipped[:3]) or "it has no BatchNorm"
            raise SelectionError(
                f"shrinkwrap: bn_act() found no BatchNorm followed by an activation in "
                f"{type(model).__name__} ({detail}). Leave bn_act() out of the plan."
            )
        return Targets([*done, *fuse], skipped, fuse)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        fuse = targets.payload
        undo = _rewrite.replace(model, [a for a, _ in fuse.values() if a], lambda n, m: FusedActivation(m))
        pairs = {}
        for bn, (a, _) in fuse.items():
            if a:
                parent, _, key = a.rpartition(".")
                act = model.get_submodule(a)
                pairs[bn] = act._sw_pair = _Pair(_rewrite.get_module(model, parent)._modules, key, act)
        undo += _rewrite.replace(model, list(fuse), lambda n, m: FusedBatchNormAct(m, pairs.get(n), fuse[n][1]))
        return undo


def apply_bn_act(model: nn.Module, pattern: Pattern | None = None) -> nn.Module:
    """Fuse each BatchNorm of ``model`` with the activation right after it, in place; return it.

    ``pattern`` picks the BatchNorm modules to consider (default: all). See :class:`BnAct` for
    what is found and :class:`FusedBatchNormAct` for what is exact. ``state_dict()`` keys do not
    change; ``shrinkwrap.revert(model)`` restores the BatchNorm and activation modules.

    Example::

        >>> apply_bn_act(torchvision.models.efficientnet_b0())
    """
    return BnAct(pattern).apply(require_module(model, "apply_bn_act()"))
