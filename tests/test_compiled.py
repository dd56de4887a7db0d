"""Every step traces under torch.compile with no graph break, and compiled training equals eager.

The backend is aot_eager: AOTAutograd's functional graphs and partitioner, as inductor uses them,
without inductor's code generation (slow on a CPU, and not what is under test).
"""

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.models import tiny_efficientnet

from toymodels import net64, resnet64

BF16 = torch.bfloat16
STEM = sw.checkpoint(r"conv1|bn1|relu|drop|maxpool", chain=True)

# (model factory, input factory, plans): each plan alone, and the steps together.
CASES = {
    "residual": (net64, lambda: torch.randn(4, 3, 8, 8, dtype=torch.float64), {
        "checkpoint": [sw.checkpoint(r"layer[12]")],
        "checkpoint_save": [sw.checkpoint(r"layer[12]", save=("conv", "matmul"))],
        "bn_act": [sw.bn_act()],
        "autocast": [sw.autocast(BF16)],
        "autocast_region": [sw.autocast(BF16, r"layer2")],
        "half": [sw.half(BF16)],
        "together": [sw.checkpoint(r"layer[12]"), sw.bn_act(), sw.autocast(BF16)],
    }),
    "efficientnet": (lambda: tiny_efficientnet().double(), lambda: torch.randn(4, 3, 32, 32, dtype=torch.float64), {
        "swish": [sw.swish()],
        "bn_act": [sw.bn_act()],
        "checkpoint": [sw.checkpoint(r"blocks\.\d+")],
        "together": [sw.swish(), sw.bn_act(), sw.checkpoint(r"blocks\.\d+"), sw.autocast(BF16)],
    }),
    # The stem as one checkpoint chain; dropout and an in-place ReLU inside it.
    "resnet": (lambda: resnet64(stem_dropout=0.25), lambda: torch.randn(4, 3, 32, 32, dtype=torch.float64), {
        "chain": [STEM],
        "chain_and_stages": [STEM, sw.checkpoint(r"layer[12]")],
        "chain_save": [sw.checkpoint(r"conv1|bn1|relu|drop|maxpool", chain=True, save=("conv",))],
    }),
}
PARAMS = [(model, plan) for model, (_, _, plans) in CASES.items() for plan in plans]


def build(model_name, plan_name):
    make, inputs, plans = CASES[model_name]
    torch.manual_seed(0)
    model = sw.apply(make(), plans[plan_name])
    torch.manual_seed(1)
    return model, inputs()


def train(model, x, steps=2):
    """Two SGD steps with fixed dropout seeds; the outputs, gradients and buffers they leave."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + i)
        out = model(x)
        out.float().square().mean().backward()
        opt.step()
        outs.append(out.detach())
    plain = getattr(model, "_orig_mod", model)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    return outs, grads, {n: b.clone() for n, b in plain.named_buffers()}


@pytest.mark.parametrize("model_name, plan_name", PARAMS)
def test_no_graph_break(model_name, plan_name):
    model, x = build(model_name, plan_name)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("model_name, plan_name", PARAMS)
def test_compiled_fullgraph_training_equals_eager(model_name, plan_name):
    model, x = build(model_name, plan_name)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, want = train(compiled, x), train(eager, x)
    lossy = any(s.lossy for s in CASES[model_name][2][plan_name])
    # Exact steps: float64 rounding (the compiler may reorder a reduction). Lossy ones: the same
    # half-precision ops eager ran, so rounding of bfloat16 at most.
    tol = dict(rtol=2e-2, atol=2e-2) if lossy else dict(rtol=1e-10, atol=1e-12)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, **tol)
    for part in (1, 2):
        assert got[part].keys() == want[part].keys()
        for k in want[part]:
            torch.testing.assert_close(got[part][k], want[part][k], **tol, msg=k)
    counts = [b for n, b in got[2].items() if n.endswith("num_batches_tracked")]
    assert counts and all(int(c) == 2 for c in counts)  # BatchNorm counted once per step


def test_compiled_checkpoint_recomputes_inside_the_graph():
    """The compiled checkpointed model keeps less for backward than the compiled plain one."""
    def saved(plan):
        torch.manual_seed(0)
        model = sw.apply(nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
                                         for _ in range(4)]), plan)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        x = torch.randn(32, 64, requires_grad=True)
        compiled(x).sum().backward()  # compile once, outside the count
        return sw.saved_tensor_bytes(lambda: compiled(x))

    assert saved([sw.checkpoint(r"\d")]) < saved([])
    # Kept matrix products stay saved in the compiled graph: more than the plain regions keep.
    assert saved([sw.checkpoint(r"\d")]) < saved([sw.checkpoint(r"\d", save=("matmul",))]) <= saved([])


def test_a_compiled_chain_keeps_less_than_the_same_modules_one_by_one():
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)

    def saved(plan):
        torch._dynamo.reset()
        compiled = torch.compile(sw.apply(resnet64(), [*plan, sw.checkpoint(r"layer[12]")]), backend="aot_eager",
                                 fullgraph=True)
        compiled(x).sum().backward()  # compile once, outside the count
        return sw.saved_tensor_bytes(lambda: compiled(x))

    chained = saved([sw.checkpoint("conv1|bn1|relu|maxpool", chain=True)])
    one_by_one = saved([sw.checkpoint("conv1|bn1")])
    conv_out = relu_out = 8 * 8 * 32 * 32 * 8
    indices = 8 * 8 * 16 * 16 * 8  # maxpool's
    assert chained + conv_out + relu_out + indices <= one_by_one  # all recomputed inside the graph


def test_a_compiled_parent_that_does_not_chain_is_named():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.b(self.a(x) * 2)

    model = sw.apply(Pair(), [sw.checkpoint("a|b", chain=True)])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"chain 'a' -> 'b': 'b' was called with something other than the output"):
        compiled(torch.randn(8, 4))
    assert model.b.num_batches_tracked.item() == 0  # refused as it was traced, before anything ran


def test_a_region_taking_a_dict_positionally_compiles():
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, extra):
            return self.lin(x) * extra["scale"] + extra["shift"][0]

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = Mix()

        def forward(self, x):
            return self.mix(x, {"scale": x.sigmoid(), "shift": (x.cos(),)})

    torch.manual_seed(0)
    model = sw.apply(Outer().double(), [sw.checkpoint("mix")])
    x = torch.randn(4, 8, dtype=torch.float64)
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
    eager = copy.deepcopy(model)
    got, want = train(torch.compile(model, backend="aot_eager", fullgraph=True), x), train(eager, x)
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-10, atol=1e-12)


def test_the_harness_reports_a_compiled_model_honestly():
    torch.manual_seed(0)
    model = sw.apply(tiny_efficientnet(), [sw.checkpoint(r"blocks\.\d+")])
    model.compile(backend="aot_eager")
    prof = sw.measure(model, torch.randn(2, 3, 32, 32), iterations=2, warmup=2, device="cpu")
    assert prof.compiled and prof.graph_breaks == 0 and prof.recompiles == 0
    assert prof.first_ms > max(prof.step_times_ms)  # compilation is in the first iteration, not the timed ones
    assert "compiled" in str(prof)
    plain = sw.measure(tiny_efficientnet(), torch.randn(2, 3, 32, 32), iterations=1, warmup=1, device="cpu")
    assert not plain.compiled and plain.graph_breaks is None
    # A child swapped for torch.compile's wrapper by hand: compiled too, its recompiles counted.
    part = tiny_efficientnet()
    part.blocks = torch.compile(part.blocks, backend="aot_eager")
    prof = sw.measure(part, torch.randn(2, 3, 32, 32), iterations=1, warmup=2, device="cpu")
    assert prof.compiled and prof.recompiles == 0 and prof.graph_breaks is not None


def test_a_graph_break_is_counted():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            torch._dynamo.graph_break()
            return y.tanh()

    model = Breaks()
    model.compile(backend="aot_eager")
    prof = sw.measure(model, torch.randn(2, 4), iterations=1, warmup=2, device="cpu")
    assert prof.graph_breaks >= 1 and prof.recompiles == 0
