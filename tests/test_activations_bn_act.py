"""The bn_act step: BatchNorm and the activation after it as one op that recomputes, and plans with both activation
steps."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.transforms.activations.bn_act import _BatchNormActFunction

from activations_helpers import DetachedSwish, F64, NaiveSwish, NewGELU, TIGHT, assert_same_run, conv_stack, mlp, run


class TimmSwish(nn.Module):  # timm's Swish(inplace=True)
    def __init__(self, inplace=True):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(x.sigmoid()) if self.inplace else x.mul(x.sigmoid())


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
