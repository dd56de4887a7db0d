"""The ``bn_act`` step: a BatchNorm and the elementwise activation right after it as one op that
keeps only the BatchNorm input (and the per-channel batch statistics) and recomputes normalisation
and activation in backward: one activation-sized tensor fewer per pair."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ... import _rewrite
from ..._wrapper import TRACED_REGIONS, TransparentWrapper, functorch_level, has_hooks, unwrap
from ...select import Pattern, SelectionError, require_module, select
from ...step import Targets
from .base import _WholeModelStep
from .recognise import _ONE_OP, _activation_kind, _probe_dtype_device

aten = torch.ops.aten


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
