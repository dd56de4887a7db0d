"""Benchmark: activation transforms on torchvision efficientnet_b0 (needs a CUDA GPU).

One training step = zero_grad(set_to_none) + forward + cross-entropy + backward + Adam step, fp32,
random data at batch 128, measured by ``shrinkwrap.measure`` (3 warm-up steps; then gc,
empty_cache, reset_peak_memory_stats, synchronize; static = memory_allocated before the measured
step, peak = max_memory_allocated over it; step time = median of 10 steps). Each configuration
runs in a fresh subprocess, so allocator caches and cuDNN workspaces of one row cannot leak into
the next.

Configurations:
    native_silu           torchvision as shipped (nn.SiLU(inplace=True))
    naive_swish           every nn.SiLU replaced by a module computing x * torch.sigmoid(x)
    naive+swish           naive_swish, then sw.apply_swish
    bn_act                native_silu, then sw.apply_bn_act
    naive+swish+bn_act    naive_swish, then the plan "swish(), bn_act()"

Usage::

    python benchmarks/bench_activations.py --out results.json [--batch 128] [--steps 10]

Targets: naive+swish peak <= 0.82x naive_swish, step <= 1.05x native_silu;
bn_act peak <= 0.72x native_silu, step <= 1.08x native_silu.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

CONFIGS = ["native_silu", "naive_swish", "naive+swish", "bn_act", "naive+swish+bn_act"]
MIB = 2**20


def build(config: str):
    import torch
    import torch.nn as nn
    import torchvision

    import shrinkwrap as sw

    class NaiveSwish(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    model = torchvision.models.efficientnet_b0()
    if config.startswith("naive"):
        for name in sw.select(model, nn.SiLU):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, NaiveSwish())
    if config == "naive+swish":
        sw.apply_swish(model)
    elif config == "bn_act":
        sw.apply_bn_act(model)
    elif config == "naive+swish+bn_act":
        sw.apply(model, "swish(), bn_act()")
    return model


def measure_one(config: str, batch: int, steps: int) -> dict:
    import functools

    import torch
    import torch.nn.functional as F

    import shrinkwrap as sw

    torch.manual_seed(0)
    model = build(config).cuda()
    x = torch.randn(batch, 3, 224, 224)
    target = torch.randint(0, 1000, (batch,), device="cuda")
    prof = sw.measure(model, x, loss_fn=lambda out: F.cross_entropy(out, target),
                      optimizer=functools.partial(torch.optim.Adam), iterations=steps, warmup=3, device="cuda")
    return {
        "config": config,
        "peak_mib": prof.peak / MIB,
        "static_mib": prof.static / MIB,
        "activation_mib": (prof.peak - prof.static) / MIB,
        "step_ms": prof.step_ms,
        "device": prof.device_name,
        "torch": prof.torch_version,
    }


def table(rows: list[dict]) -> str:
    by = {r["config"]: r for r in rows}
    native, naive = by.get("native_silu"), by.get("naive_swish")
    lines = [
        "| configuration | peak MiB | static MiB | activation MiB | peak x native | peak x naive | step ms | step x native |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error']} | | | | | | |")
            continue
        ratio = lambda key, base: f"{r[key] / base[key]:.2f}" if base and "error" not in base else "-"  # noqa: E731
        lines.append(
            f"| {r['config']} | {r['peak_mib']:.0f} | {r['static_mib']:.0f} | {r['activation_mib']:.0f} | "
            f"{ratio('peak_mib', native)} | {ratio('peak_mib', naive)} | {r['step_ms']:.1f} | {ratio('step_ms', native)} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    by = {r["config"]: r for r in rows if "error" not in r}
    checks = [
        ("naive+swish", "peak_mib", "naive_swish", 0.82),
        ("naive+swish", "step_ms", "native_silu", 1.05),
        ("bn_act", "peak_mib", "native_silu", 0.72),
        ("bn_act", "step_ms", "native_silu", 1.08),
    ]
    out = []
    for config, key, base, limit in checks:
        if config in by and base in by:
            ratio = by[config][key] / by[base][key]
            verdict = "met" if ratio <= limit else "MISSED"
            out.append(f"- {config} {key} / {base} = {ratio:.3f} (target <= {limit}): {verdict}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args()

    if args.one:
        print(json.dumps(measure_one(args.one, args.batch, args.steps)))
        return

    rows = []
    for config in args.configs:
        cmd = [sys.executable, __file__, "--out", args.out, "--one", config,
               "--batch", str(args.batch), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            err = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
            rows.append({"config": config, "error": err})
        print(f"{config}: {rows[-1]}", file=sys.stderr)

    first = next((r for r in rows if "error" not in r), {})
    meta = {
        "model": "torchvision efficientnet_b0", "batch": args.batch, "dtype": "float32",
        "optimizer": "Adam", "device": first.get("device"), "torch": first.get("torch"),
        "date": datetime.date.today().isoformat(),
    }
    report = table(rows)
    checks = targets(rows)
    print(f"efficientnet_b0 @ {args.batch}, fp32, Adam; {meta['device']}, torch {meta['torch']}, {meta['date']}\n")
    print(report)
    print("\n" + "\n".join(checks))
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "targets": checks}, f, indent=2)


if __name__ == "__main__":
    main()
