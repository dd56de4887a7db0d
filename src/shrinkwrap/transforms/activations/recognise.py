"""Recognising Swish, Mish, Hard-Swish and tanh-GELU by what a module computes, never by its class
name: a stateless, hook-free module is run on a probe input and compared, values and gradient, with
the native op. Both activation steps ask here."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._wrapper import TransparentWrapper, has_hooks
from ...select import CONTAINERS
from .efficient_swish import MemoryEfficientSwish


# The reference each candidate is compared against, and the module that replaces a hand-written
# form. Mish, Hard-Swish and tanh-GELU get the native module: it already keeps only its input.
_KINDS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], nn.Module]]] = {
    "swish": (F.silu, MemoryEfficientSwish),
    "mish": (F.mish, nn.Mish),
    "hardswish": (F.hardswish, nn.Hardswish),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), functools.partial(nn.GELU, approximate="tanh")),
}
_NATIVE: dict[type, str] = {nn.SiLU: "swish", nn.Mish: "mish", nn.Hardswish: "hardswish"}


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
    compared with four references, most of them unlike it, and building those messages took most
    of the time ``swish()`` spent probing a model of many stateless modules (autoplan applies a
    plan to each copy it measures, so the probe's time counts)."""
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
