"""Check shrinkwrap's numbers against a plain measurement: torchvision resnet18, batch 128, CUDA.

Three configurations, each measured by hand in its own fresh process, without shrinkwrap's harness
or transforms (plain ``torch.utils.checkpoint`` and ``torch.autocast``):

    baseline            the model as torchvision builds it
    checkpoint          non-reentrant checkpoint around layer1..layer4
    checkpoint+bf16     the same, forward under torch.autocast(bfloat16)

One training step is zero_grad(set_to_none) + forward + cross-entropy + backward + AdamW step;
after ``--warmup`` steps, gc + empty_cache + reset_peak_memory_stats, then one step, and the
peak is ``torch.cuda.max_memory_allocated``. Then ``sw.plan_report`` runs the same plan
(``checkpoint('layer[1-4]'), autocast(torch.bfloat16)``) and both are printed side by side with
their ratio. The target: every row's peak within 3%. Exit status 1 if one is not.

    python benchmarks/independent_resnet18.py [--batch 128] [--warmup 3] [--json results.json]

Needs a CUDA GPU and torchvision.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CONFIGS = ("baseline", "checkpoint", "checkpoint+bf16")
PLAN = "checkpoint('layer[1-4]'), autocast(torch.bfloat16)"
TOLERANCE = 0.03
MiB = 2**20


class CrossEntropy:
    """The loss both sides use; labels move to the GPU once and stay, as in the plain script."""

    def __init__(self, batch: int) -> None:
        self.labels = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1))
        self.on_device: torch.Tensor | None = None

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.on_device is None:
            self.on_device = self.labels.to(out.device)
        return F.cross_entropy(out.float(), self.on_device)


class Checkpointed(nn.Module):
    """The textbook recipe: non-reentrant torch.utils.checkpoint around a module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=False)


def measure_one(config: str, batch: int, warmup: int, timed: int = 5) -> dict:
    """Measure one configuration in this (fresh) process, by hand."""
    import torchvision

    model = torchvision.models.resnet18().cuda().train()
    if config.startswith("checkpoint"):
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, Checkpointed(getattr(model, name)))
    bf16 = config.endswith("bf16")
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)).cuda()
    loss_fn = CrossEntropy(batch)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        loss_fn(out).backward()
        opt.step()

    for _ in range(warmup):
        step()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    static = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    times = []
    for _ in range(timed):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"config": config, "peak": peak, "static": static, "step_ms": statistics.median(times)}


def independent(config: str, batch: int, warmup: int) -> dict:
    """Run :func:`measure_one` in a fresh interpreter, so nothing of another configuration leaks in."""
    run = subprocess.run(
        [sys.executable, __file__, "--one", config, "--batch", str(batch), "--warmup", str(warmup)],
        capture_output=True, text=True, check=False,
    )
    if run.returncode:
        raise SystemExit(f"independent measurement of {config} failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write both sides' figures to this file")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: one config, print JSON
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(measure_one(args.one, args.batch, args.warmup)))
        return 0

    import torchvision

    import shrinkwrap as sw

    plain = [independent(c, args.batch, args.warmup) for c in CONFIGS]
    batch = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    report = sw.plan_report(PLAN, torchvision.models.resnet18, batch, loss_fn=CrossEntropy(args.batch),
                            warmup=args.warmup, name="torchvision resnet18")
    print(report)
    print()
    print(f"{'configuration':<18} {'plain peak MiB':>14} {'shrinkwrap MiB':>14} {'ratio':>7}  "
          f"{'plain static':>12} {'sw static':>10}  {'plain ms':>8} {'sw ms':>7}")
    ok = True
    for fig, row in zip(plain, report.rows):
        p = row.profile
        if p is None:
            print(f"{fig['config']:<18} {fig['peak'] / MiB:>14.1f} {'OOM':>14}")
            ok = False
            continue
        ratio = p.peak / fig["peak"]
        ok &= abs(ratio - 1) <= TOLERANCE
        print(f"{fig['config']:<18} {fig['peak'] / MiB:>14.1f} {p.peak / MiB:>14.1f} {ratio:>7.3f}  "
              f"{fig['static'] / MiB:>12.1f} {p.static / MiB:>10.1f}  {fig['step_ms']:>8.1f} {p.step_ms:>7.1f}")
    print(f"\nevery peak within {TOLERANCE:.0%}: {'yes' if ok else 'NO'}  "
          f"({report.device_name}, torch {report.torch_version})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain, "shrinkwrap": report.to_dict()}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
