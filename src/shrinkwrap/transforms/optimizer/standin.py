"""What ``.grad`` holds once the step in backward used a gradient: :class:`Consumed`, a stand-in
with no data that keeps the gradient's 2-norm and largest magnitude. What the norms answer works
(logging the global norm, clipping within the limit by norm or by value); what needs the values
raises, naming what the user did and the way out.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ... import _compat

_LEAVE = ("or leave step_in_backward() out of the plan (shrinkwrap.revert(model)) and use a plain optimizer")


def message(what: str, fix: str) -> str:
    """A refusal: what the user did, that the gradients were applied in backward, and the way out."""
    return (f"shrinkwrap: {what}: this model's optimizer steps inside backward (step_in_backward()), which "
            f"applied each gradient there and dropped it. {fix}, {_LEAVE}.")


_ACCUMULATE = ("a backward into gradients that no zero_grad() cleared (gradient accumulation over micro-batches, "
               "two losses' backwards, a GAN's generator loss through the discriminator)", "Sum the losses and call backward once a step, or train on the whole "
               "batch at once (checkpointing frees the memory a larger batch needs)")


class Consumed(torch.Tensor):
    """What ``.grad`` holds after the step in backward used it: a tensor of the gradient's shape,
    dtype and device with no data, and the gradient's 2-norm and largest magnitude, kept before
    it was dropped. Its norms are answered (``clip_grad_norm_`` of order 2 or inf, a loop or the
    Trainer logging them), and clipping that would change nothing (by norm within the limit, by
    value above the largest magnitude) changes nothing; anything else raises, naming the step.
    ``zero_()`` (``zero_grad(set_to_none=False)``) makes it a zero gradient's stand-in, which the
    next forward drops."""

    _sw_consumed = True

    @staticmethod
    def __new__(cls, like: torch.Tensor, norm: torch.Tensor, peak: torch.Tensor, name: str = "",
                device: torch.device | None = None, stepped: bool = True) -> "Consumed":
        # A storage of no bytes: what counts storages (torch's MemTracker, shrinkwrap.estimate) sees none.
        out = _compat.wrapper_subclass(cls, like, device or like.device)
        out._sw_norm, out._sw_max, out._sw_name, out._sw_stepped = norm, peak, name, stepped
        return out

    __torch_function__ = _compat.disabled_torch_function()

    def __deepcopy__(self, memo: dict) -> "Consumed":
        return Consumed(self, self._sw_norm.clone(), self._sw_max.clone(), self._sw_name, stepped=self._sw_stepped)

    @property
    def zeroed(self) -> bool:
        """Whether this stands for a gradient of zeros (``zero_grad(set_to_none=False)``)."""
        return getattr(self, "_sw_zero", False)

    def _norm(self, order: float) -> torch.Tensor:
        return self._sw_max if math.isinf(order) else self._sw_norm

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        first = args[0] if args else None
        tensors = first if isinstance(first, (list, tuple)) else [first]
        mine = [t for t in tensors if isinstance(t, Consumed)]
        if name in ("linalg_vector_norm", "_foreach_norm") and len(mine) == len(tensors):
            order = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
            if order in (2.0, math.inf):
                out = [t._norm(order).to(kwargs.get("dtype") or t.dtype) for t in mine]
                return out if name == "_foreach_norm" else out[0]
        if name in _VIEWS:  # what a DTensor makes of its shard: another stand-in, the same norms
            meta = func(torch.empty(first.shape, dtype=first.dtype, device="meta"), *args[1:], **kwargs)
            return Consumed(meta, first._sw_norm, first._sw_max, first._sw_name, first.device, first._sw_stepped)
        if name == "detach_":  # nn.Module.zero_grad(set_to_none=False) detaches before zeroing
            return first
        if name == "_to_copy":  # a model cast or moved with its gradients: their stand-ins follow it
            like = torch.empty(first.shape, dtype=kwargs.get("dtype") or first.dtype, device="meta")
            return Consumed(like, first._sw_norm, first._sw_max, first._sw_name, kwargs.get("device") or first.device,
                            first._sw_stepped)
        if name in ("zero_", "_foreach_zero_"):
            for t in mine:
                t._sw_zero = True
                t._sw_norm, t._sw_max = torch.zeros_like(t._sw_norm), torch.zeros_like(t._sw_max)
            return None if name.startswith("_foreach") else first
        if mine and all(t.zeroed or not t._sw_stepped for t in mine) and name in _SCALES:
            # Zeros, or a gradient a backward stopped at a non-finite one did not step: clipping it
            # (a guard's clip_grad_norm_ over a non-finite total) changes nothing the step used.
            return _same(name, first)
        if name in ("mul_", "_foreach_mul_"):
            # Within the limit; or over a total that is NaN, which only a non-finite gradient
            # makes, and that backward's steps stopped at it.
            if _factor_is(args[1], lambda f: f == 1.0 or math.isnan(f)):
                return _same(name, first)
            total = _factor_text(args[1])
            raise RuntimeError(message(f"clip_grad_norm_ above its limit (it scales {_named(mine)} by {total})",
                                       "Clip with a max_norm above the global norm, which clip_grad_norm_ returns "
                                       "(logging it works), or set the Trainer's max_grad_norm=0"))
        if name in _CLAMPS:
            low, high = _bounds(name, args, kwargs)
            if all((low is None or -low >= float(t._sw_max)) and (high is None or high >= float(t._sw_max))
                   for t in mine):
                return _same(name, first) if not name.endswith("clamp") else first  # within the limit
            raise RuntimeError(message(f"clip_grad_value_ below the largest magnitude of {_named(mine)}",
                                       "Clip by value above it, or by norm within the limit"))
        if name in ("add_", "add", "_foreach_add_", "_foreach_add"):
            raise RuntimeError(message(f"{_ACCUMULATE[0]}: the gradient of {_named(mine)} was added to",
                                       _ACCUMULATE[1]))
        if name == "_amp_foreach_non_finite_check_and_unscale_":
            raise RuntimeError(message("GradScaler.unscale_() or step()", "Train in bfloat16 (autocast("
                                       "torch.bfloat16) needs no GradScaler)"))
        raise RuntimeError(message(f"reading the gradient of {_named(mine)} ({func})",
                                   "Read the norm instead (torch.linalg.vector_norm(p.grad), clip_grad_norm_ with "
                                   "max_norm=inf), check the loss before backward to skip a batch"))

    def __repr__(self) -> str:  # type: ignore[override]
        what = "a zero gradient" if self.zeroed else "a gradient used and dropped by the optimizer step in backward"
        return f"<shrinkwrap: {what}>"


_VIEWS = ("view", "alias", "detach", "_unsafe_view")
_SCALES = ("mul_", "_foreach_mul_", "clamp_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_",
           "_foreach_clamp_max_")
_CLAMPS = ("clamp_", "clamp", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_")


def _same(name: str, first: Any) -> Any:
    """What an in-place op that changed nothing returns: its tensor, or None for a foreach op."""
    return None if name.startswith("_foreach") else first


def _named(stand_ins: list[Consumed]) -> str:
    names = [repr(t._sw_name) for t in stand_ins if t._sw_name]
    if not names:
        return "a parameter"
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def _factors(factor: Any) -> list[float]:
    factors = factor if isinstance(factor, (list, tuple)) else [factor]
    return [float(f.item() if isinstance(f, torch.Tensor) else f) for f in factors]


def _factor_is(factor: Any, test: Any) -> bool:
    return all(test(f) for f in _factors(factor))


def _factor_text(factor: Any) -> str:
    return f"{min(_factors(factor)):.3g}"


def _bounds(name: str, args: tuple, kwargs: dict) -> tuple[float | None, float | None]:
    """The (min, max) a clamp applies, either None where it applies none."""
    value = lambda v: None if v is None else float(v.item() if isinstance(v, torch.Tensor) else v)  # noqa: E731
    if name.endswith("clamp_min_"):
        return value(args[1]), None
    if name.endswith("clamp_max_"):
        return None, value(args[1])
    return (value(args[1] if len(args) > 1 else kwargs.get("min")),
            value(args[2] if len(args) > 2 else kwargs.get("max")))


def norms(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each gradient's 2-norm and largest magnitude (float32 at least, as ``clip_grad_norm_``
    takes them), two launches a device and dtype: a launch a gradient costs the CPU more than a backward
    that keeps the GPU waiting can spare. A sparse gradient's come from its values."""
    two: list[Any] = [None] * len(grads)
    peak: list[Any] = [None] * len(grads)
    by_kind: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if g.is_sparse:
            values = g.coalesce().values()
            wide = torch.promote_types(g.dtype, torch.float32)
            two[i] = torch.linalg.vector_norm(values, 2, dtype=wide)
            peak[i] = torch.linalg.vector_norm(values, math.inf, dtype=wide) if values.numel() else two[i] * 0
            continue
        by_kind.setdefault((g.device, g.dtype), []).append(i)
    for (_, dtype), at in by_kind.items():
        wide = torch.promote_types(dtype, torch.float32)
        group = [grads[i].detach() for i in at]
        for out, order in ((two, 2), (peak, math.inf)):
            for i, norm in zip(at, _compat.foreach_norm(group, order, wide)):
                out[i] = norm
    return two, peak


def stand_in(p: torch.Tensor, name: str, norm: torch.Tensor, peak: torch.Tensor, stepped: bool = True) -> torch.Tensor:
    """The stand-in for ``p``'s gradient (``stepped``: the step applied it): of a DTensor (FSDP2's
    sharded parameter), a DTensor over a stand-in of this rank's shard."""
    local = getattr(p, "_local_tensor", None)
    if local is None:
        return Consumed(p, norm, peak, name, stepped=stepped)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(Consumed(local, norm, peak, name, stepped=stepped), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def is_stand_in(t: Any) -> bool:
    """Whether ``t`` (a gradient, or a DTensor over one) is a stand-in."""
    return getattr(type(getattr(t, "_local_tensor", t)), "_sw_consumed", False)


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)
