"""autoplan's rows in fresh processes and on CUDA: the baseline first, warm-ups, regions left unmeasured, and primed
processes."""

import time

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates
from shrinkwrap.autoplan import rows as rows_module

from autoplan_helpers import BATCH, FAST, _rows, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


FIRST_ROW = '''
import sys
import torch
import shrinkwrap as sw
from shrinkwrap.compare import measure_plans
from shrinkwrap.models import tiny_efficientnet


def make():
    torch.manual_seed(0)
    return tiny_efficientnet().cuda()  # CUDA starts here; autoplan keeps copies on the CPU and lets this go


if __name__ == "__main__":
    batch = torch.randn(64, 3, 32, 32)
    plan, report = sw.autoplan(make, batch, budget=0.5, iterations=2, warmup=1)
    fresh = measure_plans(make, [sw.Plan()], batch, sw.Options(device="cuda"), isolate=True).rows[0]
    print(report.isolation)
    print(report.value(report.rows[0]), report.value(fresh))
'''


@pytest.mark.cuda
def test_on_cuda_a_baseline_measured_first_with_nothing_on_the_gpu_reads_as_a_fresh_process(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "first_row.py"
    script.write_text(FIRST_ROW)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    isolation, values = done.stdout.strip().splitlines()[-2:]
    here, fresh = map(int, values.split())
    assert "baseline first in this process" in isolation
    assert abs(here - fresh) <= 0.02 * fresh


def test_eager_rows_warm_up_once_and_compiled_ones_twice_unless_the_caller_says(monkeypatch):
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    warmups = []
    real = rows_module.measure_plans

    def recording(make, plans, batch, options, **kw):
        warmups.extend((str(p), options.warmup) for p in plans)
        return real(make, plans, batch, options, **kw)

    monkeypatch.setattr(rows_module, "measure_plans", recording)
    eager, compiled = sw.Plan([sw.checkpoint(r"1\.0")]), sw.Plan([sw.checkpoint(r"1\.0"), sw.compile(backend="eager")])
    for warmup, expected in [(None, [1, 1, 2]), (3, [3, 3, 3])]:
        warmups.clear()
        rows = rows_module.Rows(mlp, mlp(), BATCH, Options(iterations=1, device="cpu"), False, {}, warmup)
        rows([sw.Plan(), eager, compiled], False)
        rows.close()
        assert [w for _, w in warmups] == expected


@pytest.mark.parametrize("cuda", [True, False])
def test_on_cuda_each_whole_model_step_and_the_base_run_before_the_rows_they_are_read_from(cuda, monkeypatch):
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    events = []
    real_rows, real_build, real_timing = rows_module.measure_plans, rows_module.build_model, rows_module.time_interleaved

    def rows_of(make, plans, batch, options, **kw):
        events.extend(("row", str(p)) for p in plans)
        return real_rows(make, plans, batch, options, **kw)

    def built(local, dev, plan):
        events.append(("built", str(plan)))
        return real_build(local, dev, plan)

    def timed(models, *args, **kw):
        events.extend(("ran", name) for name in models)
        return real_timing(models, *args, **kw)

    monkeypatch.setattr(rows_module, "measure_plans", rows_of)
    monkeypatch.setattr(rows_module, "build_model", built)
    monkeypatch.setattr(rows_module, "time_interleaved", timed)
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(iterations=1, device="cpu"), cuda, {})
    search = ap._Search(rows, mlp(), lambda r: r.profile.saved, 1000.0, 8.0, None, None, False, False)
    baseline = rows([sw.Plan()], False)[0]
    whole = [c for c in candidates(mlp(), device="cpu") if not c.covers]
    events.clear()
    search.base(whole)
    warmed = [("built", str(c)) for c in whole] if cuda else []
    assert [e for e in events if e[0] == "built"] == warmed
    assert [e for e in events if e[0] == "row"] == [("row", str(c)) for c in whole]  # the baseline's row is kept
    if cuda:
        assert events.index(("built", str(whole[-1]))) < events.index(("row", str(whole[0])))
    rows.close()
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(iterations=1, device="cpu"), cuda, {})
    search = ap._Search(rows, mlp(), lambda r: r.profile.saved, 1000.0, 8.0, None, None, False, False)
    events.clear()
    rest = [c for c in candidates(mlp(), device="cpu") if c.covers][:2]
    search.on_top((sw.swish(),), rest, baseline)
    assert [e for e in events if e[0] == "row"] == [("row", "swish()")] + [("row", f"swish(), {c}") for c in rest]
    # Warmed up (on CUDA) before its row; built once more after the rows, to time each module's forward.
    assert events[0] == (("built", "swish()") if cuda else ("row", "swish()"))
    assert events[-1] == ("built", "swish()")
    assert [e for e in events if e[0] == "built"] == [("built", "swish()")] * (2 if cuda else 1)
    rows.close()


class _PruneRows:
    """A fake row source for :meth:`_Search.on_top`: each plan's step time from ``times`` (9 ms
    where it has none), each module's forward from ``forward``, and ``cached`` rows it holds."""
    cuda = False

    def __init__(self, times, forward, cached=()):
        self.times, self.forward, self.measured = times, forward, []
        self.cache = {(str(c), False): None for c in cached}

    def __call__(self, wanted, isolate):
        from types import SimpleNamespace

        from shrinkwrap.report import Row
        self.measured += [str(p) for p in wanted]
        return [Row(p, SimpleNamespace(step_ms=self.times.get(str(p), 9.0), saved=100)) for p in wanted]

    def forward_ms(self, plan):
        return self.forward


def _on_top(rows, prune):
    """``_Search.on_top`` over the MLP's candidates with ``rows``, at a 9 ms limit (the baseline 8 ms)."""
    from types import SimpleNamespace

    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.report import Row

    search = _Search(rows, mlp(), lambda r: r.profile.saved, 1000.0, 8.0, None, 9.0, False, False, 1.125)
    return search, search.on_top((), candidates(mlp(), device="cpu"),
                                 Row(sw.Plan(), SimpleNamespace(step_ms=8.0, saved=100)), prune)


def test_regions_that_cannot_fit_the_time_limit_are_not_measured():
    # The least memory within a time limit of 9 ms: the base's row reads 8.5 ms (the baseline's 8),
    # swish() on top 6 ms. The room is the limit with its 3% tolerance and BEATEN's 10% (10.17 ms)
    # less the base's 8.5, plus the 2.5 ms swish() wins back: 4.17 ms. A region whose forward
    # alone takes longer (the search prices it at that or more) is left unmeasured, and said so,
    # unless its row is cached already; the others, and every region where a budget or the
    # compiler decides (prune off), are measured.
    cands = candidates(mlp(), device="cpu")
    forward = {"1": 12.0, "1.0": 1.0, "1.1": 3.0, "1.2": 4.4, "1.3": 5.0}
    for prune, unmeasured in ((True, ["1", "1.2"]), (False, [])):
        rows = _PruneRows({"": 8.5, "swish()": 6.0}, forward, [next(c for c in cands if c.covers == ("1.3",))])
        search, (effects, top, _, t, _) = _on_top(rows, prune)
        assert t == 8.5
        assert [c.covers[0] for c, _, _ in search.unmeasured] == unmeasured
        assert all(room == pytest.approx(4.17) and cost == forward[c.covers[0]] for c, cost, room in search.unmeasured)
        kept = [c for c in cands if not c.covers or c.covers[0] not in unmeasured]
        assert [e.candidate for e in effects] == kept and [r.plan for r in top] == [sw.Plan(c.steps) for c in kept]
        assert sorted(rows.measured) == sorted(["", *(str(sw.Plan(c.steps)) for c in kept)])


def test_a_region_without_a_forward_time_is_measured_where_there_is_no_room():
    # The base's row over the limit (11 ms; swish() wins nothing back): the room is negative,
    # -0.83 ms. Every region with a forward time is left unmeasured; "1.0", whose forward was not
    # timed, is measured, not looked up among the timed (that lookup was a KeyError of the
    # candidate's id on EfficientNetV2, where the base's row read over the limit).
    cands = candidates(mlp(), device="cpu")
    forward = {"1": 12.0, "1.1": 3.0, "1.2": 4.4, "1.3": 5.0}
    search, (effects, _, _, t, _) = _on_top(_PruneRows({"": 11.0, "swish()": 12.0}, forward), True)
    assert t == 11.0
    assert sorted(c.covers[0] for c, _, _ in search.unmeasured) == sorted(forward)
    assert all(room == pytest.approx(-0.83) for _, _, room in search.unmeasured)
    assert [e.candidate.covers for e in effects if e.candidate.covers] == [("1.0",)]


def test_autoplan_leaves_regions_unmeasured_only_where_a_time_limit_alone_decides(monkeypatch):
    # A budget comes before time, and with maximize="batch" the memory decides: every region is
    # measured there. A region left unmeasured is a note with its forward and the room.
    import sys

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    real, asked = ap._Search.on_top, []

    def on_top(self, base_steps, rest, baseline, prune=False):
        asked.append(prune)
        out = real(self, base_steps, rest, baseline, prune)
        if prune:  # as if the last region could not fit
            self.unmeasured.append((rest[-1], 5.0, 1.25))
        return out

    monkeypatch.setattr(ap._Search, "on_top", on_top)
    _, report = sw.autoplan(mlp, BATCH, max_slowdown=1.5, rounds=1, **FAST)
    assert any(n.startswith("left unmeasured: ") and "5.0 ms, more than the 1.2 ms" in n for n in report.notes)
    assert any("1 more left unmeasured" in n for n in report.notes if n.startswith("autoplan's own time"))
    sw.autoplan(mlp, BATCH, budget=0.5, max_slowdown=1.5, rounds=1, **FAST)
    sw.autoplan(mlp, BATCH, budget=0.01, maximize="batch", max_slowdown=1.5, rounds=1, **FAST)
    assert asked == [True, False, False]


def test_a_region_that_recomputes_is_priced_at_its_forward_time_or_no_less_than_nothing():
    from shrinkwrap.autoplan.choose import Effect, _priced, _search

    regions = [c for c in candidates(mlp(), device="cpu") if c.covers and "." in c.covers[0]]
    whole = next(c for c in candidates(mlp(), device="cpu") if not c.covers)  # swish(): may run faster
    effects = [Effect(c, 100.0, -3.0) for c in regions] + [Effect(whole, 0.0, -2.0)]
    priced = _priced(effects, {})
    assert [e.cost for e in priced] == [0.0] * len(regions) + [-2.0]
    assert [e.cost for e in effects][:len(regions)] == [-3.0] * len(regions)  # the measured figures stay
    # Priced at nothing, the blocks still fit a limit of the base's own time.
    assert len(_search(priced[:4], 1000.0, 8.0, None, 8.0)) == 4
    # With the forward times of the base, each region costs its modules' forward, whatever its row read.
    forward = {name: 0.25 * (i + 1) for i, name in enumerate(c.covers[0] for c in regions)}
    by_forward = _priced(effects, forward)
    assert [e.cost for e in by_forward] == [forward[c.covers[0]] for c in regions] + [-2.0]
    assert all(e.priced_by_forward for e in by_forward[:len(regions)]) and not by_forward[-1].priced_by_forward
    assert len(_search(by_forward[:4], 1000.0, 8.0, None, 8.8)) == 2  # 0.25 + 0.5 fit, 0.75 more does not
    # Rows that read about three times their forward (one of them a noisy 40x): priced at three times it.
    rows_read = [Effect(c, 100.0, f * forward[c.covers[0]]) for c, f in zip(regions, [3.0, 2.9, 3.1, 40.0])]
    assert [e.cost for e in _priced(rows_read, forward)] == pytest.approx([3.05 * forward[c.covers[0]] for c in regions])


def test_a_plan_over_its_limit_scales_every_region_priced_by_its_forward_by_what_its_own_took():
    from shrinkwrap.autoplan.choose import Effect, _raised

    regions = [c for c in candidates(mlp(), device="cpu") if c.covers and "." in c.covers[0]]
    effects = [Effect(c, 100.0, 2.0 * (i + 1), priced_by_forward=True) for i, c in enumerate(regions[:3])]
    effects.append(Effect(regions[3], 100.0, 1.0))  # measured, not priced by its forward
    # Chosen: the first two (2 + 4 ms predicted), 3 ms over: their recompute took 1.5x their forward.
    raised = _raised(effects, effects[:2], 3.0)
    assert [raised[id(e.candidate)].cost for e in effects[:3]] == [3.0, 6.0, 9.0]  # the third, not chosen, too
    assert id(effects[3].candidate) not in raised
    # None priced by its forward: a like share each, among the chosen only.
    plain = [Effect(c, 100.0, 1.0) for c in regions]
    shared = _raised(plain, plain[:2], 3.0)
    assert sorted(e.cost for e in shared.values()) == [2.5, 2.5]


def test_a_plan_that_fails_in_a_warm_up_or_its_forward_timing_is_left_to_its_row_to_report():
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(iterations=1, device="cpu"), True, {})
    bad = sw.Plan.parse("checkpoint('no_such_module')")
    rows.warm_up(bad)  # no exception: the row below reports it
    assert rows.forward_ms(bad) == {}
    (row,) = rows([bad], False)
    assert row.profile is None and "no_such_module" in row.error
    rows.close()


class OutOfMemoryAsItIs(nn.Module):
    """A model that runs out of CUDA memory as it is (simulated on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def test_a_model_out_of_memory_as_it_is_is_an_error_that_names_the_fixes():
    with pytest.raises(RuntimeError, match=r"runs out of memory at this batch \(CUDA out of memory. Tried to "
                                           r"allocate 2.00 GiB.*maximize='batch'.*sw.estimate"):
        sw.autoplan(OutOfMemoryAsItIs, BATCH, max_slowdown=1.0, device="cpu")


def test_where_no_fresh_process_can_start_every_row_is_measured_here_and_the_header_says_so():
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    rows = rows_module.Rows(lambda: mlp(), mlp(), BATCH, Options(iterations=1, device="cpu"), True, {})
    assert "does not pickle" in rows.unsendable and rows_module._isolation(rows, False) == "in this process"
    plan = sw.Plan.parse("checkpoint('1.0')")
    (row,) = rows([plan], True)  # asked for a fresh process's row: measured here
    assert row.profile is not None and list(rows.cache) == [(str(plan), False)] and rows.measured_here
    rows.close()
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(iterations=1, device="cpu"), True, {})
    assert rows.unsendable is None and rows_module._isolation(rows, False).startswith("candidates in this process")
    rows.close()


def test_the_note_on_an_eager_answer_says_a_compiled_plan_did_not_train_under_the_cap():
    from types import SimpleNamespace

    from shrinkwrap.autoplan import _eager_won
    from shrinkwrap.autoplan.stages import _Search

    rows, metric = _rows({"checkpoint('a')": (500.0, 20.0), "checkpoint('a'), compile()": (450.0, 30.0)})
    eager, compiled = rows
    compiled.role, compiled.fits = "compiled", False
    search = _Search(SimpleNamespace(cuda=True), None, metric, 1000.0, 8.0, 800.0, None, False, False)
    assert _eager_won(search, rows, eager).endswith("checkpoint('a'), compile(): did not train under the budget's cap")
    compiled.fits = None  # within the budget, and slower than the answer
    assert _eager_won(search, rows, eager).endswith("checkpoint('a'), compile(): slower (30.0 ms)")
    # Without a budget, one that reads more memory than the answer within the limits was not
    # timed in turns (_Search.outdone): more memory, whatever its own row's time.
    rows, metric = _rows({"checkpoint('a')": (500.0, 20.0), "checkpoint('a'), compile()": (600.0, 90.0)})
    eager, compiled = rows
    compiled.role = "compiled"
    search = _Search(SimpleNamespace(cuda=True), None, metric, 1000.0, 8.0, None, 40.0, False, False, 1.0)
    assert _eager_won(search, rows, eager).endswith("compile(): more memory (0.0 MiB; not timed in turns)")


def test_a_base_step_is_not_measured_together_with_a_candidate_that_cannot_share_its_plan(monkeypatch):
    # Two whole-model candidates that conflict (one step_in_backward each): when the base takes one,
    # the other is left out of the rows measured on top of it, not made into a plan that fails.
    from shrinkwrap.autoplan import stages
    from shrinkwrap.step import Candidate
    from shrinkwrap.transforms.optimizer import StepInBackward

    steps = [StepInBackward(torch.optim.AdamW), StepInBackward(torch.optim.SGD, {"lr": 0.1})]
    monkeypatch.setattr(StepInBackward, "candidates", classmethod(lambda cls, model, context: [
        Candidate((s,)) for s in steps]))
    search, calls = stages._Search.search, []

    def base_takes_the_first(self, effects, mem, t, target=None):
        calls.append([str(e.candidate) for e in effects])
        if len(calls) == 1:  # stage 1, the whole-model steps alone
            return [e for e in effects if e.candidate.steps == (steps[0],)]
        return search(self, effects, mem, t, target)

    monkeypatch.setattr(stages._Search, "search", base_takes_the_first)
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=1.5, **FAST)
    assert any(str(steps[0]) in str(r.plan) and len(r.plan) > 1 for r in report.rows)  # rows on top of the base
    assert not any(str(steps[0]) in str(r.plan) and str(steps[1]) in str(r.plan) for r in report.rows)
    assert not any(str(steps[1]) in c for c in calls[1])  # stage 3 searched without it


def test_a_compiled_plan_measured_where_it_compiled_is_timed_there_unless_its_row_decides_nothing():
    import math
    import pickle

    from shrinkwrap.autoplan.compiled import _Turn
    from shrinkwrap.measuring.ratios import MAX_ROUNDS, within_slowdown
    from shrinkwrap.report import Report, Row

    options = sw.Options(device="cpu", warmup=2, iterations=1)
    plan = sw.Plan.parse("checkpoint('1'), compile(backend='aot_eager')")
    metric = Report([], "cpu", "", "").value
    turn = _Turn(metric, 1.0, 0.03, None, ())  # the least memory within 1.0x, nothing within it yet
    sent = pickle.loads(pickle.dumps(turn.timed))  # it travels to the processes ahead
    assert sent.__func__ is _Turn.timed and sent.__self__.metric(Row(plan, sw.measure(mlp(), BATCH))) > 0
    started = time.perf_counter()
    first, key = turn.row(mlp, plan, BATCH, options)
    (profile, matched, skipped, (baseline, timed), (row_s, timed_s)), left = turn.timed(mlp, plan, BATCH, options,
                                                                                         first, [])
    assert key == profile.saved > 0 and matched == ("",)
    assert profile.step_ms > 0 and 5 <= len(timed.rounds_ms) == len(baseline.rounds_ms) <= MAX_ROUNDS
    assert 0 < row_s and 0 < timed_s and row_s + timed_s <= time.perf_counter() - started  # where its turns went
    # What it leaves the later turns: what it reads, where it is within the limit.
    assert left == (key if within_slowdown(baseline, timed, 1.0, 0.03) else math.inf)

    def timing(turn, before=()):
        (*_, timings, (_, timed_s)), left = turn.timed(mlp, plan, BATCH, options, first, list(before))
        assert (timings is None) == (timed_s is None)
        return timings, left

    # Outdone, whatever its time, by a row within the limits that reads a tenth less or under:
    # measured before the compile stage, or timed in a turn before this one. Not timed.
    assert timing(_Turn(metric, 1.0, 0.03, None, (0.89 * key,))) == (None, math.inf)
    assert timing(turn, [math.inf, 0.89 * key]) == (None, math.inf)
    assert timing(turn, [0.94 * key])[0] is not None  # within a tenth: 10% faster, it answers (unbeaten)
    # Where the answer is the fastest within the budget: timed whatever read less before it; not
    # over the budget; not without a time limit, nor where the row failed.
    assert timing(_Turn(metric, 1.0, 0.03, key, None), [0.5 * key]) != (None, math.inf)
    assert timing(_Turn(metric, 1.0, 0.03, key - 1, None)) == (None, math.inf)
    assert timing(_Turn(metric, None, 0.03, None, ())) == (None, math.inf)
    first, key = turn.row(mlp, sw.Plan.parse("compile(backend='no_such_backend')"), BATCH, options)
    (failed, *_), left = turn.timed(mlp, plan, BATCH, options, first, [])
    assert failed[0] == "failed" and "no_such_backend" in failed[1] and key == math.inf == left


def test_a_compiled_answer_measured_fresh_is_still_a_compiled_row():
    import dataclasses
    import types

    from shrinkwrap.autoplan.stages import _Search

    rows, metric = _rows({"checkpoint('a')": (500.0, 6.0), "checkpoint('a'), compile()": (400.0, 4.0)})
    rows[1].role = "compiled"

    class Search(_Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            return dataclasses.replace(next(r for r in rows if r.plan == plan))

    search = Search(types.SimpleNamespace(cuda=True), None, metric, 1000.0, 8.0, None, 8.0, False, False, 1.0)
    fresh = search._fresh_answer(list(rows))
    assert [(str(r.plan), r.role) for r in fresh] == [("checkpoint('a')", "chosen"), ("checkpoint('a'), compile()", "compiled")]


def test_the_fresh_processes_are_primed_with_the_base_and_each_eager_plan_verified_once(monkeypatch):
    # Each plan verified adds calls the base never made (a checkpoint's recompute on autograd's
    # thread, a layout measured on top of the base): recorded as its row here is read, or before
    # its fresh row where it had none here, once; not a plan whose row failed, nor a compiled
    # plan, whose iteration here would compile it; and not once the base made none.
    import types

    from shrinkwrap.autoplan import overlapped
    from shrinkwrap.autoplan.overlapped import OverlappedRows as _Rows
    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.models import tiny_efficientnet
    from shrinkwrap.report import Row

    monkeypatch.setattr(overlapped, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=1 << 40))
    recorded = []
    warm = overlapped.warm_process
    monkeypatch.setattr(overlapped, "warm_process", lambda make, plan, *a: recorded.append(str(plan)) or warm(make, plan, *a))
    compiled = sw.Plan.parse("channels_last(), compile()")

    def primed(make, batch, base, plans):
        rows = _Rows(make, make(), batch, sw.Options(device="cpu", warmup=1, iterations=1), False, {})
        rows.cache["", True] = types.SimpleNamespace(profile=types.SimpleNamespace(peak=1, first_peak=1))
        rows.cache[str(compiled), False] = Row(compiled, types.SimpleNamespace(peak=1))  # read, not compiled here
        given = []
        monkeypatch.setattr(rows.fresh, "prime", lambda calls, keep: given.append(len(calls)))
        search = _Search(rows, rows.probe, lambda r: 1.0, 1.0, 10.0, None, None, False, False)
        rows.prime(sw.Plan.parse(base))  # the base, as the candidates' rows end
        for plan, isolate in plans:
            search.measure_chosen(sw.Plan.parse(plan), isolate=isolate)
        rows.close()
        return given

    recorded.clear()
    plans = [("checkpoint('blocks.1'), channels_last()", False), (str(compiled), False),
             ("checkpoint('blocks.1'), channels_last()", True), ("checkpoint('nothing'), channels_last()", False),
             ("checkpoint('blocks.2'), channels_last()", True)]
    given = primed(tiny_efficientnet, torch.randn(2, 3, 32, 32), "channels_last()", plans)
    assert recorded == ["channels_last()", "checkpoint('blocks.1'), channels_last()",
                        "checkpoint('blocks.2'), channels_last()"]
    assert len(given) == 3 and all(given)  # what each recorded, handed on (FreshProcesses keeps what is new)
    recorded.clear()
    assert primed(mlp, BATCH, "swish()", [("checkpoint('1')", False)]) == [] and recorded == ["swish()"]  # none: once
    recorded.clear()  # a recording that failed says nothing of the calls: the next plan is recorded
    assert primed(mlp, BATCH, "checkpoint('none')", [("checkpoint('1')", False)]) == []
    assert recorded == ["checkpoint('none')", "checkpoint('1')"]


def _effnet() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.efficientnet_b0()


@pytest.mark.cuda
def test_on_cuda_a_primed_fresh_process_reads_the_same_row_without_cudnns_first_use():
    # cuDNN plans each convolution the first time a process meets its shape, layout and type:
    # under channels_last and bf16 autocast, seconds for efficientnet_b0. Primed with the calls
    # recorded here, the row's process makes them before its row: its first iteration is then
    # a steady one, and what the row reads is the same to the byte.
    pytest.importorskip("torchvision")
    from shrinkwrap.autoplan.overlapped import OverlappedRows as _Rows
    from shrinkwrap.measuring.profile import Options

    plan = sw.Plan.parse("channels_last(), autocast(torch.bfloat16)")
    batch = torch.randn(16, 3, 128, 128)
    got = {}
    for primed in (False, True):
        rows = _Rows(_effnet, _effnet(), batch, Options(device="cuda", iterations=2), True, {})
        try:
            rows([sw.Plan()], True)  # the room a replay may take is read from the baseline's peak
            rows.fresh.start_next()
            if primed:
                rows.prime(plan)
            got[primed] = rows([plan], True)[0].profile
        finally:
            rows.close()
    assert (got[True].peak, got[True].first_peak) == (got[False].peak, got[False].first_peak)
    assert got[True].first_ms < 0.5 * got[False].first_ms, (got[True].first_ms, got[False].first_ms)
