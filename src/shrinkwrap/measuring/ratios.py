"""Step-time ratios of plans timed in turns: the median of the rounds' ratios, an interval that
holds the true median with a stated confidence whatever the rounds' distribution, and whether
the rounds so far decide a slowdown limit (autoplan times more rounds until they do)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch.nn as nn

from .profile import Options, Timing
from .turns import time_interleaved

MAX_ROUNDS = 15  # rounds in turns at most (see timed_against); undecided after them, by the median
# Iterations of each model a round (see timed_against). Time drifts between rounds more than the
# iterations of one round scatter, so more rounds decide better than longer ones, and a caller's
# larger ``iterations`` (a row's) does not lengthen them (benchmarks/RESULTS.md, "Timing in turns:
# iterations a round").
PER_ROUND = 3
CONFIDENCE = 0.8  # a step-time limit is decided once the ratio's interval of this confidence is on one side


def paired_ratio(baseline: Timing, plan: Timing) -> tuple[float, float]:
    """``plan``'s step time as a multiple of ``baseline``'s, and the spread of that ratio.

    Timed in turns, round i of the plan and of the baseline ran side by side: the ratio is the
    median of the rounds' ratios (drift falls on both alike), and its spread their range over the
    ratio, without the highest and the lowest where there are five rounds or more, so that one
    hiccup of the shared GPU is not taken for noise. Timings of unequal rounds: the medians' ratio
    and the wider of their spreads."""
    ratios = _round_ratios(baseline, plan)
    if ratios is None:
        return plan.median / baseline.median, max(baseline.spread, plan.spread)
    ratio = statistics.median(ratios)
    kept = ratios[1:-1] if len(ratios) >= 5 else ratios
    return ratio, (kept[-1] - kept[0]) / ratio


def _round_ratios(baseline: Timing, plan: Timing) -> list[float] | None:
    """The rounds' ratios plan/baseline, sorted; None for timings of unequal rounds (not paired)."""
    if len(baseline.rounds_ms) != len(plan.rounds_ms):
        return None
    return sorted(p / b for p, b in zip(plan.rounds_ms, baseline.rounds_ms))


def ratio_interval(baseline: Timing, plan: Timing, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``plan``'s step time as a multiple of ``baseline``'s (the median of the rounds' ratios, as
    :func:`paired_ratio`), with an interval that holds the true median with at least
    ``confidence``, whatever the rounds' distribution: the k-th lowest and k-th highest ratio, k as
    large as the binomial distribution allows (5 rounds: their whole range; 10: the 3rd to the 8th;
    15: the 5th to the 11th; fewer than 4 rounds reach 80% with no k). It narrows as rounds are
    added, which a spread of the rounds does not. Timings of unequal rounds: the medians' ratio,
    +- half the wider of their spreads.

    Example::

        >>> ratio_interval(Timing((10.0,) * 5), Timing((10.5, 10.2, 10.4, 10.3, 13.0)))
        (1.04, 1.02, 1.3)
    """
    ratios = _round_ratios(baseline, plan)
    if ratios is None:
        ratio, half = plan.median / baseline.median, max(baseline.spread, plan.spread) / 2
        return ratio, ratio * (1 - half), ratio * (1 + half)
    n, k = len(ratios), 1
    while k < (n + 1) // 2 and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n >= confidence:
        k += 1
    return statistics.median(ratios), ratios[k - 1], ratios[n - k]


def within_slowdown(baseline: Timing, plan: Timing, max_slowdown: float, tolerance: float = 0.03) -> bool:
    """Whether ``plan`` runs within ``max_slowdown`` times ``baseline``'s step time (``tolerance``
    over it still counts as within), both timed in turns: decided on the median of the rounds'
    ratios. Whether that median can be trusted is :func:`slowdown_decided`'s question; autoplan
    times more rounds until it can, and says when it could not.

    Example::

        >>> within_slowdown(Timing((10.0, 10.2)), Timing((10.3, 10.4)), 1.0)   # 1.025x: within 3%
        True
    """
    return ratio_interval(baseline, plan)[0] <= max_slowdown * (1 + tolerance)


def slowdown_decided(baseline: Timing, plan: Timing, max_slowdown: float, tolerance: float = 0.03) -> bool:
    """Whether the rounds so far decide :func:`within_slowdown` beyond the noise: the interval of
    :func:`ratio_interval` lies wholly within the limit or wholly over it (never with fewer than
    four paired rounds, whose widest interval holds the median with less than 80%). An interval,
    not the rounds' spread: a spread wide enough to excuse a plan would pass one that is over the
    limit by its median (docs/measuring.md, "Timing in turns")."""
    if len(baseline.rounds_ms) == len(plan.rounds_ms) < 4:
        return False
    _, low, high = ratio_interval(baseline, plan)
    limit = max_slowdown * (1 + tolerance)
    return high <= limit or low > limit


def timed_against(baseline: nn.Module, plan: nn.Module, batch: Any, options: Options, max_slowdown: float,
                  tolerance: float = 0.03, progress: Callable[[str], None] | None = None) -> tuple[Timing, Timing]:
    """``baseline`` and ``plan`` (two models) timed in turns (:func:`time_interleaved`): five
    rounds of :data:`PER_ROUND` iterations each, then one at a time until they decide
    ``max_slowdown`` (:func:`slowdown_decided`), :data:`MAX_ROUNDS` at most. The timings a
    step-time limit is decided on, baseline's first. ``progress`` gets a line as each round ends."""
    timings = time_interleaved(
        {"baseline": baseline, "plan": plan}, batch, options, rounds=5, per_round=PER_ROUND,
        until=lambda t: slowdown_decided(t["baseline"], t["plan"], max_slowdown, tolerance), max_rounds=MAX_ROUNDS,
        progress=None if progress is None else lambda r: progress(f"timed in turns, round {r} of 5 to {MAX_ROUNDS}"))
    return timings["baseline"], timings["plan"]
