"""Models and the backends that the compile step's test files share."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw

from toymodels import net64


EAGER = "aot_eager"  # no C++ compiler needed; the same ops as eager


class MLP(nn.Module):
    """Elementwise ops between the linears: what the min-cut partitioner may recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = self.a(x)
        h = torch.sin(h) * torch.cos(h) + torch.tanh(h)
        h = self.b(h)
        h = torch.sigmoid(h) * h + torch.exp(-h * h)
        return self.c(h)


class OtherMLP(MLP):
    """The same graph, another class: dynamo compiles it anew instead of reusing MLP's code."""


def _mlp(cls=MLP):
    torch.manual_seed(0)
    return cls()


class Block(nn.Module):
    """A block of a class of its own: its call is nn.Module._call_impl, as every module's is."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, width), nn.Linear(width, 4)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _steps(model, run, x, loss_fn, steps=2):
    """``steps`` SGD steps of ``run`` (``model``, or a compiled form of it) on ``x``: the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(run(x))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _train(plan):
    model = net64()  # float64, BatchNorm, dropout, in-place ReLU, kwargs
    if plan:
        sw.apply(model, plan)
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    losses = _steps(model, model, x, lambda out: F.cross_entropy(out, y))
    return losses, [p.grad for p in model.parameters()], [b for b in model.buffers()]


def _compiled_names(model):
    return [n for n, m in model.named_modules() if m.__dict__.get("_compiled_call_impl") is not None]
