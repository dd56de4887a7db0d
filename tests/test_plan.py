import dataclasses

import pytest

import shrinkwrap as sw
from shrinkwrap.plan import PlanError
from shrinkwrap.step import Step, Targets

from toymodels import Net, Block


def test_text_round_trip():
    plan = sw.Plan([sw.checkpoint(r"layer[12]"), sw.checkpoint(["head"]), sw.checkpoint(Block, clone_inputs=True)])
    text = str(plan)
    assert text == "checkpoint('layer[12]'), checkpoint(('head',)), checkpoint(toymodels.Block, clone_inputs=True)"
    assert sw.Plan.parse(text) == plan
    assert plan.steps[0].pattern == "layer[12]"


def test_regexes_are_written_as_raw_strings():
    plan = sw.Plan([sw.checkpoint(r"layer\d\.\d+"), sw.checkpoint("a'\\d")])
    assert str(plan) == "checkpoint(r'layer\\d\\.\\d+'), checkpoint(\"a'\\\\d\")"
    assert sw.Plan.parse(str(plan)) == plan


def test_apply_accepts_plan_steps_and_text():
    for plan in (sw.Plan([sw.checkpoint("layer1")]), [sw.checkpoint("layer1")], sw.checkpoint("layer1"), "checkpoint('layer1')"):
        model = Net()
        assert sw.apply(model, plan) is model
        assert isinstance(model.layer1, sw.CheckpointModule)
        assert [r.step for r in sw.records(model)] == [sw.checkpoint("layer1")]
        assert sw.records(model)[0].matched == ("layer1",)


@pytest.mark.parametrize(
    "text, message",
    [
        ("checkpoint('layer1'", "cannot read plan"),
        ("frobnicate()", "unknown step 'frobnicate'"),
        ("checkpoint(nonexistent.Thing)", "neither a dtype nor an importable module type"),
        ("checkpoint('a', bogus=1)", r"got an unexpected keyword argument 'bogus'; checkpoint\(\) takes"),
        ("1 + 2", "expected a step"),
    ],
)
def test_bad_text_is_refused(text, message):
    with pytest.raises(PlanError, match=message):
        sw.Plan.parse(text)


def test_invalid_plan_is_refused_before_any_module_changes():
    model = Net()
    with pytest.raises(sw.SelectionError, match="layer9"):
        sw.apply(model, [sw.checkpoint("layer1"), sw.checkpoint("layer9")])
    assert not isinstance(model.layer1, sw.CheckpointModule)
    assert sw.records(model) == []


@dataclasses.dataclass(frozen=True)
class _Explodes(Step):
    def targets(self, model):
        return Targets()

    def rewrite(self, model, targets):
        raise RuntimeError("boom")


def test_a_step_failing_midway_rolls_back_the_steps_before_it():
    model = Net()
    with pytest.raises(RuntimeError, match="boom"):
        sw.apply(model, [sw.checkpoint("layer1"), _Explodes()])
    assert type(model.layer1) is Block and sw.records(model) == []


def test_conflicting_steps_are_refused_by_the_plan():
    @dataclasses.dataclass(frozen=True)
    class Picky(Step):
        def conflict(self, other):
            return "picky wants to be alone" if isinstance(other, sw.checkpoint) else None

    with pytest.raises(PlanError, match="picky wants to be alone"):
        sw.Plan([Picky(), sw.checkpoint("layer1")])


def test_non_steps_are_refused():
    with pytest.raises(PlanError, match="holds steps"):
        sw.Plan(["checkpoint('layer1')"])


def test_plan_composes():
    plan = sw.Plan([sw.checkpoint("layer1")]) + sw.checkpoint("layer2")
    assert len(plan) == 2 and [s.pattern for s in plan] == ["layer1", "layer2"]


def test_steps_with_different_predicates_are_not_taken_for_one_another():
    model = Net()
    sw.apply(model, [sw.checkpoint(lambda m, n: n == "layer1")])
    sw.apply(model, [sw.checkpoint(lambda m, n: n == "layer2")])   # prints the same text
    assert isinstance(model.layer2, sw.CheckpointModule)
    sw.apply(model, [sw.checkpoint("layer1")])                      # text names it: skipped
    assert len(sw.records(model)) == 3 and sw.records(model)[-1].skipped == (("layer1", "already checkpointed"),)


def test_a_skipped_step_is_not_checked_again():
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Counted(Step):
        name = "counted_test_step"

        def targets(self, model):
            calls.append("check")
            return Targets(["layer1"])

        def rewrite(self, model, targets):
            return []

    model = Net()
    sw.apply(model, [Counted()])
    calls.clear()
    sw.apply(model, [Counted()])
    assert calls == []
