"""Binding the model's parameters to the handle: an optimizer and a hook for each parameter that
requires grad, bound again where the model holds another object under a name (FSDP2's shards, an
unfrozen parameter, an adapter added, the model moved or cast). Mixed into
:class:`~.handle.InBackward`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from ... import _rewrite
from .backward import _HOW
from .cpu import _OnCpu, _one_optimizer


def _signature(p: torch.Tensor) -> tuple:
    return p.device, p.dtype, tuple(p.shape)


class Binding:
    """The parameters' optimizers and hooks, taken from the model as it is now."""

    def bind(self, model: nn.Module) -> None:
        """Take the model's parameters as they are now: every parameter joins the first group, and
        each that requires grad gets an optimizer and the hook, where it has none or the model
        holds another object under its name, or the same one on another device or dtype, than
        when it got one (at apply; after FSDP2's fully_shard swapped them; after a parameter was
        unfrozen, an adapter added, the model moved)."""
        named = dict(model.named_parameters())
        # Under FSDP2 the model holds its sharded parameters between forwards and the unsharded ones
        # while a module runs: the step takes the sharded one, whose reduced gradient FSDP2 hands to
        # the hooks.
        sharded = bool(_rewrite.sharded(model))
        changed = list(named) != self.names and not sharded
        for n, p in named.items():
            if sharded and getattr(p, "_local_tensor", None) is None:
                continue
            if self.params.get(n) is not p:
                self.params[n], changed = p, True
            then = self.bound.get(n)
            if p.requires_grad and (then is None or then[0] is not p or then[1] != _signature(p)):
                self._bind_one(n, p)
                changed = True
        if not changed:
            return
        if not sharded:
            for n in [n for n in self.params if n not in named]:
                self._unbind(n)
            self.names = list(named)
        else:
            self.names = [n for n in named if n in self.params]
        self._regroup()
        self.together.clear()
        self.grad_bytes = sum(p.numel() * p.element_size() for n, p in self.params.items() if n in self.optimizers)

    def _bind_one(self, n: str, p: torch.Tensor) -> None:
        old = self.optimizers.get(n)
        if old is not None and any(old.state.values()):
            then = self.bound[n]
            what = ("was replaced (by sharding?)" if then[0] is not p else
                    f"moved from {then[1][0]} {then[1][1]} to {p.device} {p.dtype}")
            raise RuntimeError(f"shrinkwrap: parameter {n!r} {what} after training began; its optimizer state "
                               "cannot follow it. Shard, move or cast the model before its first step, or load the "
                               "handle's state_dict() again after.")
        if n in self.hooks:
            self.hooks.pop(n).remove()
        if self.on_cpu and getattr(p, "_local_tensor", None) is not None:
            raise RuntimeError(f"shrinkwrap: step_in_backward(state='cpu') does not take FSDP2's sharded parameters "
                               f"({n!r}); use state='device', whose step takes each rank's shard")
        if self.on_cpu and self.rounding == "stochastic" and p.dtype == torch.float16:
            raise ValueError(f"shrinkwrap: step_in_backward(rounding='stochastic') rounds the master copy to "
                             f"bfloat16, and {n!r} is float16: use half(torch.bfloat16), or rounding='nearest'")
        on = _OnCpu(p, self.cls, self.options) if self.on_cpu else None
        # A DTensor (FSDP2's shard) keeps the single-tensor step: torch's fused kernels are
        # not among the operations DTensor shards in every version.
        new = on.optimizer if on else _one_optimizer(
            self.cls, p, self.options, fused=p.is_cuda and getattr(p, "_local_tensor", None) is None)
        if old is not None:
            group = old.param_groups[0]
            # The dict the optimizer held, stepping as the new optimizer does (fused where the new
            # one took a GPU tensor, a shard's single-tensor step otherwise).
            group.update({k: v for k, v in new.param_groups[0].items() if k in ("params", *_HOW)})
            new.param_groups[0] = group
        if on is not None:
            self.cpu[n] = on
        self.optimizers[n], self.bound[n] = new, (p, _signature(p))
        if n in self.pending:
            self._load_one(n, self.pending.pop(n))
        self.hooks[n] = p.register_post_accumulate_grad_hook(self._hook(n))

    def _unbind(self, n: str) -> None:
        if n in self.hooks:
            self.hooks.pop(n).remove()
        for table in (self.params, self.optimizers, self.bound, self.cpu, self.pending, self.group_of):
            table.pop(n, None)

    def _rebind(self) -> None:
        model = self.model()
        if model is not None:
            self.bind(model)

    def _hook(self, name: str) -> Any:
        # The hook reaches the handle through a weak reference: a tensor's hooks are held from C++,
        # where the garbage collector cannot see them, so a handle -> parameter -> hook -> handle
        # cycle would never be collected, and a model dropped without revert() would keep its
        # parameters and optimizer state on the GPU.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            handle = ref()
            if handle is not None:  # else the model and its handle are gone
                handle._arrived(name, p)
        return hook
