"""autoplan's rows in this process: copies of one model, verified rows beside the answer, and what a call leaves as it
was."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates
from shrinkwrap.autoplan import rows as rows_module

from autoplan_helpers import BATCH, FAST, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


class Uncopyable(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x)

    def __deepcopy__(self, memo):
        raise TypeError("holds a handle that cannot be copied")


@pytest.mark.parametrize("build, copied", [(mlp, True), (Uncopyable, False)])
def test_rows_in_this_process_are_copies_of_one_model_the_factory_made_where_it_copies(build, copied):
    built = []

    def make():
        built.append(1)
        return build()

    plan, report = sw.autoplan(make, BATCH, budget=0.45, **FAST)
    assert len(report.rows) > 5
    assert (len(built) == 1) if copied else (len(built) > 5)  # the probe only; else the probe and each row
    assert report.value(report.rows[-1]) <= 0.45 * report.value(report.rows[0])


def _lettered(figures):
    """Rows of plans named by letter, each reading ``figures[letter]`` (memory, ms; A is the
    answer, the others candidates), and a row source that notes the letters it measures."""
    from types import SimpleNamespace

    from shrinkwrap.report import Row

    plans = {k: sw.Plan.parse(f"checkpoint('{i}')") for i, k in enumerate(figures)}
    name = {str(p): k for k, p in plans.items()}

    def row(k):
        return Row(plans[k], SimpleNamespace(step_ms=figures[k][1]), role="chosen" if k == "A" else "candidate")

    class Rows:
        cuda, measured = True, []

        def __call__(self, wanted, isolate):
            self.measured += [name[str(p)] for p in wanted]
            return [row(name[str(p)]) for p in wanted]

        def prime(self, plan):  # no fresh process to prime
            pass

    return Rows(), row, name


def test_a_row_that_reads_faster_in_as_little_memory_is_verified_and_answers():
    # A looser limit's answer (A) beside rows of the same search: the tighter limit's answer from
    # the shared cache (B: alike memory, a third less time), a candidate that reads less memory
    # but slower (C), one a little over the 2% of alike memory (D). B is measured as a chosen
    # plan is and answers; C and D are not measured again.
    from shrinkwrap.autoplan.stages import _Search

    figures = {"A": (500, 30.0), "B": (495, 20.0), "C": (400, 40.0), "D": (505, 10.0)}
    rows, row, name = _lettered(figures)
    search = _Search(rows, None, lambda r: figures[name[str(r.plan)]][0], 1000.0, 30.0, 600.0, None, False, False)
    tried = search.undominated([row("A")], [row(k) for k in "BCD"])
    assert rows.measured == ["B"] and name[str(search.final(tried).plan)] == "B"
    # Nothing is measured again once no row beats the answer, nor where the answer misses its
    # limits (the search said why), nor on a CPU, whose step times decide nothing.
    assert search.undominated(tried, [row(k) for k in "BCD"]) == tried and rows.measured == ["B"]
    search.target = 100.0
    assert search.undominated([row("A")], [row("B")]) == [row("A")]
    rows.cuda, search.target = False, 600.0
    assert search.undominated([row("A")], [row("B")]) == [row("A")] and rows.measured == ["B"]


def test_where_no_verified_plan_meets_the_time_limit_a_measured_row_within_it_is_verified():
    # A time limit of 30 ms and no budget: the verified plan (A) took 40, so the answer would be
    # the model as it is (1000 bytes, 30 ms). B and D read less memory within the limit by their
    # own rows, C is over it, E keeps memory alike to the model's: B, the least, is verified and
    # answers; where it times over the limit in turns, D is tried next.
    from shrinkwrap.autoplan.stages import _Search

    figures = {"A": (500, 40.0), "B": (495, 29.0), "C": (400, 40.0), "D": (700, 25.0), "E": (990, 10.0)}
    rows, row, name = _lettered(figures)

    class Search(_Search):
        slow: set = set()

        def time_against_baseline(self, plan):  # the ratio in turns: 1.0x, or 1.2x for the slow ones
            ratio = 1.2 if name[str(plan)] in self.slow else 1.0
            self.ratios[str(plan)] = (sw.Timing((30.0,) * 5), sw.Timing((30.0 * ratio,) * 5))

    search = Search(rows, None, lambda r: figures[name[str(r.plan)]][0], 1000.0, 30.0, None, 30.0, False, False, 1.0)
    assert not search.fits(row("A"))
    tried = search.undominated([row("A")], [row(k) for k in "BCDE"])
    assert rows.measured == ["B"] and name[str(search.final(tried).plan)] == "B" and search.fits(search.final(tried))
    rows.measured, search.ratios, search.slow = [], {}, {"B"}
    tried = search.undominated([row("A")], [row(k) for k in "BCDE"])
    assert rows.measured == ["B", "D"] and name[str(search.final(tried).plan)] == "D"
    # A row whose memory is alike to the model's (E) is no better answer than the model itself;
    # nor is B where its fresh reading is (the model as it is answers, and is among no rows): D is.
    rows.measured, search.ratios, search.slow = [], {}, set()
    assert search.undominated([row("A")], [row("E")]) == [row("A")] and rows.measured == []
    fresh = search.measure_chosen
    search.measure_chosen = lambda plan: (figures.update(B=(990, 29.0)) if name[str(plan)] == "B" else None) or fresh(plan)
    tried = search.undominated([row("A")], [row(k) for k in "BCDE"])
    assert rows.measured == ["B", "D"] and [name[str(r.plan)] for r in tried] == ["A", "D"]
    figures["B"], rows.measured, search.ratios = (495, 29.0), [], {}
    del search.measure_chosen
    # With maximize="batch" the time limit decides the plan whatever the budget: B is verified.
    search.target, search.by_memory = 600.0, True
    tried = search.undominated([row("A")], [row(k) for k in "BCDE"])
    assert rows.measured == ["B"] and name[str(search.final(tried).plan)] == "B"
    # With a budget the answer outside the limits is the search's (see _answer): nothing is measured.
    rows.measured, search.ratios, search.by_memory = [], {}, False
    assert search.undominated([row("A")], [row(k) for k in "BCDE"]) == [row("A")] and rows.measured == []


def test_a_measured_row_with_less_memory_within_the_time_limit_is_verified_beside_the_answer():
    # The least memory within 40 ms: the answer A (500 bytes, 30 ms) fits; B reads less within the
    # limit by its own row and is verified, and answers; C reads less but over the limit, D as
    # little as A (within SAME_MEMORY) and slower: neither is measured. E (alike, faster) comes
    # first where it is there; F is an answer over budget with maximize="batch". With a budget
    # the fastest within it answers, and B is no better answer (slower than A).
    from shrinkwrap.autoplan.stages import _Search

    figures = {"A": (500, 30.0), "B": (300, 38.0), "C": (200, 60.0), "D": (495, 35.0), "E": (495, 10.0),
               "F": (700, 30.0)}
    rows, row, name = _lettered(figures)

    class Search(_Search):
        def time_against_baseline(self, plan):
            pass  # its own row's time decides (fits_time)

    search = Search(rows, None, lambda r: figures[name[str(r.plan)]][0], 1000.0, 40.0, None, 40.0, False, False, 1.0)
    tried = search.undominated([row("A")], [row(k) for k in "BCD"])
    assert rows.measured == ["B"] and name[str(search.final(tried).plan)] == "B"
    # A faster row of alike memory (E: a third of A's time) is verified before rows of less memory.
    rows.measured = []
    tried = search.undominated([row("A")], [row(k) for k in "BCDE"])
    assert rows.measured == ["E", "B"] and name[str(search.final(tried).plan)] == "B"
    # With maximize="batch" the answer within the time limit but over the budget (F: 700) is read
    # the same way: the least memory within the time limit answers (the batch is scaled later).
    rows.measured, search.target, search.by_memory = [], 600.0, True
    tried = search.undominated([row("F")], [row(k) for k in "BCD"])
    assert rows.measured == ["B"] and name[str(search.final(tried).plan)] == "B"
    rows.measured, search.by_memory = [], False
    assert search.undominated([row("A")], [row(k) for k in "BCD"]) == [row("A")] and rows.measured == []


def test_the_notes_take_the_candidates_the_answer_is_made_of():
    # An answer verified as its candidate's row was measured (autocast, then a block on top of
    # it): those two; a compiled form of the verified plan: the verified plan's; a verified set: its own.
    from types import SimpleNamespace

    from shrinkwrap.autoplan import _made_of
    from shrinkwrap.autoplan.choose import Effect

    effects = [Effect(c, 1.0, 1.0) for c in candidates(mlp(), device="cpu", allow_lossy=True)]
    by_name = {str(e.candidate): e for e in effects}
    lossy, block, other = by_name["autocast(torch.bfloat16)"], by_name["checkpoint(('1.2',))"], by_name["swish()"]
    search = SimpleNamespace(sets={"swish()": [other]})
    verified = [other]
    row_plan = sw.Plan(lossy.candidate.steps + block.candidate.steps)
    assert _made_of(search, row_plan, effects, verified) == [block, lossy]
    assert _made_of(search, row_plan + sw.Plan.parse("compile()"), effects, verified) == verified
    assert _made_of(search, sw.Plan.parse("swish()"), effects, []) == [other]


def test_a_plan_that_reads_more_memory_than_one_within_the_limits_is_not_timed_in_turns():
    # The least memory within 40 ms is the answer: A (500 bytes) is within it. A compiled plan
    # reading 600 cannot answer before A whatever its time, and is not timed in turns; one reading
    # 505 (alike memory: the faster answers) and one reading 400 are. With a budget the fastest
    # within it answers: every plan within the budget is timed.
    from shrinkwrap.autoplan.stages import _Search

    figures = {"A": (500, 30.0), "B": (600, 20.0), "C": (505, 20.0), "D": (400, 35.0)}
    rows, row, name = _lettered(figures)
    timed = []

    class Search(_Search):
        def time_against_baseline(self, plan):
            timed.append(name[str(plan)])

    search = Search(rows, None, lambda r: figures[name[str(r.plan)]][0], 1000.0, 40.0, None, 40.0, False, False, 1.0)
    for k in "BCD":
        search.measure_chosen(row(k).plan, isolate=False, beside=[row("A")])
    assert timed == ["C", "D"] and rows.measured == ["B", "C", "D"]
    # Beside a plan over the time limit (E: 50 ms), every plan could answer, and is timed.
    timed.clear()
    figures["E"] = (500, 50.0)
    rows, row, name = _lettered(figures)
    search.rows = rows
    for k in "BCD":
        search.measure_chosen(row(k).plan, isolate=False, beside=[row("E")])
    assert timed == ["B", "C", "D"]
    timed.clear()
    search.target = 1000.0
    for k in "BCD":
        search.measure_chosen(row(k).plan, isolate=False, beside=[row("A")])
    assert timed == ["B", "C", "D"]


def test_rows_measured_in_this_process_read_above_what_it_held_before(monkeypatch):
    # A caller's tensors on the GPU (300 bytes here) are no plan's: a row measured in this
    # process reads its peaks above them, as a fresh process would.
    import dataclasses
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    real = rows_module.measure_plans

    def on_cuda(*args, **kwargs):
        report = real(*args, **kwargs)
        row = report.rows[0]
        row.profile = dataclasses.replace(row.profile, peak=1000, first_peak=1200, static=400)
        return report

    allocated = [300]
    monkeypatch.setattr(rows_module, "measure_plans", on_cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(device="cpu"), True, {})
    p = rows([sw.Plan.parse("swish()")], False)[0].profile
    assert (p.peak, p.first_peak, p.static) == (700, 900, 100)
    # What the rows leave themselves (cuBLAS's workspace) is theirs, as in a fresh process: the
    # bytes held before the first row are what is taken off.
    allocated[0] = 340
    p = rows([sw.Plan.parse("swish(), checkpoint('1.0')")], False)[0].profile
    assert (p.peak, p.first_peak, p.static) == (700, 900, 100)
    rows.close()
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(device="cpu"), False, {})  # without CUDA nothing is held
    p = rows([sw.Plan.parse("swish()")], False)[0].profile
    assert (p.peak, p.first_peak, p.static) == (1000, 1200, 400)
    rows.close()


def test_rows_an_earlier_call_verified_count_only_where_this_call_could_answer_with_them():
    from shrinkwrap.autoplan import _answerable
    from shrinkwrap.report import Row

    texts = ["checkpoint('1.0')", "checkpoint('1.0'), autocast(torch.bfloat16)", "checkpoint('1.0'), compile()"]
    cache = {(t, True): Row(sw.Plan.parse(t), None) for t in texts}
    cache["checkpoint('1.1')", False] = Row(sw.Plan.parse("checkpoint('1.1')"), None)  # this process's: a candidate
    cache["", True] = Row(sw.Plan(), None)  # the baseline

    def answerable(**kw):
        cands = candidates(mlp(), device="cpu", allow_lossy=kw.get("allow_lossy", False))
        return [str(r.plan) for r in _answerable(cache, cands, kw.get("compile"), kw.get("allow_lossy", False))]

    assert answerable() == texts[:1]  # neither the lossy plan nor the compiled one
    assert answerable(allow_lossy=True) == texts[:2]
    assert answerable(allow_lossy=True, compile=sw.Plan.parse("compile()")) == texts


def test_the_baseline_runs_in_this_process_only_while_nothing_of_it_is_on_the_gpu(monkeypatch):
    import sys

    from shrinkwrap.measuring.profile import Options

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    rows = rows_module.Rows(mlp, mlp(), BATCH, Options(device="cuda"), True, {})
    allocated = [0]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    for started, on_gpu, untouched in [(False, 0, True), (True, 0, True), (True, 512, False)]:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started)
        allocated[0] = on_gpu
        assert rows.untouched() is untouched
    rows.cuda = False
    assert rows.untouched() is False
    rows.close()


@pytest.mark.parametrize("budget", [0.45, "16B"])
@pytest.mark.parametrize("cuda_started", [True, False])
def test_chosen_plans_are_refined_in_this_process_and_only_one_that_fits_is_measured_fresh(budget, cuda_started,
                                                                                          monkeypatch):
    import sys

    ap = sys.modules["shrinkwrap.autoplan.stages"]

    measured = []
    real = rows_module.measure_plans

    def recording(make, plans, batch, options, *, isolate, **kw):
        measured.extend((str(p), isolate) for p in plans)
        return real(make, plans, batch, options, isolate=False, **kw)  # no CUDA here: rows as if

    class OnCuda(rows_module.Rows):
        def __init__(self, *args):
            super().__init__(*args)
            self.cuda = True

        def untouched(self):  # CUDA starts with the first row measured in this process
            return not cuda_started and not measured

    from shrinkwrap.fit import Probe

    monkeypatch.setattr(rows_module, "measure_plans", recording)
    monkeypatch.setattr(sys.modules["shrinkwrap.autoplan"], "_rows_for", OnCuda)  # autoplan() makes its rows
    monkeypatch.setattr(sys.modules["shrinkwrap.autoplan"], "trains_under",  # the cap test passes
                        lambda make, batch, cap, plan, options: Probe(cap, True, reserved=cap))
    plan, report = sw.autoplan(mlp, BATCH, budget=budget, rounds=3, **FAST)
    chosen = [str(r.plan) for r in report.rows if r.role == "chosen"]
    fresh = [text for text, isolate in measured if isolate]
    assert all((text, False) in measured for text in chosen)  # every chosen plan first in this process
    # Where CUDA had not started, the baseline is this process's first row, as a fresh process's.
    assert measured[0] == ("", cuda_started) and measured.count(("", False)) == 1
    assert ("baseline first in this process" in report.isolation) is not cuda_started
    baseline = [""] if cuda_started else []
    if budget == "16B":   # 16 bytes: none fits, none goes to a fresh process
        assert fresh == baseline
    else:
        # The answer, and any row that read faster in as little memory (verified the same way).
        assert fresh[:len(baseline)] == baseline and str(plan) in fresh[len(baseline):]
        rows = {str(r.plan): r for r in report.rows}
        assert all(rows[t].role == "chosen" and report.value(rows[t]) <= 0.45 * report.value(report.rows[0])
                   for t in fresh[len(baseline):])


def test_where_the_plans_read_within_the_budget_do_not_train_under_its_cap_the_search_aims_lower(monkeypatch):
    import sys

    from shrinkwrap.fit import Probe

    ap, stages = sys.modules["shrinkwrap.autoplan"], sys.modules["shrinkwrap.autoplan.stages"]
    made, probed, verified = [], [], []

    class OnCuda(rows_module.Rows):  # a CUDA run's stages; its rows measured here, as if isolated
        def __init__(self, *args):
            super().__init__(*args)
            self.cuda = True
            made.append(self)

        def untouched(self):
            return False

    real, verify = rows_module.measure_plans, stages._Search.verify
    monkeypatch.setattr(rows_module, "measure_plans", lambda make, plans, batch, options, *, isolate, **kw: real(
        make, plans, batch, options, isolate=False, **kw))
    monkeypatch.setattr(stages._Search, "verify", lambda self, *a, **k: verified.append(1) or verify(self, *a, **k))
    # Which measured rows undominated verifies is decided by CPU step times here (the rows are
    # "on CUDA"): on a loaded machine it verified the plan that reads least, and no plan was left
    # 8% under it to aim at. Not what this test is about.
    monkeypatch.setattr(stages._Search, "undominated", lambda self, tried, measured, tries=2: tried)

    def trains_under(make, batch, cap, plan, options):
        # The plans of the first search do not train under the cap, as if they read low; later ones do.
        ok = len(verified) > 1
        probed.append((str(plan), made[0].cache[str(plan), False].profile.saved, ok))
        return Probe(cap, ok, oom=not ok, error=None if ok else "OutOfMemoryError (as if)", reserved=cap)

    monkeypatch.setattr(ap, "_rows_for", OnCuda)
    monkeypatch.setattr(ap, "trains_under", trains_under)
    plan, report = sw.autoplan(mlp, BATCH, budget=0.9, rounds=3, **FAST)
    failed = [saved for _, saved, ok in probed if not ok]
    assert failed and any(n.startswith("aiming at ") for n in report.notes), "\n".join(report.notes)
    assert any(n.startswith("fits in ") for n in report.notes), "\n".join(report.notes)
    answer = next(r for r in report.rows if r.trained_under is not None)
    assert str(answer.plan) == str(plan) == probed[-1][0]
    assert report.value(answer) <= (1 - ap.HEADROOM) * min(failed)
    assert all(r.fits is False for r in report.rows if str(r.plan) in {p for p, _, ok in probed if not ok})


def test_autoplan_leaves_the_callers_collector_and_modules_as_they_were():
    # Nothing of the caller's process state changes: objects it froze stay frozen and none are
    # added (during the rows or after), and sys.modules keeps its order.
    import gc
    import sys

    during = []

    def loss(out):
        during.append(gc.get_freeze_count())
        return out.mean()

    for frozen in (False, True):  # as Python 3.12 starts: some objects frozen already
        gc.unfreeze()
        if frozen:
            gc.freeze()
        before, order = gc.get_freeze_count(), list(sys.modules)
        during.clear()
        try:
            sw.autoplan(mlp, BATCH, budget=0.45, loss_fn=loss, **FAST)
            after = gc.get_freeze_count()
        finally:
            gc.unfreeze()
        # Frozen objects still go when nothing refers to them: the count may fall, never rise.
        assert during and max(during) <= before and after <= before and (after > 0) == frozen
        assert [name for name in sys.modules if name in order] == order
