"""Tiny models shared by the tests: BatchNorm, Dropout, in-place ReLU, residual adds, kwargs."""

import torch
import torch.nn as nn


class Block(nn.Module):
    """A residual block whose forward takes kwargs, a nested dict of tensors, and ends in relu_."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x, *, scale=1.0, extra=None):
        out = self.drop(self.relu(self.bn1(self.conv1(x))))
        out = self.bn2(self.conv2(out)) * scale
        if extra is not None:
            out = out + extra["bias"][0]
        return self.relu(out + x)


class Net(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.layer1 = Block(c)
        self.layer2 = Block(c)
        self.layer3 = Block(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x, scale=1.0):
        x = self.stem(x)
        bias = torch.linspace(-0.1, 0.1, x.shape[1], dtype=x.dtype, device=x.device)[None, :, None, None]
        x = self.layer1(x, scale=scale, extra={"bias": (bias,)})
        x = self.layer2(x, scale=scale)
        x = self.layer3(x)
        return self.head(x.mean((2, 3)))


def net64(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()
