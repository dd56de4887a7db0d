"""Hand-written activations and the models and runs that the activation test files share."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


F64 = torch.float64


# -- hand-written activations, as found in the wild -------------------------------------------


class NaiveSwish(nn.Module):  # EfficientNet-PyTorch's Swish
    def forward(self, x):
        return x * torch.sigmoid(x)


class NewGELU(nn.Module):  # Hugging Face's NewGELUActivation (GPT-2's gelu_new), as written there
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class DetachedSwish(nn.Module):  # Swish's values, not its gradient
    def forward(self, x):
        return x * torch.sigmoid(x).detach()


def mlp(act=NaiveSwish, n=3, width=16):
    layers = [nn.Linear(width, width)]
    for _ in range(n):
        layers += [act(), nn.Linear(width, width)]
    return nn.Sequential(*layers).to(F64)


def conv_stack(act=lambda: nn.SiLU(inplace=True), blocks=3, ch=8, bn=nn.BatchNorm2d, **bn_kw):
    layers, cin = [], 3
    for _ in range(blocks):
        layers += [nn.Conv2d(cin, ch, 3, padding=1, bias=False), bn(ch, **bn_kw), act()]
        cin = ch
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 5)).to(F64)


def run(model, x, steps=2):
    """Forward+backward a few times; return outputs, input grad, param grads and buffers."""
    x = x.detach().clone().requires_grad_()
    outs = []
    for _ in range(steps):
        y = model(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)).sum().backward()
        outs.append(y.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return outs, x.grad, grads, {n: b.clone() for n, b in model.named_buffers()}


TIGHT = dict(rtol=1e-13, atol=1e-13)  # float64: rounding only (bn_act recomputes in another order)


def assert_same_run(a, b, **tol):
    tol = tol or TIGHT
    for u, v in zip(a[0], b[0]):
        torch.testing.assert_close(u, v, **tol)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert a[2].keys() == b[2].keys() and a[3].keys() == b[3].keys()
    for k in a[2]:
        torch.testing.assert_close(a[2][k], b[2][k], **tol)
    for k in a[3]:
        torch.testing.assert_close(a[3][k], b[3][k], **tol, msg=k)
