"""autoplan's answer against its limits: budgets, time limits, the largest batch, and arguments it refuses."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates, parse_budget, scale_batch

from autoplan_helpers import BATCH, Block, FAST, _effects_table, _rows, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_verified_plan_over_whole_stages_is_measured_again_with_a_region_a_block():
    # ConvNeXt's shape: the search took the stages whole, whose rows alone read as their blocks'
    # did; measured together, a region a block keeps less (a stage's recompute holds the whole
    # stage). The plan with the stages' blocks each alone is measured, and answers.
    import dataclasses
    import sys

    from types import SimpleNamespace

    from shrinkwrap.report import Row

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    features = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[Block() for _ in range(3)]),
                             nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), nn.Sequential(*[Block() for _ in range(4)]))
    model = nn.Sequential(features, nn.Linear(8, 1))
    by_cover = {c.covers: c for c in candidates(model, device="cpu")}
    stages = [by_cover[("0.1",)], by_cover[("0.3",)]]
    blocks = [by_cover[("0.1.0", "0.1.1", "0.1.2")], by_cover[("0.3.0", "0.3.1", "0.3.2", "0.3.3")]]
    halves = [by_cover[("0.3.0", "0.3.1")], by_cover[("0.3.2", "0.3.3")]]
    effects = [ap.Effect(c, 100.0, 1.0) for c in stages + blocks + halves]
    finer = ap._finer(effects[:2], model)
    assert [e.candidate.covers for e in finer] == [c.covers for c in blocks]  # every block of each stage, each alone
    assert ap._finer(effects[2:4], model) is None  # nothing finer than a region a block
    # A candidate over a stage and the module after it (a pair of features' children, as on
    # ConvNeXt): the stage goes block by block, the module without a stack inside stays whole.
    from shrinkwrap.step import Candidate
    from shrinkwrap.transforms.checkpoint import Checkpoint

    pair = Candidate((Checkpoint(("0.1", "0.2")),), ("0.1", "0.2"))
    assert ap._finer([ap.Effect(pair, 100.0, 1.0)], model)[0].candidate.covers == (*blocks[0].covers, "0.2")
    # A region over a stage of stages gives the blocks inside them: features whole gives every
    # block of both stages, and the module between them that is a block of features itself.
    (outer,) = [c for c in candidates(model, device="cpu") if c.covers == ("0",)]
    inner = ap._finer([ap.Effect(outer, 100.0, 1.0)], model)[0].candidate.covers
    assert set(inner) == {"0.2", *blocks[0].covers, *blocks[1].covers}

    whole, each = ap._plan(stages, model), ap._plan(blocks, model)
    keeps = {str(whole): 600.0, str(each): 450.0}
    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    measured = []

    class Search(ap._Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            measured.append((str(plan), isolate))
            return Row(plan, dataclasses.replace(prof, step_ms=9.0))

    search = Search(SimpleNamespace(cuda=False), model, lambda r: keeps[str(r.plan)], 1000.0, 8.0, None, 10.0, False,
                    False, 1.25)
    tried = search.verify(effects[:2], [], effects, 1)
    assert [t for t, isolate in measured if not isolate] == [str(whole), str(each)]
    assert search.final(tried).plan == each


def test_budgets_read_as_bytes_text_or_fraction():
    assert parse_budget(2**30, 5000) == 2**30
    assert parse_budget("4GiB", 0) == 4 * 2**30 and parse_budget("500MB", 0) == 500e6
    assert parse_budget(0.5, 5000) == 2500
    with pytest.raises(ValueError, match="cannot read budget"):
        parse_budget("lots", 1)


def test_chosen_plan_fits_the_budget_and_is_verified():
    plan, report = sw.autoplan(mlp, BATCH, budget=0.45, **FAST)
    base = report.value(report.rows[0])
    final = report.rows[-1]
    assert plan == final.plan and final.role == "chosen"
    assert report.value(final) <= 0.45 * base
    # the verification is real: applying the plan and counting again gives the same bytes
    model = sw.apply(mlp(), plan)
    assert sw.saved_tensor_bytes(model, BATCH) == report.value(final)
    assert any(n.startswith("taken:") for n in report.notes)


def test_progress_true_draws_the_stages_on_stderr_and_anything_else_uncallable_is_refused(capsys):
    sw.autoplan(mlp, BATCH, budget=0.45, progress=True, **FAST)
    err = capsys.readouterr().err.splitlines()  # not a terminal here: a line as each stage starts and each item ends
    assert err[0] == "shrinkwrap: 0/1 baseline"
    assert any(" verifying, " in line for line in err)
    assert err[-1] == "shrinkwrap: 1/1 done"  # a bar ends its line
    told = []
    sw.autoplan(mlp, BATCH, budget=0.45, progress=lambda i, n, text: told.append((i, n, text)), **FAST)
    assert told[0] == (0, 1, "baseline") and told[-1] == (1, 1, "done")
    sw.autoplan(mlp, BATCH, budget=0.45, progress=False, **FAST)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="shrinkwrap: progress is True"):
        sw.autoplan(mlp, BATCH, budget=0.45, progress="yes", **FAST)


def test_a_budget_the_baseline_meets_gives_the_empty_plan():
    plan, report = sw.autoplan(mlp(), BATCH, budget=1.0, **FAST)
    assert plan == sw.Plan() and "the empty plan" in report.notes[-1]
    assert len(report.rows) == 1   # nothing else measured


def test_an_impossible_budget_is_an_answer_not_an_error():
    plan, report = sw.autoplan(mlp, BATCH, budget="16B", rounds=3, **FAST)  # 16 bytes: an int that small is refused
    assert len(plan) > 0
    msg = next(n for n in report.notes if n.startswith("no plan found"))
    smallest = min(report.value(r) for r in report.rows if r.role == "chosen")
    assert f"{smallest / 2**20:.1f} MiB" in msg and str(plan) in msg


def test_a_time_limit_no_verified_plan_meets_is_answered_with_the_model_as_it_is(monkeypatch):
    import sys

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    # A generous limit lets the search choose plans; then every plan it verifies reads over the limit.
    monkeypatch.setattr(ap._Search, "fits_time", lambda self, row: len(row.plan) == 0)
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, rounds=2, **FAST)
    assert any(r.role == "chosen" and len(r.plan) for r in report.rows)  # plans were verified, over the limit
    assert len(plan) == 0
    assert any(n.startswith("no plan found within the step-time limit; the answer is the empty plan")
               for n in report.notes)
    assert not any(n.startswith("taken:") for n in report.notes)


def test_where_no_plan_meets_both_limits_the_fastest_within_the_budget_is_the_answer():
    from shrinkwrap.autoplan.stages import _Search

    rows, metric = _rows({"checkpoint('a')": (500.0, 30.0), "checkpoint('b')": (400.0, 40.0),
                          "checkpoint('c')": (900.0, 10.0)})
    search = _Search(None, None, metric, 1000.0, 8.0, 800.0, 5.0, False, False, 0.6)  # none within 5 ms
    assert str(search.final(rows).plan) == "checkpoint('a')"  # not b, the smallest; not c, over budget
    search.target = 300.0  # none within the budget either: the smallest
    assert str(search.final(rows).plan) == "checkpoint('b')"


def test_where_no_set_meets_both_limits_the_search_takes_the_fastest_within_the_budget():
    from shrinkwrap.autoplan.choose import _search

    # b alone is within the time limit but not the budget; a is within the budget, over the time limit.
    table = _effects_table(("a", ("a",), 5.0, 10.0), ("b", ("b",), 3.0, 1.0), ("c", ("c",), 1.0, 20.0))
    for max_t in (105.0, 90.0):  # 90: not even the baseline is within it
        chosen = _search(table, 10.0, 100.0, target=6.0, max_t=max_t)
        assert [str(e.candidate) for e in chosen] == ["checkpoint('a')"]
    # A budget no set reaches: the smallest set within the time limit, as before.
    chosen = _search(table, 10.0, 100.0, target=0.5, max_t=105.0)
    assert [str(e.candidate) for e in chosen] == ["checkpoint('b')"]


def test_the_largest_batch_search_answers_a_plan_where_the_given_batch_fits_no_budget():
    plan, report = sw.autoplan(mlp, BATCH, budget=0.01, maximize="batch", rounds=2, **FAST)
    assert len(plan) > 0
    assert not any("step-time limit" in n for n in report.notes)


def test_an_answer_its_fresh_process_reads_over_the_budget_hands_the_answer_to_the_next_plan():
    import dataclasses
    import types

    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.report import Row

    prof = sw.measure(nn.Linear(2, 2), torch.randn(2, 2), iterations=1, warmup=1)
    here = {"checkpoint('a')": (700, 10.0), "checkpoint('b')": (750, 12.0), "checkpoint('c')": (900, 9.0)}
    fresh = {"checkpoint('a')": 820, "checkpoint('b')": 760}  # a fresh process reads more than this one
    memory: dict[int, float] = {}
    measured = []

    def row(text, mem, ms):
        r = Row(sw.Plan.parse(text), dataclasses.replace(prof, step_ms=ms), role="chosen")
        memory[id(r)] = mem
        return r

    class Search(_Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            measured.append(str(plan))
            return row(str(plan), fresh[str(plan)], here[str(plan)][1])

    search = Search(types.SimpleNamespace(cuda=True), None, lambda r: memory[id(r)], 1000.0, 8.0, 800.0, None,
                    False, False)
    tried = search._fresh_answer([row(text, mem, ms) for text, (mem, ms) in here.items()])
    best = search.final(tried)
    assert measured == ["checkpoint('a')", "checkpoint('b')"]  # a, the fastest within, reads 820 fresh
    assert str(best.plan) == "checkpoint('b')" and memory[id(best)] == 760
    assert len(tried) == 3

    # Within the budget but over the time limit (none meets both): the answer is measured fresh too.
    measured.clear()
    search.max_t, search.max_slowdown = 4.0, 0.5
    search._fresh_answer([row(text, mem, ms) for text, (mem, ms) in here.items()])
    assert measured == ["checkpoint('a')", "checkpoint('b')"]


def test_least_memory_within_a_slowdown():
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, **FAST)
    singles = [report.value(r) for r in report.rows[1:] if r.role != "chosen"]
    answer = next(r for r in report.rows if r.plan == plan)
    assert report.value(answer) <= min(singles)   # no single candidate does better
    assert "checkpoint('1')" in str(plan)         # the whole stage: the least memory here
    # A region a block was measured too (the stage's blocks each alone), and kept more here.
    (each,) = [r for r in report.rows if r.role == "chosen" and str(r.plan).startswith(r"checkpoint(r'1\.\d+')")]
    assert report.value(each) > report.value(answer)


def test_the_largest_batch_that_fits():
    plan, report = sw.autoplan(mlp, BATCH, budget="200000B", maximize="batch", **FAST)
    tried = [r for r in report.rows if r.role == "batch"]
    fits = [r.batch_size for r in tried if r.fits]
    too_large = [r.batch_size for r in tried if not r.fits]
    assert fits and too_large and max(fits) < min(too_large)
    assert f"largest batch that fits the budget: {max(fits)}" in report.notes[-1]


def test_scale_batch_cuts_and_repeats_along_the_first_dimension():
    b = {"ids": torch.arange(6).view(3, 2), "x": torch.ones(3)}
    assert scale_batch(b, 2)["ids"].tolist() == [[0, 1], [2, 3]]
    assert scale_batch(b, 5)["ids"].shape == (5, 2) and scale_batch(b, 5)["x"].shape == (5,)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="needs a budget"):
        sw.autoplan(mlp, BATCH)
    with pytest.raises(ValueError, match="maximize"):
        sw.autoplan(mlp, BATCH, budget=0.5, maximize="fun")
