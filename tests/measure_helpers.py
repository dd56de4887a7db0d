"""The model and the quick measuring options that several of the measuring harness's test files share."""

import torch
import torch.nn as nn


FAST = dict(iterations=1, warmup=1, device="cpu")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
