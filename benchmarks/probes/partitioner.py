"""Probe: the min-cut partitioner's settings under a compiled plan, activation memory only.

    python benchmarks/probes/partitioner.py --model resnet18 --budget 0.6 [--set ban_recompute_reductions=False ...]
    python benchmarks/probes/partitioner.py --model resnet18 --sweep   # every row below, one process each, in parallel

One configuration per process: ``plan`` (``channels_last(), autocast(bf16), compile(memory_budget=B)``
on resnet18) measured by ``shrinkwrap.measure`` on a fresh model, with ``torch._functorch.config``
patched by ``--set`` for the whole measure (the compile happens in its first iteration). The
budget itself is the compile step's. Memory readings do not depend on what else runs on the GPU,
so ``--sweep`` runs the processes side by side; their step times are not comparable.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "src"))

PLAN = {"resnet18": "channels_last(), autocast(torch.bfloat16), compile(memory_budget={b})",
        "efficientnet_b0": "autocast(torch.bfloat16), compile(memory_budget={b})"}
SWEEP = [(b, ()) for b in (0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7)] + [
    (b, sets) for b in (0.5, 0.6) for sets in (
        ("ban_recompute_reductions=False",),
        ("ban_recompute_not_in_allowlist=False",),
        ("ban_recompute_reductions=False", "ban_recompute_not_in_allowlist=False"),
        ("activation_memory_budget_solver='greedy'",),
        ("activation_memory_budget_runtime_estimator='profile'",),
    )]


def one(model_name: str, budget: float, sets: list[str], prefix: str) -> dict:
    import torch
    import torch._functorch.config as functorch_config

    import shrinkwrap as sw
    from run import MODELS, _load, build

    patch = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in sets)}
    text = prefix + PLAN[model_name].format(b=budget)
    batch = _load(model_name, MODELS[model_name][1])[1]
    with functorch_config.patch(**patch):
        prof = sw.measure(sw.apply(build(model_name), text), batch, iterations=3, warmup=3, device="cuda")
    return {"model": model_name, "plan": text, "set": sets, "activation_mib": round((prof.peak - prof.static) / 2**20, 1),
            "step_ms": round(prof.step_ms, 2), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--budget", type=float, default=0.6)
    ap.add_argument("--set", nargs="*", default=[])
    ap.add_argument("--prefix", default="", help="steps before the plan, e.g. \"checkpoint('maxpool'), \"")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--jobs", type=int, default=6)
    args = ap.parse_args()
    if not args.sweep:
        print(json.dumps(one(args.model, args.budget, args.set, args.prefix)), flush=True)
        return
    procs, rows = [], []
    todo = list(SWEEP)
    while todo or procs:
        while todo and len(procs) < args.jobs:
            b, sets = todo.pop(0)
            cmd = [sys.executable, __file__, "--model", args.model, "--budget", str(b), "--prefix", args.prefix,
                   "--set", *sets]
            procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"}), (b, sets)))
        p, what = procs.pop(0)
        out = p.communicate()[0].strip().splitlines()
        rows.append(json.loads(out[-1]) if out and out[-1].startswith("{") else {"failed": what, "tail": out[-3:]})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| plan | partitioner settings | activation MiB |\n|---|---|---|")
    for r in rows:
        if "plan" in r:
            print(f"| `{r['plan']}` | {', '.join(r['set']) or 'default'} | {r['activation_mib']} |")


if __name__ == "__main__":
    main()
