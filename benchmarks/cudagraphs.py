"""CUDA graphs under compiled plans: ``compile(mode='reduce-overhead')`` against compile + bf16.

    python benchmarks/cudagraphs.py --model resnet18 [--rounds 8] [--json out.json]

Step times: every configuration of the model in this process, in turns
(``shrinkwrap.time_interleaved``, paired ratios in the table). Memory: each configuration alone in
a fresh process, read two ways:

- ``activation MiB``: ``shrinkwrap.measure`` there, on the model fresh. A CUDA graph's replay
  writes into its private memory pool without the allocator's counters seeing it (alone they read
  45 MiB of resnet18's 1283), so for a graphed model the harness reads the warm-up iteration that
  recorded the graphs, whose allocations the replays reuse (``Profile.graph_recorded``; before
  2026-11-26 it counted the pool's reserved bytes, less the gradients in it: an upper bound).
  Each ``_cg`` plan's twin without graphs, where the table has one, runs the same program: the
  two readings should agree.
- ``activation (reserved)``: the steady iterations' peak of the allocator's reserved bytes, less
  the parameters, buffers, gradients, optimizer state and batch, the model's output dropped before
  backward. It counts the caching allocator's slack too, for every row alike.

``in this process``: ``shrinkwrap.measure`` in the timing process, where every graphed row's pool
is alive and counted (an upper bound over all of them). The JSON rows also keep the allocator's
counters alone (the fresh process's ``allocated_activation_mib`` is not in the table).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from run import MODELS, HandAutocast, _load, build, measure_same_run, ratio_table  # noqa: E402

CG = "mode='reduce-overhead'"
BUDGET = {"resnet18": 0.6, "efficientnet_b0": 0.6, "resnet152": 0.6, "bert": 0.5, "gpt2": 0.8}
LAYOUT = {"resnet18": "channels_last(), ", "resnet152": "channels_last(), "}
BLOCKS = {"resnet18": r"layer\d\.\d+", "resnet152": r"layer\d\.\d+", "efficientnet_b0": r"features\.[1-7]\.\d+",
          "bert": r"bert\.encoder\.layer\.\d+", "gpt2": r"transformer\.h\.\d+"}
HEAD = {"gpt2": "chunked_loss(), "}
STEM = {"resnet18": "checkpoint('conv1'), "}  # the stem's convolution recomputed: its 196 MiB output not kept


def plans(model_name: str) -> dict[str, str]:
    """The best compiled plans of the earlier runs, with and without CUDA graphs."""
    pre = HEAD.get(model_name, "") + LAYOUT.get(model_name, "") + "autocast(torch.bfloat16), "
    ckpt = f"checkpoint(r'{BLOCKS[model_name]}'), "
    b = BUDGET[model_name]
    stem = {"sw_stem_budget": STEM[model_name] + pre + f"compile(memory_budget={b})",
            "sw_stem_budget_cg": STEM[model_name] + pre + f"compile({CG}, memory_budget={b})"} if model_name in STEM else {}
    return {
        "sw_budget": pre + f"compile(memory_budget={b})",
        "sw_budget_cg": pre + f"compile({CG}, memory_budget={b})",
        "sw_ckpt_cg": ckpt + pre + f"compile({CG})",
        "sw_ckpt_budget_cg": ckpt + pre + f"compile({CG}, memory_budget={b})",
        **stem,
    }


def configurations(model_name: str) -> dict[str, Callable[[], nn.Module]]:
    def plan(text: str) -> Callable[[], nn.Module]:
        return lambda: sw.apply(build(model_name), text)

    return {"fp32_eager": lambda: build(model_name),
            "compile_bf16": lambda: torch.compile(HandAutocast(build(model_name))),
            "compile_bf16_cg": lambda: torch.compile(HandAutocast(build(model_name)), mode="reduce-overhead"),
            **{name: plan(text) for name, text in plans(model_name).items()}}


def memory_one(model_name: str, config: str, iterations: int = 2, warmup: int = 4) -> dict[str, Any]:
    """One configuration in this (fresh) process: reserved and allocated peaks of steady iterations."""
    from torch._dynamo.utils import counters

    from shrinkwrap.measure.sizes import _bytes
    from shrinkwrap.measure.step import call_model, default_loss

    _, batch = _load(model_name, MODELS[model_name][1])
    batch = sw._tree.tree_map(lambda t: t.cuda(), batch)
    model = configurations(model_name)[config]().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        default_loss(call_model(model, batch)).backward()
        opt.step()

    # The harness first, on the model fresh: a graphed model is read where its graphs are recorded.
    prof = sw.measure(model, batch, device="cuda", warmup=3, iterations=2)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    state = _bytes([*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
                    *(t for s in opt.state.values() for t in s.values()), *sw._tree.tensors(batch)])
    allocated = torch.cuda.memory_allocated()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    peak_reserved, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    return {"model": model_name, "config": config, "harness_activation_mib": round((prof.peak - prof.static) / 2**20, 1),
            "graph_recorded": prof.graph_recorded, "graph_pool_mib": round((prof.graph_pool or 0) / 2**20, 1),
            "reserved_activation_mib": round((peak_reserved - state) / 2**20, 1),
            "allocated_activation_mib": round((peak_allocated - allocated) / 2**20, 1),
            "state_mib": round(state / 2**20, 1), "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def run(model_name: str, rounds: int, only: list[str] | None, parallel: int = 3) -> list[dict[str, Any]]:
    """Each configuration's memory in a fresh process (``parallel`` at a time: what one process
    reserves is its own, so they may share the GPU), then every step time in this process."""
    from concurrent.futures import ThreadPoolExecutor

    names = [n for n in configurations(model_name) if not only or n in only]

    def fresh(name: str) -> dict[str, Any]:
        budget = ["--budget", str(BUDGET[model_name])]
        proc = subprocess.run([sys.executable, __file__, "--memory-one", model_name, name, *budget],
                              capture_output=True, text=True, timeout=400)
        last = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
        out = json.loads(last[0]) if last else {"error": proc.stderr.strip().splitlines()[-1:]}
        print(f"fresh {name}: {out}", file=sys.stderr, flush=True)
        return out

    with ThreadPoolExecutor(parallel) as pool:
        memory = dict(zip(names, pool.map(fresh, names)))
    makers = {n: m for n, m in configurations(model_name).items() if n in names}
    rows = measure_same_run(model_name, makers, rounds, plans(model_name))
    for row in rows:
        fresh_row(row, memory.get(row["config"], {}))
    return rows


def fresh_row(row: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """``row`` (measured in this process) with its fresh process's memory: ``activation_mib`` is
    the fresh harness figure where there is one (a graphed row's pool is then its own alone)."""
    row.update(activation_in_process_mib=row.get("activation_in_process_mib", row.get("activation_mib")),
               reserved_activation_mib=fresh.get("reserved_activation_mib"),
               fresh_harness_activation_mib=fresh.get("harness_activation_mib"),
               cudagraph_skips=fresh.get("cudagraph_skips"), fresh_error=fresh.get("error"),
               graph_recorded=fresh.get("graph_recorded"), graph_pool_mib=fresh.get("graph_pool_mib"))
    if row["fresh_harness_activation_mib"] is not None:
        row["activation_mib"] = row["fresh_harness_activation_mib"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    return ratio_table(rows, {"fp32": "fp32_eager", "compile+bf16": "compile_bf16"},
                       {"in this process MiB": lambda r: r.get("activation_in_process_mib"),
                        "activation (reserved) MiB": lambda r: r.get("reserved_activation_mib"),
                        "x compile+bf16 (reserved)": lambda r: _ratio(rows, r, "reserved_activation_mib"),
                        "cudagraph skips": lambda r: r.get("cudagraph_skips"),
                        "read at recording": lambda r: r.get("graph_recorded"),
                        "pool reserved MiB": lambda r: r.get("graph_pool_mib") or "-"})


def _ratio(rows: list[dict[str, Any]], row: dict[str, Any], key: str) -> Any:
    ref = next((r.get(key) for r in rows if r["config"] == "compile_bf16" and r["model"] == row["model"]), None)
    return "-" if not ref or row.get(key) is None else f"{row[key] / ref:.2f}"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--configs")
    p.add_argument("--json")
    p.add_argument("--parallel", type=int, default=3, help="fresh memory processes at a time")
    p.add_argument("--budget", type=float, help="the partitioner's budget of the _budget plans (default: BUDGET)")
    p.add_argument("--memory-one", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.budget is not None:  # the fresh processes get it through their own command line
        BUDGET = {name: args.budget for name in BUDGET}
    if args.memory_one:
        print(json.dumps(memory_one(*args.memory_one)))
        sys.exit(0)
    rows = run(args.model, args.rounds, args.configs.split(",") if args.configs else None, args.parallel)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
