"""Probe: where a compiled plan's step time goes, kernel by kernel, beside compile + bf16's.

    python benchmarks/probes/kernels.py --model resnet18 --plan "stem=checkpoint('conv1'), channels_last(), ..."

Each row (``compile+bf16`` and every ``--plan NAME=TEXT``) is built fresh, run for 4 warm-up
iterations (compiling), then 5 iterations under ``torch.profiler``. The table sums the GPU time of
each kernel name per iteration; the last lines list the kernels whose time differs most between
the first ``--plan`` and each other row. Kernel names are cut to 70 characters. Without CUDA graphs
only: a graph's replay hides its kernels from the profiler.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from run import ANCHORS, MODELS, _load, build  # noqa: E402
from shrinkwrap.measure.step import call_model, default_loss  # noqa: E402

ITERATIONS = 5


def kernel_ms(model: torch.nn.Module, batch) -> dict[str, float]:
    """Milliseconds of GPU time per iteration, by kernel name."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        default_loss(call_model(model, batch)).backward()
        opt.step()

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:70]] += event.device_time / 1e3 / ITERATIONS
    return dict(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    ap.add_argument("--plan", action="append", default=[], help="NAME=TEXT")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    _, batch = _load(args.model, MODELS[args.model][1])
    batch = sw._tree.tree_map(lambda t: t.cuda(), batch)
    plans = dict(p.split("=", 1) for p in args.plan)
    rows = {"compile+bf16": kernel_ms(ANCHORS["compile+bf16"](build(args.model), (), batch), batch)}
    for name, text in plans.items():
        torch._dynamo.reset()
        rows[name] = kernel_ms(sw.apply(build(args.model), text), batch)
    print("\n| row | GPU ms per iteration | kernels |\n|---|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {sum(times.values()):.2f} | {len(times)} |")
    for name, times in rows.items():
        print(f"\n{name}: top kernels (ms per iteration)")
        for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {v:7.3f}  {k}")
    first = next(iter(plans), None)
    for name in [n for n in rows if n != first and first]:
        a, b = rows[first], rows[name]
        diff = sorted(((a.get(k, 0.0) - b.get(k, 0.0), k) for k in {*a, *b}), key=lambda d: -abs(d[0]))
        print(f"\n{first} minus {name}: {sum(a.values()) - sum(b.values()):+.3f} ms; largest differences")
        for d, k in diff[:args.top]:
            print(f"  {d:+7.3f}  {k}")


if __name__ == "__main__":
    main()
