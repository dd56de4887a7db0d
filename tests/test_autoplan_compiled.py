"""autoplan's compile stage: the plans tried compiled, their form under the partitioner's memory budget, and compiling
ahead."""

import time

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates
from shrinkwrap.autoplan import rows as rows_module
from toymodels import resnet64
from autoplan_helpers import BATCH, FAST, _rows, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("step", [
    "compile(backend='aot_eager')",  # the same ops as eager: no C++ compiler needed
    r"compile(backend='aot_eager', pattern=r'1\.\d+')",  # regional: the blocks only
])
def test_the_compile_stage_tries_the_plans_compiled_and_answers_the_best(step):
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, compile=step, **FAST)
    compiled = [r for r in report.rows if r.role == "compiled"]
    assert compiled and all(str(r.plan).endswith(step) and r.profile is not None and r.profile.compiled for r in compiled)
    assert all(r.label.startswith("compiled: ") for r in compiled)
    tried = [r for r in report.rows if r.role in ("chosen", "compiled")]
    best = min(tried, key=lambda r: (report.value(r), r.profile.step_ms))
    assert plan == best.plan
    assert not [r for r in sw.autoplan(mlp, BATCH, max_slowdown=100.0, **FAST)[1].rows if r.role == "compiled"]


def test_the_budgeted_form_keeps_a_stem_chains_convolution_as_a_region():
    # The partitioner recomputes the stem's normalisation, activation and pooling itself, never its
    # convolution, whose output the normalisation keeps: the budgeted form keeps that one region.
    from shrinkwrap.autoplan.compiled import _budgeted

    step = sw.Plan.parse("compile(backend='aot_eager_decomp_partition')")
    plan = sw.Plan.parse(r"checkpoint('conv1|bn1|relu|maxpool', chain=True), checkpoint(r'layer1\.\d+'), "
                         "channels_last(), autocast(torch.bfloat16)")
    assert str(_budgeted(plan, step, resnet64())) == (  # the stem's convolution in its fast form, run twice
        "space_to_depth(pattern='conv1'), checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), "
        "compile(memory_budget=0.6, backend='aot_eager_decomp_partition')")
    no_layout = sw.Plan.parse("checkpoint('conv1|bn1|relu|maxpool', chain=True), autocast(torch.bfloat16)")
    assert str(_budgeted(no_layout, step, resnet64())).startswith("checkpoint('conv1'), autocast(")
    # Only the stem convolutions a region recomputes: one inside a region over its parent too.
    from shrinkwrap.autoplan.compiled import _fast_stem

    model = nn.Sequential(resnet64(), resnet64())
    steps = list(sw.Plan.parse("checkpoint('1'), channels_last()"))
    assert str(sw.Plan(_fast_stem(steps, model))) == r"space_to_depth(pattern=r'1\.conv1'), checkpoint('1'), channels_last()"
    no_chain = sw.Plan.parse(r"checkpoint(r'layer1\.\d+'), autocast(torch.bfloat16)")
    assert str(_budgeted(no_chain, step, resnet64())) == \
        "autocast(torch.bfloat16), compile(memory_budget=0.6, backend='aot_eager_decomp_partition')"

    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    budget = "compile(memory_budget=0.6, backend='aot_eager_decomp_partition')"
    saved, grads = {}, {}
    for text in (budget, f"checkpoint('conv1'), {budget}"):
        torch._dynamo.reset()
        model = sw.apply(resnet64(), text)
        saved[text] = sw.saved_tensor_bytes(lambda: model(x).sum())
        model(x).sum().backward()
        grads[text] = [p.grad for p in model.parameters()]
    conv1_out = 4 * 8 * 32 * 32 * 8  # bytes of the stem convolution's float64 output
    assert saved[f"checkpoint('conv1'), {budget}"] <= saved[budget] - conv1_out / 2
    ref = resnet64()
    ref(x).sum().backward()
    for g in grads.values():
        assert all(torch.allclose(a, p.grad) for a, p in zip(g, ref.parameters()))


def test_the_compile_stage_tries_a_stems_convolution_under_the_partitioners_budget():
    step = "compile(backend='aot_eager_decomp_partition')"
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    _, report = sw.autoplan(resnet64, x, max_slowdown=100.0, compile=step, **FAST)
    budgeted = [r for r in report.rows if r.role == "compiled" and r.plan.steps[-1].memory_budget is not None]
    assert [str(s) for r in budgeted for s in r.plan.steps if s.recomputes] == ["checkpoint('conv1')"]
    assert all(r.profile is not None for r in budgeted)


def test_the_compile_stage_measures_the_smallest_sets_budgeted_form_where_it_keeps_a_region():
    import dataclasses

    from shrinkwrap.autoplan.choose import Effect
    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.report import Row

    model = resnet64()
    by_cover = {c.covers: c for c in candidates(model, device="cpu")}
    stem, layer1 = by_cover[("conv1", "bn1", "relu", "maxpool")], by_cover[("layer1",)]
    rows, metric = _rows({r"checkpoint('layer1')": (500.0, 10.0)})  # verified: no stem region
    measured = []

    class Search(_Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            measured.append(str(plan))
            return Row(plan, dataclasses.replace(rows[0].profile), role="chosen")

    search = Search(None, model, metric, 1000.0, 8.0, None, 100.0, False, False, 10.0)
    step = sw.Plan.parse("compile(backend='aot_eager_decomp_partition')")
    budget = "compile(memory_budget=0.6, backend='aot_eager_decomp_partition')"
    search.compiled(rows, [Effect(stem, 100.0, 1.0), Effect(layer1, 100.0, 1.0)], 1000.0, 8.0, step)
    assert [m for m in measured if "memory_budget" in m] == [budget, f"checkpoint('conv1'), {budget}"]
    measured.clear()  # a smallest set without a chain: its budgeted form, which keeps no region, is not measured
    (layout,) = [c for c in candidates(model, device="cpu") if str(c) == "channels_last()"]
    search.compiled(rows, [Effect(layer1, 100.0, 1.0), Effect(layout, 100.0, 1.0)], 1000.0, 8.0, step)
    assert [m for m in measured if "memory_budget" in m] == [budget]


def test_the_compile_stage_compiles_its_inductor_plans_ahead_side_by_side(monkeypatch):
    import dataclasses
    import sys
    import types

    from shrinkwrap.autoplan.choose import Effect
    from shrinkwrap.autoplan import _ahead_note
    from shrinkwrap.autoplan.compiled import _Turn
    from shrinkwrap.autoplan.stages import _Search
    from shrinkwrap.report import Row

    model = resnet64()
    by_cover = {c.covers: c for c in candidates(model, device="cpu")}
    rows, metric = _rows({r"checkpoint('layer1')": (500.0, 10.0)})
    ahead, measured = [], []
    timings = (sw.Timing((10.0,) * 5), sw.Timing((6.0,) * 5))
    there = (dataclasses.replace(rows[0].profile, peak=1234), ("",), (), timings, (2.0, 3.0))  # _Turn.timed's
    failed = (("failed", "BackendCompilerFailed: ..."), (), (), None, (9.0, None))

    def fake_ahead(make, plans, batch, options, room, then, compiled, after, finished):
        ahead.append(([str(p) for p in plans], room, then, after))
        if then is not None:  # told once every plan has compiled: the processes measure next
            time.sleep(0.05)
            compiled([50.0, 60.0, float("nan"), 80.0][:len(plans)], (3, 5))  # NaN: an earlier wave's process died first
            time.sleep(0.05)
        for i in range(len(plans)):  # each plan's entry arrives
            told.append(("arrived", i))
            finished(i)
        # The first plan measured there, the second failed there; the third's process died in its
        # turn (its error), and the fourth's turn never came. Without ``then``: compiled only.
        return len(plans), ([there, failed] if then else [None, None]) + ["BrokenProcessPool: ...", None][:len(plans) - 2]

    overlapped = sys.modules["shrinkwrap.autoplan.overlapped"]
    monkeypatch.setattr(overlapped, "compile_ahead", fake_ahead)

    class Search(_Search):
        def measure_chosen(self, plan, isolate=True, beside=()):
            measured.append(str(plan))
            besides.append(len(beside))
            return Row(plan, dataclasses.replace(rows[0].profile), role="chosen")

    besides = []
    base = Row(sw.Plan(), dataclasses.replace(rows[0].profile, peak=3000, first_peak=4000))
    cache = {("", True): base, (r"checkpoint('layer1'), compile()", False): rows[0]}  # measured already
    stopped = []  # how many compilations ahead had started when the row process waiting was stopped
    fresh = types.SimpleNamespace(stop_next=lambda: stopped.append(len(ahead)))
    stage = types.SimpleNamespace(cache=cache, make=resnet64, batch=None, options_for=lambda plan: None, cuda=True,
                                  fresh=fresh)
    stage.compiled_ahead = lambda *args: overlapped.OverlappedRows.compiled_ahead(stage, *args)
    told = []
    search = Search(stage, model, metric, 1000.0, 8.0, None, 100.0, False, False, 10.0,
                    progress=lambda i, n, text: told.append((i, n, text)))
    effects = [Effect(by_cover[("conv1", "bn1", "relu", "maxpool")], 100.0, 1.0), Effect(by_cover[("layer1",)], 100.0, 1.0)]
    out = search.compiled(rows, effects, 1000.0, 8.0, sw.Plan.parse("compile()"))
    ((texts, room, then, after),) = ahead
    # Progress: the plans compiled ahead, a tick as each one's entry arrives (its turn there over),
    # a line once all have compiled; then the compile stage's plans, a tick as each is measured.
    ticks = [t for t in told if t[0] != "arrived"]
    assert ticks[0] == (0, 4, "4 plans compiled side by side in fresh processes, then each measured there")
    assert "the last compiled after" in ticks[1][2] and ticks[1][:2] == (0, 4)
    for i in range(4):
        tick = told[told.index(("arrived", i)) + 1]
        assert tick[:2] == (i + 1, 4) and tick[2].endswith(texts[i])
    assert [t[:2] for t in ticks[6:]] == [(i, len(out)) for i in range(len(out) + 1)]
    assert ticks[6][2].startswith("compiled plans") and ticks[-1][2].endswith(str(out[-1].plan))
    assert stopped == [0]  # before the free memory is read: their CUDA contexts are no room for a plan
    # The plan measured there is a fresh process's row, with its timings in turns, and this
    # process measures the others itself (compiling them from the on-disk caches).
    (row,) = [r for r in out if str(r.plan) == texts[0]]
    assert row.profile.peak == 1234 and row.role == "compiled" and search.ratios[texts[0]] == timings
    assert cache[texts[0], True].profile.peak == 1234
    (bad,) = [r for r in out if str(r.plan) == texts[1]]
    assert bad.status == "failed" and "BackendCompilerFailed" in bad.error and bad.role == "compiled"
    assert set(texts) == set(measured) - {r"checkpoint('layer1'), compile()"} | set(texts[:2]) and len(texts) == 4
    assert not set(texts[:2]) & set(measured)
    # Those measured here, each beside the verified rows and the compiled rows before it (see _Search.outdone).
    assert besides == [len(rows) + i for i, r in enumerate(out) if str(r.plan) not in texts[:2]]
    # Among them the one-line recipe: every block a region of its own, compiled.
    assert r"checkpoint(r'layer[12]\.\d+'), compile()" in texts
    assert room == 4000 and (search.ahead.plans, search.ahead.at_once, search.ahead.measured) == (4, 4, 2)
    # What failed there, for the notes: a process, and a plan's row.
    assert search.ahead.errors == ["BrokenProcessPool: ...", "BackendCompilerFailed: ..."]
    assert 0.05 <= search.ahead.compiling < search.ahead.seconds - 0.04  # compiling, then measuring
    assert search.ahead.first == [50.0, 60.0, 80.0] and search.ahead.turns == [(2.0, 3.0), (9.0, None)]
    note = _ahead_note(search.ahead)  # where the stage's time went
    assert "4 processes at once (the last compiled after " in note and "first iterations took 50.0-80.0 s, 3 graph(s) from the compiler's on-disk caches and 5 anew)" in note
    assert "measuring 2 of them there, one at a time (a row 2.0-9.0 s, and timing 1 in turns 3.0 s)" in note
    assert "; 2 measured in this process" in note and "; 2 failed there, the first with BrokenProcessPool" in note
    # What each process does once all have compiled: its row, then its time in turns against the
    # limit, unless a row within the limits, here or timed there before it, reads less.
    turn = then.__self__
    assert isinstance(turn, _Turn) and then == turn.row and after == turn.timed
    assert (turn.slowdown, turn.tolerance, turn.target) == (10.0, search.tolerance, None)
    assert turn.within == tuple(metric(r) for r in rows if search.fits(r))
    # Plans that run CUDA graphs: compiled ahead, not measured there (the first iterations' graph
    # pools would count in the row).
    ahead.clear()
    cache.clear()
    cache["", True] = base
    search.ahead = None
    search.compiled(rows, effects, 1000.0, 8.0, sw.Plan.parse("compile(mode='reduce-overhead')"))
    assert ahead[0][2] is None is ahead[0][3] and search.ahead.compiling is None and not search.ahead.first
    note = _ahead_note(search.ahead)  # compiled ahead, measured in this process
    assert f"processes at once; {len(ahead[0][0])} measured in this process" in note and "; 1 failed there" in note
    assert "first iterations" not in note and "measuring" not in note
    # Not where nothing is kept on disk (another backend), where kernels are tuned as the graph
    # compiles (beside other processes, the choice would be kept), or without CUDA.
    for step, cuda in [("compile(backend='aot_eager_decomp_partition')", True), ("compile(mode='max-autotune')", True),
                       ("compile()", False)]:
        ahead.clear()
        cache.clear()
        stage.cuda, search.ahead = cuda, None
        search.compiled(rows, effects, 1000.0, 8.0, sw.Plan.parse(step))
        assert not ahead and search.ahead is None


def test_sets_of_candidates_that_make_the_same_plan_cover_alike():
    from shrinkwrap.autoplan.choose import Effect, _covered

    by_cover = {c.covers: c for c in candidates(mlp(), device="cpu", max_groups=2)}
    chunk = [Effect(by_cover[("1.0", "1.1")], 1.0, 1.0)]
    singles = [Effect(by_cover[("1.0",)], 1.0, 1.0), Effect(by_cover[("1.1",)], 1.0, 1.0)]
    assert _covered(chunk) == _covered(singles) and _covered(singles[:1]) < _covered(chunk)


def test_the_compile_stage_also_leaves_the_recompute_to_the_partitioners_memory_budget():
    step = "compile(backend='aot_eager_decomp_partition')"  # the min-cut partitioner, no C++ compiler
    cache: dict = {}
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, compile=step, cache=cache, **FAST)
    compiled = [r.plan for r in report.rows if r.role == "compiled"]
    (budgeted,) = [p for p in compiled if p.steps[-1].memory_budget is not None]
    verified = compiled[0].steps[:-1]  # the verified plan, compiled first
    assert any(s.recomputes for s in verified)  # checkpoint and swish, on this model
    assert list(budgeted.steps[:-1]) == [s for s in verified if not s.recomputes]
    assert budgeted.steps[-1].memory_budget == 0.6 and budgeted.steps[-1].backend == "aot_eager_decomp_partition"
    assert all(r.profile is not None for r in report.rows if r.role == "compiled")
    for given, budget in [("compile(backend='aot_eager')", None),  # no partitioner to give a budget to
                          ("compile(backend='aot_eager_decomp_partition', memory_budget=0.8)", 0.8),  # the user's
                          (r"compile(backend='aot_eager_decomp_partition', pattern=r'1\.\d+')", None)]:  # regional
        _, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, compile=given, cache=cache, **FAST)
        budgets = [r.plan.steps[-1].memory_budget for r in report.rows if r.role == "compiled"]
        assert budgets and budgets == [budget] * len(budgets)


def test_a_plan_that_fails_to_compile_is_a_row_and_the_eager_plan_stands():
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, compile="compile(backend='no_such_backend')", **FAST)
    failed = [r for r in report.rows if r.role == "compiled"]
    assert failed and all(r.profile is None and "no_such_backend" in r.error for r in failed)
    assert len(plan) and "compile" not in str(plan)
    # The notes say why the eager plan is the answer: each compiled plan failed.
    (why,) = [n for n in report.notes if n.startswith("the answer is eager")]
    assert why.count("failed (") == len(failed)
    # The one-line recipe was among them: every block of the stack a region of its own, compiled.
    assert any(str(r.plan).startswith(r"checkpoint(r'1\.\d+')") for r in failed), [str(r.plan) for r in failed]


@pytest.mark.parametrize("bad", ["compiel()", "swish()", "compile(), swish()", 3])
def test_a_compile_argument_that_is_no_compile_step_fails_before_anything_is_measured(bad, monkeypatch):
    import sys

    ap = sys.modules["shrinkwrap.autoplan.stages"]
    monkeypatch.setattr(rows_module, "measure_plans", lambda *a, **k: pytest.fail("measured before reading compile="))
    with pytest.raises(ValueError):
        sw.autoplan(mlp, BATCH, max_slowdown=2.0, compile=bad, **FAST)


def test_the_largest_batch_search_keeps_the_least_memory_plan_when_compiled_rows_are_faster():
    from shrinkwrap.autoplan.stages import _Search

    rows, metric = _rows({"checkpoint('a')": (500.0, 30.0), "checkpoint('a'), compile()": (600.0, 10.0),
                          "checkpoint('b'), compile()": (400.0, 20.0)})
    search = _Search(None, None, metric, 1000.0, 30.0, 800.0, 45.0, False, True, 1.5)
    assert str(search.final(rows).plan) == "checkpoint('b'), compile()"
    search.by_memory = False  # a budget to meet at the highest speed: the fastest within it
    assert str(search.final(rows).plan) == "checkpoint('a'), compile()"


def stages_of_stages() -> nn.Module:
    """Two stages, each a stack of two stacks of blocks: three grains of blocks (stages, stacks, blocks)."""
    torch.manual_seed(0)

    def stack():
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))
                               for _ in range(2)])

    return nn.Sequential(nn.Linear(16, 32), nn.Sequential(*[nn.Sequential(stack(), stack()) for _ in range(2)]),
                         nn.Linear(32, 4))


def test_the_compile_stage_offers_every_block_checkpointed_at_each_depth_of_the_stacks():
    from shrinkwrap.select import blocks_by_depth, pattern_for
    from shrinkwrap.transforms.checkpoint import Checkpoint

    model = stages_of_stages()
    grains = blocks_by_depth(model)
    assert [len(g) for g in grains] == [2, 4, 8]
    step = "compile(backend='no_such_backend')"  # fails at once: which plans were tried is the question
    _, report = sw.autoplan(stages_of_stages, BATCH, max_slowdown=100.0, compile=step, **FAST)
    tried = {str(r.plan) for r in report.rows if r.role == "compiled"}
    for grain in grains:
        every = str(Checkpoint(pattern_for(model, grain)))
        assert any(p.startswith(every + ", ") for p in tried), (every, tried)
    # A grain whose plan cannot be made is left out, with a note; the others are not.
    from shrinkwrap.autoplan import stages

    made = stages._every_block

    def fails_on_four(plan, step_, model_, blocks):
        if len(blocks) == 4:
            raise KeyError(3)
        return made(plan, step_, model_, blocks)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "_every_block", fails_on_four)
        _, report = sw.autoplan(stages_of_stages, BATCH, max_slowdown=100.0, compile=step, **FAST)
    tried = {str(r.plan) for r in report.rows if r.role == "compiled"}
    assert "every block checkpointed, 4 blocks: left out, its making raised KeyError: 3" in report.notes
    for grain in (grains[0], grains[2]):
        assert any(p.startswith(str(Checkpoint(pattern_for(model, grain))) + ", ") for p in tried)


def test_a_step_or_a_compiled_plan_that_cannot_be_made_is_a_note_and_the_call_goes_on(monkeypatch):
    from shrinkwrap.autoplan import stages
    from shrinkwrap.transforms.activations import Swish

    def raises(*args):
        raise KeyError(3)  # an integer key, as a model's own dict can raise

    monkeypatch.setattr(Swish, "candidates", classmethod(raises))
    monkeypatch.setattr(stages, "_every_block", raises)
    with pytest.raises(KeyError):  # called alone, the error is the caller's to see
        candidates(mlp(), device="cpu")
    plan, report = sw.autoplan(mlp, BATCH, max_slowdown=100.0, compile="compile(backend='aot_eager')", **FAST)
    assert "swish" not in str(plan) and "checkpoint" in str(plan)
    assert "swish(): no candidates, its search on this model raised KeyError: 3" in report.notes
    assert "every block checkpointed, 4 blocks: left out, its making raised KeyError: 3" in report.notes
    compiled = [r for r in report.rows if r.role == "compiled"]
    assert compiled  # the other compiled plans were measured
    (spent,) = [n for n in report.notes if n.endswith(f"s in the compile stage ({len(compiled)} compiled plans)")]
    assert float(spent.split()[2]) > 0
