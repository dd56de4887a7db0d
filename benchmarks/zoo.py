"""autoplan on models it was not tuned on: torchvision classifiers of twenty families, timm models
of ten more (``harness.TIMM``, each at its batch) and the five bench models, each against the
one-line recipes a user writes by hand.

    python benchmarks/zoo.py --models convnext_tiny,swin_t --gpus 0,1 --json benchmarks/zoo.json
    python benchmarks/zoo.py --all --gpus 0,1,2,3 --compile --json benchmarks/zoo.json
    python benchmarks/zoo.py --one convnext_tiny           # one model, in this process, on this GPU
    python benchmarks/zoo.py --profile bert [--no-profile]  # where one autoplan call's seconds go

Each model runs in a process of its own, one a GPU, as many side by side as ``--gpus`` names. In
it, ``sw.autoplan`` answers for ``max_slowdown`` 1.0 (``auto_fast``) and 1.5 (``auto_small``),
eager, lossy steps allowed, the two calls sharing one cache; with ``--compile`` also
``compile=True`` at 1.0 (``auto_compile``). Its own seconds are kept. Then every row is measured
in that process (``harness.measure_same_run``: memory one row at a time, activation = peak less what
was allocated before; step times in turns): fp32 as it is (``base_fp32``), ``compile+bf16``,
every block checkpointed with torch's ``checkpoint_wrapper`` under bf16 autocast
(``ckpt_every_block+bf16``; the blocks are the classes named in ``ZOO``, as a user names them),
the same compiled, and compile + bf16 with the partitioner's ``activation_memory_budget=0.5``
(``compile_budget0.5+bf16``, measured last: the budget is a global setting, and reaches any later
compilation in the process). An autoplan row is dominated by a row with at least 2% less
activation whose slowest round is faster than its fastest (``harness.dominated_by``); RESULTS.md
also reads each answer by autoplan's own rule (``results.beaten_by``), and compile=True's compile
stage seconds against ``compile+bf16``'s first iteration, the model's own cold compile; with
``--compile`` a second compile=True call in a fresh process, torch's on-disk caches warm, is
timed too (``again_s``). A model that fails, or
runs past ``--timeout``, is a row with its error. ``benchmarks/results.py`` makes the table of
RESULTS.md from the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import (ANCHORS, JSON_HELP, MODELS, ZOO, HandAutocast, compiled, dominated_by,  # noqa: E402
                     Ended, load_rows, measure_same_run, on_gpus, save_rows, setup)

AUTOPLAN = {"auto_fast": (1.0, False), "auto_small": (1.5, False), "auto_compile": (1.0, True)}
AGAIN_TIMEOUT = 600  # seconds the second compile=True call may take
COMPILE_STAGE = re.compile(r"of which (?P<seconds>[\d.]+) s in the compile stage")
ANSWER = re.compile(r"(?P<model>\S+) (?P<config>auto_\w+): .* \((?P<seconds>[\d.]+) s\)")


def recipes(make: Callable[[], nn.Module], blocks: tuple[str, ...]) -> dict[str, Callable[[], nn.Module]]:
    """The one-line recipes, as users write them (``harness.ANCHORS``, the same compiled, and compile +
    bf16 under the partitioner's budget, last: a global setting)."""
    def anchor(name: str) -> Callable[[], nn.Module]:
        return lambda: ANCHORS[name](make(), blocks, None)

    every = anchor("ckpt_every_block+bf16")
    return {**{name: anchor(name) for name in ("base_fp32", "compile+bf16", "ckpt_every_block+bf16")},
            "ckpt_every_block+bf16_compiled": lambda: compiled(every()),
            "compile_budget0.5+bf16": lambda: compiled(HandAutocast(make()), 0.5)}


def one(name: str, rounds: int, with_compile: bool) -> list[dict[str, Any]]:
    """Every row of one model, in this process."""
    make, batch, blocks = setup(name)
    cache: dict = {}
    auto: dict[str, dict[str, Any]] = {}
    for config, (slowdown, comp) in AUTOPLAN.items():
        if comp and not with_compile:
            continue
        started = time.perf_counter()
        try:
            plan, report = sw.autoplan(make, batch, max_slowdown=slowdown, allow_lossy=True, device="cuda",
                                       cache=cache, compile=comp)
        except Exception as exc:  # noqa: BLE001 - a model autoplan cannot handle is a row with its error
            auto[config] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
            print(f"{name} {config}: {type(exc).__name__} ({time.perf_counter() - started:.1f} s)", file=sys.stderr,
                  flush=True)
            continue
        spent = [n for n in report.notes if n.startswith(("autoplan's own time", "of which"))]
        # Why the answer, in autoplan's words: the frontier with its figures, and where compile=True
        # answered eager, what each compiled plan missed.
        why = [n for n in report.notes if n.startswith(("frontier", "the answer is eager"))]
        auto[config] = {"plan": str(plan), "autoplan_s": round(time.perf_counter() - started, 1),
                        "frontier": [str(r.plan) for r in report.frontier()], "autoplan_time": spent, "why": why}
        if stage_seconds(spent) is not None:
            auto[config]["compile_stage_s"] = stage_seconds(spent)
        print(f"{name} {config}: {plan} ({auto[config]['autoplan_s']} s)", file=sys.stderr, flush=True)
        for note in spent:
            print(f"  {note}", file=sys.stderr, flush=True)
    makers = recipes(make, blocks)
    last = makers.pop("compile_budget0.5+bf16")
    plans = {k: v["plan"] for k, v in auto.items() if "plan" in v}
    makers.update({k: functools.partial(lambda text: sw.apply(make(), text), text) for k, text in plans.items()})
    makers["compile_budget0.5+bf16"] = last
    rows = measure_same_run(name, makers, rounds, plans, batch=batch)
    if "plan" in auto.get("auto_compile", {}):  # after the rows: a slow second call costs it alone
        auto["auto_compile"].update(again(name))
    rows += [{"model": name, "config": k, **v} for k, v in auto.items() if "error" in v]
    for row in rows:
        row.update({k: v for k, v in auto.get(row["config"], {}).items() if k != "plan"})
        if row["config"] in AUTOPLAN:
            row["dominated_by"] = dominated_by(row, rows)
    return rows


def again(name: str) -> dict[str, Any]:
    """compile=True called a second time on the model, in a fresh process (``--again``), after the
    first call left torch's on-disk caches (the FX graph and AOTAutograd caches, the autotune
    results) warm: its seconds, whole and in the compile stage (``again_s``, ``again_stage_s``), and
    where the stage's went, with the graphs its processes took from the caches (``again_time``)."""
    import subprocess

    try:
        run = subprocess.run([sys.executable, __file__, "--again", name], capture_output=True, text=True,
                             timeout=AGAIN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"again_error": f"timed out after {AGAIN_TIMEOUT} s"}
    said = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not said:
        return {"again_error": (run.stderr.strip().splitlines() or ["nothing said"])[-1][:200]}
    return said[-1]


def second_call(name: str) -> None:
    """``--again``: one compile=True call, its seconds printed as a JSON line (see :func:`again`)."""
    make, batch, _ = setup(name)
    started = time.perf_counter()
    _, report = sw.autoplan(make, batch, max_slowdown=1.0, allow_lossy=True, device="cuda", compile=True)
    stage = stage_seconds(report.notes)
    print(json.dumps({"again_s": round(time.perf_counter() - started, 1),
                      **({"again_stage_s": stage} if stage is not None else {}),
                      "again_time": [n for n in report.notes if n.startswith("of which")]}), flush=True)


def stage_seconds(notes: list[str]) -> float | None:
    """The compile stage's seconds, as autoplan's notes give them (None: no compile stage)."""
    found = [m for m in map(COMPILE_STAGE.match, notes) if m]
    return float(found[0]["seconds"]) if found else None


def run_all(models: list[str], gpus: list[str], timeout: float, rounds: int, with_compile: bool,
            deadline: float | None) -> list[dict[str, Any]]:
    """Each model in a process of its own, one a GPU, as many at once as ``gpus``; a model that
    fails or outruns ``timeout`` (or the ``deadline``, seconds from now) is a row with its error."""
    rows: list[dict[str, Any]] = []
    run = time.strftime("%Y-%m-%dT%H:%M:%S")  # the rows' run, so a later one replaces it whole (results.py)
    folder = tempfile.mkdtemp(prefix="zoo-")
    outs = {name: os.path.join(folder, f"{name}.json") for name in models}
    commands = {name: [__file__, "--one", name, "--rounds", str(rounds), "--json", out,
                       *(["--compile"] if with_compile else [])] for name, out in outs.items()}

    def ended(end: Ended) -> None:
        name, out = end.name, outs[end.name]
        got = [json.loads(line) for line in Path(out).read_text().splitlines() if line.endswith("}")] \
            if os.path.exists(out) else []  # a line cut short by the kill is left out
        said = [line for line in end.stderr.splitlines() if line.strip()]
        # "<model> <config>: <plan> (<s> s)", whole: a line cut short by the kill is left out
        answered = [m for m in map(ANSWER.fullmatch, said) if m and m["model"] == name]
        for m in answered:
            print(m.string, file=sys.stderr, flush=True)
        if not got:
            # Where a stopped model's time went: the autoplan answers it gave first, and their seconds.
            gave = [f"{m['config']} in {m['seconds']} s" for m in answered]
            gave = f"; it had answered {', '.join(gave)}" if gave else "; before autoplan's first answer"
            why = (f"timed out after {end.seconds:.0f} s{gave}" if end.over else
                   f"stopped at the run's deadline after {end.seconds:.0f} s{gave}") if end.late else \
                f"exit {end.returncode}: {said[-1][:200] if said else 'nothing said'}"
            # cut: stopped by the run's deadline, not the model's own failure or timeout. results.py
            # keeps the model's earlier run for a cut run and for one that "timed out after" (its
            # rows not measured), not for one that exited.
            got = [{"model": name, "config": "all", "error": why, **({"cut": True} if end.late and not end.over else {})}]
        rows.extend({**r, "run": run} for r in got)
        print(f"{name}: {len(got)} rows on GPU {end.gpu} in {end.seconds:.0f} s", file=sys.stderr, flush=True)

    unstarted = on_gpus(commands, gpus, timeout, deadline, ended)
    rows += [{"model": n, "config": "all", "error": "not started: the run's deadline passed", "cut": True, "run": run}
             for n in unstarted]
    return rows


def profile(args: argparse.Namespace) -> None:
    """Where autoplan's own seconds go (``--profile MODEL``): one ``sw.autoplan`` call, under
    cProfile unless ``--no-profile``. A diagnosis, not a benchmark: prints each stage as it starts
    (seconds since the call began), autoplan's notes (its own time among them), then the functions
    with the most cumulative time (building models, measuring iterations, subprocesses)."""
    import cProfile
    import pstats

    from shrinkwrap.compare import measure_plans

    make, batch, _ = setup(args.profile)
    profiler = cProfile.Profile()
    started = time.perf_counter()

    def progress(i: int, n: int, text: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {i}/{n} {text}", flush=True)

    if not args.no_profile:
        profiler.enable()
    plan, report = sw.autoplan(make, batch, max_slowdown=args.slowdown, allow_lossy=True, device="cuda",
                               compile=args.compile, progress=progress)
    profiler.disable()
    print(f"{args.profile}: {plan} in {time.perf_counter() - started:.1f} s")
    print("\n".join(report.notes))
    answer = next(r for r in reversed(report.rows) if r.plan == plan)
    print(f"answer: {report.value(answer) / 2**20:.1f} MiB, {answer.profile.step_ms:.1f} ms ({answer.role})")
    print(f"rows measured {report.isolation}")
    if args.dump and not args.no_profile:
        profiler.dump_stats(args.dump)
    if not args.no_profile:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.top)
    if args.check_baseline:  # is a first row in this process what a fresh process sees?
        fresh = measure_plans(make, [sw.Plan()], batch, isolate=True,
                              options=sw.Options(device="cuda")).rows[0]
        for where, row in (("autoplan's", report.rows[0]), ("fresh process", fresh)):
            print(f"baseline, {where}: {report.value(row) / 2**20:.1f} MiB, {row.profile.step_ms:.1f} ms")



def stopped(group: list[dict[str, Any]]) -> bool:
    """A model's run that ended without rows: the run's deadline cut it, or it outran ``--timeout``."""
    return all(r["config"] == "all" and (r.get("cut") or r["error"].startswith("timed out after")) for r in group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated: ZOO names and bench models (default: --all)")
    parser.add_argument("--all", action="store_true", help="every ZOO model, then the five bench models")
    parser.add_argument("--gpus", default="0", help="comma-separated GPU indices, one model on each at a time")
    parser.add_argument("--compile", action="store_true", help="also autoplan with compile=True at 1.0x")
    parser.add_argument("--rounds", type=int, default=5)
    # With --compile a model's three autoplan calls and four compiled rows can outrun the eager default.
    parser.add_argument("--timeout", type=float, help="seconds a model may take (default 900, 1800 with --compile)")
    parser.add_argument("--deadline", type=float, help="seconds from now after which nothing runs")
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--again", help=argparse.SUPPRESS)
    parser.add_argument("--profile", metavar="MODEL", help="where one autoplan call's seconds go, in this process")
    parser.add_argument("--slowdown", type=float, default=1.0, help="--profile: autoplan's max_slowdown")
    parser.add_argument("--top", type=int, default=30, help="--profile: how many functions to print")
    parser.add_argument("--sort", default="cumulative", help="--profile: pstats sort key: cumulative, tottime, ...")
    parser.add_argument("--dump", help="--profile: also write the raw profile here, for pstats")
    parser.add_argument("--no-profile", action="store_true",
                        help="--profile: autoplan's own time without cProfile, whose overhead falls on the Python "
                             "side (copies of the model, module calls)")
    parser.add_argument("--check-baseline", action="store_true",
                        help="--profile: after autoplan, the baseline again in a fresh process, beside autoplan's")
    args = parser.parse_args()
    if args.profile:
        profile(args)
        return 0
    if args.again:
        second_call(args.again)
        return 0
    if args.one:
        rows = one(args.one, args.rounds, args.compile)
    else:
        models = args.models.split(",") if args.models else list(ZOO) + list(MODELS)
        unknown = [m for m in models if m not in ZOO and m not in MODELS]
        if unknown or not (args.models or args.all):
            parser.error(f"give --models from {sorted(ZOO) + sorted(MODELS)}, or --all" if not unknown
                         else f"unknown model(s) {unknown}; known: {sorted(ZOO) + sorted(MODELS)}")
        timeout = args.timeout or (1800 if args.compile else 900)
        rows = run_all(models, args.gpus.split(","), timeout, args.rounds, args.compile, args.deadline)
    if args.json:
        # A model's run replaces its earlier run's rows, but for one that ended without rows.
        had = {r["model"] for r in load_rows(args.json) if r["config"] != "all"}
        by: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by.setdefault(r["model"], []).append(r)
        save_rows(args.json, [r for m, group in by.items() if not (m in had and stopped(group)) for r in group],
                  key=lambda r: r["model"])
    if not args.one:
        from results import zoo_lines

        print("\n".join(zoo_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
