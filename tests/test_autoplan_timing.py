"""How autoplan decides a time limit: the median and its noise, more rounds, and timing in turns with the baseline."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import rows as rows_module

from autoplan_helpers import BATCH, FAST, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_step_time_limit_is_decided_on_the_median_and_trusted_beyond_the_noise():
    from shrinkwrap.measuring.ratios import slowdown_decided, within_slowdown

    base = sw.Timing((10.0, 10.1, 9.9, 10.0, 10.0))
    tight_in, tight_over = sw.Timing((10.2, 10.3, 10.1, 10.2, 10.2)), sw.Timing((11.0, 11.1, 10.9, 11.0, 11.0))
    assert within_slowdown(base, tight_in, 1.0) and slowdown_decided(base, tight_in, 1.0)   # 1.02x: in the tolerance
    assert not within_slowdown(base, tight_over, 1.0) and slowdown_decided(base, tight_over, 1.0)  # 1.10x: over
    assert not within_slowdown(base, tight_in, 1.0, tolerance=0.0)
    # 1.10x by the median, rounds spread over 36%: over, but not yet beyond the noise (more rounds decide).
    noisy = sw.Timing((9.0, 11.0, 13.0, 11.0, 12.0))
    assert not within_slowdown(base, noisy, 1.0) and not slowdown_decided(base, noisy, 1.0)
    # One slow round no longer excuses 1.2x: the median decides, the interval only says whether to go on.
    hiccup = sw.Timing((12.0, 12.1, 11.9, 12.0, 30.0))
    assert not within_slowdown(base, hiccup, 1.0) and slowdown_decided(base, hiccup, 1.0)
    # Drift that falls on both alike (rounds paired) is no noise: 1.10x in every round is over.
    drift = sw.Timing((10.0, 14.0, 10.0, 14.0, 10.0))
    assert not within_slowdown(drift, sw.Timing((11.0, 15.4, 11.0, 15.4, 11.0)), 1.0)
    assert slowdown_decided(drift, sw.Timing((11.0, 15.4, 11.0, 15.4, 11.0)), 1.0)


@pytest.mark.parametrize("n, inner", [(5, (0, 4)), (10, (2, 7)), (15, (4, 10))])
def test_the_ratios_interval_narrows_to_inner_order_statistics_as_rounds_are_added(n, inner):
    from shrinkwrap.measuring.ratios import ratio_interval

    ratios = [1.0 + i / 100 for i in range(n)]  # sorted already, distinct
    ratio, low, high = ratio_interval(sw.Timing((10.0,) * n), sw.Timing(tuple(10.0 * r for r in ratios)))
    assert (low, high) == pytest.approx((ratios[inner[0]], ratios[inner[1]]))
    assert ratio == pytest.approx(ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2)


def test_a_chosen_plan_is_timed_in_more_rounds_until_its_limit_is_decided(monkeypatch):
    """A fake clock: the plan's rounds alternate 0.9x and 1.2x the baseline's, then settle at 1.1x.
    Five rounds leave 1.0x inside the interval; rounds go on until it is not, and the median of
    them all is over the limit."""
    import sys

    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.measuring import turns as measure_turns
    from shrinkwrap.measuring.ratios import MAX_ROUNDS, slowdown_decided
    from shrinkwrap.report import Row

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    plan_times = iter([9.0, 12.0, 9.0, 12.0, 9.0] + [11.0] * 50)
    turns = []

    def fake_timed(step, device, n):  # the baseline (built first) runs first in even rounds
        rnd, pos = divmod(len(turns), 2)
        turns.append(step)
        return [next(plan_times) if pos == (1 if rnd % 2 == 0 else 0) else 10.0] * n

    monkeypatch.setattr(measure_turns, "_timed", fake_timed)
    rows = rows_module.Rows(mlp, mlp(), BATCH, sw.Options(device="cpu", warmup=1, iterations=1), False, {}, None)
    search = _Search(rows, rows.probe, None, 1.0, 10.0, None, 10.0, False, False, 1.0)
    plan = sw.Plan.parse("checkpoint('1')")
    search.time_against_baseline(plan)
    baseline, timed = search.ratios[str(plan)]
    assert 5 < len(timed.rounds_ms) < MAX_ROUNDS
    assert sorted(timed.rounds_ms[:5]) == [9.0, 9.0, 9.0, 12.0, 12.0] and set(baseline.rounds_ms) == {10.0}
    assert slowdown_decided(baseline, timed, 1.0)
    assert not search.fits_time(Row(plan, None))
    rows.close()


def test_of_plans_alike_in_memory_the_least_memory_answer_is_the_fastest():
    import dataclasses

    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.report import Row

    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    plans = {"checkpoint('a')": (869.0, 38.0), "checkpoint('a'), compile()": (875.0, 14.5),
             "checkpoint('b')": (700.0, 99.0)}
    rows = [Row(sw.Plan.parse(text), dataclasses.replace(prof, step_ms=ms)) for text, (_, ms) in plans.items()]
    search = _Search(None, None, lambda r: plans[str(r.plan)][0], 1000.0, 30.0, None, 45.0, False, False, 1.5)
    assert str(search.final(rows).plan) == "checkpoint('a'), compile()"  # 0.7% more memory at 0.4x the time
    search.max_t = 120.0
    assert str(search.final(rows).plan) == "checkpoint('b')"  # 20% less memory: the smaller wins


def test_a_chosen_plan_is_timed_in_turns_with_the_baseline(monkeypatch):
    import sys

    ratios = sys.modules["shrinkwrap.measuring.ratios"]
    calls = []
    real = ratios.time_interleaved

    def spy(models, *args, **kwargs):
        calls.append(sorted(models))
        return real(models, *args, **kwargs)

    monkeypatch.setattr(ratios, "time_interleaved", spy)
    plan, report = sw.autoplan(mlp, BATCH, budget=0.45, max_slowdown=100.0, **FAST)
    assert calls and all(c == ["baseline", "plan"] for c in calls)
    assert any("timed in turns with it" in n and "within the limit of 100.0x" in n for n in report.notes)
