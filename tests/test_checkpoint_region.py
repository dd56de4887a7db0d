"""CheckpointModule / apply_checkpoint: one region, exact and transparent: names, state, dropout and BatchNorm,
in-place changes, training only, revert, copies, compile, containers and caches."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.select import SelectionError
from shrinkwrap.transforms import checkpoint as ckpt_mod

from toymodels import net64
from checkpoint_helpers import run


def pair(pattern=r"layer[12]", seed=0, **opts):
    ref = net64(seed)
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, pattern, **opts)
    return ref, model


def assert_same(ref, model, x, **kw):
    out_r, g_r = run(ref, x, **kw)
    out_m, g_m = run(model, x, **kw)
    assert torch.equal(out_r, out_m)
    assert g_r.keys() == g_m.keys() and len(g_r) == len(list(ref.parameters()))
    for n in g_r:
        assert torch.equal(g_r[n], g_m[n]), n


def x64(n=4):
    torch.manual_seed(123)
    return torch.randn(n, 3, 8, 8, dtype=torch.float64)


# 1. names
def test_names_and_state_dict_unchanged_and_load_both_ways():
    ref, model = pair()
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert isinstance(model.layer1, sw.CheckpointModule)

    other = net64(seed=7)
    model.load_state_dict(other.state_dict())           # saved before the transform, loaded after
    assert torch.equal(model.layer1.conv1.weight, other.layer1.conv1.weight)
    fresh = net64(seed=9)
    fresh.load_state_dict(model.state_dict())            # saved after, loaded into a plain model
    assert torch.equal(fresh.layer2.bn1.running_var, other.layer2.bn1.running_var)


def test_parameters_are_the_same_objects():
    ref = net64()
    before = list(ref.parameters())
    sw.apply_checkpoint(ref, "layer1")
    assert all(a is b for a, b in zip(before, ref.parameters()))


# 2 + 4. exact in float64, with BatchNorm, Dropout (same mask in recompute), in-place ReLU,
# residual add and kwargs (including a nested dict of tuples of tensors)
def test_outputs_and_gradients_bit_equal_in_float64():
    ref, model = pair(r"layer[123]")
    assert_same(ref, model, x64(), scale=0.5)


def test_dropout_mask_is_reused_in_recompute():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 16)), nn.Linear(16, 1)).double()
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, "1")
    x = torch.randn(8, 16, dtype=torch.float64)
    for m in (ref, model):
        torch.manual_seed(5)
        m(x).sum().backward()
    assert torch.equal(ref[1][1].weight.grad, model[1][1].weight.grad)


# 3. BatchNorm statistics are updated once per step, as without the checkpoint
def test_batchnorm_statistics_match_after_training_steps():
    ref, model = pair(r"layer[123]")
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = x64() + step
        for m, opt in ((ref, opt_r), (model, opt_m)):
            opt.zero_grad()
            run(m, x, seed=step)
            opt.step()
    for (n, b_r), (_, b_m) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(b_r, b_m), n
    assert model.layer1.bn1.num_batches_tracked.item() == 3


def test_batchnorm_inside_other_wrappers_is_counted_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU()), nn.Conv2d(4, 2, 1))
    sw.apply(model, [sw.bn_act(), sw.checkpoint("0")])
    assert isinstance(model[0][1], sw.FusedBatchNormAct)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model[0][1].num_batches_tracked.item() == 1


def test_plain_torch_checkpoint_double_counts_batchnorm():
    # The defect this package fixes; if torch ever fixes it, this test tells us.
    bn = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert bn[1].num_batches_tracked.item() == 2


# 5. inputs that do not require grad; kwargs and nested containers pass through
def test_frozen_input_still_gives_parameter_gradients():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 16).double().requires_grad_(False)
    ref = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 1)).double()
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, "0")
    tokens = torch.randint(0, 10, (4, 5))
    for m in (ref, model):
        m(emb(tokens)).sum().backward()
    assert model[0][0].weight.grad is not None
    assert torch.equal(ref[0][0].weight.grad, model[0][0].weight.grad)


def test_kwargs_with_option_names_of_torch_checkpoint_pass_through():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, debug=None, preserve_rng_state=None):
            return self.lin(x) * debug["w"] + preserve_rng_state

    outer = nn.Sequential()
    outer.add_module("m", M())
    sw.apply_checkpoint(outer, "m")
    x = torch.randn(2, 4)
    out = outer.m(x, debug={"w": torch.tensor(2.0)}, preserve_rng_state=torch.ones(4))
    out.sum().backward()
    assert outer.m.lin.weight.grad is not None


# 6. in-place operations at the region's boundary
def test_inplace_after_the_region_works():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3)).double()
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, "[01]")       # the in-place ReLU right after modifies the region's output
    x = x64()
    outs = []
    for m in (ref, model):
        outs.append(m(x))
        outs[-1].sum().backward()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(ref[0].weight.grad, model[0].weight.grad)


def test_region_starting_in_place_is_refused_at_apply_time():
    # torch's checkpoint_sequential over torchvision resnet18 fails at this boundary.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3)))
    with pytest.raises(SelectionError, match=r"'2'.*in-place ReLU.*clone_inputs=True"):
        sw.apply_checkpoint(model, "2")
    assert not isinstance(model[2], sw.CheckpointModule)


def test_clone_inputs_makes_an_in_place_region_work():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3))).double()
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, "2", clone_inputs=True)
    assert_grads = []
    for m in (ref, model):
        out = m(x64())
        out.sum().backward()
        assert_grads.append((out, m[0].weight.grad))
    assert torch.equal(assert_grads[0][0], assert_grads[1][0])
    assert torch.equal(assert_grads[0][1], assert_grads[1][1])


def test_hidden_in_place_input_change_is_named_at_the_first_forward():
    class AddsInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    model = nn.Sequential(nn.Linear(4, 4), AddsInPlace())
    sw.apply_checkpoint(model, "1")
    with pytest.raises(RuntimeError, match=r"'1' modified its input in place"):
        model(torch.randn(2, 4))


# 7. eval, no_grad, inference_mode: no checkpoint, no overhead
@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_no_checkpoint_outside_training(mode, monkeypatch):
    calls = []
    real = ckpt_mod.region._torch_checkpoint
    monkeypatch.setattr(ckpt_mod.region, "_torch_checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, model = pair()
    x = x64()
    ctx = {"eval": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    if mode == "eval":
        ref.eval(), model.eval()
        assert not model.layer1.wrapped.training and not model.layer1.bn1.training
    with ctx():
        saved_ref = sw.saved_tensor_bytes(ref, x)
        saved = sw.saved_tensor_bytes(model, x)
        outs = [torch.manual_seed(3) and m(x) for m in (ref, model)]
        assert torch.equal(*outs)
    assert calls == [] and saved == saved_ref
    model.train()
    model(x)
    assert len(calls) == 2


# 8. idempotent, nested, reversible
def test_applying_a_plan_twice_changes_nothing():
    model = net64()
    plan = sw.Plan([sw.checkpoint(r"layer[12]")])
    sw.apply(model, plan)
    first = (model.layer1, model.layer2, len(sw.records(model)))
    sw.apply(model, plan)
    sw.apply_checkpoint(model, r"layer[12]")   # also directly: already checkpointed, passed over
    assert (model.layer1, model.layer2) == first[:2]
    assert sw.records(model)[-1].skipped == (("layer1", "already checkpointed"), ("layer2", "already checkpointed"))
    assert not isinstance(model.layer1.wrapped, sw.CheckpointModule)


def test_never_a_checkpoint_inside_a_checkpoint():
    model = net64()
    sw.apply_checkpoint(model, r"layer1\.conv1")
    sw.apply_checkpoint(model, "layer1")           # absorbs the inner region
    inner = [n for n, m in model.layer1.named_modules() if isinstance(m, sw.CheckpointModule)]
    assert inner == [""]
    sw.apply_checkpoint(model, r"layer1\.conv2")   # inside a region: passed over
    assert sw.records(model)[-1].skipped == (("layer1.conv2", "inside checkpointed 'layer1'"),)
    assert sw.records(model)[-1].matched == ()


def test_revert_gives_back_the_same_objects():
    ref = net64()
    model = copy.deepcopy(ref)
    originals = {n: m for n, m in model.named_modules()}
    sw.apply_checkpoint(model, r"layer1\.conv1")
    sw.apply_checkpoint(model, r"layer[12]")
    sw.revert(model)
    assert {n: m for n, m in model.named_modules()} == originals
    assert all(originals[n] is m for n, m in model.named_modules())
    assert sw.records(model) == []
    assert_same(ref, model, x64())


def test_modules_without_forward_are_refused():
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(SelectionError, match=r"'0' \(ModuleList\).*no forward"):
        sw.apply_checkpoint(model, "0")


# 9. deepcopy, torch.save of the whole model, torch.compile, print
def test_deepcopy_and_whole_model_save_load():
    ref, model = pair()
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (clone, loaded):
        assert isinstance(m.layer1, sw.CheckpointModule)
        assert m.layer1.conv1.weight is m.layer1.wrapped.conv1.weight   # sharing survives the copy
        assert_same(ref, m, x64())
        sw.revert(m)
        assert type(m.layer1).__name__ == "Block"


def test_torch_compile_runs_a_checkpointed_model():
    # aot_eager: AOTAutograd's functional graphs, as inductor's, without its code generation. The
    # debug backend "eager" runs torch's own checkpoint on the traced region, and its recompute
    # counts BatchNorm twice: shrinkwrap's compiled form needs an AOTAutograd backend.
    ref, model = pair()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = x64()
    out_r, g_r = run(ref, x)
    out_c, g_c = run(compiled, x)
    torch.testing.assert_close(out_c, out_r)
    for n in g_r:
        torch.testing.assert_close(g_c[n], g_r[n])
    assert model.layer1.bn1.num_batches_tracked.item() == 1


def test_print_shows_checkpointed_modules():
    _, model = pair()
    text = repr(model)
    assert "(layer1): Checkpoint[Block](" in text and "(layer3): Block(" in text


def test_attributes_and_indexing_reach_the_wrapped_module():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)))
    sw.apply_checkpoint(model, "0")
    assert model[0][1].in_features == 3 and len(model[0]) == 2
    model[0].custom_flag = True
    assert model[0].wrapped.custom_flag is True


# memory without a GPU: a checkpointed region keeps only its input
def test_checkpointed_blocks_save_only_their_inputs():
    torch.manual_seed(0)
    d, batch = 64, 32
    blocks = [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d)) for _ in range(8)]
    model = nn.Sequential(*blocks)
    x = torch.randn(batch, d)
    before = sw.saved_tensor_bytes(model, x)
    sw.apply_checkpoint(model, r"\d")
    after = sw.saved_tensor_bytes(model, x)
    block_input = batch * d * 4
    assert after <= 8 * block_input
    assert before >= 8 * (2 * 4 * block_input)  # each block saves at least its two 4d-wide tensors


# Containers a region writes into: the recompute starts from them as they were before the forward.
class Decoder(nn.Module):
    """Keeps its hidden state in a dict it is given, as seed 002's GRU decoder does."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(6, 6)
        self.out = nn.Linear(6, 6)

    def forward(self, x, state):
        h = self.cell(x, state["h"])
        state["h"] = h
        state["history"].append(h)
        return self.out(h) * state["history"][0]


class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.dec = Decoder()

    def forward(self, xs):
        state = {"h": torch.zeros(xs.shape[1], 6, dtype=xs.dtype), "history": []}
        return torch.stack([self.dec(x, state) for x in xs]).sum(0) + state["h"]


def test_region_writing_into_a_dict_and_list_it_was_given_is_exact():
    torch.manual_seed(0)
    ref = Loop().double()
    model = copy.deepcopy(ref)
    sw.apply_checkpoint(model, "dec")
    torch.manual_seed(1)
    xs = torch.randn(4, 3, 6, dtype=torch.float64)
    assert_same(ref, model, xs)


def test_in_place_change_to_a_tensor_inside_a_container_is_named():
    class Scale(nn.Module):
        def forward(self, x, extra):
            extra["t"][0].mul_(2)
            return x * 2

    model = nn.Sequential()
    model.add_module("inner", Scale())
    sw.apply_checkpoint(model, "inner")
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="'inner' modified its input in place"):
        model.inner(x, {"t": [torch.ones(3)]})


# Models that take use_cache (Hugging Face): no KV cache while checkpointed regions train.
class CacheBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, use_cache=True):
        self.seen.append(use_cache)
        return self.lin(x)


class CacheModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CacheBlock(), CacheBlock()])

    def forward(self, x, use_cache=None):
        for block in self.blocks:
            x = block(x, use_cache=use_cache is not False)
        return x


def test_a_model_taking_use_cache_runs_without_cache_in_training_only():
    model = CacheModel()
    sw.apply_checkpoint(model, r"blocks\.\d")
    assert "use_cache=False" in sw.records(model)[-1].notes[0]
    x = torch.randn(2, 4)
    model(x).sum().backward()
    model(x, True).sum().backward()                  # positional use_cache too
    assert model.blocks[0].seen == [False] * 4       # forward and recompute, twice
    model.blocks[0].seen.clear()
    with torch.no_grad():
        model(x)
    model.eval()
    model(x, use_cache=True)
    assert model.blocks[0].seen == [True, True]
    sw.apply_checkpoint(model, r"blocks\.1")          # a second step adds no second hook
    assert len(model._forward_pre_hooks) == 1
    sw.revert(model)
    assert not model._forward_pre_hooks


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to the low-precision copies autocast makes of the given weights."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {w.data_ptr(): name for name, w in weights}
        self.copies: dict[str, list] = {name: [] for _, name in self.ptrs.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            import weakref

            self.copies[self.ptrs[args[0].data_ptr()]].append(weakref.ref(out))
        return out


@pytest.mark.parametrize("chain", [False, True])
def test_autocast_copies_of_a_regions_weights_are_freed_with_the_region(chain):
    """Autocast keeps the bfloat16 copy of each weight it casts until the outermost autocast exits;
    a checkpoint region drops what it saves, so its weights' copies must go with it (a Llama of
    1.2B parameters kept 1.8 GB of them through its loss). Outside a region they stay (saved for
    backward, and cached): the test tells the two apart."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    sw.apply(model, "checkpoint('0|1', chain=True)" if chain else "checkpoint('1')")
    x = torch.randn(8, 16, requires_grad=True)
    model(x)  # a chain's first training forward runs its members plainly, to see the parent chain them
    inside = ["1.weight", "0.weight"] if chain else ["1.weight"]
    casts = _Casts([(f"{i}.weight", model[i].weight) for i in (0, 1, 3)])
    grads = []
    for m in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if m is model:
                with casts:
                    y = m(x)
                assert all(casts.copies[n] and all(r() is None for r in casts.copies[n]) for n in inside)
                assert all(r() is not None for r in casts.copies["3.weight"])
            else:
                y = m(x)
            loss = y.float().square().mean()
        grads.append(torch.autograd.grad(loss, [x, *m.parameters()]))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
