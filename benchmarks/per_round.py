"""How many iterations a round of timing in turns needs: plans timed in turns with the model as it
is for 15 rounds of 6 iterations, every iteration's time kept; then autoplan's decision rules
(:func:`shrinkwrap.measuring.ratios.slowdown_decided` and ``within_slowdown``: five rounds, then one
at a time until decided, 15 at most) replayed on the first k iterations of each round.

    python benchmarks/per_round.py efficientnet_b0 --json benchmarks/per_round.json   # on CUDA
    python benchmarks/results.py                                                       # the table

Each plan is timed twice in one process. A decision made on one timing, at each of eight
step-time limits, is checked against what the other timing says on all of its iterations (the
median of its 15 rounds' ratios within the limit plus 3%, or not): how often the rules, on k
iterations a round, decide as a second timing of the same plan would, and how many iterations
they spend doing it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from shrinkwrap.measuring import turns as measure_turns  # noqa: E402
from shrinkwrap.measuring.ratios import MAX_ROUNDS, slowdown_decided, within_slowdown  # noqa: E402
from shrinkwrap.measuring.profile import Timing  # noqa: E402

sys.path.insert(0, str(HERE))
from harness import JSON_HELP, ROW_KEYS, run_stamp, save_rows, setup  # noqa: E402

PLANS = {
    "maxvit_t": ["autocast(torch.bfloat16)", "channels_last(), autocast(torch.bfloat16)",
                 "swish(), bn_act(), channels_last(), autocast(torch.bfloat16)",
                 "checkpoint('stem'), swish(), channels_last(), autocast(torch.bfloat16)"],
    "efficientnet_b0": ["channels_last(), autocast(torch.bfloat16)",
                        "swish(), bn_act(), channels_last(), autocast(torch.bfloat16)",
                        r"checkpoint(r'features\.4'), swish(), bn_act(), channels_last(), autocast(torch.bfloat16)",
                        r"checkpoint(r'features\.[0-2]'), bn_act(), channels_last(), autocast(torch.bfloat16)"],
    "densenet121": ["channels_last()", "autocast(torch.bfloat16)", "checkpoint(('features.transition1',))",
                    "channels_last(), autocast(torch.bfloat16)"],
}
ROUNDS, ITERATIONS, TIMINGS = 15, 6, 2
LIMITS = (0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5)
TOLERANCE = 0.03


def collect(name: str) -> list[dict]:
    """Every plan of ``name`` timed :data:`TIMINGS` times in turns with the model as it is: each
    iteration's milliseconds, a list a round, for both."""
    make, batch, _ = setup(name)
    times: list[list[float]] = []
    timed = measure_turns._timed

    def kept(step, device, n):  # time_interleaved's rounds, each iteration's time kept
        out = timed(step, device, n)
        times.append(out)
        return out

    measure_turns._timed = kept
    rows = []
    try:
        for text in PLANS[name]:
            for timing in range(TIMINGS):
                times.clear()
                sw.time_interleaved({"baseline": make(), "plan": sw.apply(make(), text)}, batch,
                                    sw.Options(device="cuda", warmup=1), rounds=ROUNDS, per_round=ITERATIONS)
                # Round r runs the baseline first where r is even, the plan first where it is odd.
                firsts, seconds = times[0::2], times[1::2]
                base = [f if r % 2 == 0 else s for r, (f, s) in enumerate(zip(firsts, seconds))]
                plan = [s if r % 2 == 0 else f for r, (f, s) in enumerate(zip(firsts, seconds))]
                rows.append({"model": name, "plan": text, "timing": timing, "baseline_ms": base, "plan_ms": plan,
                             **run_stamp()})
    finally:
        measure_turns._timed = timed
    return rows


def _ratio(row: dict) -> float:
    """The median of the rounds' ratios over every iteration of a timing."""
    return statistics.median(statistics.mean(p) / statistics.mean(b) for p, b in zip(row["plan_ms"], row["baseline_ms"]))


def decided(row: dict, k: int, limit: float) -> tuple[bool, int, bool]:
    """The rules on the first ``k`` iterations of each round: within ``limit``, the rounds spent,
    and whether the interval decided it (else the median did, after :data:`MAX_ROUNDS`)."""
    base = [statistics.mean(r[:k]) for r in row["baseline_ms"]]
    plan = [statistics.mean(r[:k]) for r in row["plan_ms"]]
    n = 5
    while n < MAX_ROUNDS and not slowdown_decided(Timing(tuple(base[:n])), Timing(tuple(plan[:n])), limit, TOLERANCE):
        n += 1
    b, p = Timing(tuple(base[:n])), Timing(tuple(plan[:n]))
    return within_slowdown(b, p, limit, TOLERANCE), n, slowdown_decided(b, p, limit, TOLERANCE)


def replayed(rows: list[dict], ks: tuple[int, ...] = (2, 3, 4, 5)) -> list[dict]:
    """For each ``k``: the iterations spent (both models), the decisions that agree with the same
    plan's other timing, of how many, and how many the interval left undecided."""
    pairs: dict[tuple, list[dict]] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["plan"]), []).append(r)
    out = []
    for k in ks:
        spent = agree = made = undecided = 0
        for both in pairs.values():
            for one, other in zip(both, both[1:] + both[:1]) if len(both) > 1 else ():
                truth = _ratio(other)
                for limit in LIMITS:
                    within, n, sure = decided(one, k, limit)
                    spent += 2 * n * k
                    agree += within == (truth <= limit * (1 + TOLERANCE))
                    made += 1
                    undecided += not sure
        out.append({"k": k, "iterations": spent, "agree": agree, "decisions": made, "undecided": undecided})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(PLANS))
    parser.add_argument("--json", type=Path, help=JSON_HELP)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    rows = collect(args.model)
    if args.json:
        save_rows(args.json, rows, key=ROW_KEYS["per_round.json"])
    for r in replayed(rows):
        print(f"{r['k']} iterations a round: {r['iterations']} iterations, {r['agree']}/{r['decisions']} agree "
              f"with the other timing, {r['undecided']} undecided")
    return 0


if __name__ == "__main__":
    sys.exit(main())
