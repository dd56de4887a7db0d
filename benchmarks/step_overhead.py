"""What stepping inside backward costs the CPU a parameter, beside the plain loop: a model of many
small parameters on the CPU, where the per-step bookkeeping, not the arithmetic, is what the time
shows (on a GPU a backward that waits on the CPU pays it in full).

    python benchmarks/step_overhead.py      # prints the median iteration of each, and the difference a parameter
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)) for _ in range(100)])  # 400 parameters


def main() -> int:
    torch.set_num_threads(1)
    x = torch.randn(8, 32)
    medians = {}
    for name, plan in (("plain AdamW", None), ("in backward", "step_in_backward(torch.optim.AdamW)")):
        m = model()
        opt = torch.optim.AdamW(m.parameters(), foreach=False) if plan is None else sw.optimizer(sw.apply(m, plan))
        times = []
        for _ in range(30):
            start = time.perf_counter()
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times[5:]) * 1e3
    n = sum(1 for _ in model().parameters())
    for name, ms in medians.items():
        print(f"{name}: {ms:.2f} ms an iteration")
    print(f"in backward over plain: {(medians['in backward'] - medians['plain AdamW']) / n * 1e3:.0f} µs a parameter "
          f"({n} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
