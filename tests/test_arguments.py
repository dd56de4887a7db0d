"""Every public entry point checks its arguments: a wrong one is a TypeError saying what the function
takes and what it got, before anything changes (not an AttributeError from deep inside)."""

import sys

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.plan import PlanError
from shrinkwrap.select import SelectionError

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


# -- numbers, flags and batches: refused before anything is measured -------------------------------

nan, inf = float("nan"), float("inf")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


X = torch.randn(2, 4)


class Measured(BaseException):
    """Raised where an iteration would run: a call that gets there took its arguments."""


@pytest.fixture
def no_measuring(monkeypatch):
    def measured(*args, **kwargs):
        raise Measured

    import shrinkwrap.measuring.step as step
    monkeypatch.setattr(step, "_measure", measured)
    monkeypatch.setattr(step, "setup_iteration", measured)
    monkeypatch.setattr(sys.modules["shrinkwrap.measuring.turns"], "setup_iteration", measured)
    monkeypatch.setattr(sys.modules["shrinkwrap.compare"], "warm_process", lambda *a: None)


def ap(**kw):
    return sw.autoplan(mlp, kw.pop("batch", X), **{"max_slowdown": 1.5, "iterations": 1, "rounds": 1, **kw})


@pytest.mark.parametrize("budget, reads", [
    (2**30, 2**30), (2**20, 2**20), (0.5, 500.0), (1.0, 1000.0), ("0.5", 500.0), (".5", 500.0),
    ("8 GB", 8e9), ("8gib", 8 * 2**30), (" 8GiB ", 8 * 2**30), ("0.5GiB", 2**29), ("100B", 100.0), ("1TiB", 2**40),
    (None, None),
    (2, (ValueError, r"^shrinkwrap: autoplan\(\) budget=2 reads as 2 bytes, less than 1 MiB: write budget='2GiB', "
                     r"2 \* 2\*\*30, or a fraction of the baseline such as 0\.5$")),
    (2**20 - 1, (ValueError, "reads as 1048575 bytes, less than 1 MiB: write the size with its unit")),
    (True, (TypeError, "a budget is bytes .*; got bool True")),
    ([1], (TypeError, "got list")),
    (0, (ValueError, "a budget is a positive finite size, got 0")),
    (-1, (ValueError, "positive finite size, got -1")),
    (-0.5, (ValueError, "positive finite size, got -0.5")),
    (nan, (ValueError, "positive finite size, got nan")),
    (inf, (ValueError, "positive finite size, got inf.*leave it out")),
    (1.5, (ValueError, "budget 1.5 has no unit.*write e.g. '1.5GiB'")),
    (8e9, (ValueError, "budget 8000000000.0 has no unit.*'7.45GiB' or 8000000000")),
    ("2", (ValueError, "budget 2.0 has no unit")),
    ("1e9", (ValueError, "budget 1000000000.0 has no unit.*'1000000000B'")),  # text: the int form is text too
    ("1e9", (ValueError, "budget 1000000000.0 has no unit")),
    ("0", (ValueError, "positive finite size, got 0.0")),
    ("inf", (ValueError, "positive finite size, got inf")),
    ("nan", (ValueError, "positive finite size, got nan")),
    ("0GiB", (ValueError, "a budget must be positive, got '0GiB'")),
    ("-1GiB", (ValueError, "a budget must be positive, got '-1GiB'")),
    ("8G", (ValueError, "cannot read budget '8G'")),
    ("lots", (ValueError, "cannot read budget 'lots'")),
])
def test_every_budget_reads_as_meant_or_is_refused(budget, reads):
    from shrinkwrap.autoplan import parse_budget

    if isinstance(reads, tuple):
        with pytest.raises(reads[0], match=reads[1]):
            parse_budget(budget, 1000.0)
    else:
        assert parse_budget(budget, 1000.0) == reads


REFUSED = {  # name: (call, error, what the message says after "shrinkwrap: ")
    "autoplan(budget=2)": (lambda: ap(budget=2), ValueError, "autoplan() budget=2 reads as 2 bytes"),
    "autoplan(budget=nan)": (lambda: ap(budget=nan), ValueError, "a budget is a positive finite size"),
    **{f"autoplan(max_slowdown={v!r})": ((lambda v=v: ap(max_slowdown=v)), error, "autoplan() takes max_slowdown= a "
                                         "finite number above 0")
       for v, error in ((0, ValueError), (-1, ValueError), (nan, ValueError), (inf, ValueError), (True, TypeError),
                        ("1.2", TypeError))},
    **{f"autoplan(tolerance={v!r})": ((lambda v=v: ap(tolerance=v)), error, "autoplan() takes tolerance= a finite "
                                      "number of 0 or more")
       for v, error in ((-0.1, ValueError), (nan, ValueError), (inf, ValueError), (True, TypeError),
                        ("0.03", TypeError), (3, ValueError))},  # 3 for 3%: a limit four times max_slowdown
    **{f"autoplan({k}={v!r})": ((lambda k=k, v=v: ap(**{k: v})), error, f"autoplan() takes {k}= an int of at least 1")
       for k, v, error in (("rounds", 0, ValueError), ("rounds", -1, ValueError), ("rounds", 1.5, TypeError),
                           ("rounds", True, TypeError), ("rounds", "4", TypeError), ("iterations", 0, ValueError),
                           ("iterations", 1.5, TypeError), ("iterations", True, TypeError),
                           ("warmup", 0, ValueError), ("warmup", 2.5, TypeError), ("warmup", True, TypeError))},
    "autoplan(allow_lossy='no')": (lambda: ap(allow_lossy="no"), TypeError, "autoplan() takes allow_lossy= True or False"),
    "autoplan(isolate_candidates=1)": (lambda: ap(isolate_candidates=1), TypeError,
                                       "autoplan() takes isolate_candidates= True or False"),
    "autoplan(cache=[])": (lambda: ap(cache=[]), TypeError, "autoplan() takes cache= a dict"),
    "autoplan(maximize='Speed')": (lambda: ap(maximize="Speed"), ValueError, "maximize is 'speed' or 'batch'"),
    "autoplan(device='gpu')": (lambda: ap(device="gpu"), ValueError, "autoplan() takes device= 'cuda', 'cuda:1', 'cpu'"),
    "autoplan(device=True)": (lambda: ap(device=True), TypeError, "autoplan() takes device="),
    "autoplan(progress='yes')": (lambda: ap(progress="yes"), TypeError, "progress is True (a bar on stderr) or a function"),
    "autoplan(loss_fn=3)": (lambda: ap(loss_fn=3), TypeError, "autoplan() takes loss_fn= a function"),
    "autoplan(optimizer=an optimizer)": (lambda: ap(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1)), TypeError,
                                         "autoplan() takes optimizer= a function params -> Optimizer"),
    "autoplan(batch='x')": (lambda: ap(batch="x"), TypeError, "autoplan() takes a batch: a tensor"),
    "autoplan(batch=[1, 2])": (lambda: ap(batch=[1, 2]), TypeError, "autoplan() takes a batch"),
    "autoplan(factory of no model)": (lambda: sw.autoplan(lambda: 3, X, max_slowdown=1.5), TypeError,
                                      "autoplan() takes a model or a function returning one; got the function "
                                      "<lambda>, which returned int 3"),
    "plan_report(iterations=True)": (lambda: sw.plan_report("", mlp, X, iterations=True), TypeError,
                                     "plan_report() takes iterations= an int of at least 1; got bool True"),
    "plan_report(warmup=1.5)": (lambda: sw.plan_report("", mlp, X, warmup=1.5), TypeError, "plan_report() takes warmup="),
    "plan_report(device='gpu')": (lambda: sw.plan_report("", mlp, X, device="gpu"), ValueError,
                                  "plan_report() takes device="),
    "plan_report(isolate=1)": (lambda: sw.plan_report("", mlp, X, isolate=1), TypeError,
                               "plan_report() takes isolate= True, False or None"),
    "plan_report(fit='no')": (lambda: sw.plan_report("", mlp, X, fit="no"), TypeError, "plan_report() takes fit="),
    "plan_report(name=3)": (lambda: sw.plan_report("", mlp, X, name=3), TypeError, "plan_report() takes name= a str"),
    "plan_report(snapshot=3)": (lambda: sw.plan_report("", mlp, X, snapshot=3), TypeError,
                                "plan_report() takes snapshot= a path"),
    "plan_report(parallelize=3)": (lambda: sw.plan_report("", mlp, X, parallelize=3), TypeError,
                                   "plan_report() takes parallelize= a function"),
    "plan_report(batch=None)": (lambda: sw.plan_report("", mlp, None), TypeError, "plan_report() takes a batch"),
    "measure(iterations=True)": (lambda: sw.measure(mlp(), X, iterations=True), TypeError,
                                 "measure() takes iterations= an int of at least 1; got bool True"),
    "measure(iterations=2.5)": (lambda: sw.measure(mlp(), X, iterations=2.5), TypeError, "measure() takes iterations="),
    "measure(iterations='3')": (lambda: sw.measure(mlp(), X, iterations="3"), TypeError, "measure() takes iterations="),
    "measure(warmup=0)": (lambda: sw.measure(mlp(), X, warmup=0), ValueError, "measure() takes warmup="),
    "measure(grad_scaler=1)": (lambda: sw.measure(mlp(), X, grad_scaler=1), TypeError,
                               "measure() takes grad_scaler= True, False or None"),
    "measure(snapshot=3)": (lambda: sw.measure(mlp(), X, snapshot=3), TypeError, "measure() takes snapshot="),
    "measure(optimizer=3)": (lambda: sw.measure(mlp(), X, optimizer=3), TypeError, "measure() takes optimizer="),
    "measure(device='cuda:x')": (lambda: sw.measure(mlp(), X, device="cuda:x"), ValueError, "measure() takes device="),
    "measure(batch=None)": (lambda: sw.measure(mlp(), None), TypeError, "measure() takes a batch"),
    "estimate(batch='x')": (lambda: sw.estimate(mlp, "x"), TypeError, "estimate() takes a batch"),
    "measure(batch={'x': 1})": (lambda: sw.measure(mlp(), {"x": 1}), TypeError, "measure() takes a batch"),
    "Options(iterations=1.5)": (lambda: sw.Options(iterations=1.5), TypeError, "Options() takes iterations="),
    "Options(warmup=True)": (lambda: sw.Options(warmup=True), TypeError, "Options() takes warmup="),
    "Options(device='gpu')": (lambda: sw.Options(device="gpu"), ValueError, "Options() takes device="),
    "Options(module_log='no')": (lambda: sw.Options(module_log="no"), TypeError, "Options() takes module_log="),
    "Options(loss_fn=3)": (lambda: sw.Options(loss_fn=3), TypeError, "Options() takes loss_fn="),
    "time_interleaved(rounds=1.5)": (lambda: sw.time_interleaved({"a": mlp()}, X, rounds=1.5), TypeError,
                                     "time_interleaved() takes rounds="),
    "time_interleaved(per_round=0)": (lambda: sw.time_interleaved({"a": mlp()}, X, per_round=0), ValueError,
                                      "time_interleaved() takes per_round="),
    "time_interleaved(max_rounds=True)": (lambda: sw.time_interleaved({"a": mlp()}, X, max_rounds=True), TypeError,
                                          "time_interleaved() takes max_rounds="),
    "time_interleaved(until=3)": (lambda: sw.time_interleaved({"a": mlp()}, X, until=3, max_rounds=5), TypeError,
                                  "time_interleaved() takes until="),
    "time_interleaved([model])": (lambda: sw.time_interleaved([mlp()], X), TypeError,
                                  "time_interleaved() takes models= a dict"),
    "time_interleaved({})": (lambda: sw.time_interleaved({}, X), TypeError, "time_interleaved() takes models= a dict"),
    "time_interleaved(options=dict)": (lambda: sw.time_interleaved({"a": mlp()}, X, {"iterations": 1}), TypeError,
                                       "time_interleaved() takes options= an Options"),
    "fit(iterations=1.5)": (lambda: sw.fit(mlp, X, iterations=1.5), TypeError, "fit() takes iterations="),
    "fit(resolution=-1)": (lambda: sw.fit(mlp, X, resolution=-1), ValueError, "fit() takes resolution="),
    "fit(at_once=0)": (lambda: sw.fit(mlp, X, at_once=0), ValueError, "fit() takes at_once="),
    "fit(options=dict)": (lambda: sw.fit(mlp, X, options={"iterations": 1}), TypeError, "fit() takes options= an Options"),
    "fit(batch='x')": (lambda: sw.fit(mlp, "x"), TypeError, "fit() takes a batch"),
    "trains_under(cap='8GiB')": (lambda: sw.trains_under(mlp, X, "8GiB"), TypeError, "trains_under() takes cap="),
    "trains_under(cap=True)": (lambda: sw.trains_under(mlp, X, True), TypeError, "trains_under() takes cap="),
    "trains_under(iterations=0)": (lambda: sw.trains_under(mlp, X, 2**30, iterations=0), ValueError,
                                   "trains_under() takes iterations="),
    "revert(keep=-1)": (lambda: sw.revert(mlp(), keep=-1), ValueError, "revert() takes keep= an int of at least 0"),
    "revert(keep=1.5)": (lambda: sw.revert(mlp(), keep=1.5), TypeError, "revert() takes keep="),
    "revert(keep=True)": (lambda: sw.revert(mlp(), keep=True), TypeError, "revert() takes keep="),
    "select(outermost=1)": (lambda: sw.select(mlp(), "0", outermost=1), TypeError, "select() takes outermost="),
    "select(allow_empty='yes')": (lambda: sw.select(mlp(), "0", allow_empty="yes"), TypeError,
                                  "select() takes allow_empty="),
    "offload_traffic(reset=1)": (lambda: sw.offload_traffic(mlp(), reset=1), TypeError,
                                 "offload_traffic() takes reset= True or False"),
    "ProgressBar(quiet='no')": (lambda: sw.ProgressBar("no"), TypeError, "ProgressBar() takes quiet= True or False"),
    "checkpoint(3)": (lambda: sw.checkpoint(3), SelectionError, "cannot select modules with 3"),
    "checkpoint(None)": (lambda: sw.checkpoint(None), SelectionError, "cannot select modules with None"),
    "checkpoint('[')": (lambda: sw.checkpoint("["), SelectionError, "invalid regular expression '['"),
    "swish(3)": (lambda: sw.swish(3), SelectionError, "cannot select modules with 3"),
    "half(torch.float16, keep=3)": (lambda: sw.half(torch.float16, keep=3), SelectionError, "cannot select modules"),
    "Plan.parse('checkpoint(3)')": (lambda: sw.Plan.parse("checkpoint(3)"), SelectionError, "cannot select modules"),
    "offload(devices=('gpu',))": (lambda: sw.offload(devices=("gpu",)), ValueError, "'gpu' is no device type"),
    "offload(devices=('cuda:0',))": (lambda: sw.offload(devices=("cuda:0",)), ValueError, "'cuda:0' is no device type"),
    "offload(devices=())": (lambda: sw.offload(devices=()), ValueError, "none offloads nothing"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_misread_argument_is_refused_before_anything_is_measured(case, no_measuring):
    call, error, says = REFUSED[case]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert message.startswith("shrinkwrap: ") and "\n" not in message, message
    assert says in message, message


ACCEPTED = {  # what the checks must let through: each call gets as far as measuring
    "autoplan(max_slowdown=0.5)": lambda: ap(max_slowdown=0.5),  # a compiled plan can be faster
    "autoplan(tolerance=0)": lambda: ap(tolerance=0),
    "autoplan(budget='0.5GiB')": lambda: ap(budget="0.5GiB"),
    "autoplan(device=torch.device('cpu'))": lambda: ap(device=torch.device("cpu")),
    "autoplan(a model, no factory)": lambda: sw.autoplan(mlp(), X, max_slowdown=1.2),
    "measure(batch=[x])": lambda: sw.measure(mlp(), [X]),
    "measure(optimizer=a class)": lambda: sw.measure(mlp(), X, optimizer=torch.optim.SGD, iterations=1, warmup=1),
    "time_interleaved(until, max_rounds)": lambda: sw.time_interleaved({"a": mlp()}, X, until=lambda t: True,
                                                                       max_rounds=3),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_right_numbers_still_pass_the_checks(case, no_measuring):
    with pytest.raises(Measured):
        ACCEPTED[case]()


def test_right_step_arguments_still_pass():
    assert sw.offload(devices=("cpu",)).devices == ("cpu",)
    assert str(sw.checkpoint(nn.Linear)) == "checkpoint(torch.nn.modules.linear.Linear)"
    model = sw.apply(mlp(), sw.checkpoint(["0", "2"]))
    assert sw.revert(model, keep=1) is model and len(sw.records(model)) == 1
    assert sw.revert(model, keep=0) is model and sw.records(model) == []
