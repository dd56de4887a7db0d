"""Every public entry point checks its arguments: a wrong one is a TypeError saying what the function
takes and what it got, before anything changes (not an AttributeError from deep inside)."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.plan import PlanError

from toymodels import Net

BATCH = torch.randn(2, 3, 8, 8)
TAKES_MODEL = "takes a model (an nn.Module)"
TAKES_PLAN = "takes a Plan, a step, a list of steps or the plan's text"
TAKES_FACTORY = "takes a model or a function returning one"

# (call, the message's start after "shrinkwrap: ", what it must say it got)
CASES = {
    "apply(model, step class)": (lambda m: sw.apply(m, sw.swish), f"apply() {TAKES_PLAN}",
                                 "got the class Swish — call it: swish()"),
    "apply(model, class needing args)": (lambda m: sw.apply(m, sw.checkpoint), f"apply() {TAKES_PLAN}",
                                         "got the class Checkpoint — call it: checkpoint(...)"),
    "apply(model, None)": (lambda m: sw.apply(m, None), f"apply() {TAKES_PLAN}", "got None"),
    "apply(model, 42)": (lambda m: sw.apply(m, 42), f"apply() {TAKES_PLAN}", "got int 42"),
    "apply(str, plan)": (lambda m: sw.apply("resnet", sw.Plan([sw.swish()])), f"apply() {TAKES_MODEL}",
                         "got str 'resnet'"),
    "apply(model class, plan)": (lambda m: sw.apply(Net, "swish()"), f"apply() {TAKES_MODEL}",
                                 "got the class Net — call it: Net()"),
    "Plan(step class)": (lambda m: sw.Plan(sw.swish), "Plan() takes a list of steps", "got the class Swish"),
    "Plan(step)": (lambda m: sw.Plan(sw.swish()), "Plan() takes a list of steps", "put it in a list: Plan([swish()])"),
    "Plan(text)": (lambda m: sw.Plan("swish()"), "Plan() takes a list of steps", "Plan.parse(...)"),
    "Plan(None)": (lambda m: sw.Plan(None), "Plan() takes a list of steps", "got None"),
    "Plan.parse(None)": (lambda m: sw.Plan.parse(None), "Plan.parse() takes the plan's text (a str)", "got None"),
    "plan + step class": (lambda m: sw.Plan() + sw.swish, f"plan + other {TAKES_PLAN}", "call it: swish()"),
    "revert(str)": (lambda m: sw.revert("resnet"), f"revert() {TAKES_MODEL}", "got str 'resnet'"),
    "records(None)": (lambda m: sw.records(None), f"records() {TAKES_MODEL}", "got None"),
    "select(str, pattern)": (lambda m: sw.select("resnet", "layer1"), f"select() {TAKES_MODEL}", "got str"),
    "apply_checkpoint(str)": (lambda m: sw.apply_checkpoint("resnet", "layer1"), f"apply_checkpoint() {TAKES_MODEL}",
                              "got str"),
    "apply_swish(None)": (lambda m: sw.apply_swish(None), f"apply_swish() {TAKES_MODEL}", "got None"),
    "apply_bn_act(str)": (lambda m: sw.apply_bn_act("resnet"), f"apply_bn_act() {TAKES_MODEL}", "got str"),
    "apply_autocast(str)": (lambda m: sw.apply_autocast("resnet"), f"apply_autocast() {TAKES_MODEL}", "got str"),
    "apply_half(model class)": (lambda m: sw.apply_half(Net), f"apply_half() {TAKES_MODEL}", "got the class Net"),
    "measure(factory)": (lambda m: sw.measure(torch.relu, BATCH), f"measure() {TAKES_MODEL}", "got the function relu"),
    "plan_report(step class, ...)": (lambda m: sw.plan_report(sw.swish, m, BATCH), f"plan_report() {TAKES_PLAN}",
                                     "call it: swish()"),
    "plan_report(model, plan) swapped": (lambda m: sw.plan_report(m, sw.Plan(), BATCH), f"plan_report() {TAKES_PLAN}",
                                         "got Net("),
    "plan_report(plan, str)": (lambda m: sw.plan_report(sw.Plan(), "resnet", BATCH), f"plan_report() {TAKES_FACTORY}",
                               "got str 'resnet'"),
    "autoplan(str)": (lambda m: sw.autoplan("resnet", BATCH, budget=0.5), f"autoplan() {TAKES_FACTORY}", "got str"),
    "saved_tensor_bytes(str)": (lambda m: sw.saved_tensor_bytes("resnet", BATCH),
                                "saved_tensor_bytes() takes a function or model to run, then its arguments", "got str"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_argument_is_one_clear_type_error(case):
    call, takes, got = CASES[case]
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError) as info:
        call(model)
    message = str(info.value)
    assert message.startswith(f"shrinkwrap: {takes}; got "), message
    assert got in message and "\n" not in message, message
    assert repr(model) == repr(Net()) and sw.records(model) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("steps", [[sw.swish], ["swish()"], [sw.swish(), nn.ReLU()]])
def test_a_plan_of_non_steps_is_a_plan_error_and_a_type_error(steps):
    for error in (PlanError, TypeError):
        with pytest.raises(error, match=r"^shrinkwrap: Plan\(\) takes a list of steps .*holds steps.*; got "):
            sw.Plan(steps)


def test_right_arguments_still_pass():
    model = Net()
    plan = sw.Plan([sw.checkpoint("layer1")]) + "checkpoint('head')"  # a plan adds text too
    assert str(plan) == "checkpoint('layer1'), checkpoint('head')"
    assert sw.apply(model, (sw.checkpoint("layer1"),)) is model
    assert sw.Plan(s for s in plan).steps == plan.steps  # any iterable of steps
    assert sw.saved_tensor_bytes(model, BATCH) > 0
