"""Apply a plan to a small built-in model and show what changed (no GPU, no downloads)."""

import torch
import torch.nn as nn

import shrinkwrap as sw


def block(c: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True))


model = nn.Sequential(block(8), block(8), block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
x = torch.randn(16, 8, 32, 32)

before = sw.saved_tensor_bytes(lambda: model(x).sum())
plan = sw.Plan([sw.checkpoint(r"[01]")])
sw.apply(model, plan)
after = sw.saved_tensor_bytes(lambda: model(x).sum())

print(f"plan: {plan}")
print(model)
for rec in sw.records(model):
    print(f"{rec.step}: matched {', '.join(rec.matched)}")
print(f"saved for backward: {before / 2**20:.2f} MiB before, {after / 2**20:.2f} MiB after")
