"""What fits: each configuration's reading beside the smallest cap it trains under, in one run.

    python benchmarks/fits.py --model resnet18 [--configs fp32_eager,compile_bf16,best] [--json out.json]

For each configuration of a bench model: the reading (``shrinkwrap.measure`` in a fresh process:
the steady step's ``max_memory_allocated``, the bytes allocated before it, whether CUDA graphs ran)
and the fit (``shrinkwrap.fit``: the smallest allocator cap under which a fresh process trains its
first 8 iterations, compilation and recording included, bisected in fresh processes). Rows:

- ``fp32_eager``: the model as it is, the plain ``max_memory_allocated`` control;
- ``compile_bf16``: ``torch.compile`` around a hand-written bf16 autocast, the anchor;
- ``best``: the plan RESULTS.md names as the model's best against compile + bf16 (``BEST``);
- ``recipe``: the hand recipe of checkpointed blocks and bf16 autocast, eager (``harness.RECIPES``' small).

``--configs autoplan`` (not among the default ones) runs ``sw.autoplan`` with ``--budget`` (a share of
the model's own reading, 0.5 by default; bf16 allowed) and writes its answer: the plan, its reading, the cap it
trained under (autoplan trains its answer under the budget's cap before it returns it) and the
seconds it took.

Every figure of a row comes from the same GPU and run; one JSON object per row.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import JSON_HELP, MODELS, ROW_KEYS, RECIPES, HandAutocast, build, load_bench, save_rows  # noqa: E402

MiB = 2**20
# The plan each bench model's dominance claim rests on (RESULTS.md, "against compile + bf16").
BEST = {
    "resnet18": "space_to_depth(), checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), "
                "compile(mode='reduce-overhead', memory_budget=0.6)",
    "efficientnet_b0": "autocast(torch.bfloat16), compile(mode='reduce-overhead', memory_budget=0.6)",
    "resnet152": r"checkpoint(r'layer\d\.\d+'), channels_last(), autocast(torch.bfloat16), "
                 "compile(mode='reduce-overhead')",
    "gpt2": "chunked_loss(), autocast(torch.bfloat16), compile(mode='reduce-overhead', memory_budget=0.8)",
    "bert": r"autocast(torch.bfloat16), compile(pattern=r'bert\.encoder\.layer\.\d+\.(?:attention\.output|"
            r"intermediate|output)')",
}
CONFIGS = ("fp32_eager", "compile_bf16", "best", "recipe")
BUDGET = 0.5  # autoplan's budget, a share of the model's reading as it is


def configured(model_name: str, config: str) -> nn.Module:
    """A fresh model of ``config`` (module level: fresh processes build it from its name)."""
    model = build(model_name)
    if config == "fp32_eager":
        return model
    if config == "compile_bf16":
        return torch.compile(HandAutocast(model))
    return sw.apply(model, plan_of(model_name, config))


def plan_of(model_name: str, config: str) -> str:
    return BEST[model_name] if config == "best" else RECIPES[model_name]["small"] if config == "recipe" else config


def estimated(model_name: str, config: str, batch: Any) -> dict[str, Any]:
    """The eager configurations' CUDA peak predicted on this host's CPU (shrinkwrap.estimate)."""
    if config not in ("fp32_eager", "recipe"):
        return {}
    factory, _ = load_bench(model_name, 1)

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = factory()
        if model_name == "gpt2":
            model.config.use_cache, model.loss_type = False, "ForCausalLM"
        elif model_name == "bert":
            model.config.use_cache = False
        return model

    est = sw.estimate(make, batch, plan_of(model_name, config) if config == "recipe" else "")
    return {"estimate_mib": round(est.peak / MiB, 1), "estimate_seconds": round(est.seconds, 1)}


def answer(model_name: str, batch: Any, budget: float) -> dict[str, Any]:
    """autoplan's answer for ``budget`` and whether it trained under the budget's cap."""
    started = time.perf_counter()
    plan, report = sw.autoplan(functools.partial(build, model_name), batch, budget=budget, device="cuda", allow_lossy=True,
                               progress=lambda i, n, what: print(f"  autoplan {i}/{n} {what}", flush=True))
    base = report.value(report.rows[0])  # the figure the budget is a share of
    final = next((r for r in report.rows[::-1] if str(r.plan) == str(plan) and r.role != "candidate"), report.rows[0])
    out = {"model": model_name, "config": "autoplan", "kind": "autoplan", "plan": str(plan), "budget": budget,
           "budget_mib": round(budget * base / MiB, 1), "baseline_mib": round(base / MiB, 1),
           "allow_lossy": True, "autoplan_s": round(time.perf_counter() - started, 1), "notes": report.notes,
           "trained_under_mib": round(final.trained_under / MiB, 1) if final.trained_under else None,
           "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat()}
    if final.profile is None:
        return {**out, "error": final.error}
    return {**out, "reading_mib": round(final.profile.peak / MiB, 1), "static_mib": round(final.profile.static / MiB, 1),
            "value_mib": round(report.value(final) / MiB, 1), "time_ratio": final.time_ratio}


def row(model_name: str, config: str, batch: Any) -> dict[str, Any]:
    make = functools.partial(configured, model_name, config)
    options = sw.Options(device="cuda")
    reading = sw.compare.measure_plans(make, [sw.Plan()], batch, options, fit=False).rows[0]
    out: dict[str, Any] = {"model": model_name, "config": config,
                           "plan": plan_of(model_name, config),
                           "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "date": datetime.date.today().isoformat()}
    if reading.profile is None:
        return {**out, "error": reading.error}
    p = reading.profile
    est = estimated(model_name, config, batch)
    fit = sw.fit(make, batch, sw.Plan(), options, progress=lambda line: print(f"  {model_name} {config}: {line}",
                                                                             flush=True))
    free = fit.uncapped
    return {**out, "reading_mib": round(p.peak / MiB, 1), "static_mib": round(p.static / MiB, 1),
            "activation_mib": round((p.peak - p.static) / MiB, 1), "cuda_graphs": p.cuda_graphs,
            "fit_mib": round(fit.cap / MiB, 1), "fit_below_mib": round(fit.below / MiB, 1) if fit.below else None,
            "resolution_mib": round(fit.resolution / MiB, 1), "fit_above_static_mib": round((fit.cap - p.static) / MiB, 1),
            "fit_x_reading": round(fit.cap / p.peak, 3),
            "uncapped_reserved_mib": round(free.reserved / MiB, 1), "uncapped_allocated_mib": round(free.allocated / MiB, 1),
            "uncapped_pools_mib": round((free.pools or 0) / MiB, 1), "probes": len(fit.probes),
            "fit_seconds": round(fit.seconds, 1), **est}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help="autoplan's budget, a share of the model's reading as it is (--configs autoplan)")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--estimate-only", action="store_true",
                        help="only the eager configurations' estimates, on this host's CPU (no GPU)")
    args = parser.parse_args()
    _, batch = load_bench(args.model, MODELS[args.model][1])
    if args.estimate_only:
        for config in args.configs.split(","):
            est = estimated(args.model, config, batch)
            if est:
                out = {"model": args.model, "config": config, "kind": "estimate", **est, "device_name": "cpu",
                       "torch": torch.__version__, "date": datetime.date.today().isoformat()}
                print(json.dumps(out), flush=True)
                if args.json:
                    save_rows(args.json, [out], key=ROW_KEYS["fits.json"])
        return 0
    rows = []
    for config in args.configs.split(","):
        rows.append(answer(args.model, batch, args.budget) if config == "autoplan" else row(args.model, config, batch))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            save_rows(args.json, rows[-1:], key=ROW_KEYS["fits.json"])
    print(f"\n| model | config | reading MiB | static MiB | fits in MiB (not under) | fit x reading | probes | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r or r["config"] == "autoplan":
            print(f"| {r['model']} | {r['config']} | {r.get('error') or r['plan']} | {r.get('reading_mib')} | "
                  f"budget {r.get('budget_mib')} | trained under {r.get('trained_under_mib')} |")
            continue
        print(f"| {r['model']} | {r['config']} | {r['reading_mib']} | {r['static_mib']} | {r['fit_mib']} "
              f"({r['fit_below_mib']}) | {r['fit_x_reading']} | {r['probes']} | {r['fit_seconds']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
