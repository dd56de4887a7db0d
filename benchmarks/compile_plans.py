"""What ``compile=True`` pays per plan: four plans of one model compiled cold, alone, after another
plan in the same caches, and side by side, each in a fresh process, as autoplan's processes ahead
compile them.

    python benchmarks/compile_plans.py efficientnet_b0 --json benchmarks/compile_plans.json

The plans are of the kinds autoplan's compile stage compiles (``PLANS``): the whole-model steps
compiled, every block checkpointed, the partitioner's memory budget, and stages checkpointed.
Runs (``--runs``), in this order: ``alone``, plan 0 with empty caches; ``after``, plan 1 in plan
0's caches (its kernels, where the two share them, are compiled already; after ``alone`` only);
``alone_1``, plan 1 with empty caches (its rows' run reads ``alone``); ``side_by_side``, the four
at once with empty caches. Each process builds the zoo's model
(``zoo.setup``: its batch), applies the plan and runs a process ahead's iterations (warm-up and one
more), then writes one JSON line: the seconds to build, the first iteration's seconds, and from
dynamo's timers where they went (``TIMERS``), and how many graphs dynamo compiled. The driver adds
each run's wall seconds. ``benchmarks/results.py`` makes RESULTS.md's table from the rows, in the
order they ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
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


def work(name: str, index: int) -> dict:
    """One plan's process ahead, in this process: its figures."""
    started = time.perf_counter()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    import torch
    from torch._dynamo.utils import compile_times, counters

    import shrinkwrap as sw
    from shrinkwrap.measure.step import Options, _setup
    from shrinkwrap.processes.copies import _build
    from zoo import setup

    make, batch, _ = setup(name)
    device = torch.device("cuda")
    step, _ = _setup(_build(make, device, sw.Plan.parse(PLANS[name][index])), batch, Options(device="cuda"), device)
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


def run(name: str, run_name: str, indices: list[int], cache: str) -> list[dict]:
    """``indices``' processes at once, in ``cache``: their rows, each with the run's wall seconds."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, __file__, name, "--work", str(i)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in indices]
    outs = [p.communicate() for p in processes]
    wall = round(time.perf_counter() - started, 1)
    rows = []
    for i, p, (out, err) in zip(indices, processes, outs):
        row = json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else {
            "error": (err.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
        rows.append({"model": name, "run": run_name, "plan": PLANS[name][i], "index": i, "at_once": len(indices),
                     "wall_s": wall, **row, "date": datetime.date.today().isoformat()})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(PLANS))
    parser.add_argument("--work", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="append the rows here")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"which runs, of {','.join(RUNS)}")
    args = parser.parse_args()
    if args.work is not None:
        print(json.dumps(work(args.model, args.work)), flush=True)
        return 0
    first = tempfile.mkdtemp()  # "after" runs in "alone"'s caches
    runs = {"alone": ([0], first), "after": ([1], first), "alone_1": ([1], tempfile.mkdtemp()),
            "side_by_side": ([0, 1, 2, 3], tempfile.mkdtemp())}
    rows = []
    chosen = args.runs.split(",")
    if not set(chosen) <= set(RUNS):
        parser.error(f"--runs takes some of {','.join(RUNS)}, got {args.runs}")
    for run_name in chosen:
        indices, cache = runs[run_name]
        rows += run(args.model, "alone" if run_name == "alone_1" else run_name, indices, cache)
        for row in rows[-len(indices):]:
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
