"""checkpoint(pattern, chain=True): one region over sibling modules that their parent calls one after
another (a ResNet's stem), exact as a plain checkpoint region, and loud where the parent does not chain."""

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan.choose import _plan
from shrinkwrap.autoplan import candidates
from shrinkwrap.select import SelectionError
from shrinkwrap.transforms import checkpoint as ckpt_mod

from toymodels import ResNet, resnet64

STEM = "conv1|bn1|relu|maxpool"
CHAIN = sw.checkpoint(STEM, chain=True)
STEM_CANDIDATE = sw.checkpoint("conv1|bn1|relu|maxpool", chain=True)  # as pattern_for writes it


def x64(n=4, size=32):
    torch.manual_seed(123)
    return torch.randn(n, 3, size, size, dtype=torch.float64)


def train(model, x, steps=3):
    """SGD steps with a fixed dropout seed before each: the outputs and gradients of every step,
    and the parameters and buffers at the end. The first step of a chain checks the parent (the
    members run plainly); the later ones run the chain under checkpoint."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step)
        out = model(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return outs, grads, {n: t.detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())}


def assert_trains_the_same(ref, model, x, steps=3):
    (out_r, g_r, s_r), (out_m, g_m, s_m) = train(ref, x, steps), train(model, x, steps)
    for a, b in zip(out_r, out_m):
        assert torch.equal(a, b)
    for step, (a, b) in enumerate(zip(g_r, g_m)):
        assert list(a) == list(b) and len(a) == len(list(ref.parameters()))
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step} gradient {n}"
    assert list(s_r) == list(s_m)
    for n in s_r:
        assert torch.equal(s_r[n], s_m[n]), n


def spy_checkpoint(monkeypatch):
    calls = []
    real = ckpt_mod.region._torch_checkpoint
    monkeypatch.setattr(ckpt_mod.region, "_torch_checkpoint", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_a_chain_with_dropout_trains_bit_equal_in_float64(monkeypatch):
    ref = resnet64(stem_dropout=0.25)
    model = sw.apply(copy.deepcopy(ref), [sw.checkpoint(r"conv1|bn1|relu|drop|maxpool", chain=True)])
    assert all(isinstance(m, sw.ChainMember) for m in list(model.children())[:5])
    x = x64()
    torch.manual_seed(0)
    assert not torch.equal(ref(x), ref(x))  # dropout draws: equal outputs below mean equal masks
    ref.load_state_dict(model.state_dict())  # undo the BatchNorm statistics those two calls moved
    calls = spy_checkpoint(monkeypatch)
    assert_trains_the_same(ref, model, x)
    assert len(calls) == 2  # the first step checked the parent; the other two ran one checkpoint each
    assert model.bn1.num_batches_tracked.item() == 3  # once per step, not again in the recompute


def test_a_chain_in_a_sequential_with_stages_checkpointed_too_is_exact():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())  # noqa: E731
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Dropout(0.2),
                        nn.Sequential(block(), block()), nn.Flatten(), nn.LazyLinear(2)).double()
    ref(x64(size=8))
    model = sw.apply(copy.deepcopy(ref), [sw.checkpoint("[0-3]", chain=True), sw.checkpoint("4")])
    assert_trains_the_same(ref, model, x64(size=8))


def test_the_chained_stem_keeps_only_its_input_for_backward():
    """Bytes autograd keeps for backward (CPU, float32, batch 8 at 64x64). Checkpointed one by one
    (relu, in place, cannot be) each stem module keeps its own input; as one chain only ``x`` is kept."""
    x = torch.randn(8, 3, 64, 64)

    def saved(plan):
        torch.manual_seed(0)
        model = sw.apply(ResNet(), [*plan, sw.checkpoint(r"layer\d")])
        model(x).sum().backward()  # the chain checks its parent in the first training step
        return model, sw.saved_tensor_bytes(model, x)

    _, plain = saved([])
    _, one_by_one = saved([sw.checkpoint("conv1|bn1|maxpool")])
    model, chained = saved([CHAIN])
    h = model.maxpool(model.relu(model.bn1(model.conv1(x)))).detach()  # plain: the chain is not started
    rest = sw.saved_tensor_bytes(lambda: model.fc(torch.flatten(model.avgpool(model.layer2(model.layer1(h))), 1)))
    assert chained == x.nbytes + rest  # of the stem, only x
    conv_out = relu_out = 8 * 8 * 32 * 32 * 4
    indices = 8 * 8 * 16 * 16 * 8  # maxpool's, int64
    assert one_by_one >= chained + conv_out + relu_out  # bn1 and maxpool keep their inputs
    assert plain >= chained + conv_out + relu_out + indices
    assert (plain, one_by_one, chained) == (1180288, 1049088, 524800)  # the figures, for the record


class Pair(nn.Module):
    """Two siblings, ``a`` then ``b``, that ``forward`` may fail to chain in one of the ways named."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.BatchNorm1d(4)

    def forward(self, x, how="chain"):
        if how == "scaled":
            return self.b(self.a(x) * 2)
        if how == "stop":
            return self.a(x)
        x = self.b(self.a(x))
        return self.b(x) if how == "twice" else x


@pytest.mark.parametrize("how, what", [
    ("scaled", r"'b' was called with something other than the output of 'a' alone"),
    ("twice", r"'b' was called without 'a' before it"),
])
def test_a_parent_that_does_not_chain_is_named_at_the_first_forward(how, what):
    model = sw.apply(Pair(), [sw.checkpoint("a|b", chain=True)])
    with pytest.raises(RuntimeError, match=rf"chain 'a' -> 'b': {what}\..*without chain=True"):
        model(torch.randn(8, 4), how)
    assert model.b.num_batches_tracked.item() == (1 if how == "twice" else 0)  # as called, not more


@pytest.mark.parametrize("how", ["scaled", "twice", "stop"])
def test_a_parent_that_stops_chaining_later_gets_an_error_not_a_wrong_answer(how):
    model = sw.apply(Pair(), [sw.checkpoint("a|b", chain=True)])
    x = torch.randn(8, 4)
    model(x).sum().backward()  # chained: checked
    model(x).sum().backward()  # under checkpoint
    with pytest.raises(RuntimeError, match="chain 'a' -> 'b'"):
        model(x, how)
        model(x)  # one that stopped inside the chain is named at the next forward
    assert model.b.num_batches_tracked.item() == 3  # the chain ran b once in the broken forward, not twice
    model(x).sum().backward()  # and it works again
    assert model.b.num_batches_tracked.item() == 4


class Skip(nn.Module):
    """A chain whose first output is used again after it, by a skip connection."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.BatchNorm1d(6)
        self.c = nn.Tanh()
        self.d = nn.Dropout(0.3)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h)
        y = self.c(y)
        return self.d(y) * h + h


def test_a_skip_connection_reusing_the_first_output_gets_its_gradient():
    torch.manual_seed(0)
    ref = Skip().double()
    model = sw.apply(copy.deepcopy(ref), [sw.checkpoint("a|b|c|d", chain=True)])
    torch.manual_seed(1)
    assert_trains_the_same(ref, model, torch.randn(16, 6, dtype=torch.float64))


def test_names_revert_copies_and_plan_text():
    ref = resnet64()
    model = copy.deepcopy(ref)
    originals = dict(model.named_modules())
    plan = sw.Plan([CHAIN])
    assert str(plan) == "checkpoint('conv1|bn1|relu|maxpool', chain=True)" and sw.Plan.parse(str(plan)) == plan
    sw.apply(model, plan)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert "(conv1): CheckpointChain[Conv2d](" in repr(model)
    sw.apply_checkpoint(model, STEM, chain=True)  # again: nothing more
    assert sw.records(model)[-1].skipped == tuple((n, "already checkpointed") for n in STEM.split("|"))
    x = x64()
    train(ref, x, 2), train(model, x, 2)
    chain = model.conv1._sw_chain
    assert chain.step == 0 and chain.outs is None and chain.last is None  # nothing held between forwards
    clone, pickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    for m in (clone, pickled):
        assert m.bn1._sw_chain is m.conv1._sw_chain is not chain and m.conv1._sw_chain.members[1] is m.bn1
    assert_trains_the_same(copy.deepcopy(ref), pickled, x, 2)
    assert_trains_the_same(ref, clone, x, 2)
    sw.revert(model)
    assert sw.records(model) == [] and all(originals[n] is m for n, m in model.named_modules())
    assert list(dict(model.named_modules())) == list(originals)


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_members_run_plainly_outside_training(mode, monkeypatch):
    ref = resnet64()
    model = sw.apply(copy.deepcopy(ref), [CHAIN])
    train(model, x64(), 1)
    ref.load_state_dict(model.state_dict())
    calls = spy_checkpoint(monkeypatch)
    if mode == "eval":
        ref.eval(), model.eval()
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        assert torch.equal(ref(x64()), model(x64()))
    assert calls == []


def test_selections_that_cannot_chain_are_refused_at_apply_time():
    model = resnet64()
    with pytest.raises(SelectionError, match=r"'maxpool' as a chain: no module next to it"):
        sw.apply(model, [sw.checkpoint("conv1|bn1|maxpool", chain=True)])
    with pytest.raises(SelectionError, match=r"the chain 'relu' -> 'maxpool': it starts with an in-place ReLU"):
        sw.apply(model, [sw.checkpoint("relu|maxpool", chain=True)])
    assert not any(isinstance(m, sw.CheckpointModule) for m in model.modules()) and sw.records(model) == []


def test_a_region_holding_a_chain_absorbs_it_and_reverts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()), nn.Linear(4, 1))
    inner = list(model[0])
    sw.apply(model, [sw.checkpoint(r"0\.[01]", chain=True), sw.checkpoint("0")])
    assert isinstance(model[0], sw.CheckpointModule) and not isinstance(model[0], sw.ChainMember)
    assert list(model[0]) == inner
    model(torch.randn(8, 4)).sum().backward()
    assert model[0][1].num_batches_tracked.item() == 1
    sw.revert(model)
    assert type(model[0]) is nn.Sequential and list(model[0]) == inner


def test_the_resnet_stem_is_a_chain_candidate():
    model = resnet64()
    found = {c.covers: c for c in candidates(model, device="cpu")}
    stem = found[("conv1", "bn1", "relu", "maxpool")]
    assert stem.steps == (STEM_CANDIDATE,)
    assert not stem.overlaps(found[("layer1",)]) and stem.overlaps(sw.step.Candidate((), ("",)))
    plan = _plan([stem, found[("layer1",)], found[("layer2",)]], model)
    assert str(plan) == "checkpoint('conv1|bn1|relu|maxpool', chain=True), checkpoint('layer1|layer2')"
    ref = copy.deepcopy(model)
    assert_trains_the_same(ref, sw.apply(model, plan), x64(), 2)


class Tower(nn.Module):
    """Modules before a ModuleList of layers, as a transformer's embeddings: not offered as a chain."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Linear(4, 8), nn.LayerNorm(8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        x = self.norm(self.embed(x))
        for layer in self.layers:
            x = layer(x)
        return x


def test_chain_candidates_only_before_a_sequential_stack():
    block = lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())  # noqa: E731
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Sequential(block(), block()))
    chains = [c.covers for c in candidates(model, device="cpu") if getattr(c.steps[0], "chain", False)]
    assert chains == [("0", "1", "2")]
    assert not [c for c in candidates(Tower(), device="cpu") if getattr(c.steps[0], "chain", False)]


def test_merge_keeps_chain_steps_apart():
    model = resnet64()
    steps = [sw.checkpoint(("conv1", "bn1"), chain=True), sw.checkpoint(("layer1",)), sw.checkpoint(("layer2",))]
    assert sw.checkpoint.merge(steps, model) == [steps[0], sw.checkpoint("layer1|layer2")]
