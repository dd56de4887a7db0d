"""The compile(...) plan step in a plan: last, its text, what it refuses, revert, copies, patterns and the memory
budget per model."""

import copy
import io

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import shrinkwrap as sw
from shrinkwrap.plan import PlanError

from toymodels import net64, resnet64
from compile_step_helpers import EAGER, OtherMLP, _compiled_names, _mlp, _train


MINCUT = "aot_eager_decomp_partition"  # min-cut partitioner, which honours the memory budget


def _saved(model):
    torch.manual_seed(1)
    return sw.saved_tensor_bytes(lambda: model(torch.randn(32, 64)).sum())


@pytest.mark.parametrize("text", [
    "compile()",
    "compile(mode='max-autotune', memory_budget=0.5)",
    "checkpoint('layer1'), compile(fullgraph=True, dynamic=False, backend='aot_eager')",
    r"compile(memory_budget=0.5, pattern=r'layer\d')",
])
def test_plan_text_round_trips(text):
    plan = sw.Plan.parse(text)
    assert str(plan) == text and sw.Plan.parse(str(plan)) == plan
    assert plan.steps[-1] == sw.compile(**{k: getattr(plan.steps[-1], k)
                                           for k in ("mode", "fullgraph", "dynamic", "memory_budget", "backend", "pattern")})
    assert sw.compile(memory_budget=1) == sw.compile(memory_budget=1.0)


def test_a_step_after_compile_is_refused_by_the_plan():
    with pytest.raises(PlanError, match=r"compile goes last in a plan, but swish\(\) comes after compile\(\)"):
        sw.Plan([sw.compile(), sw.swish()])
    with pytest.raises(PlanError, match="compile goes last"):
        sw.Plan.parse("compile(), checkpoint('layer1')")
    with pytest.raises(PlanError, match="compile goes last"):
        sw.Plan([sw.compile()]) + sw.bn_act()
    with pytest.raises(PlanError, match="a model is compiled once"):
        sw.Plan([sw.compile(), sw.compile(mode="max-autotune")])
    assert len(sw.Plan([sw.swish(), sw.compile()])) == 2


def test_a_compiled_model_refuses_other_steps_until_reverted():
    model = net64()
    sw.apply(model, "compile(backend='aot_eager')")
    for apply in (lambda: sw.apply(model, "checkpoint('layer1')"),
                  lambda: sw.apply(model, "bn_act(), compile(backend='aot_eager')"),
                  lambda: sw.apply_checkpoint(model, "layer1"),
                  lambda: sw.apply(model, "compile(backend='aot_eager', fullgraph=True)")):
        with pytest.raises(ValueError, match=r"already has compile\(backend='aot_eager'\): compile goes last"):
            apply()
    assert not isinstance(model.layer1, sw._wrapper.TransparentWrapper) and len(sw.records(model)) == 1
    sw.apply(model, "compile(backend='aot_eager')")  # the same step again: nothing to do
    assert len(sw.records(model)) == 1
    sw.revert(model)
    sw.apply(model, "checkpoint('layer1'), compile(backend='aot_eager')")
    assert isinstance(model.layer1, sw.CheckpointModule) and model._compiled_call_impl is not None


def test_revert_removes_it():
    model = net64()
    sw.apply(model, "checkpoint('layer1'), compile(backend='aot_eager')")
    model(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    sw.revert(model)
    assert model._compiled_call_impl is None and "_compiled_call_impl" not in model.__dict__
    assert not isinstance(model.layer1, sw._wrapper.TransparentWrapper) and sw.records(model) == []
    counters.clear()
    model(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert not counters["stats"]  # eager again: dynamo saw nothing


def test_a_model_compiled_by_hand_is_refused():
    model = _mlp()
    model.compile(backend=EAGER)
    with pytest.raises(ValueError, match=r"already compiled in place \(nn.Module.compile\)"):
        sw.apply(model, [sw.compile(backend=EAGER)])
    assert sw.records(model) == []
    wrapped = torch.compile(_mlp(), backend=EAGER)  # torch.compile's wrapper, as the model or in place of a child
    with pytest.raises(ValueError, match=r"already compiled by torch.compile \(an OptimizedModule wrapper\)"):
        sw.apply(wrapped, [sw.compile(backend=EAGER)])
    parent = nn.Sequential(torch.compile(_mlp(), backend=EAGER))
    with pytest.raises(ValueError, match=r"0 is already compiled by torch.compile .* would replace that"):
        sw.apply(parent, [sw.compile(backend=EAGER, pattern="0")])


def _copies(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return copy.deepcopy(model), torch.load(buf, weights_only=False)


def test_copies_of_a_compiled_model_are_compiled_too():
    model = _mlp()
    sw.apply(model, [sw.compile(backend=EAGER)])
    x = torch.randn(4, 64)
    ref = model(x)
    for other in _copies(model):  # PyTorch drops the compiled call when it copies a module
        assert other._compiled_call_impl is not None and other._compiled_call_impl is not model._compiled_call_impl
        assert [r.step for r in sw.records(other)] == [sw.compile(backend=EAGER)]
        assert list(other.state_dict()) == list(model.state_dict())
        torch.testing.assert_close(other(x), ref, rtol=0, atol=0)
        sw.revert(other)
        assert other._compiled_call_impl is None
    assert model._compiled_call_impl is not None  # reverting a copy leaves the original compiled


def test_memory_budget_applies_to_its_model_only():
    global_budget = torch._functorch.config.activation_memory_budget
    default = _mlp()
    sw.apply(default, [sw.compile(backend=MINCUT)])
    full = _saved(default)  # compiled first: dynamo would share this code with the models below
    budgeted = _mlp()
    sw.apply(budgeted, [sw.compile(memory_budget=0.05, backend=MINCUT)])
    assert _saved(budgeted) < 0.75 * full  # the budget changed what is saved for backward
    assert torch._functorch.config.activation_memory_budget == global_budget  # nothing left behind
    after = _mlp(OtherMLP)
    after.compile(backend=MINCUT)  # compiled by hand, anew, after the budgeted one: by default
    assert _saved(after) == full
    one = _mlp()
    sw.apply(one, [sw.compile(memory_budget=1.0, backend=MINCUT)])
    assert _saved(one) == full  # 1.0 is the default strategy


@pytest.mark.parametrize("before", ["", "checkpoint('layer1'), bn_act()"])
def test_a_pattern_compiles_the_selected_modules_only_and_trains_as_eager(before):
    text = f"{before}, compile(backend='aot_eager', pattern=r'layer[12]')".lstrip(", ")
    model = net64()
    keys = list(model.state_dict())
    sw.apply(model, text)
    assert _compiled_names(model) == ["layer1", "layer2"]  # layer3, the head and the root stay eager
    assert sw.records(model)[-1].matched == ("layer1", "layer2") and list(model.state_dict()) == keys
    counters.clear()
    compiled = _train(text)
    assert counters["aot_autograd"]["ok"] >= 1
    eager = _train(before)
    for a, b in zip(eager, compiled):
        for t, u in zip(a, b):
            torch.testing.assert_close(u, t, rtol=0, atol=1e-12)
    sw.revert(model)
    assert _compiled_names(model) == [] and type(model.layer1).__name__ == "Block"


def test_a_pattern_over_nested_modules_compiles_the_outermost_and_copies_keep_it():
    model = net64()
    sw.apply(model, r"compile(backend='aot_eager', pattern=r'layer1|layer1\..*|head')")
    assert _compiled_names(model) == ["layer1", "head"]
    model.eval()  # no dropout: the copies' outputs compare exactly
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref = model(x)
    for other in _copies(model):
        assert _compiled_names(other) == ["layer1", "head"]
        torch.testing.assert_close(other(x), ref, rtol=0, atol=0)
        sw.revert(other)
        assert _compiled_names(other) == []
    assert _compiled_names(model) == ["layer1", "head"]


def test_a_pattern_that_selects_nothing_or_a_module_compiled_by_hand_is_refused():
    model = net64()
    with pytest.raises(sw.SelectionError, match="layer9"):
        sw.apply(model, "compile(pattern='layer9')")
    model.layer2.compile(backend=EAGER)
    with pytest.raises(ValueError, match=r"layer2 is already compiled in place .* would replace that"):
        sw.apply(model, r"compile(pattern=r'layer\d')")
    assert sw.records(model) == [] and _compiled_names(model) == ["layer2"]
    root = net64()
    root.compile(backend=EAGER)  # by hand, above the region: the region would be a graph in a graph
    with pytest.raises(ValueError, match=r"Net is already compiled in place .* would compile layer1 \(Block\) inside it"):
        sw.apply(root, "compile(pattern='layer1')")
    assert sw.records(root) == [] and _compiled_names(root) == [""]


def test_a_pattern_over_a_container_or_a_chain_member_is_refused():
    container = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(sw.SelectionError, match=r"1 \(ModuleList\) has no forward of its own .* e\.g\. r'1\\\.\\d\+'"):
        sw.apply(container, "compile(pattern='1')")
    model = resnet64()
    sw.apply(model, "checkpoint('conv1|bn1|relu|maxpool', chain=True)")
    with pytest.raises(ValueError, match=r"conv1 \(CheckpointChain\[Conv2d\]\) is a member of a region over several sibling modules"):
        sw.apply(model, "compile(backend='aot_eager', pattern='conv1|bn1')")
    assert _compiled_names(model) == []
    sw.apply(model, r"compile(backend='aot_eager', pattern=r'layer\d')")  # beside the chain: fine
    assert _compiled_names(model) == ["layer1", "layer2"]


def test_revert_names_a_region_compiled_again_by_hand():
    model = net64()
    sw.apply(model, "compile(backend='aot_eager', pattern='layer1|layer2')")
    model.layer2.compile(backend=EAGER)  # replaces the step's compiled call: no longer ours
    with pytest.warns(UserWarning, match=r"layer2\._compiled_call_impl"):
        sw.revert(model)
    assert _compiled_names(model) == ["layer2"]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"memory_budget": 0}, ValueError, r"memory_budget= a float in \(0, 1\] or None; got 0"),
    ({"memory_budget": 1.5}, ValueError, "got 1.5"),
    ({"memory_budget": "0.5"}, TypeError, "got str '0.5'"),
    ({"memory_budget": True}, TypeError, "got bool True"),
    ({"memory_budget": 0.5, "backend": "aot_eager"}, ValueError, "would do nothing"),
    ({"mode": 3}, TypeError, "mode= a str or None; got int 3"),
    ({"fullgraph": None}, TypeError, "fullgraph= True or False; got None"),
    ({"backend": len}, TypeError, "backend= a str; got the function len"),
    ({"mode": "layer1"}, ValueError, r"mode='layer1', which is no mode of inductor's .* compile\(pattern='layer1'\)"),
])
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        sw.compile(**kwargs)


def test_not_lossy_goes_last_and_offers_autoplan_nothing():
    assert not sw.compile.lossy and sw.compile.last
    assert sw.registered()[-1] is sw.compile
    assert sw.compile.candidates(_mlp(), sw.step.Context()) == []


@pytest.mark.cuda
def test_memory_budget_with_inductor_on_cuda():
    def saved(model):
        torch.manual_seed(1)
        x = torch.randn(512, 64, device="cuda")
        return sw.saved_tensor_bytes(lambda: model(x).sum())

    full, budgeted = _mlp().cuda(), _mlp().cuda()
    sw.apply(full, [sw.compile()])
    sw.apply(budgeted, [sw.compile(memory_budget=0.05)])
    assert saved(budgeted) < 0.75 * saved(full)
