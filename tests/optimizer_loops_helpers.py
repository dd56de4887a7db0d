"""The plain loop, data and comparisons that step_in_backward's loop test files share: float64 on the CPU, AdamW with
foreach off."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

import shrinkwrap as sw
from toymodels import Net


OPTIONS = {"lr": 0.01, "weight_decay": 0.1}
STATES = ["device", "cpu"]
S = torch.optim.lr_scheduler


def _batch(i: int = 0) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    torch.manual_seed(100 + i)  # dropout, if any
    return model(_batch(i)).square().mean()


def plain_step(model, opt, i):
    opt.zero_grad()
    _loss(model, i).backward()
    opt.step()


def _steps(n: int, step: Callable = plain_step) -> Callable:
    def loop(model, opt, sched=None):
        for i in range(n):
            step(model, opt, i)
            if sched is not None:
                sched.step() if not isinstance(sched, S.ReduceLROnPlateau) else sched.step(1.0 / (i + 1))
    return loop


def _pair(state: str, cls: type = torch.optim.AdamW, options: dict = OPTIONS, make: Callable = None,
          plain: Callable = None) -> tuple:
    """(the plain loop's model, its optimizer, the plan's model, its handle), alike at the start."""
    torch.manual_seed(0)
    ref = (make or (lambda: Net().double()))()
    model = copy.deepcopy(ref)
    foreach = {"foreach": False} if cls.__module__.startswith("torch.optim") else {}
    opt_ref = plain(ref) if plain else cls(ref.parameters(), **foreach, **options)
    sw.apply(model, sw.step_in_backward(cls, options, state=state))
    return ref, opt_ref, model, sw.optimizer(model)


def _same(a: nn.Module, b: nn.Module) -> None:
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n


def _beside(state: str, loop: Callable, **kw: Any) -> tuple:
    ref, opt_ref, model, opt = _pair(state, **kw)
    loop(ref, opt_ref)
    loop(model, opt)
    _same(ref, model)
    return ref, opt_ref, model, opt


def _same_dict(before: dict, model: nn.Module) -> None:
    for k, v in before.items():
        assert torch.equal(v, model.state_dict()[k]), k
