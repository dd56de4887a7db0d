"""How a model travels to a fresh process and is built there: a factory, or copies of an instance
(:class:`ModelCopies`), and a plan's model made on the device (:func:`build_model`)."""

from __future__ import annotations

import copy
import io
from typing import Callable

import torch
import torch.nn as nn

from ..plan import Plan
from ..select import wrong


class ModelCopies:
    """Fresh copies of one model instance, so the user's own model is never touched.

    In this process a copy is a ``deepcopy`` (given a ``device``, made there directly: see
    :func:`_copy_onto`); sent to a subprocess, the model travels as ``torch.save`` bytes loaded onto
    the CPU (no CUDA memory shared between processes).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__name__ = type(model).__name__

    def __call__(self, device: torch.device | None = None) -> nn.Module:
        return copy.deepcopy(self.model) if device is None else _copy_onto(self.model, device)

    def __getstate__(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.model, buf)
        return {"blob": buf.getvalue(), "name": self.__name__}

    def __setstate__(self, state: dict) -> None:
        self.model = torch.load(io.BytesIO(state["blob"]), map_location="cpu", weights_only=False)
        self.__name__ = state["name"]


def model_maker(model_or_factory: nn.Module | Callable[[], nn.Module], where: str) -> Callable[[], nn.Module]:
    """A function returning a fresh model each call: the factory itself, or copies of an instance;
    ``where`` names the public function for the message if it is neither."""
    if isinstance(model_or_factory, nn.Module):
        return ModelCopies(model_or_factory)
    if callable(model_or_factory):
        return model_or_factory
    raise TypeError(wrong(where, "a model or a function returning one", model_or_factory))


def _copy_onto(model: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are made on ``device`` straight from
    the originals, not cloned on the CPU first and then moved: the faster copy, made for every
    row autoplan measures in this process (docs/architecture.md, "autoplan's processes").
    Parameter subclasses, tensors with a gradient, and tensors sharing memory take the plain
    path, which keeps what they are."""
    originals = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    storages = [t.untyped_storage().data_ptr() for t in originals if t.numel()]
    if len(set(storages)) < len(storages) or any(
            type(t) not in (torch.Tensor, nn.Parameter) or t.grad is not None or t.layout != torch.strided
            for t in originals):
        return copy.deepcopy(model).to(device)
    memo: dict = {}
    for t in originals:
        new = t.detach().to(device, copy=True)
        new = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new.requires_grad_(t.requires_grad)
        new.__dict__.update(copy.deepcopy(t.__dict__, memo))
        memo[id(t)] = new
    return copy.deepcopy(model, memo)


def build_model(make: Callable[[], nn.Module], device: torch.device, plan: Plan) -> nn.Module:
    model = make(device) if isinstance(make, ModelCopies) else make()
    if not isinstance(model, nn.Module):
        raise TypeError(f"shrinkwrap: the model factory returned {type(model).__name__}, not an nn.Module")
    return plan.apply(model.to(device))
