"""Measuring in place: :func:`restored` gives the model back as it was, its parameters, buffers,
gradients, flags, and the state of an optimizer that steps it in backward."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from .._tree import tree_map
from .._wrapper import TransparentWrapper
from ..transforms.optimizer.interface import holds_no_gradient, trained_by
from .ranks import local


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[nn.Module]:
    """Give ``model`` back afterwards as it was: the same parameter and buffer objects with their
    values, gradients, devices and train/eval flags. Copies go to CPU memory, so measuring in
    place adds nothing to the device's count (a deepcopy on the GPU would); of an FSDP2 shard,
    only this rank's part is copied."""
    flags = [(m, m.training) for m in _all_modules(model)]
    slots = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    # Of a gradient only the values: holding the tensor would keep it on the device,
                    # and in the measured peak, through the whole measurement.
                    grad = _copy(t.grad)[1:] if t.grad is not None and not holds_no_gradient(t.grad) else None
                    slots.append((table, key, _copy(t), grad))
    handle = trained_by(model)
    states = _cpu_copy(handle.state_dict()) if handle is not None else None
    try:
        yield model
    finally:
        if handle is not None:
            handle.load_state_dict(states)  # the iterations stepped the model's own optimizer
        with torch.no_grad():
            for table, key, (t, dev, value), grad in slots:
                table[key] = t  # a forward may have swapped a buffer for a new tensor
                _put_back(t, dev, value)
                if grad is None:
                    t.grad = None
                elif t.grad is not None and _fits(local(t.grad), *grad):
                    local(t.grad).copy_(grad[1])  # into the gradient the last iteration made
                else:
                    t.grad = grad[1].to(grad[0])
        for m, mode in flags:
            m.training = mode


def _cpu_copy(state: Any) -> Any:
    return tree_map(lambda t: t.detach().to("cpu", copy=True), state)


def _copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.device, torch.Tensor]:
    """``t``, its device, and a CPU copy of what this rank holds of it (a DTensor's local shard)."""
    return t, t.device, local(t).detach().to("cpu", copy=True)


def _fits(held: torch.Tensor, device: torch.device, value: torch.Tensor) -> bool:
    return held.device == device and held.dtype == value.dtype and held.shape == value.shape


def _put_back(t: torch.Tensor, device: torch.device, value: torch.Tensor) -> None:
    """``t``'s values from ``value``: in place where it is still where it was, so that storage it
    shares stays shared (FSDP2's sharded parameters are views of its own buffers, which its
    all-gathers read); moved back otherwise."""
    held = local(t)
    if _fits(held, device, value):
        held.copy_(value)
    else:
        held.data = value.to(device)


def _all_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module, and the originals inside shrinkwrap's wrappers (they keep their own flags)."""
    for m in model.modules():
        yield m
        while isinstance(m, TransparentWrapper):
            m = m.wrapped
            yield m
