"""What a cold compilation costs autoplan's ``compile=True`` before anything is measured: a model
compiled whole or by regions, and four plans compiled alone, after another, and side by side.

    python benchmarks/compile_time.py regions resnet152 [--hows whole,per_block] --json benchmarks/compile_time.json
    python benchmarks/compile_time.py plans efficientnet_b0 --json benchmarks/compile_plans.json

``regions``: one torchvision classifier at batch 64 under ``autocast(torch.bfloat16)`` on CUDA,
compiled one of three ways (``HOWS``): ``whole`` (``compile()``); ``per_block``, the blocks
autoplan finds (:func:`~shrinkwrap.select.innermost_blocks`) each compiled through a frame whose
code object is its own, the rest eager; ``shared_call``, those blocks compiled the way torch's
``nn.Module.compile()`` does, through ``nn.Module._call_impl``, one code object for all, but for
the blocks whose forward is torch's own (an ``nn.Sequential``'s), each through a frame of its own.
Each in a fresh process whose compiler caches start empty; its row from ``sw.measure`` (SGD,
cross-entropy): the first iteration's seconds, the median of 15 steady steps and their spread, and
the activation (the steady step's peak less what was allocated before it).

``plans``: the plans of the kinds autoplan's compile stage compiles (``PLANS``), each in a fresh
process as its processes ahead compile them. Runs (``--runs``), in this order: ``alone``, plan 0
with empty caches; ``after``, plan 1 in plan 0's caches (after ``alone`` only); ``alone_1``, plan 1
with empty caches (its rows' run reads ``alone``); ``side_by_side``, the four at once with empty
caches. Each process builds the zoo's model (``harness.setup``: its batch), applies the plan and
runs a process ahead's iterations (warm-up and one more): the seconds to build, the first
iteration's seconds, and from dynamo's timers where they went (``TIMERS``). The driver adds each
run's wall seconds.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import JSON_HELP, ROW_KEYS, fresh_processes, last_row, save_rows, setup  # noqa: E402
from shrinkwrap.select import innermost_blocks, pattern_for  # noqa: E402
from shrinkwrap.transforms.compile import _torchs_own  # noqa: E402

HOWS = ("whole", "per_block", "shared_call")


def region_work(name: str, how: str) -> dict:
    """One model compiled ``how``, in this process (its caches empty): its row."""
    import torchvision
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).cuda()
    side = 299 if name == "inception_v3" else 224
    x, y = torch.randn(64, 3, side, side), torch.randint(0, 1000, (64,), device="cuda")
    blocks = innermost_blocks(model)
    torchs_own = [b for b in blocks if _torchs_own(model.get_submodule(b))]
    # per_block is compile(pattern=...): each region through a frame of its own.
    regions = {"whole": None, "per_block": blocks, "shared_call": torchs_own}[how]
    compile_step = "compile()" if regions is None else f"compile(pattern=r'{pattern_for(model, regions)}')"
    sw.apply(model, f"autocast(torch.bfloat16), {compile_step}" if regions != [] else "autocast(torch.bfloat16)")
    if how == "shared_call":
        for block in set(blocks) - set(torchs_own):
            model.get_submodule(block).compile()
    profile = sw.measure(model, x, loss_fn=lambda out: F.cross_entropy(out, y), iterations=15, warmup=5,
                         optimizer=functools.partial(torch.optim.SGD, lr=1e-3), device="cuda")
    return {
        "model": name, "how": how, "blocks": len(blocks), "first_s": round(profile.first_ms / 1e3, 1),
        "step_ms": round(profile.step_ms, 2), "step_ms_low": round(min(profile.step_times_ms), 2),
        "step_ms_high": round(max(profile.step_times_ms), 2),
        "activation_mib": round((profile.peak - profile.static) / 2**20, 1),
        "graphs": counters["stats"]["unique_graphs"], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}



PLANS = {
    "efficientnet_b0": [
        "channels_last(), autocast(torch.bfloat16), compile()",
        r"checkpoint(r'features\.[1-7]\.\d+'), channels_last(), autocast(torch.bfloat16), compile()",
        "channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        r"checkpoint(r'features\.[2-5]'), channels_last(), autocast(torch.bfloat16), compile()"],
    "swin_t": [
        "autocast(torch.bfloat16), compile()",
        r"checkpoint(r'features\.[1357]\.\d+'), autocast(torch.bfloat16), compile()",
        "autocast(torch.bfloat16), compile(memory_budget=0.6)",
        r"checkpoint(r'features\.[1357]'), autocast(torch.bfloat16), compile()"],
}
# dynamo's timers (compile_times): the forward traced and compiled, the backward compiled, and
# kernels' configurations tuned on the GPU at their first run; within them, dynamo's tracing of
# the bytecode, AOTAutograd's of the joint graph, the partitioner, and inductor (both graphs)
TIMERS = {"forward_s": "_compile.compile_inner", "backward_s": "compile_fx.<locals>.bw_compiler",
          "tuning_s": "CachingAutotuner.benchmark_all_configs", "tracing_s": "bytecode_tracing",
          "joint_s": "aot_trace_joint_graph", "partition_s": "min_cut_rematerialization_partition",
          "inductor_s": "fx_codegen_and_compile"}
RUNS = ("alone", "after", "alone_1", "side_by_side")


def plan_work(name: str, index: int) -> dict:
    """One plan's process ahead, in this process: its figures."""
    started = time.perf_counter()
    from torch._dynamo.utils import compile_times, counters

    from shrinkwrap.measuring.profile import Options
    from shrinkwrap.measuring.step import setup_iteration
    from shrinkwrap.processes.copies import build_model

    make, batch, _ = setup(name)
    device = torch.device("cuda")
    step, _ = setup_iteration(build_model(make, device, sw.Plan.parse(PLANS[name][index])), batch, Options(device="cuda"), device)
    built = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter()
    for _ in range(Options().warmup):
        step()
    torch.cuda.synchronize()
    names, values = compile_times(repr="csv", aggregate=True)
    timers = dict(zip(names, map(float, values)))
    return {"setup_s": round(built - started, 1), "first_s": round(first - built, 1),
            **{key: round(timers.get(timer, 0.0), 1) for key, timer in TIMERS.items()},
            "graphs": counters["stats"]["unique_graphs"],  # more than one: the plan broke dynamo's graph
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def plans_run(name: str, run_name: str, indices: list[int], cache: str) -> list[dict]:
    """``indices``' processes at once, in ``cache``: their rows, each with the run's wall seconds."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    started = time.perf_counter()
    done = fresh_processes([[__file__, "--work-plan", name, str(i)] for i in indices], at_once=len(indices), env=env)
    wall = round(time.perf_counter() - started, 1)
    rows = []
    for i, process in zip(indices, done):
        row = last_row(process)
        rows.append({"model": name, "run": run_name, "plan": PLANS[name][i], "index": i, "at_once": len(indices),
                     "wall_s": wall, **row, "date": datetime.date.today().isoformat()})
    return rows


def cold_env() -> dict[str, str]:
    """This process's environment with empty caches for inductor and triton."""
    return dict(os.environ, **{var: tempfile.mkdtemp(prefix=var.split("_")[0].lower() + "-")
                               for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})


def regions_run(name: str, hows: list[str]) -> list[dict]:
    """Each way of compiling ``name`` in a fresh process of cold caches, one after another: their rows."""
    rows = []
    for how in hows:
        process = fresh_processes([[__file__, "--work-region", name, how]], env=cold_env())[0]
        rows.append({"model": name, "how": how, **last_row(process), "date": datetime.date.today().isoformat()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=["regions", "plans"])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--hows", default=",".join(HOWS), help=f"regions: which, of {','.join(HOWS)}")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"plans: which runs, of {','.join(RUNS)}")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--work-region", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--work-plan", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work_region:
        print(json.dumps(region_work(*args.work_region)), flush=True)
        return 0
    if args.work_plan:
        print(json.dumps(plan_work(args.work_plan[0], int(args.work_plan[1]))), flush=True)
        return 0
    if not args.what or not args.model:
        parser.error("give regions MODEL or plans MODEL")
    if args.what == "regions":
        if not set(args.hows.split(",")) <= set(HOWS):
            parser.error(f"--hows takes some of {','.join(HOWS)}, got {args.hows}")
        rows = regions_run(args.model, args.hows.split(","))
        if args.json:
            save_rows(args.json, rows, key=ROW_KEYS["compile_time.json"])
        return 0
    if args.model not in PLANS:
        parser.error(f"plans: a model of {', '.join(sorted(PLANS))}")
    first = tempfile.mkdtemp()  # "after" runs in "alone"'s caches
    runs = {"alone": ([0], first), "after": ([1], first), "alone_1": ([1], tempfile.mkdtemp()),
            "side_by_side": ([0, 1, 2, 3], tempfile.mkdtemp())}
    rows = []
    chosen = args.runs.split(",")
    if not set(chosen) <= set(RUNS):
        parser.error(f"--runs takes some of {','.join(RUNS)}, got {args.runs}")
    for run_name in chosen:
        indices, cache = runs[run_name]
        rows += plans_run(args.model, "alone" if run_name == "alone_1" else run_name, indices, cache)
        for row in rows[-len(indices):]:
            print(json.dumps(row), flush=True)
    if args.json:
        save_rows(args.json, rows, key=ROW_KEYS["compile_plans.json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
