"""A small built-in EfficientNet-style model for the demo and the tests (no downloads).

It is written the way much EfficientNet code in the wild is: a hand-written Swish module
(``x * torch.sigmoid(x)``, which keeps two tensors for backward), Conv-BN-activation blocks in
``nn.Sequential``, squeeze-and-excite, and residual inverted-bottleneck blocks. About 0.37 M
parameters (1.4 MiB); a training step at batch 8 on 32x32 images takes tens of milliseconds on
a laptop CPU.

Example::

    >>> from shrinkwrap.models import tiny_efficientnet
    >>> model = tiny_efficientnet()
    >>> model(torch.randn(2, *tiny_efficientnet.input_shape)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Swish(nn.Module):
    """Swish written by hand, as in many EfficientNet ports: ``x * sigmoid(x)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


def conv_bn_act(c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """Conv -> BatchNorm -> Swish, the pattern ``bn_act`` fuses."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        Swish(),
    )


class SqueezeExcite(nn.Module):
    """Channel attention: scale each channel by a gate computed from the pooled features."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.act = Swish()
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(self.act(self.reduce(s))))


class MBConv(nn.Module):
    """Inverted bottleneck: expand (1x1), depthwise (kxk), squeeze-excite, project (1x1); a
    residual connection when the shape allows."""

    def __init__(self, c_in: int, c_out: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = c_in * expand
        self.expand = conv_bn_act(c_in, mid) if expand != 1 else nn.Identity()
        self.depthwise = conv_bn_act(mid, mid, kernel, stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, c_in // 4))
        self.project = nn.Sequential(nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


# (expand ratio, channels out, repeats, stride, kernel) per stage, EfficientNet-B0's recipe, narrowed.
_STAGES = ((1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 2, 2, 3), (6, 112, 1, 1, 5))


class TinyEfficientNet(nn.Module):
    """An EfficientNet-B0-shaped network, narrowed: stem, ``blocks.0`` .. ``blocks.7``, head, classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = conv_bn_act(3, 32, 3, 2)
        blocks, c_in = [], 32
        for expand, c_out, repeats, stride, kernel in _STAGES:
            for i in range(repeats):
                blocks.append(MBConv(c_in, c_out, expand, kernel, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = conv_bn_act(c_in, 320)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(320, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(torch.flatten(self.pool(x), 1))


def tiny_efficientnet(num_classes: int = 10) -> TinyEfficientNet:
    """The built-in demo model, randomly initialised (seeded, so every call gives the same weights)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TinyEfficientNet(num_classes)


# One sample's shape, read by `shrinkwrap profile shrinkwrap.models:tiny_efficientnet`.
tiny_efficientnet.input_shape = (3, 32, 32)  # type: ignore[attr-defined]

DEMO_PLAN = r"swish(), bn_act(), checkpoint(r'blocks\.\d+'), autocast(torch.bfloat16)"
