"""Models, batches and scripted rows that several of autoplan's test files share."""

import torch
import torch.nn as nn

import shrinkwrap as sw


class Naive(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def mlp() -> nn.Module:
    """Four identical residual-free MLP blocks inside a Sequential, with naive Swish."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 128), Naive(), nn.Linear(128, 32), nn.LayerNorm(32)) for _ in range(4)]
    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*blocks), nn.Linear(32, 4))


BATCH = torch.randn(64, 16)
FAST = dict(iterations=1, warmup=1, device="cpu")


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


def _rows(figures):
    """Rows of constructed figures: plan text -> (memory, step ms); the metric reads the memory."""
    import dataclasses

    from shrinkwrap.report import Row

    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    rows = [Row(sw.Plan.parse(text), dataclasses.replace(prof, step_ms=ms), role="chosen")
            for text, (_, ms) in figures.items()]
    return rows, lambda r: figures[str(r.plan)][0]


def _effects_table(*rows):
    """Effects from (name, covers, saving, cost) rows: constructed, not measured."""
    from shrinkwrap.autoplan.choose import Effect
    from shrinkwrap.step import Candidate

    return [Effect(Candidate((sw.checkpoint(name),), covers), saving, cost) for name, covers, saving, cost in rows]
