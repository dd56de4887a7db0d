"""What is refused before any parameter changes: an optimizer class that cannot step a parameter
at a time in backward (probed at apply), and ``GradScaler.scale`` on a loss whose backward would
step scaled gradients."""

from __future__ import annotations

import functools
import importlib
import weakref
from typing import Any

import torch

from .lowbit import LowBitAdamW

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the handles alive (InBackward), for the GradScaler guard


def per_parameter_options(cls: type, options: dict) -> dict:
    """``options`` with ``foreach=False`` where ``cls`` takes it: an optimizer over one tensor has
    nothing to group (a class without the keyword, most third-party ones, takes ``options`` as given)."""
    try:
        cls([torch.zeros(1, requires_grad=True)], **{**options, "foreach": False})
    except TypeError:
        return dict(options)
    return {**options, "foreach": False}


def guard_grad_scaler() -> None:
    """``GradScaler.scale`` refuses a loss of a model whose optimizer steps in backward, before its
    backward steps the scaled gradients: torch's, and FSDP's ``ShardedGradScaler``, which has a
    ``scale`` of its own (installed with each handle, once a class)."""
    sharded = None
    if torch.distributed.is_available():
        try:
            sharded = importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")
        except ImportError:
            pass
    for cls in (torch.amp.GradScaler, getattr(sharded, "ShardedGradScaler", None)):
        if cls is not None and not getattr(cls.__dict__.get("scale"), "_sw_guard", False) and "scale" in cls.__dict__:
            _guard(cls)


def _guard(cls: type) -> None:
    original = cls.scale

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        if getattr(self, "_enabled", True) and len(_LIVE):
            _refuse_scaled(outputs)
        return original(self, outputs)

    scale._sw_guard = True  # type: ignore[attr-defined]
    cls.scale = scale


def _refuse_scaled(outputs: Any) -> None:
    """Raise where the graph behind ``outputs`` reaches a parameter a live handle steps, or where a
    handle steps FSDP2's shards (whose graph holds the unsharded parameters instead)."""
    handles = list(_LIVE)
    stepped = {id(p) for h in handles for p in h.params.values()}
    reached = any(getattr(p, "_local_tensor", None) is not None for h in handles for p in h.params.values())
    roots = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    while todo and not reached:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        reached = id(getattr(node, "variable", None)) in stepped
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    if reached:
        raise RuntimeError(
            "shrinkwrap: GradScaler.scale() on a loss of a model whose optimizer steps inside backward "
            "(step_in_backward()): backward would step each parameter with the scaled gradient before the "
            "scaler could unscale or skip it. Train in bfloat16 (autocast(torch.bfloat16) needs no scaler), "
            "or leave step_in_backward() out of the plan (shrinkwrap.revert(model)).")


def check_class(cls: type, options: dict, device: torch.device) -> None:
    """Refuse, before any change, a class whose step cannot run a parameter at a time in backward:
    LBFGS (a closure evaluated again within a step), a class whose update of several parameters
    differs from its update of each alone (a global gradient norm, LAMB-style), one that cannot
    step without a closure. torch's classes and :class:`LowBitAdamW` update each parameter alone."""
    if cls is torch.optim.LBFGS:
        raise ValueError("shrinkwrap: step_in_backward(torch.optim.LBFGS): LBFGS evaluates the loss again within a "
                         "step through a closure, which cannot run inside backward; train with it as a plain "
                         "optimizer (leave step_in_backward() out of the plan)")
    if cls.__module__.startswith("torch.optim") or cls is LowBitAdamW:
        return
    options = per_parameter_options(cls, options)
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,)]
    start = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(3)]
    together = [t.clone().to(device).requires_grad_(True) for t in start]
    alone = [t.clone().to(device).requires_grad_(True) for t in start]
    try:
        opts = [cls(together, **options)] + [cls([p], **options) for p in alone]
        for step in grads:
            for p, q, grad in zip(together, alone, step):
                p.grad, q.grad = grad.to(device), grad.to(device)
            for opt in opts:
                opt.step()
    except Exception as exc:  # noqa: BLE001 - the class's own message, before any change
        raise ValueError(f"shrinkwrap: step_in_backward({cls.__qualname__}) steps each parameter alone, without a "
                         f"closure; {cls.__qualname__} could not step two small tensors so on {device}: {exc}") from None
    if not all(torch.equal(p, q) for p, q in zip(together, alone)):
        raise ValueError(f"shrinkwrap: step_in_backward({cls.__qualname__}): its update of two parameters together "
                         "differs from its update of each alone (a norm over all the gradients, as LAMB-style or "
                         "clipping optimizers take), and the step in backward steps each alone. Train with it as a "
                         "plain optimizer (leave step_in_backward() out of the plan).")
