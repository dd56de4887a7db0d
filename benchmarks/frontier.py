"""autoplan's plans beside the suite's anchors and hand recipes, every row in one process.

    python benchmarks/frontier.py --model resnet18 [--rounds 5] [--json out.json]
    python benchmarks/frontier.py --model resnet152 --configs base_fp32,answer --plan "answer=autocast(torch.bfloat16)"

First ``sw.autoplan`` answers for ``max_slowdown`` 1.0 (``auto_fast``) and 1.5 (``auto_small``; with
``--configs``, only those of the two it names),
lossy steps allowed, with its compile stage (``compile=True``), the second call reusing the first's
measurements; its own seconds are recorded. Then every row (the anchors of ``harness.ANCHORS`` as users
write them, the hand recipes eager and compiled, and the two plans) is measured in this process
by ``harness.measure_same_run``: memory one configuration at a time, step times in turns. ``compile_budget0.5`` is left out: its budget is a global setting that
would reach every later compilation in the process. torch's SAC planner (``auto_sac*``) runs only
where ``--configs`` names it: it needs pulp and pwlf, and its planning of a model takes minutes.

With ``--warm`` the compiled rows (all but autoplan's, whose compile stage compiles its own plans
ahead) are first compiled side by side in processes of their own, before anything is timed; the
rows then compile from inductor's on-disk caches (see ``warm``).

A plan is *dominated* by a row with less activation memory, by more than 2%, and less step time,
beyond the spread: that row's slowest round faster than the plan's fastest. The table names, for
each autoplan row and each ``--plan`` row, the rows that dominate it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import (ANCHORS, MODELS, breaks, build, dominated_by, fresh_processes, load_bench,  # noqa: E402
                     measure_same_run, ratio_table, recipes, same_run_main)

SLOWDOWNS = {"auto_fast": 1.0, "auto_small": 1.5}
PLANS: dict[str, str] = {}  # --plan NAME=TEXT: more rows, such as an answer autoplan gave in an earlier call
WARM = False  # --warm: compile the compiled rows ahead, side by side (see warm)


def makers_for(model_name: str, texts: dict[str, str], only: list[str] | None) -> dict[str, Callable[[], nn.Module]]:
    """The rows' model makers: the anchors, then the plans of ``texts`` (name -> plan text)."""
    _, batch = load_bench(model_name, MODELS[model_name][1])
    blocks = MODELS[model_name][2]
    makers: dict[str, Callable[[], nn.Module]] = {
        name: functools.partial(lambda a: ANCHORS[a](build(model_name), blocks, batch), name)
        for name in ANCHORS
        if name != "compile_budget0.5" and (not name.startswith("auto_sac") or name in (only or ()))}
    makers.update({name: functools.partial(lambda t: sw.apply(build(model_name), t), text)
                   for name, text in texts.items()})
    return {k: v for k, v in makers.items() if not only or k in only}


def compiled_rows(model_name: str, only: list[str] | None) -> list[str]:
    """The rows (of ``only``, or all) that run compiled: the compiled anchors, recipes and ``--plan`` rows."""
    return [k for k in makers_for(model_name, {**recipes(model_name), **PLANS}, only)
            if "compile" in k or "compile(" in PLANS.get(k, "")]


def warm(model_name: str, names: list[str], at_once: int = 4) -> None:
    """The compiled rows' first iterations, each in its own process, ``at_once`` side by side, before
    anything is timed on this GPU: what they compile lands in inductor's on-disk caches, and this
    process then compiles those rows from there, a small share of a cold compilation's seconds
    (RESULTS.md, a cold compilation). Nothing of theirs is measured."""
    started = time.perf_counter()
    extra = [a for p in PLANS.items() for a in ("--plan", "=".join(p))]
    done = fresh_processes([[__file__, "--model", model_name, "--warm-one", name, *extra] for name in names],
                           at_once=at_once, capture=False)
    failed = [name for name, process in zip(names, done) if process.returncode]
    print(f"warmed {len(names)} compiled rows, {at_once} at a time, in {time.perf_counter() - started:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr, flush=True)


def warm_one(model_name: str, name: str) -> None:
    _, batch = load_bench(model_name, MODELS[model_name][1])
    model = makers_for(model_name, {**recipes(model_name), **PLANS}, [name])[name]()
    sw.time_interleaved({name: model}, batch, sw.Options(device="cuda", warmup=2), rounds=1, per_round=1)


def run(model_name: str, rounds: int, only: list[str] | None = None) -> list[dict[str, Any]]:
    _, batch = load_bench(model_name, MODELS[model_name][1])
    if WARM:
        warm(model_name, compiled_rows(model_name, only))
    cache: dict = {}
    auto: dict[str, dict[str, Any]] = {}
    # --configs runs autoplan only for the answers it names (a model's two answers with their
    # compilations may not fit one 10-minute call; naming neither measures the other rows alone,
    # which also fills the compiler's on-disk cache for a later call on the same machine).
    wanted = [k for k in SLOWDOWNS if not only or k in only]
    for config, slowdown in ((k, SLOWDOWNS[k]) for k in wanted):
        started = time.perf_counter()
        plan, report = sw.autoplan(functools.partial(build, model_name), batch, max_slowdown=slowdown,
                                   allow_lossy=True, device="cuda", cache=cache, compile=True,
                                   progress=lambda i, n, what: print(f"  autoplan {i}/{n} {what}", file=sys.stderr))
        auto[config] = {"plan": str(plan), "autoplan_s": round(time.perf_counter() - started, 1),
                        "candidates": sum(r.role == "candidate" for r in report.rows), "notes": report.notes}
        print(f"{config}: {plan} ({auto[config]['autoplan_s']} s)", file=sys.stderr, flush=True)
    texts = {**recipes(model_name), **PLANS, **{k: v["plan"] for k, v in auto.items()}}
    makers = makers_for(model_name, texts, (only or []) + list(auto) if only else None)
    rows = measure_same_run(model_name, makers, rounds, texts)
    for row in rows:
        row.update(auto.get(row["config"], {}))
    for row in rows:
        if row["config"] in auto or row["config"] in PLANS:
            row["dominated_by"] = dominated_by(row, rows)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    text = ratio_table(rows, {"fp32": "base_fp32", "compile+bf16": "compile+bf16"}, {
        "graph breaks": breaks, "autoplan s": lambda r: r.get("autoplan_s", ""),
        "dominated by": lambda r: ", ".join(r["dominated_by"]) or "none" if "dominated_by" in r else ""})
    return "\n".join([text, "", *(f"- {r['config']}: `{r['plan']}`" for r in rows if r.get("plan") and "error" not in r)])


if __name__ == "__main__":
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--plan", action="append", default=[], help="NAME=TEXT: one more row, this plan")
    extra.add_argument("--warm", action="store_true",
                       help="first run the compiled rows' first iterations in processes side by side (see warm)")
    extra.add_argument("--warm-only", action="store_true",
                       help="only that: compile the compiled rows (of --configs, or all) ahead, measure nothing")
    extra.add_argument("--warm-one", help=argparse.SUPPRESS)
    known, sys.argv[1:] = extra.parse_known_args()
    PLANS.update(p.split("=", 1) for p in known.plan)
    WARM = known.warm
    if known.warm_one or known.warm_only:
        rows = argparse.ArgumentParser(add_help=False)
        rows.add_argument("--model", required=True, choices=sorted(MODELS))
        rows.add_argument("--configs")
        which, _ = rows.parse_known_args()
        if known.warm_one:
            warm_one(which.model, known.warm_one)
        else:
            warm(which.model, compiled_rows(which.model, which.configs.split(",") if which.configs else None))
        sys.exit(0)
    same_run_main(__doc__, list(MODELS), run, table, rounds=5)
