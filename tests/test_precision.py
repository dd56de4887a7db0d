"""autocast and half, on CPU: memory saved, tolerance, names, revert, plans, composition."""

import collections
import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from shrinkwrap.select import SelectionError
from shrinkwrap.transforms.precision import AutocastModule, KeepFloatModule

from toymodels import Net

BF16 = torch.bfloat16
TOL_BF16 = 2e-2  # the relative error the precision module's docstring documents for bfloat16


def linear_stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )


def conv_stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
    )


def net(seed=0):
    torch.manual_seed(seed)
    return Net(c=8)


def images(n=8, seed=1):
    torch.manual_seed(seed)
    return torch.randn(n, 3, 8, 8)


def rel_err(out, ref):
    return (torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref)).item()


def hooks(model):
    """What surrounds the root's forward: (what runs before it, what runs after it). Autocast
    wraps it (both), half casts its inputs (before)."""
    forward, kinds = model.__dict__.get("forward"), []
    while forward is not None:
        kinds.append(type(forward).__name__)
        forward = forward.previous
    before = len(model._forward_pre_hooks) + len(kinds)
    return before, len(model._forward_hooks) + kinds.count("_AutocastForward")


def dtypes(model):
    return {n: t.dtype for n, t in (*model.named_parameters(), *model.named_buffers())}


# -- autocast ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, x",
    [(linear_stack, torch.randn(4096, 128)), (conv_stack, torch.randn(32, 16, 32, 32))],
    ids=["linear", "conv"],
)
def test_bf16_autocast_halves_bytes_saved_for_backward(make, x):
    model = make()
    fp32 = sw.saved_tensor_bytes(model, x)
    sw.apply_autocast(model, BF16)
    bf16 = sw.saved_tensor_bytes(model, x)
    # Each layer saves its input in bfloat16 instead of float32, plus a small bf16 copy of its weight.
    assert bf16 / fp32 <= 0.6, (fp32, bf16)


def test_output_float32_by_default_within_tolerance_and_bf16_on_request():
    ref = linear_stack()
    x = torch.randn(256, 128)
    expected = ref(x)
    model = sw.apply_autocast(copy.deepcopy(ref), BF16)
    out = model(x)
    assert out.dtype == torch.float32
    assert 0 < rel_err(out, expected) <= TOL_BF16  # it did compute in bfloat16, and closely

    kept = sw.apply_autocast(copy.deepcopy(ref), BF16, keep_output_dtype=True)
    assert kept(x).dtype == BF16
    assert torch.equal(kept(x).float(), out)


def test_submodule_autocast_wraps_without_renaming_and_returns_float32():
    ref = linear_stack()
    model = sw.apply_autocast(copy.deepcopy(ref), BF16, r"[02]")
    assert isinstance(model[0], AutocastModule) and isinstance(model[2], AutocastModule)
    assert "Autocast[Linear]" in str(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = torch.randn(64, 128)
    assert model(x).dtype == torch.float32 and seen == [torch.float32]
    assert rel_err(model(x), ref(x)) <= TOL_BF16


def test_state_dict_keys_unchanged_and_revert_restores_exact_behaviour():
    ref = net().eval()  # eval: no dropout draw, no running statistics moving between the calls
    x = images()
    expected = ref(x)
    model = copy.deepcopy(ref)
    sw.apply(model, sw.Plan([sw.autocast(BF16)]))
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert str(model).startswith("Autocast[Net](")
    assert not torch.equal(model(x), expected)
    sw.revert(model)
    assert hooks(model) == (0, 0) and "_get_name" not in model.__dict__
    assert str(model) == str(ref)
    assert torch.equal(model(x), expected)


def test_autocast_is_idempotent_and_never_nests():
    x = torch.randn(16, 128)
    model = linear_stack()
    sw.apply_autocast(model, BF16)
    out = model(x)
    sw.apply_autocast(model, BF16)
    sw.apply(model, "autocast(torch.bfloat16)")
    assert hooks(model) == (1, 1) and str(model).startswith("Autocast[Sequential](")
    sw.apply_autocast(model, BF16, "0")  # inside the root's region: nothing to do
    assert not isinstance(model[0], AutocastModule)
    assert sw.records(model)[-1].skipped == (("0", "inside the autocast root"),)
    assert torch.equal(model(x), out)

    model = linear_stack()
    sw.apply_autocast(model, BF16, "0")
    sw.apply_autocast(model, BF16, "0")
    assert isinstance(model[0], AutocastModule) and not isinstance(model[0].wrapped, AutocastModule)
    sw.apply_autocast(model, BF16)  # the root's region absorbs the one inside it
    assert not any(isinstance(m, AutocastModule) for m in model.modules())
    assert torch.equal(model(x), out)
    sw.revert(model)
    assert isinstance(model[0], nn.Linear) and hooks(model) == (0, 0)


def test_runs_plainly_inside_an_enclosing_region_and_closes_its_region_on_error():
    model = sw.apply_autocast(linear_stack(), BF16)
    with torch.autocast("cpu", dtype=BF16):  # the user's own region is in charge of the outputs
        assert model(torch.randn(4, 128)).dtype == BF16

    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    failing = sw.apply_autocast(nn.Sequential(nn.Linear(2, 2), Boom()), BF16)
    with pytest.raises(KeyError):
        failing(torch.randn(1, 2))
    assert not torch.is_autocast_enabled("cpu")


def test_nested_outputs_cast_back_and_integers_untouched():
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        ids: torch.Tensor

    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            ids = torch.arange(3)
            return {"pair": Pair(y, [y, ids]), "out": Out(y, ids), "od": collections.OrderedDict(y=y)}

    out = sw.apply_autocast(Many(), BF16)(torch.randn(2, 4))
    assert isinstance(out["pair"], Pair) and isinstance(out["out"], Out)
    assert isinstance(out["od"], collections.OrderedDict)
    assert {out["pair"].a.dtype, out["pair"].b[0].dtype, out["out"].logits.dtype, out["od"]["y"].dtype} == {
        torch.float32
    }
    assert out["pair"].b[1].dtype == out["out"].ids.dtype == torch.int64


def test_copy_pickle_and_save_keep_the_region_and_revert_acts_on_the_copy_only():
    model = sw.apply_autocast(linear_stack(), BF16)
    x = torch.randn(8, 128)
    out = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buf, weights_only=False)]
    for c in copies:
        assert torch.equal(c(x), out) and str(c) == str(model)
        sw.revert(c)
        assert hooks(c) == (0, 0)
    assert hooks(model) == (1, 1) and torch.equal(model(x), out)


def test_bad_dtypes_and_selections_refused_before_any_change(monkeypatch):
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        sw.autocast(torch.float32)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        sw.apply_half(linear_stack(), torch.float64)

    model = linear_stack()
    before = str(model)
    with pytest.raises(SelectionError):
        sw.apply_autocast(model, BF16, "nope")
    holder = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(SelectionError, match="no forward of its own"):
        sw.apply_autocast(holder, BF16, "0")

    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(ValueError, match="has no autocast for device 'cpu'"):
        sw.apply_autocast(model, BF16)
    assert str(model) == before and hooks(model) == (0, 0) and not sw.records(model)


def test_grad_scaler_flag():
    assert sw.autocast(torch.float16).needs_grad_scaler
    assert not sw.autocast(BF16).needs_grad_scaler
    assert not sw.half(torch.float16).needs_grad_scaler  # GradScaler refuses float16 gradients


# -- plans --------------------------------------------------------------------------------------
def test_plan_text_round_trip():
    plan = sw.Plan([
        sw.checkpoint(r"layer[12]"),
        sw.autocast(BF16),
        sw.autocast(BF16, pattern=["head"], keep_output_dtype=True),
        sw.half(BF16, keep=(nn.BatchNorm2d, nn.LayerNorm)),
    ])
    text = str(plan)
    assert text == (
        "checkpoint('layer[12]'), autocast(torch.bfloat16), "
        "autocast(torch.bfloat16, pattern=('head',), keep_output_dtype=True), "
        "half(torch.bfloat16, keep=(torch.nn.modules.batchnorm.BatchNorm2d, "
        "torch.nn.modules.normalization.LayerNorm))"
    )
    assert sw.Plan.parse(text) == plan
    short = sw.Plan.parse("autocast(float16), half(torch.float16)")
    assert str(short) == "autocast(torch.float16), half(torch.float16)"
    assert sw.autocast.lossy and sw.half.lossy


@pytest.mark.parametrize(
    "steps",
    [
        "autocast(torch.float16), half(torch.bfloat16)",
        "half(torch.bfloat16), autocast(torch.float16)",
        "autocast(torch.float16), autocast(torch.bfloat16)",
        "half(torch.float16), half(torch.bfloat16)",
        "half(torch.bfloat16), half(torch.bfloat16, keep=())",
    ],
)
def test_contradictory_plans_refused_before_any_change(steps):
    model = net()
    before = dtypes(model)
    with pytest.raises(sw.PlanError, match="cannot share a plan"):
        sw.apply(model, steps)
    assert dtypes(model) == before and hooks(model) == (0, 0) and not sw.records(model)


def test_step_contradicting_what_the_model_already_has_refused_before_any_change():
    model = sw.apply_half(net(), BF16)
    before, state = dtypes(model), str(model)
    with pytest.raises(ValueError, match=r"already has half\(torch.bfloat16\).*revert"):
        sw.apply_autocast(model, torch.float16)
    with pytest.raises(ValueError, match="already has"):
        sw.apply_half(model, torch.float16)
    assert dtypes(model) == before and str(model) == state and len(sw.records(model)) == 1


# -- half ---------------------------------------------------------------------------------------
def test_half_keeps_norms_float32_and_trains_in_bf16():
    model = net()
    params = list(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before: must still hold the parameters
    sw.apply_half(model, BF16)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if "bn" in name or name.startswith("stem.1"):
            assert t.dtype == (torch.int64 if name.endswith("num_batches_tracked") else torch.float32), name
        else:
            assert t.dtype == BF16, name
    assert isinstance(model.stem[1], KeepFloatModule) and "KeepFloat[BatchNorm2d]" in str(model)
    assert str(model).startswith("Half[Net](")

    x, y = images(32), torch.randint(0, 3, (32,))
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        assert out.dtype == BF16
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.stem[1].num_batches_tracked.item() == 5 and model.stem[1].running_mean.dtype == torch.float32


def test_half_casts_floating_inputs_and_leaves_token_ids_alone():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.norm = nn.LayerNorm(16)
            self.proj = nn.Linear(16, 16)

        def forward(self, ids, mask=None):
            h = self.proj(self.norm(self.emb(ids)))
            return h if mask is None else h * mask[..., None]

    torch.manual_seed(0)
    model = sw.apply_half(Tagger(), BF16)
    seen = {}
    model.emb.register_forward_pre_hook(lambda m, args: seen.update(ids=args[0].dtype))
    model.norm.wrapped.register_forward_pre_hook(lambda m, args: seen.update(norm=args[0].dtype))
    ids = torch.randint(0, 50, (2, 7))
    out = model(ids, mask=torch.ones(2, 7))
    assert seen == {"ids": torch.int64, "norm": torch.float32}
    assert out.dtype == BF16 and model.emb.weight.dtype == BF16 and model.norm.weight.dtype == torch.float32


def test_half_revert_restores_dtypes_objects_and_behaviour_up_to_rounding():
    ref = net().eval()
    x = images()
    expected = ref(x)
    model = copy.deepcopy(ref)
    params = list(model.parameters())
    sw.apply_half(model, BF16)
    assert list(model.state_dict()) == list(ref.state_dict())
    sw.revert(model)
    assert dtypes(model) == dtypes(ref) and [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert str(model) == str(ref) and hooks(model) == (0, 0)
    out = model(x)
    assert out.dtype == torch.float32
    assert rel_err(out, expected) <= TOL_BF16  # values were rounded through bfloat16


def test_half_is_idempotent_and_survives_copies():
    model = sw.apply_half(net(), BF16)
    state = copy.deepcopy(model.state_dict())
    sw.apply_half(model, BF16)
    sw.apply(model, "half(torch.bfloat16)")
    assert hooks(model) == (1, 0) and len(sw.records(model)) == 1
    assert not isinstance(model.stem[1].wrapped, KeepFloatModule)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())

    x = images()
    out = model.eval()(x)
    for c in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(c(x), out)
        sw.revert(c)
        assert c.head.weight.dtype == torch.float32
    assert model.head.weight.dtype == BF16


def test_half_with_keep_nothing_and_a_custom_keep():
    model = sw.apply_half(net(), BF16, keep=())
    assert {t.dtype for t in model.parameters()} == {BF16}
    model = sw.apply_half(net(), BF16, keep="head")
    assert model.head.weight.dtype == torch.float32 and model.stem[1].weight.dtype == BF16
    assert model(images()).dtype == BF16


# -- composition --------------------------------------------------------------------------------
def test_checkpoint_then_autocast_applies_trains_and_reverts():
    ref = net().eval()
    x = images()
    expected = ref(x)
    model = copy.deepcopy(ref)
    sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]"), sw.autocast(BF16)]))
    assert isinstance(model.layer1, sw.CheckpointModule) and str(model).startswith("Autocast[Net](")
    assert rel_err(model(x), expected) <= TOL_BF16
    out = model.train()(x)
    assert out.dtype == torch.float32
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    sw.revert(model)
    assert isinstance(model.layer1, type(ref.layer1)) and hooks(model) == (0, 0)
    # The training forward moved the BatchNorm statistics: compare with a plain Net holding them.
    plain = net()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(model.eval()(x), plain.eval()(x))


def test_half_with_autocast_of_the_same_dtype_and_checkpoint():
    model = net()
    sw.apply(model, "checkpoint('layer[12]'), half(torch.bfloat16), autocast(torch.bfloat16)")
    assert str(model).startswith("Autocast[Half[Net]](")
    out = model(images())
    assert out.dtype == torch.float32  # autocast's outputs come back as float32
    out.sum().backward()
    assert model.layer1.conv1.weight.grad.dtype == BF16
    assert model.layer1.bn1.weight.grad.dtype == torch.float32
    sw.revert(model)
    assert {t.dtype for t in model.parameters()} == {torch.float32} and str(model) == str(net())


def test_an_output_carrying_its_loss_keeps_its_logits_in_the_half_dtype():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = sw.apply(transformers.GPT2LMHeadModel(cfg), [sw.autocast(BF16)])
    ids = torch.randint(0, 100, (2, 16))
    with_loss = model(input_ids=ids, labels=ids)
    assert with_loss.logits.dtype == BF16 and with_loss.loss.dtype == torch.float32  # no float32 copy of the logits
    with_loss.loss.backward()
    assert model(input_ids=ids).logits.dtype == torch.float32  # no loss: outputs as float32, as before


def test_model_outputs_pass_without_copy_copy_which_dynamo_does_not_trace(monkeypatch):
    """On torch 2.11 / Python 3.12 dynamo breaks the graph at ``copy.copy``: every compiled BERT
    with autocast broke 5 times at the output cast. An output whose loss is float32 already comes
    back as it is; a ModelOutput with something to cast is built by its own constructor."""
    import copy

    transformers = pytest.importorskip("transformers")
    from shrinkwrap._tree import tree_map

    def no_copy(obj):
        raise AssertionError(f"copy.copy({type(obj).__name__})")

    monkeypatch.setattr(copy, "copy", no_copy)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    sw.apply(model, [sw.autocast(BF16)])
    ids = torch.randint(0, 100, (2, 16))
    with_loss = model(input_ids=ids, labels=ids)
    assert with_loss.loss.dtype == torch.float32 and with_loss.logits.dtype == BF16
    without = model(input_ids=ids)  # the logits are cast: a new MaskedLMOutput, of the same type
    assert type(without) is type(with_loss) and without.logits.dtype == torch.float32
    doubled = tree_map(lambda t: t * 2, with_loss)
    assert type(doubled) is type(with_loss) and doubled is not with_loss
    assert list(doubled.keys()) == ["loss", "logits"] and torch.equal(doubled.loss, with_loss.loss * 2)


def test_outputs_the_constructor_cannot_rebuild_keep_their_keys():
    """A ModelOutput with a key that is no field, and a dataclass dict that is no ModelOutput,
    come back with every key (by copy, as before)."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from shrinkwrap._tree import tree_map

    out = transformers.modeling_outputs.CausalLMOutputWithPast(loss=torch.ones(()), logits=torch.ones(2))
    out["extra"] = torch.ones(3)
    mapped = tree_map(lambda t: t * 2, out)
    assert type(mapped) is type(out) and list(mapped.keys()) == ["loss", "logits", "extra"]
    assert torch.equal(mapped["extra"], torch.full((3,), 2.0))

    @dataclasses.dataclass
    class Tagged(dict):
        tag: str = "x"

    tagged = Tagged()
    tagged["tag"] = torch.ones(1)
    mapped = tree_map(lambda t: t * 3, tagged)
    assert type(mapped) is Tagged and list(mapped) == ["tag"] and torch.equal(mapped["tag"], torch.full((1,), 3.0))
