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


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, narrowed: conv-bn-relu-conv-bn, a downsampling shortcut."""

    def __init__(self, c_in: int, c: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.downsample = None
        if stride != 1 or c_in != c:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet shape, narrowed: the stem conv1 -> bn1 -> relu (in place) -> maxpool, called
    one after another by the root's forward, then two stages of BasicBlocks. ``stem_dropout`` puts a
    Dropout between relu and maxpool (registered there too)."""

    def __init__(self, c: int = 8, classes: int = 3, stem_dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(stem_dropout) if stem_dropout else None
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(c, c), BasicBlock(c, c))
        self.layer2 = nn.Sequential(BasicBlock(c, 2 * c, 2), BasicBlock(2 * c, 2 * c))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        if self.drop is not None:
            x = self.drop(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet64(seed: int = 0, **kw) -> ResNet:
    torch.manual_seed(seed)
    return ResNet(**kw).double()


def below(backward):
    """An identity in forward whose backward hands ``backward(grad)`` to what lies below it: a NaN
    gradient, an error halfway through backward."""

    class Below(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return backward(g)

    return Below.apply
