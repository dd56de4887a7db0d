"""The fit test: the smallest memory cap under which a configuration trains, found by training it.

On the CPU: the bisection over constructed outcomes (a threshold, disagreeing probes, a
configuration that needs less than it allocated), the refusal without CUDA, and autoplan's check
of its answer under the budget's cap with the probe replaced. The probes themselves train on a GPU:
tests/test_fit_cuda.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.fit import Probe, bisect, bracket

MiB = 2**20


def threshold(need: int, calls: list):
    """Probes of a configuration that trains exactly under caps of ``need`` bytes and more."""
    def run(caps):
        calls.append(list(caps))
        return [Probe(c, c >= need, oom=c < need) for c in caps]
    return run


@pytest.mark.parametrize("need_mib", [700, 1000, 1099, 1499])
@pytest.mark.parametrize("at_once", [1, 3, 7])
def test_bisection_brackets_the_need_to_the_resolution(need_mib, at_once):
    calls = []
    free = Probe(None, True, reserved=1500 * MiB, allocated=1100 * MiB)
    probes = bisect(free, threshold(need_mib * MiB, calls), lambda passed: at_once, 16 * MiB)
    cap, below = bracket(probes)
    assert below is not None and below < need_mib * MiB <= cap and cap - below <= 16 * MiB
    assert all(len(c) <= at_once for c in calls)
    if at_once == 7 and need_mib >= 990:  # within the first round's span: two rounds of seven
        assert len(calls) <= 2


def test_a_configuration_needing_less_than_it_allocated_freely_is_found_below_the_first_round():
    calls = []
    free = Probe(None, True, reserved=1500 * MiB, allocated=1400 * MiB)  # allocated freely, not needed
    cap, below = bracket(bisect(free, threshold(300 * MiB, calls), lambda passed: 4, 16 * MiB))
    assert below < 300 * MiB <= cap and len(calls) > 1


def test_probes_that_disagree_give_the_smallest_cap_that_trained():
    probes = [Probe(None, True, reserved=900 * MiB, allocated=800 * MiB), Probe(700 * MiB, False, oom=True),
              Probe(650 * MiB, True), Probe(600 * MiB, False, oom=True)]
    assert bracket(probes) == (650 * MiB, 600 * MiB)


def test_a_failure_other_than_out_of_memory_ends_the_search():
    def run(caps):
        return [Probe(c, False, oom=False, error="RuntimeError: boom") for c in caps]

    free = Probe(None, True, reserved=1000 * MiB, allocated=900 * MiB)
    probes = bisect(free, run, lambda passed: 4, 16 * MiB)
    assert len(probes) == 5 and not any(p.oom for p in probes[1:])


def test_fit_and_trains_under_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"^shrinkwrap: fit\(\) caps the CUDA allocator; it needs a CUDA device"):
        sw.fit(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"^shrinkwrap: trains_under\(\) caps the CUDA allocator"):
        sw.trains_under(nn.Linear(4, 4), torch.randn(2, 4), 2**30)


def test_autoplan_answers_with_the_first_plan_that_trains_under_the_budget_s_cap(monkeypatch):
    ap = sys.modules["shrinkwrap.autoplan"]
    tried = []

    def probe(make, batch, cap, plan, options, **kw):  # the second plan is the first to train under the cap
        tried.append(str(plan))
        return Probe(cap, len(tried) == 2, oom=len(tried) != 2, error="CUDA out of memory", reserved=cap // 2)

    class Rows:
        make, batch, options, unsendable = nn.Linear, torch.randn(2, 4), sw.Options(), None

        def options_for(self, plan):
            return self.options

    monkeypatch.setattr(ap, "trains_under", probe)
    rows = [sw.Row(sw.Plan.parse(text), None) for text in ("checkpoint('a')", "checkpoint('b')", "checkpoint('c')")]
    row, notes = ap._under_cap(rows, Rows(), 64 * MiB)
    assert row is rows[1] and row.trained_under == 64 * MiB and rows[0].trained_under is None
    assert tried == ["checkpoint('a')", "checkpoint('b')"]
    assert "did not train under a 64 MiB cap: CUDA out of memory" in notes[0]
    assert notes[1].startswith("fits in 64 MiB: checkpoint('b') trained 8 iterations under a 64 MiB cap")
    tried.clear()
    none, notes = ap._under_cap(rows[:1], Rows(), 64 * MiB)
    assert none is None and len(notes) == 1
