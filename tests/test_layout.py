"""channels_last, on CPU: layout, exactness, revert, plans, compile."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.autoplan import candidates
from shrinkwrap.models import tiny_efficientnet
from shrinkwrap.select import SelectionError

from toymodels import Net, net64

CL = torch.channels_last
# Exact, not bit for bit: channels_last kernels add in another order (the module docstring).
TOL = dict(rtol=1e-12, atol=1e-12)

pytestmark = pytest.mark.usefixtures("one_thread")


def no_dropout(model):
    # Dropout draws its mask in memory order: on a channels_last tensor the same numbers fall on
    # other elements (test_dropout_masks_...). The exactness tests compare without it.
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def net():
    return no_dropout(net64())


def efficientnet():
    return tiny_efficientnet().double()


def x64(n=4, size=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(n, 3, size, size, dtype=torch.float64)


def is_cl(t):
    return t.is_contiguous(memory_format=CL) and not t.is_contiguous()


def conv_weights(model):
    return {n: p for n, p in model.named_parameters() if p.dim() == 4 and p.shape[-1] > 1}


def train_step(model, x):
    """Output, gradients and buffers of one forward and backward in training mode."""
    model.train()
    model.zero_grad()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters()}, dict(model.named_buffers())


def assert_same_step(ref, model, x):
    out_r, grads_r, bufs_r = train_step(ref, x)
    out_m, grads_m, bufs_m = train_step(model, x)
    torch.testing.assert_close(out_m, out_r, **TOL)
    assert grads_m.keys() == grads_r.keys() and bufs_m.keys() == bufs_r.keys()
    for n in grads_r:
        torch.testing.assert_close(grads_m[n], grads_r[n], **TOL, msg=n)
    for n in bufs_r:
        torch.testing.assert_close(bufs_m[n], bufs_r[n], **TOL, msg=n)


def hooks(model):
    """What runs before and after the root's forward: the step's input conversion is before."""
    own = int("forward" in model.__dict__)
    return len(model._forward_pre_hooks) + own, len(model._forward_hooks)


class Inputs(nn.Module):
    """Records the layout of what its forward receives: positional, keyword, integer, 3-D."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.seen = {}

    def forward(self, x, mask=None, ids=None, seq=None):
        self.seen = {"x": is_cl(x), "mask": is_cl(mask), "ids": ids.is_contiguous(), "seq": seq.is_contiguous()}
        return self.conv(x * mask)


# -- what it does --------------------------------------------------------------------------------
def test_conv_weights_and_4d_inputs_become_channels_last_keeping_the_same_parameter_objects():
    model = net()
    x = x64()
    train_step(model, x)  # gradients already there: they follow their parameters
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sw.apply(model, sw.Plan([sw.channels_last()]))
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params.values()))
    for n, p in conv_weights(model).items():
        assert is_cl(p) and is_cl(p.grad), n
    assert model.head.weight.is_contiguous() and model.stem[1].running_mean.is_contiguous()
    rec = sw.records(model)[-1]
    assert rec.matched[:3] == ("", "stem.0", "layer1.conv1") and len(rec.matched) == 8
    assert str(model).startswith("ChannelsLast[Net](") and hooks(model) == (1, 0)
    out, grads, _ = train_step(model, x)
    assert is_cl(grads["layer1.conv1.weight"])
    opt.step()  # the optimizer updates the channels_last weights it held before
    assert is_cl(model.layer1.conv1.weight)

    model = sw.apply_channels_last(Inputs())
    model(torch.randn(2, 3, 5, 5), mask=torch.rand(2, 3, 5, 5), ids=torch.ones(2, 3, 5, 5, dtype=torch.long),
          seq=torch.randn(2, 5, 5))
    assert model.seen == {"x": True, "mask": True, "ids": True, "seq": True}


@pytest.mark.parametrize("make, size", [(net, 8), (efficientnet, 32)], ids=["toy", "tiny_efficientnet"])
def test_outputs_gradients_and_batchnorm_buffers_equal_the_plain_model_to_float64_rounding(make, size):
    ref = make()
    model = sw.apply_channels_last(copy.deepcopy(ref))
    x = x64(size=size)
    for _ in range(2):  # the running statistics move twice, from the same values
        assert_same_step(ref, model, x)
    ref.eval(), model.eval()
    torch.testing.assert_close(model(x), ref(x), **TOL)


def test_dropout_masks_fall_on_other_elements_and_eval_is_unaffected():
    ref = net64()  # Dropout(0.25) in each block
    model = sw.apply_channels_last(copy.deepcopy(ref))
    x = x64()
    torch.testing.assert_close(model.eval()(x), ref.eval()(x), **TOL)
    ref.train(), model.train()
    torch.manual_seed(0)
    out_r = ref(x)
    torch.manual_seed(0)
    assert not torch.allclose(model(x), out_r)  # same random numbers, other elements: the docstring says so


def test_revert_restores_every_layout_the_hook_and_the_name():
    ref = net()
    x = x64()
    model = copy.deepcopy(ref)
    train_step(model, x)
    before = {n: (t.stride(), t.grad.stride() if t.grad is not None else None)
              for n, t in (*model.named_parameters(), *model.named_buffers())}
    sw.apply_channels_last(model)
    train_step(model, x)  # gradients made in channels_last go back with their parameters
    sw.revert(model)
    after = {n: (t.stride(), t.grad.stride() if t.grad is not None else None)
             for n, t in (*model.named_parameters(), *model.named_buffers())}
    assert after == before
    assert hooks(model) == (0, 0) and "_get_name" not in model.__dict__ and sw.records(model) == []
    assert str(model) == str(ref)
    model.load_state_dict(ref.state_dict())  # the values the step above moved
    ref.eval(), model.eval()
    assert torch.equal(model(x), ref(x))  # contiguous again: the same kernels, bit for bit


def test_applying_twice_changes_nothing_and_a_later_conv_is_converted_alone():
    model = net()
    sw.apply_channels_last(model)
    sw.apply_channels_last(model)
    sw.apply(model, "channels_last()")
    assert len(sw.records(model)) == 1 and hooks(model) == (1, 0)
    assert str(model).startswith("ChannelsLast[Net](")

    model.layer3.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False).double()  # replaced after the step
    sw.apply_channels_last(model)
    assert sw.records(model)[-1].matched == ("layer3.conv2",) and hooks(model) == (1, 0)
    assert is_cl(model.layer3.conv2.weight)
    sw.revert(model)
    assert model.layer3.conv2.weight.is_contiguous() and hooks(model) == (0, 0)


def test_weights_that_share_storage_are_left_alone_and_listed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 3))
    flat = torch.randn(72)
    model[0].weight = nn.Parameter(flat[:36].view(2, 2, 3, 3))  # views of one storage (a flat buffer)
    model[1].weight = nn.Parameter(flat[36:].view(2, 2, 3, 3))
    sw.apply_channels_last(model)
    assert model[0].weight.is_contiguous() and model[1].weight.is_contiguous() and is_cl(model[2].weight)
    assert [n for n, _ in sw.records(model)[-1].skipped] == ["0.weight", "1.weight"]
    assert sw.records(model)[-1].matched == ("", "2")


def test_a_model_without_convolutions_is_an_error_naming_it_and_the_fix():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(SelectionError, match=r"channels_last\(\) found no 4-D floating parameter .* in Sequential"
                                             r".*Leave channels_last\(\) out of the plan"):
        sw.apply(mlp, sw.Plan([sw.checkpoint("0"), sw.channels_last()]))
    assert isinstance(mlp[0], nn.Linear) and sw.records(mlp) == [] and hooks(mlp) == (0, 0)  # checked first
    with pytest.raises(SelectionError, match="lazy parameters first"):
        sw.apply_channels_last(nn.Sequential(nn.LazyConv2d(4, 3)))
    assert not sw.channels_last().applies(mlp)


def test_autoplan_offers_it_on_convolutional_models_between_bn_act_and_autocast():
    found = [str(c) for c in candidates(efficientnet(), allow_lossy=True, device="cpu")]
    assert found[-3:] == ["bn_act()", "channels_last()", "autocast(torch.bfloat16)"]
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert "channels_last()" not in [str(c) for c in candidates(mlp, device="cpu")]
    assert not sw.channels_last.lossy


# -- what it keeps -------------------------------------------------------------------------------
def test_state_dict_keys_and_values_unchanged_and_loads_both_ways():
    ref = net()
    model = sw.apply_channels_last(copy.deepcopy(ref))
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())
    for n, v in ref.state_dict().items():
        assert torch.equal(state[n], v), n
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = Net().double()
    fresh.load_state_dict(torch.load(buf))  # a plain model reads what a channels_last one saved
    for n, v in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[n], v), n
    other = Net().double()
    model.load_state_dict(other.state_dict())  # and the reverse: values copied in, layout kept
    assert is_cl(model.layer1.conv1.weight)
    assert torch.equal(model.layer1.conv1.weight, other.layer1.conv1.weight)


def test_deepcopy_pickle_and_torch_save_of_the_model_round_trip():
    ref = net()
    model = sw.apply_channels_last(copy.deepcopy(ref))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buf, weights_only=False)]
    x = x64()
    for m in copies:
        assert str(m).startswith("ChannelsLast[Net](") and is_cl(m.layer1.conv1.weight)
        assert isinstance(sw.records(m)[0].step, sw.channels_last)
        assert_same_step(copy.deepcopy(ref), m, x)
        sw.revert(m)
        assert m.layer1.conv1.weight.is_contiguous() and hooks(m) == (0, 0) and str(m) == str(ref)


def test_plan_text_round_trips():
    plan = sw.Plan([sw.checkpoint(r"layer[12]"), sw.bn_act(), sw.channels_last(), sw.autocast(torch.bfloat16)])
    assert str(plan) == "checkpoint('layer[12]'), bn_act(), channels_last(), autocast(torch.bfloat16)"
    assert sw.Plan.parse(str(plan)) == plan


# -- with the other steps, and torch.compile ------------------------------------------------------
def test_composes_with_checkpoint_and_bn_act_exactly_and_with_autocast_in_one_plan():
    ref = net()
    model = copy.deepcopy(ref)
    sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]"), sw.bn_act(), sw.channels_last()]))
    assert isinstance(model.layer1, sw.CheckpointModule) and isinstance(model.stem[1], sw.FusedBatchNormAct)
    assert is_cl(model.layer1.conv1.weight)
    assert_same_step(ref, model, x64())

    torch.manual_seed(0)
    ref = no_dropout(Net(c=8))
    model = copy.deepcopy(ref)
    plan = sw.Plan([sw.checkpoint(r"layer[12]"), sw.bn_act(), sw.channels_last(), sw.autocast(torch.bfloat16)])
    sw.apply(model, plan)
    assert str(model).startswith("Autocast[ChannelsLast[Net]](")
    x = x64().float()
    out = model(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and is_cl(model.layer1.conv1.weight.grad)
    err = torch.linalg.norm(out - ref(x)) / torch.linalg.norm(ref(x))
    assert 0 < err <= 2e-2  # bf16's tolerance (test_precision)
    sw.revert(model)
    assert str(model) == str(ref) and hooks(model) == (0, 0) and model.layer1.conv1.weight.is_contiguous()


def test_torch_compile_trains_a_channels_last_model_in_one_graph():
    ref = net()
    model = sw.apply_channels_last(copy.deepcopy(ref))
    x = x64()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt, opt_r = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out_c, out_r = compiled(x), ref(x)
    torch.testing.assert_close(out_c, out_r, **TOL)
    out_c.sum().backward(), out_r.sum().backward()
    opt.step(), opt_r.step()
    assert is_cl(model.layer1.conv1.weight) and is_cl(model.layer1.conv1.weight.grad)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=n)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


# -- space_to_depth ------------------------------------------------------------------------------
def resnet_toy():
    from toymodels import resnet64

    return resnet64()


def hf_resnet():
    """transformers' ResNet, built from a small config (its embedder's 7x7 stride-2 convolution is the stem)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x).logits

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    return Logits(ResNetForImageClassification(config)).double()


def test_the_space_to_depth_form_equals_the_convolution_on_odd_shapes_strides_and_kernels():
    torch.manual_seed(0)
    for c, k, s, p, h, w in [(3, 7, 2, 3, 33, 40), (4, 3, 2, 1, 17, 16), (3, 4, 4, 0, 32, 32), (2, 5, 3, 2, 20, 23),
                             (3, (3, 5), 2, (0, 2), 15, 18), (1, 2, 2, 0, 9, 9)]:
        conv = nn.Conv2d(c, 8, k, s, p).double()
        for x in (torch.randn(2, c, h, w, dtype=torch.float64, requires_grad=True),
                  torch.randn(2, c, h, w, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()):
            ref = conv(x)
            (gx, gw, gb) = torch.autograd.grad((ref * ref.detach()).sum(), (x, conv.weight, conv.bias))
            out = sw.SpaceToDepthConv(conv)(x)
            got = torch.autograd.grad((out * ref.detach()).sum(), (x, conv.weight, conv.bias))
            assert out.shape == ref.shape and is_cl(out) == is_cl(ref), (c, k, s, p, h, w)
            for a, b in zip((out, *got), (ref, gx, gw, gb)):
                torch.testing.assert_close(a, b, **TOL)
    conv = nn.Conv2d(3, 8, 7, 2, 3).double()  # unbatched: the convolution itself
    x = torch.randn(3, 20, 20, dtype=torch.float64)
    assert torch.equal(sw.SpaceToDepthConv(conv)(x), conv(x))
    with pytest.raises(RuntimeError, match="expected input.* to have 3 channels"):  # the convolution's own error
        sw.SpaceToDepthConv(conv)(torch.randn(2, 4, 20, 20, dtype=torch.float64))
    # One input channel: contiguous both ways by shape; the strides say channels_last, as for torch's.
    conv = nn.Conv2d(1, 16, 7, 2, 3).double()
    conv.weight.data = conv.weight.data.to(memory_format=CL)
    x = torch.randn(4, 1, 32, 32, dtype=torch.float64).to(memory_format=CL)
    ref, out = conv(x), sw.SpaceToDepthConv(conv)(x)
    assert out.stride() == ref.stride() != ref.contiguous().stride()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("make, size", [(resnet_toy, 30), (hf_resnet, 32)], ids=["toy_resnet", "transformers_resnet"])
def test_space_to_depth_trains_as_the_plain_model_to_float64_rounding_with_and_without_channels_last(make, size):
    ref = make()
    stem = "conv1" if make is resnet_toy else "model.resnet.embedder.embedder.convolution"
    for plan in ["space_to_depth()", f"space_to_depth(), checkpoint('{stem}'), channels_last()"]:
        model = sw.apply(copy.deepcopy(ref), plan)
        assert sw.records(model)[0].matched == (stem,)
        assert model.state_dict().keys() == ref.state_dict().keys()
        x = x64(size=size)
        for _ in range(2):  # the running statistics move twice, from the same values
            assert_same_step(ref, model, x)
        sw.revert(model)
        assert str(model) == str(ref) and not any(isinstance(m, sw.SpaceToDepthConv) for m in model.modules())


def test_space_to_depth_selects_the_stem_by_default_and_passes_over_what_it_cannot_rewrite():
    model = sw.apply(resnet_toy(), "space_to_depth()")
    assert isinstance(model.conv1, sw.SpaceToDepthConv) and sw.records(model)[-1].matched == ("conv1",)
    assert model.conv1.wrapped.weight is model.conv1.weight and str(model.conv1).startswith("SpaceToDepthConv[Conv2d](")
    assert sw.Plan.parse(str(sw.Plan([sw.space_to_depth("conv1")]))) == sw.Plan([sw.space_to_depth("conv1")])
    sw.apply(model, "space_to_depth()")  # again: nothing more to do
    assert isinstance(model.conv1.wrapped, nn.Conv2d)

    model = resnet_toy()
    model.layer2[0].conv1.dilation = (2, 2)
    sw.apply(model, r"space_to_depth(r'layer\d\.\d\.conv1|conv1')")
    skipped = dict(sw.records(model)[-1].skipped)
    assert "stride (1, 1)" in skipped["layer1.0.conv1"] and "dilation=(2, 2)" in skipped["layer2.0.conv1"]

    with pytest.raises(SelectionError, match=r"no convolution to rewrite in Net \(no nn.Conv2d of stride 2"):
        sw.apply(net(), "space_to_depth()")  # its stem has stride 1
    model = sw.apply(resnet_toy(), "checkpoint('conv1')")
    with pytest.raises(SelectionError, match=r"conv1 is wrapped already \(Checkpoint\[Conv2d\]\): put space_to_depth\(\) "
                                             r"before"):
        sw.apply(model, "space_to_depth()")
    model = resnet_toy()
    model.conv1.register_forward_hook(lambda *a: None)
    with pytest.raises(SelectionError, match="has hooks"):
        sw.apply(model, "space_to_depth()")

    class StandardisedConv(nn.Conv2d):  # changes the weight it convolves with: not torch's sums
        def _conv_forward(self, x, w, b):
            return super()._conv_forward(x, (w - w.mean()) / w.std(), b)

    model = resnet_toy()
    model.conv1 = StandardisedConv(3, 8, 7, 2, 3).double()
    with pytest.raises(SelectionError, match=r"conv1 is test_layout\.[\w.<>]*StandardisedConv, not an nn.Conv2d computing"):
        sw.apply(model, "space_to_depth()")


def test_space_to_depth_compiles_without_a_graph_break_and_trains_as_eager():
    ref = resnet_toy()
    model = sw.apply(copy.deepcopy(ref), "space_to_depth(), checkpoint('conv1'), channels_last()")
    x = x64(size=30)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out_c, out_r = compiled(x), ref(x)
    torch.testing.assert_close(out_c, out_r, **TOL)
    out_c.sum().backward(), out_r.sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.cuda
def test_space_to_depth_on_cuda_equals_the_plain_model_in_float64_and_compiles_with_inductor():
    ref = resnet_toy().cuda()
    model = sw.apply(copy.deepcopy(ref), "space_to_depth(), checkpoint('conv1'), channels_last()")
    x = x64(size=30).cuda()
    for _ in range(2):
        assert_same_step(ref, model, x)
    # bf16 under inductor: the padded, channels-last form cuDNN runs (within bf16's rounding of eager's).
    torch.manual_seed(0)
    ref = resnet_toy().float().cuda()
    plan = "space_to_depth(), checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), compile()"
    model = sw.apply(copy.deepcopy(ref), plan)
    x = torch.randn(8, 3, 64, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(x).float()
    got = model(x)
    got.sum().backward()
    assert model.conv1.weight.grad is not None
    assert torch.linalg.norm(got - want) / torch.linalg.norm(want) <= 2e-2
