"""The compile(...) plan step: torch.compile in place, last in a plan, memory budget per model."""

import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import shrinkwrap as sw
from shrinkwrap.plan import PlanError

from toymodels import net64, resnet64

EAGER = "aot_eager"  # no C++ compiler needed; the same ops as eager
MINCUT = "aot_eager_decomp_partition"  # min-cut partitioner, which honours the memory budget


class MLP(nn.Module):
    """Elementwise ops between the linears: what the min-cut partitioner may recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = self.a(x)
        h = torch.sin(h) * torch.cos(h) + torch.tanh(h)
        h = self.b(h)
        h = torch.sigmoid(h) * h + torch.exp(-h * h)
        return self.c(h)


class OtherMLP(MLP):
    """The same graph, another class: dynamo compiles it anew instead of reusing MLP's code."""


def _mlp(cls=MLP):
    torch.manual_seed(0)
    return cls()


def _saved(model):
    torch.manual_seed(1)
    return sw.saved_tensor_bytes(lambda: model(torch.randn(32, 64)).sum())


def test_compiles_in_place_keeping_the_object_and_its_names():
    model = _mlp()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    x = torch.randn(4, 64)
    ref = model(x)
    counters.clear()
    assert sw.apply(model, [sw.compile(backend=EAGER)]) is model
    assert model._compiled_call_impl is not None
    assert torch.equal(model(x), ref)
    assert counters["stats"]["unique_graphs"] >= 1  # the call went through dynamo
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    model.load_state_dict(_mlp().state_dict())  # no _orig_mod. prefix either way
    assert sw.records(model)[0].matched == ("",) and sw.records(model)[0].step == sw.compile(backend=EAGER)


@pytest.mark.parametrize("pattern", [None, "1"])
def test_a_sequential_root_or_region_is_compiled_and_trains_as_eager(pattern):
    # nn.Module.compile on an nn.Sequential traces nothing (dynamo runs torch's own forward
    # eagerly): the step compiles it all the same, to eager's numbers in float64.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)).double()

    x = torch.randn(4, 8, dtype=torch.float64)
    ref, compiled = model(), model()
    sw.apply(compiled, [sw.compile(backend="aot_eager", pattern=pattern)])
    counters.clear()
    out, expected = compiled(x), ref(x)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert counters["aot_autograd"]["ok"] >= 1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for p, q in zip(compiled.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    sw.revert(compiled)
    assert all("_compiled_call_impl" not in m.__dict__ for m in compiled.modules())


def test_twelve_sequential_regions_of_different_contents_are_each_compiled():
    # Dynamo's limit of recompiles is per code object: one shared by every Sequential would leave
    # all but eight eager.
    model = nn.Sequential(*[nn.Sequential(*[nn.Linear(4, 4) for _ in range(i + 1)]) for i in range(12)])
    sw.apply(model, [sw.compile(backend="aot_eager", pattern=r"\d+")])
    counters.clear()
    model(torch.randn(2, 4)).sum().backward()
    assert counters["aot_autograd"]["ok"] == 12 and not counters["stats"].get("unique_graphs", 0) < 12


class Block(nn.Module):
    """A block of a class of its own: its call is nn.Module._call_impl, as every module's is."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, width), nn.Linear(width, 4)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_twelve_blocks_of_one_class_and_different_shapes_are_each_compiled():
    # Through the one code object of their class's call (nn.Module._call_impl), dynamo compiles
    # eight and runs the rest eagerly, with a warning in torch's log only.
    model = nn.Sequential(*[Block(4 + i) for i in range(12)])
    sw.apply(model, [sw.compile(backend="aot_eager", pattern=r"\d+")])
    counters.clear()
    model(torch.randn(2, 4)).sum().backward()
    assert counters["aot_autograd"]["ok"] == 12 and not counters["stats"].get("unique_graphs", 0) < 12
    assert not counters["unimplemented"]  # no recompile limit met, no graph break


def test_a_hook_on_one_of_alike_regions_runs():
    # Dynamo does not guard the hooks of a module it inlines: one frame shared by alike blocks
    # would run the third with the code compiled for the second, without its hook.
    torch.manual_seed(0)
    model = nn.Sequential(Block(4), Block(4), Block(4))  # the second and third see one input
    model[2].register_forward_hook(lambda module, args, out: out * 5)
    x = torch.randn(3, 4)
    expected = model(x)
    sw.apply(model, [sw.compile(backend="aot_eager", pattern=r"\d+")])
    torch.testing.assert_close(model(x), expected)


def test_a_second_model_of_one_plan_runs_the_code_compiled_for_the_first():
    # autoplan builds a plan's model afresh for each row and timing: compiling each again would
    # be a compilation a build.
    counters.clear()
    graphs = []
    for _ in range(2):
        model = sw.apply(Block(4), [sw.checkpoint("up"), sw.compile(backend="aot_eager")])
        model(torch.randn(2, 4)).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0]


def _steps(model, run, x, loss_fn, steps=2):
    """``steps`` SGD steps of ``run`` (``model``, or a compiled form of it) on ``x``: the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(run(x))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _train(plan):
    model = net64()  # float64, BatchNorm, dropout, in-place ReLU, kwargs
    if plan:
        sw.apply(model, plan)
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    losses = _steps(model, model, x, lambda out: F.cross_entropy(out, y))
    return losses, [p.grad for p in model.parameters()], [b for b in model.buffers()]


@pytest.mark.parametrize("before", ["", "checkpoint('layer[12]'), bn_act()"])
def test_trains_to_the_same_losses_gradients_and_statistics_as_eager(before):
    counters.clear()
    compiled = _train(f"{before}, compile(backend='aot_eager')".lstrip(", "))
    assert counters["aot_autograd"]["ok"] >= 1  # it did compile: the comparison is not eager with eager
    eager = _train(before)
    for a, b in zip(eager, compiled):
        for t, u in zip(a, b):
            torch.testing.assert_close(u, t, rtol=0, atol=1e-12)


class Shifting(nn.Module):
    """A forward with Python side effects: it changes a list its module holds and sets an
    attribute; with BatchNorm inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.shift = nn.Linear(8, 8), nn.BatchNorm1d(8), [3, 2]

    def forward(self, x):
        self.shift[0] = 0
        self.seen = x.shape[0]
        return torch.relu(self.bn(self.lin(x))) * self.shift[1] + self.shift[0]


class Breaking(nn.Module):
    """A region dynamo cannot trace (a graph break inside it), with BatchNorm; ``counted``: a
    buffer its forward changes and reads as well."""

    def __init__(self, counted: bool = False) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        if counted:
            self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        h = self.bn(self.lin(x))
        torch._dynamo.graph_break()
        if hasattr(self, "seen"):
            self.seen += 1
            h = h * self.seen
        return torch.relu(h)


def _headed(block):
    return lambda: nn.Sequential(block(), nn.Linear(8, 1))


def _trained(make, compile=False, plan=""):
    torch.manual_seed(0)
    model = make().double()
    if plan:
        sw.apply(model, plan)
    run = torch.compile(model, backend=EAGER) if compile else model
    torch.manual_seed(1)
    losses = _steps(model, run, torch.randn(16, 8, dtype=torch.float64), lambda out: out.square().mean())
    return model, [losses, *model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]


def test_a_region_with_python_side_effects_compiles_as_one_graph_and_trains_as_the_model():
    # Without the step's dynamo setting the checkpoint region breaks the graph, torch's checkpoint
    # runs it eagerly, and its recompute counts BatchNorm a second time.
    eager, expected = _trained(_headed(Shifting))
    counters.clear()
    model, got = _trained(_headed(Shifting), plan="checkpoint('0'), compile(backend='aot_eager')")
    assert counters["aot_autograd"]["ok"] >= 1 and not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    for t, u in zip(expected, got):
        torch.testing.assert_close(u, t, rtol=0, atol=1e-12)
    assert (model[0].shift, model[0].seen) == (eager[0].shift, eager[0].seen) == ([0, 2], 16)
    assert model[0].bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("save", ["", ", save=('matmul',)"])
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("how", ["step", "by hand"])
def test_a_region_the_compiler_cannot_trace_trains_as_the_model(how, counted, save):
    # torch's checkpoint runs such a region eagerly; without the eager safeguards its recompute
    # would count BatchNorm twice and start from the count the forward left (with save=, the
    # safeguards' copies run outside the selective mode, which would look for them among the
    # forward's kept outputs).
    block = _headed(lambda: Breaking(counted))
    _, expected = _trained(block)
    torch._dynamo.reset()  # so that the graph break is counted again
    counters.clear()
    plan = f"checkpoint('0'{save}), compile(backend='aot_eager')" if how == "step" else f"checkpoint('0'{save})"
    model, got = _trained(block, compile=how == "by hand", plan=plan)
    assert counters["graph_break"]  # dynamo ran, and broke the graph in the region
    for t, u in zip(expected, got):
        torch.testing.assert_close(u, t, rtol=0, atol=1e-12)
    assert model[0].bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("how", ["eager", "compiled, not traced"])
def test_a_region_keeps_no_reference_to_its_input_to_the_backward(how):
    # Saved-tensor hooks may move what a region saves (offload does); a reference held beside
    # them would keep the tensor where it was.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Breaking(), nn.Linear(8, 1)).double()
    sw.apply(model, "checkpoint('1')" + (", compile(backend='aot_eager')" if how != "eager" else ""))
    torch._dynamo.reset()
    inputs = []
    model[0].register_forward_hook(lambda m, args, out: inputs.append(weakref.ref(out)))
    with torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
        loss = model(torch.randn(16, 8, dtype=torch.float64)).sum()
    gc.collect()
    assert inputs and inputs[0]() is None
    loss.backward()


class Scaling(nn.Linear):
    """Reads a scale from the dict it is given, then writes one there: a Python side effect that
    dynamo cannot trace inside a checkpoint region under torch.compile by hand."""

    def forward(self, x, state):
        h = super().forward(x) * state.get("scale", 1.0)
        state["scale"] = 3.0
        return torch.tanh(h)


class Writing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.out = Scaling(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.block(x, {}))


@pytest.mark.parametrize("how", ["step", "by hand"])
def test_a_region_writing_into_its_input_dict_recomputes_from_what_it_was_given(how):
    _, expected = _trained(Writing)
    torch._dynamo.reset()
    plan = "checkpoint('block'), compile(backend='aot_eager')" if how == "step" else "checkpoint('block')"
    _, got = _trained(Writing, compile=how == "by hand", plan=plan)
    for t, u in zip(expected, got):
        torch.testing.assert_close(u, t, rtol=0, atol=1e-12)


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


def _compiled_names(model):
    return [n for n, m in model.named_modules() if m.__dict__.get("_compiled_call_impl") is not None]


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


@pytest.mark.cuda
def test_measure_counts_the_memory_cuda_graphs_keep():
    """A replayed CUDA graph writes into its private pool without the allocator's counters seeing
    it: with mode='reduce-overhead' they read almost nothing (45 MiB of resnet18's 1283 MiB on
    an H100). Measured fresh, the graphed model is read at the iteration that recorded its
    graphs: at least what the same program keeps without graphs (on an H100 this MLP read 117.2
    MiB against 80.7: a recording allocates some 30-36 MiB more, in every model tried), and no
    more than the pool counted whole (130.2). Recorded before (the second measure), the pool is
    counted whole, and so is a model run once before the measure, which records in the measure's
    first iteration (that one also makes the optimizer's state: not the steady step's). With
    warmup=1 the steady step is the recording, read as it is; with measure's default warmup=2 the
    steady step follows the recording and reads what warmup=3 reads. A plain compiled model
    measured beside them is not counted as graphed."""
    x = torch.randn(16384, 64)
    plain = sw.apply(_mlp(), [sw.compile()])
    graphed = sw.apply(_mlp(OtherMLP), [sw.compile(mode="reduce-overhead")])
    g1, p, g2 = (sw.measure(m, x, device="cuda", warmup=3) for m in (graphed, plain, graphed))
    once = sw.apply(_mlp(type("ThirdMLP", (MLP,), {})).cuda(), [sw.compile(mode="reduce-overhead")])
    once(x.cuda()).sum().backward()
    fresh = sw.apply(_mlp(type("FourthMLP", (MLP,), {})), [sw.compile(mode="reduce-overhead")])
    default = sw.apply(_mlp(type("FifthMLP", (MLP,), {})), [sw.compile(mode="reduce-overhead")])
    g3, g4 = sw.measure(once, x, device="cuda", warmup=3), sw.measure(fresh, x, device="cuda", warmup=1)
    g5 = sw.measure(default, x, device="cuda")  # warmup=2: the recording's gradients are counted, then replaced unseen
    assert g3.cuda_graphs and not g3.graph_recorded and g3.peak - g3.static >= p.peak - p.static
    for g in (g4, g5):
        assert g.cuda_graphs and g.graph_recorded
        assert p.peak - p.static <= g.peak - g.static <= g2.peak - g2.static, [(m.peak - m.static) / 2**20 for m in (g, p, g2)]
    assert abs((g5.peak - g5.static) - (g1.peak - g1.static)) <= 0.05 * (g1.peak - g1.static)  # the same program
    act = [(m.peak - m.static) / 2**20 for m in (g1, p, g2)]
    assert not p.cuda_graphs and p.graph_pool is None and not p.graph_recorded
    assert g1.graph_recorded and not g2.graph_recorded, act
    for g in (g1, g2):
        assert g.cuda_graphs and g.graph_pool > 0
        assert g.peak - g.static >= 0.9 * (p.peak - p.static), act
    assert g1.peak - g1.static <= g2.peak - g2.static, act
    assert "recorded them" in str(g1) and "upper bound" in str(g2)


def test_graph_trees_counts_every_node_of_the_cuda_graph_trees(monkeypatch):
    from types import SimpleNamespace

    from torch._inductor import cudagraph_trees

    from shrinkwrap.measuring.graphs import _graph_trees

    def node(*children):
        return SimpleNamespace(children={"f": list(children)} if children else {})

    manager = SimpleNamespace(roots={"fwd": [node(node(), node(node()))], "other": [node()]})
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: manager)
    assert _graph_trees(torch.device("cuda", 0)) == 5
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: None)
    assert _graph_trees(torch.device("cuda", 0)) == 0  # nothing compiled with graphs yet
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: object())
    assert _graph_trees(torch.device("cuda", 0)) is None  # a torch whose trees say nothing: the upper bound


def test_an_iteration_is_read_as_a_recording_only_where_it_recorded_and_replayed_nothing():
    from shrinkwrap.measuring.graphs import _recorded_whole

    assert _recorded_whole(2, 4, [11, 12])  # forward and backward recorded (each replayed once as it is)
    assert not _recorded_whole(2, 3, [11, 12])  # the backward re-recorded, the forward replayed unseen
    assert not _recorded_whole(2, 4, [11, 11])  # one recorded and replayed as it was, then replayed again
    assert not _recorded_whole(4, 4, [11, 12])  # replayed only
    assert not _recorded_whole(4, 4, [])  # a warm-up, or no graphs at all
    assert not _recorded_whole(2, 4, [])  # recordings that never ran: a torch that works otherwise
    assert not _recorded_whole(None, 4, [11, 12]) and not _recorded_whole(2, None, [11, 12])


def test_the_steady_step_is_read_as_the_warm_up_that_recorded_every_graph_it_replays():
    from shrinkwrap.measuring.graphs import _as_recorded
    from shrinkwrap.measuring.profile import Phase

    mib = 2**20
    steady = [Phase("zero_grad", 10 * mib, 12 * mib), Phase("backward", 11 * mib, 11 * mib),  # replays: counters miss them
              Phase("step", 30 * mib, 50 * mib)]  # an optimizer step the recording's iteration skipped (a GradScaler's)
    recording = [Phase("zero_grad", 8 * mib, 9 * mib), Phase("backward", 9 * mib, 40 * mib), Phase("step", 9 * mib, 10 * mib)]
    partial = [Phase("zero_grad", 8 * mib, 9 * mib), Phase("backward", 9 * mib, 20 * mib), Phase("step", 9 * mib, 9 * mib)]
    read = _as_recorded(steady, [1, 2], [(partial, [1, 2, 3], False), (recording, [1, 2], True)], unseen_grads=3 * mib)
    # aligned at zero_grad (the steady step holds 2 MiB more there: its optimizer's state, say), and never below
    # the steady step's own counters with the gradients a replay wrote
    assert read == [Phase("zero_grad", 10 * mib, 12 * mib), Phase("backward", 14 * mib, 42 * mib),
                    Phase("step", 33 * mib, 53 * mib)]
    assert _as_recorded(steady, [1, 2, 4], [(recording, [1, 2], True)], 0) is None  # it replays a graph recorded elsewhere
    assert _as_recorded(steady, [1, 2], [(partial, [1, 2], False)], 0) is None  # no whole recording
    assert _as_recorded(steady, [1, 2], [], 0) is None  # warmup=1


def test_replays_lists_cuda_graph_replays_and_puts_replay_back(monkeypatch):
    from shrinkwrap.measuring.graphs import _replays

    class Base:
        def replay(self):
            self.replayed = True

    class Graph(Base):
        pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    with _replays() as replayed:
        g, h = Graph(), Graph()
        g.replay(), h.replay(), g.replay()
    assert replayed == [g, h, g] and g.replayed
    assert "replay" not in vars(Graph) and Graph.replay is Base.replay  # inherited again, as it was
    Graph.replay = own = lambda self: None
    with _replays() as replayed:
        g.replay()
    assert replayed == [g] and Graph.replay is own


def test_regional_compile_of_hugging_face_bert_trains_as_eager_in_float64():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=100)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    text = r"compile(backend='aot_eager', pattern=r'bert\.encoder\.layer\.\d+\.(?:attention\.output|intermediate|output)|cls')"

    def train(plan):
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(config).double().train()
        if plan:
            sw.apply(model, plan)
        torch.manual_seed(1)  # the same dropout masks in both runs
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return model, [loss.detach(), *(p.grad for p in model.parameters())]

    counters.clear()
    compiled_model, compiled = train(text)
    assert counters["aot_autograd"]["ok"] >= 1  # it did compile: the comparison is not eager with eager
    assert len(_compiled_names(compiled_model)) == 7  # three parts of each layer, and the head
    assert "bert.encoder.layer.0.attention.self" not in _compiled_names(compiled_model)
    _, eager = train(None)
    for t, u in zip(eager, compiled):
        torch.testing.assert_close(u, t, rtol=0, atol=1e-12)


def test_a_model_compiled_past_dynamos_limit_of_recompiles_is_not_measured_as_compiled():
    # Every model compiled whole shares nn.Module._call_impl's limit: the ninth of another shape
    # runs eagerly, which dynamo says in its log only; measure says it instead of reading it.
    torch._dynamo.reset()
    for width in range(4, 12):
        model = sw.apply(Block(width), [sw.compile(backend="aot_eager")])
        assert sw.measure(model, torch.randn(2, 4), device="cpu", iterations=1, warmup=1).compiled
    ninth = sw.apply(Block(12), [sw.compile(backend="aot_eager")])
    with pytest.raises(RuntimeError, match=r"shrinkwrap: dynamo met its limit of recompiles .*recompile_limit"):
        sw.measure(ninth, torch.randn(2, 4), device="cpu", iterations=1, warmup=1)
    torch._dynamo.reset()
    assert sw.measure(ninth, torch.randn(2, 4), device="cpu", iterations=1, warmup=1).compiled
