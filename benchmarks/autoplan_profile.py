"""Where autoplan's own seconds go: one ``sw.autoplan`` call, under cProfile unless ``--no-profile``.

    python benchmarks/autoplan_profile.py --model bert [--slowdown 1.0] [--compile] [--check-baseline] [--no-profile]

A diagnosis, not a benchmark: prints each stage as it starts (seconds since the call began), autoplan's
notes (its own time among them), then the functions with the most cumulative time (building models,
measuring iterations, emptying caches, subprocesses). ``--model`` is a bench model or one of the zoo's
torchvision classifiers (``zoo.py``, at its batch).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from run import MODELS  # noqa: E402
from shrinkwrap.compare import measure_plans  # noqa: E402
from zoo import ZOO, setup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted({*MODELS, *ZOO}))
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="cumulative", help="pstats sort key: cumulative, tottime, ...")
    parser.add_argument("--dump", help="also write the raw profile here, for pstats")
    parser.add_argument("--no-profile", action="store_true",
                        help="autoplan's own time without cProfile, whose overhead falls on the Python side "
                             "(copies of the model, module calls)")
    parser.add_argument("--check-baseline", action="store_true",
                        help="after autoplan, the baseline again in a fresh process, beside autoplan's")
    args = parser.parse_args()
    make, batch, _ = setup(args.model)
    profiler = cProfile.Profile()
    started = time.perf_counter()

    def progress(i: int, n: int, text: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {i}/{n} {text}", flush=True)

    if not args.no_profile:
        profiler.enable()
    plan, report = sw.autoplan(make, batch, max_slowdown=args.slowdown, allow_lossy=True, device="cuda",
                               compile=args.compile, progress=progress)
    profiler.disable()
    print(f"{args.model}: {plan} in {time.perf_counter() - started:.1f} s")
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


if __name__ == "__main__":
    main()
