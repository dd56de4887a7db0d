"""The compile(...) plan step on regions: torch.compile in place, each region compiled, training as eager, side
effects, untraceable code and inputs."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import shrinkwrap as sw

from compile_step_helpers import Block, EAGER, _compiled_names, _mlp, _steps, _train


def test_compiles_in_place_keeping_the_object_and_its_names():
    model = _mlp()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    x = torch.randn(4, 64)
    ref = model(x)
    torch._dynamo.reset()  # a model of the same code compiled by an earlier test would be a cache hit
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
