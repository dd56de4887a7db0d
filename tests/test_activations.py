"""Activation transforms: memory-efficient Swish/Mish/Hard-Swish and BatchNorm+activation recompute."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from shrinkwrap.transforms.activations.bn_act import _BatchNormActFunction
from shrinkwrap.transforms.activations.efficient_swish import _SwishFunction

F64 = torch.float64


# -- hand-written activations, as found in the wild -------------------------------------------


class NaiveSwish(nn.Module):  # EfficientNet-PyTorch's Swish
    def forward(self, x):
        return x * torch.sigmoid(x)


class Act(nn.Module):  # the same under a name that says nothing
    def forward(self, x):
        return x.mul(x.sigmoid())


class NaiveMish(nn.Module):
    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


class NaiveHardSwish(nn.Module):
    def forward(self, x):
        return x * F.relu6(x + 3) / 6


class NewGELU(nn.Module):  # Hugging Face's NewGELUActivation (GPT-2's gelu_new), as written there
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class ScaledSwish(nn.Module):  # state: a parameter (beta = 1 computes Swish)
    def __init__(self):
        super().__init__()
        self.beta = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * torch.sigmoid(self.beta * x)


class BufferSwish(nn.Module):  # state: a buffer
    def __init__(self):
        super().__init__()
        self.register_buffer("beta", torch.ones(()))

    def forward(self, x):
        return x * torch.sigmoid(self.beta * x)


class CountingSwish(nn.Module):  # a side effect on itself
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * torch.sigmoid(x)


class InplaceSwish(nn.Module):
    def forward(self, x):
        return x.mul_(torch.sigmoid(x))


class TimmSwish(nn.Module):  # timm's Swish(inplace=True)
    def __init__(self, inplace=True):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(x.sigmoid()) if self.inplace else x.mul(x.sigmoid())


class DetachedSwish(nn.Module):  # Swish's values, not its gradient
    def forward(self, x):
        return x * torch.sigmoid(x).detach()


def mlp(act=NaiveSwish, n=3, width=16):
    layers = [nn.Linear(width, width)]
    for _ in range(n):
        layers += [act(), nn.Linear(width, width)]
    return nn.Sequential(*layers).to(F64)


def conv_stack(act=lambda: nn.SiLU(inplace=True), blocks=3, ch=8, bn=nn.BatchNorm2d, **bn_kw):
    layers, cin = [], 3
    for _ in range(blocks):
        layers += [nn.Conv2d(cin, ch, 3, padding=1, bias=False), bn(ch, **bn_kw), act()]
        cin = ch
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 5)).to(F64)


def run(model, x, steps=2):
    """Forward+backward a few times; return outputs, input grad, param grads and buffers."""
    x = x.detach().clone().requires_grad_()
    outs = []
    for _ in range(steps):
        y = model(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)).sum().backward()
        outs.append(y.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return outs, x.grad, grads, {n: b.clone() for n, b in model.named_buffers()}


TIGHT = dict(rtol=1e-13, atol=1e-13)  # float64: rounding only (bn_act recomputes in another order)


def assert_same_run(a, b, **tol):
    tol = tol or TIGHT
    for u, v in zip(a[0], b[0]):
        torch.testing.assert_close(u, v, **tol)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert a[2].keys() == b[2].keys() and a[3].keys() == b[3].keys()
    for k in a[2]:
        torch.testing.assert_close(a[2][k], b[2][k], **tol)
    for k in a[3]:
        torch.testing.assert_close(a[3][k], b[3][k], **tol, msg=k)


# -- MemoryEfficientSwish ---------------------------------------------------------------------


def test_swish_function_gradcheck_and_gradgradcheck():
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwishFunction.apply, (x,))
    assert torch.autograd.gradgradcheck(_SwishFunction.apply, (x,))


def test_memory_efficient_swish_is_silu_exactly_and_naive_swish_to_rounding():
    x = torch.randn(64, 33, dtype=F64, requires_grad=True)
    y = sw.MemoryEfficientSwish()(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    x2 = x.detach().clone().requires_grad_()
    y2 = F.silu(x2)
    (g2,) = torch.autograd.grad(y2.sum(), x2)
    assert torch.equal(y, y2) and torch.equal(g, g2)
    x3 = x.detach().clone().requires_grad_()
    y3 = NaiveSwish()(x3)
    (g3,) = torch.autograd.grad(y3.sum(), x3)
    torch.testing.assert_close(y, y3, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(g, g3, rtol=1e-14, atol=1e-14)


def test_memory_efficient_swish_without_grad_saves_nothing():
    with torch.no_grad(), sw.SavedTensors() as saved:
        sw.MemoryEfficientSwish()(torch.randn(8, 8))
    assert saved.count == 0


# -- apply_swish --------------------------------------------------------------------------------


@pytest.mark.parametrize("act", [NaiveSwish, Act])
def test_naive_swish_mlp_saves_two_tensors_per_activation_before_and_one_after(act):
    model = mlp(act)
    x = torch.randn(32, 16, dtype=F64, requires_grad=True)
    acts = [m for m in model if isinstance(m, act)]
    h = torch.randn(32, 16, dtype=F64, requires_grad=True) * 1  # like a Linear's output

    def per_activation(module):
        with sw.SavedTensors() as saved:
            module(h)
        return saved.count

    with sw.SavedTensors() as before:
        model(x)
    assert [per_activation(a) for a in acts] == [2, 2, 2]
    sw.apply_swish(model)
    swapped = [m for m in model if isinstance(m, sw.MemoryEfficientSwish)]
    assert len(swapped) == 3 and [per_activation(a) for a in swapped] == [1, 1, 1]
    with sw.SavedTensors() as after:
        model(x)
    assert before.count - after.count == 3
    assert before.bytes - after.bytes == 3 * 32 * 16 * 8


def test_apply_swish_is_exact_to_rounding_in_float64():
    torch.manual_seed(0)
    model = mlp(NaiveSwish)
    ref = copy.deepcopy(model)
    sw.apply_swish(model)
    x = torch.randn(32, 16, dtype=F64)
    assert_same_run(run(model, x), run(ref, x), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("act,native,saved_before",
                         [(NaiveMish, nn.Mish, 2), (NaiveHardSwish, nn.Hardswish, 3), (NewGELU, nn.GELU, 4)])
def test_naive_mish_hardswish_and_tanh_gelu_become_the_native_module(act, native, saved_before):
    torch.manual_seed(0)
    model = mlp(act, n=1)
    ref = copy.deepcopy(model)
    h = torch.randn(32, 16, dtype=F64, requires_grad=True) * 1
    with sw.SavedTensors() as saved:
        model[1](h)
    assert saved.count == saved_before
    sw.apply_swish(model)
    assert type(model[1]) is native and getattr(model[1], "approximate", "tanh") == "tanh"
    with sw.SavedTensors() as saved:
        model[1](h)
    assert saved.count == 1
    x = torch.randn(32, 16, dtype=F64)
    assert_same_run(run(model, x), run(ref, x), rtol=1e-14, atol=1e-14)


def test_a_tanh_gelu_keeping_only_its_input_is_left_alone():
    # A tanh-GELU that keeps only its input already (native, or one op written by hand) is left be,
    # unreported: swish() is no candidate for it. The exact GELU is no tanh-GELU.
    class OneOpGELU(nn.Module):  # Hugging Face's GELUTanh
        def forward(self, x):
            return F.gelu(x, approximate="tanh")

    plain = nn.Sequential(nn.Linear(4, 4), nn.GELU("tanh"), OneOpGELU(), nn.GELU()).to(F64)
    assert not sw.swish().applies(plain)
    native = sw.apply_swish(nn.Sequential(*plain, NaiveSwish()))
    assert [type(m) for m in native] == [nn.Linear, nn.GELU, OneOpGELU, nn.GELU, sw.MemoryEfficientSwish]
    assert sw.records(native)[-1].matched == ("4",) and not sw.records(native)[-1].skipped
    fused = sw.apply_bn_act(conv_stack(OneOpGELU, blocks=1))  # still an activation bn_act can fuse
    assert isinstance(fused[1], sw.FusedBatchNormAct)


class FastGELU(nn.Module):  # Hugging Face's FastGELUActivation: the tanh GELU with sqrt(2/pi) cut to 10 digits
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def test_a_tanh_gelu_with_a_cut_constant_is_no_tanh_gelu_in_float64_and_is_in_float32():
    # In float64 it differs from the native tanh GELU by more than rounding (5e-9 relative): not
    # replaced there, where exactness is tested. In float32 the difference is far below rounding.
    assert not sw.swish().applies(mlp(FastGELU, n=1).to(F64))
    model = sw.apply_swish(mlp(FastGELU, n=1).float())
    assert type(model[1]) is nn.GELU


def test_gpt2s_gelu_new_is_replaced_and_training_matches_to_rounding():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).to(F64)
    model = sw.apply(copy.deepcopy(ref), "swish()")
    assert sw.records(model)[-1].matched == ("transformer.h.0.mlp.act", "transformer.h.1.mlp.act")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        torch.manual_seed(3)  # dropout on: the same masks
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
    sw.revert(model)
    assert type(model.transformer.h[0].mlp.act) is type(ref.transformer.h[0].mlp.act)


@pytest.mark.parametrize("act", [NaiveSwish, NewGELU])
def test_a_half_precision_model_is_probed_in_float32(act):
    """In bfloat16 a written-out activation rounds each of its operations, more than one
    rounding's tolerance: the probe runs in float32, and the module is found as in float32."""
    model = mlp(act, n=2).to(torch.bfloat16)
    sw.apply_swish(model)
    assert sw.records(model)[-1].matched == ("1", "3")
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    ref = mlp(act, n=2).to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), ref(x), rtol=2e-2, atol=2e-2)  # bfloat16 rounding apart


def test_modules_with_state_hooks_or_side_effects_are_left_alone_and_reported():
    hooked = NaiveSwish()
    hooked.register_forward_hook(lambda m, i, o: None)
    model = nn.Sequential(
        nn.Linear(4, 4), ScaledSwish(), BufferSwish(), CountingSwish(), InplaceSwish(), DetachedSwish(),
        hooked, NaiveSwish(),
    ).to(F64)
    originals = list(model)
    sw.apply_swish(model)
    assert all(model[i] is originals[i] for i in range(7))
    assert isinstance(model[7], sw.MemoryEfficientSwish)
    rec = sw.records(model)[-1]
    assert rec.matched == ("7",)
    skipped = dict(rec.skipped)
    assert set(skipped) == {"1", "2", "3", "4", "5", "6"}
    assert "state" in skipped["1"] and "state" in skipped["2"]
    assert "side effect" in skipped["3"] and model[3].calls == 0  # probe undone on the module
    assert "in place" in skipped["4"]
    assert "gradient" in skipped["5"]
    assert "hooks" in skipped["6"]


def test_probing_does_not_move_the_rng_stream():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), NaiveSwish())
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    sw.apply_swish(model)
    assert torch.equal(torch.rand(3), expected)


def test_silu_is_reported_and_swapped_only_when_asked():
    model = nn.Sequential(nn.Linear(4, 4), nn.SiLU(), nn.SiLU(inplace=True))
    sw.apply_swish(model)
    assert type(model[1]) is nn.SiLU and "include_silu" in dict(sw.records(model)[-1].skipped)["1"]
    sw.revert(model)
    sw.apply_swish(model, include_silu=True)
    assert isinstance(model[1], sw.MemoryEfficientSwish)
    assert type(model[2]) is nn.SiLU and "in-place" in dict(sw.records(model)[-1].skipped)["2"]


def test_revert_restores_the_same_objects_and_applying_twice_is_a_no_op():
    model = mlp(NaiveMish, n=1)
    model.append(NaiveSwish())
    originals = list(model)
    sw.apply_swish(model)
    swapped = list(model)
    sw.apply_swish(model)  # already done: matched again, nothing replaced, no error
    assert list(model) == swapped and sw.records(model)[-1].undo == []
    assert sw.records(model)[-1].matched == ("1", "3")
    sw.apply(model, sw.Plan([sw.swish()]))
    assert list(model) == swapped
    sw.revert(model)
    assert all(a is b for a, b in zip(model, originals))


def test_no_swish_is_an_error_naming_the_model_unless_a_pattern_is_given():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(sw.SelectionError, match="Sequential"):
        sw.apply_swish(model)
    with pytest.raises(sw.SelectionError, match="Sequential"):
        sw.apply(model, sw.Plan([sw.swish()]))  # checked before anything changes
    sw.apply_swish(model, r"\d")
    assert dict(sw.records(model)[-1].skipped) == {
        "0": "has parameters or buffers (state); shrinkwrap never replaces a module with state",
        "1": "does not compute Swish, Mish, Hard-Swish or tanh-GELU",
    }


# -- bn_act -------------------------------------------------------------------------------------

ACTS = {
    "silu_inplace": lambda: nn.SiLU(inplace=True),
    "silu": nn.SiLU,
    "relu_inplace": lambda: nn.ReLU(inplace=True),
    "relu6": nn.ReLU6,
    "leaky": lambda: nn.LeakyReLU(0.1, inplace=True),
    "gelu_tanh": lambda: nn.GELU("tanh"),
    "hardswish": nn.Hardswish,
    "mish": nn.Mish,
    "naive_swish": NaiveSwish,
    "naive_gelu_tanh": NewGELU,
    "timm_swish_inplace": TimmSwish,
    "me_swish": sw.MemoryEfficientSwish,
}


@pytest.mark.parametrize("act", sorted(ACTS))
def test_bn_act_function_gradcheck(act):
    seq = conv_stack(ACTS[act], blocks=1)
    sw.apply_bn_act(seq)
    spec = seq[1]._sw_spec
    x = torch.randn(3, 4, 3, 3, dtype=F64, requires_grad=True)
    w = torch.rand(4, dtype=F64, requires_grad=True)
    b = torch.randn(4, dtype=F64, requires_grad=True)
    fn = lambda x, w, b: _BatchNormActFunction.apply(x, w, b, None, None, 0.1, 1e-5, spec)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("act", sorted(ACTS))
def test_bn_act_matches_the_unfused_model_in_float64_train_and_eval(act):
    torch.manual_seed(0)
    model = conv_stack(ACTS[act])
    ref = copy.deepcopy(model)
    sw.apply_bn_act(model)
    assert sum(isinstance(m, sw.FusedBatchNormAct) for m in model.modules()) == 3
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    assert_same_run(run(model, x, steps=3), run(ref, x, steps=3))
    assert model[1].num_batches_tracked.item() == 3
    model.eval(), ref.eval()
    assert_same_run(run(model, x), run(ref, x))


@pytest.mark.parametrize(
    "bn,kw",
    [
        (nn.BatchNorm2d, dict(momentum=None)),
        (nn.BatchNorm2d, dict(affine=False)),
        (nn.BatchNorm2d, dict(track_running_stats=False)),
    ],
)
def test_bn_act_batchnorm_options(bn, kw):
    torch.manual_seed(0)
    model = conv_stack(bn=bn, **kw)
    ref = copy.deepcopy(model)
    sw.apply_bn_act(model)
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    assert_same_run(run(model, x, steps=3), run(ref, x, steps=3))
    model.eval(), ref.eval()
    assert_same_run(run(model, x), run(ref, x))


def test_bn_act_leaves_running_stats_alone_when_tracking_is_switched_off_later():
    torch.manual_seed(0)
    model = conv_stack()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats = False  # buffers stay; F.batch_norm gets none in training
    ref = copy.deepcopy(model)
    sw.apply_bn_act(model)
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    assert_same_run(run(model, x), run(ref, x))
    assert torch.equal(model[1].running_mean, torch.zeros(8, dtype=F64))


def test_bn_act_batchnorm1d_and_no_grad_in_train_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).to(F64)
    ref = copy.deepcopy(model)
    sw.apply_bn_act(model)
    x = torch.randn(16, 6, dtype=F64)
    assert_same_run(run(model, x), run(ref, x))
    with torch.no_grad():  # still updates the running stats, as BatchNorm does
        torch.testing.assert_close(model(x), ref(x), **TIGHT)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, **TIGHT)
    assert model[1].num_batches_tracked == ref[1].num_batches_tracked == 3


def test_conv_bn_silu_stack_saves_one_activation_sized_tensor_fewer_per_block():
    model = conv_stack(blocks=3, ch=16)
    x = torch.randn(8, 3, 16, 16, dtype=F64)
    act_bytes = 8 * 16 * 16 * 16 * 8
    before = sw.saved_tensor_bytes(model, x)
    sw.apply_bn_act(model)
    after = sw.saved_tensor_bytes(model, x)
    # The rest of the difference is per-channel statistics (a few hundred bytes).
    assert abs((before - after) - 3 * act_bytes) < act_bytes // 16


def test_bn_act_keeps_state_dict_keys_reverts_and_is_idempotent():
    model = conv_stack()
    keys = list(model.state_dict())
    params = [n for n, _ in model.named_parameters()]
    originals = list(model)
    sw.apply_bn_act(model)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == params
    fused = list(model)
    assert isinstance(model[1], sw.FusedBatchNormAct) and isinstance(model[2], sw.FusedActivation)
    assert model[2].wrapped is originals[2]
    sw.apply_bn_act(model)
    assert list(model) == fused and sw.records(model)[-1].matched == ("1", "4", "7")
    sw.revert(model)
    assert all(a is b for a, b in zip(model, originals))
    assert list(model.state_dict()) == keys


def test_bn_act_reports_what_it_cannot_fuse():
    class Block(nn.Module):  # the BatchNorm's consumer is hidden in forward
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.act(self.bn(x))

    hooked = nn.ReLU()
    hooked.register_forward_hook(lambda m, i, o: None)
    model = nn.Sequential(
        Block(), nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU(),
        nn.BatchNorm2d(3), hooked, nn.BatchNorm2d(3),
    )
    sw.apply_bn_act(model)
    rec = sw.records(model)[-1]
    assert rec.matched == ("3",)
    skipped = dict(rec.skipped)
    assert "nn.Sequential" in skipped["0.bn"]
    assert "Conv2d" in skipped["1"]
    assert "hooks" in skipped["5"] and model[6] is hooked
    assert "last" in skipped["7"]
    with pytest.raises(sw.SelectionError, match="Block"):
        sw.apply_bn_act(Block())


class BatchNormAct2d(nn.BatchNorm2d):
    """A stand-in with timm's BatchNormAct2d structure and forward (timm is not installed here)."""

    def __init__(self, num_features, act=nn.SiLU, **kw):
        super().__init__(num_features, **kw)
        self.drop = nn.Identity()
        self.act = act()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_bn_act_fuses_a_timm_style_batchnormact2d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), BatchNormAct2d(4, act=TimmSwish), nn.Conv2d(4, 4, 3),
                          BatchNormAct2d(4, act=nn.ReLU)).to(F64)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    sw.apply_bn_act(model)
    assert isinstance(model[1], sw.FusedBatchNormAct) and isinstance(model[3], sw.FusedBatchNormAct)
    assert list(model.state_dict()) == keys
    x = torch.randn(4, 3, 8, 8, dtype=F64)
    assert_same_run(run(model, x), run(ref, x))
    with sw.SavedTensors() as saved:
        model(x.requires_grad_())
    with sw.SavedTensors() as saved_ref:
        ref(x)
    assert saved_ref.bytes - saved.bytes >= 4 * 4 * (6 * 6 + 4 * 4) * 8  # one BN output per pair


# -- both, plans, persistence -------------------------------------------------------------------


def test_plan_text_round_trip():
    plan = sw.Plan([sw.swish(), sw.swish(r"act\d", include_silu=True), sw.bn_act(), sw.bn_act(r"features\..*")])
    text = str(plan)
    assert text.startswith("swish(), swish(pattern=") and "include_silu=True" in text and "bn_act(), bn_act(" in text
    assert sw.Plan.parse(str(plan)) == plan


def naive_efficientnet_like():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), NaiveSwish(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), NaiveSwish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), NaiveSwish(), nn.Linear(8, 3),
    ).to(F64)


def test_swish_then_bn_act_deepcopy_and_torch_save_round_trip():
    torch.manual_seed(0)
    model = naive_efficientnet_like()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    sw.apply(model, "swish(), bn_act()")
    assert list(model.state_dict()) == keys
    assert isinstance(model[1], sw.FusedBatchNormAct) and isinstance(model[9], sw.MemoryEfficientSwish)
    x = torch.randn(4, 3, 6, 6, dtype=F64)
    assert_same_run(run(model, x), run(ref, x), rtol=1e-14, atol=1e-14)

    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    for other in (twin, loaded):
        assert list(other.state_dict()) == keys
        for n, t in model.state_dict().items():
            assert torch.equal(t, other.state_dict()[n])
        torch.testing.assert_close(run(other, x, steps=1)[0][0], run(copy.deepcopy(model), x, steps=1)[0][0], **TIGHT)
        sw.revert(other)
        assert type(other[1]) is nn.BatchNorm2d and isinstance(other[2], NaiveSwish)

    # state_dicts load both ways
    ref.load_state_dict(model.state_dict())
    model.load_state_dict(ref.state_dict())


# -- CUDA (skipped without a GPU) ---------------------------------------------------------------


@pytest.mark.cuda
def test_bn_act_on_cuda_matches_unfused_float32():
    torch.manual_seed(0)
    model = conv_stack(ch=32).float().cuda()
    ref = copy.deepcopy(model)
    sw.apply_bn_act(model)
    x = torch.randn(16, 3, 32, 32, device="cuda")
    assert_same_run(run(model, x), run(ref, x), rtol=1e-4, atol=1e-5)


def test_revert_keeps_a_module_the_user_replaced_after_apply_and_names_it():
    model = mlp()
    originals = list(model)
    sw.apply_swish(model)
    users = NaiveSwish()
    model[3] = users  # what efficientnet_pytorch's set_swish() does after shrinkwrap's swap
    with pytest.warns(UserWarning, match=r"kept 1 module.*: 3\."):
        sw.revert(model)
    assert model[3] is users
    assert model[1] is originals[1] and model[5] is originals[5]


def test_bn_act_names_why_an_activation_that_computes_swish_is_not_fused():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), DetachedSwish(), nn.Conv2d(4, 4, 1)).to(F64)
    with pytest.raises(sw.SelectionError, match="DetachedSwish, which shrinkwrap cannot fuse: it returns swish.s values but not its gradient"):
        sw.apply_bn_act(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_close_decides_as_assert_close_does_at_each_dtypes_tolerance(dtype):
    """_close is assert_close's test at its default tolerance (float64's tightened to 1e-12 and
    1e-14) without the message: the same verdict on pairs either side of the tolerance, NaN,
    infinity, and shape or dtype unlike."""
    from shrinkwrap.transforms.activations.recognise import _close

    # assert_close's defaults, and float64's tightened: fixed here, not read from the code tested
    rtol, atol = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
                  torch.float64: (1e-12, 1e-14)}[dtype]
    x = torch.linspace(-6, 6, 240, dtype=torch.float64)
    pairs = []
    for k in (0.0, 0.5, 0.99, 1.01, 2.0, 50.0):
        step = (atol + rtol * x.abs()) * k
        pairs += [(x, x + step), (x, x - step), (x, x + step * (torch.arange(240) % 7 == 3))]
    nan, inf = x.clone(), x.clone()
    nan[5], inf[7] = math.nan, math.inf
    pairs += [(nan, nan), (inf, inf), (inf, x), (x, x.reshape(2, 120)), (x, x.float() if dtype == torch.float64 else x)]
    seen = set()
    for a, b in pairs:
        a, b = a.to(dtype), b.to(dtype) if b.dtype == torch.float64 else b
        try:
            torch.testing.assert_close(a, b, **(dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else {}))
            expected = True
        except AssertionError:
            expected = False
        assert _close(a, b) is expected
        seen.add(expected)
    assert seen == {True, False}
    meta = torch.empty(3, device="meta", dtype=dtype)
    assert _close(meta, meta)  # as assert_close: a meta tensor has no values to differ


def test_torchs_inert_modules_are_not_probed_and_probing_them_finds_no_kind(monkeypatch):
    """Each of torch's stateless modules taken as computing none of the kinds, probed, computes none
    (so skipping the probe changes no answer); then it is not probed, while nn.GELU('tanh'), a
    subclass of one, and a hand-written Swish still are."""
    from shrinkwrap.transforms.activations import recognise as act

    modules = [cls() for cls in act._INERT if cls not in (nn.Softmax, nn.LogSoftmax, nn.AdaptiveAvgPool1d,
                                                           nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AvgPool1d,
                                                           nn.AvgPool2d, nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d,
                                                           nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d)]
    modules += [nn.Softmax(-1), nn.LogSoftmax(1), nn.AdaptiveAvgPool1d(8), nn.AdaptiveAvgPool2d(1),
                nn.AdaptiveAvgPool3d(2), nn.AvgPool1d(1), nn.AvgPool2d(1), nn.AvgPool3d(1), nn.MaxPool1d(1),
                nn.MaxPool2d(1, padding=0), nn.MaxPool3d(1), nn.AdaptiveMaxPool1d(8), nn.AdaptiveMaxPool2d(1),
                nn.Dropout(0.0).eval(), nn.LeakyReLU(1.0), nn.ELU(0.0), nn.Hardtanh(-6, 6), nn.ReLU6(True)]
    assert {type(m) for m in modules} == set(act._INERT)
    for m in modules:
        assert act._probe(m, torch.float64, torch.device("cpu"))[0] is None, m

    class MyReLU(nn.ReLU):
        def forward(self, x):
            return x * torch.sigmoid(x)

    probed = []
    real = act._probe
    monkeypatch.setattr(act, "_probe", lambda m, *a, **k: probed.append(type(m)) or real(m, *a, **k))
    for m in modules:
        assert act._activation_kind(m, torch.float64, torch.device("cpu")) == (None, act._NONE)
    assert probed == []
    assert act._activation_kind(nn.GELU(approximate="tanh"), torch.float64, torch.device("cpu"))[0] == "gelu_tanh"
    assert act._activation_kind(MyReLU(), torch.float64, torch.device("cpu")) == ("swish", "")
    patched = nn.ReLU()
    patched.forward = lambda x: x * torch.sigmoid(x)
    assert act._activation_kind(patched, torch.float64, torch.device("cpu")) == ("swish", "")
    assert probed == [nn.GELU, MyReLU, nn.ReLU]
