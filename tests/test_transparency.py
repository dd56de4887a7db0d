"""Tools that walk a transformed model see the model they expect, or get a shrinkwrap error.

Each case is real training code that got a different answer with no error: torch.func's
functional_call through a checkpoint region, a PEFT adapter on a head the chunked loss reads,
BatchNorms hidden from isinstance (frozen the detectron2 way, weight-decay groups by type,
convert_sync_batchnorm), the Hugging Face Trainer's decay groups after half(), a hook registered
on a wrapper and dropped by revert, state a region keeps outside buffers (its own generator, a
Python counter). Then crashes with unclear errors and arguments that were accepted. Float64 on
the CPU; the reference is the same model untransformed.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import shrinkwrap as sw
from shrinkwrap._wrapper import TransparentWrapper
from toymodels import Net

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def mlp_with_bn() -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(4, 8), block, nn.Linear(8, 1)).to(F64)


def conv_bn_act(act=nn.ReLU, **bn) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, **bn), act(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, **bn), act(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).to(F64)


def images() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol.get("rtol", 0), atol=tol.get("atol", 0), msg=k)


# -- 1. torch.func.functional_call with substituted parameters and buffers ---------------------


def _meta_step(model: nn.Module, x: torch.Tensor) -> tuple[list, dict, dict]:
    """A MAML-style inner step: the loss of the model called with other parameters and buffers,
    differentiated with respect to those."""
    fast = {n: (p * 0.5 + 0.1).detach().requires_grad_() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    out = functional_call(model, {**fast, **buffers}, (x,))
    g = torch.autograd.grad(out.square().sum(), list(fast.values()))
    return list(g), buffers, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("plan", ["checkpoint('1')", r"checkpoint(r'1\.[0-2]', chain=True)"])
def test_functional_call_through_a_region_differentiates_the_substituted_tensors(plan):
    ref = mlp_with_bn()
    model = sw.apply(copy.deepcopy(ref), plan)
    x = torch.randn(16, 4, dtype=F64)
    for _ in range(2):  # a chain runs its members plainly at its first forward
        want, got = _meta_step(ref, x), _meta_step(model, x)
        for a, b in zip(want[0], got[0]):
            assert torch.equal(a, b)
        assert_equal(want[1], got[1])  # the substituted running statistics, updated once
        assert_equal(want[2], got[2])  # the module's own, untouched


def test_functional_call_on_a_real_model_with_checkpointed_blocks():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0)
    ref = tf.GPT2LMHeadModel(config).to(F64).train()
    model = sw.apply(copy.deepcopy(ref), r"checkpoint(r'transformer\.h\.\d+')")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))

    def inner_step(m):
        fast = {n: (p * 0.9).detach().requires_grad_() for n, p in m.named_parameters()}
        loss = functional_call(m, fast, (), {"input_ids": ids, "labels": ids}).loss
        return torch.autograd.grad(loss, list(fast.values()))

    for a, b in zip(inner_step(ref), inner_step(model)):
        assert torch.equal(a, b)


def test_a_torch_func_transform_over_a_region_is_a_shrinkwrap_error_naming_it():
    model = sw.apply(mlp_with_bn(), "checkpoint('1')")
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match=r"^shrinkwrap: checkpointed module '1' cannot run under a torch\.func "
                                           r"transform.*functional_call"):
        torch.func.grad(lambda p: functional_call(model, p, (torch.randn(4, 4, dtype=F64),)).sum())(params)
    model.eval()  # no recompute in eval: it runs
    torch.func.vmap(lambda x: model(x), in_dims=0)(torch.randn(3, 4, 4, dtype=F64))


def test_the_fused_activations_run_plainly_under_torch_func():
    # Without running statistics: torch.func refuses a function that updates a captured buffer.
    ref = conv_bn_act(nn.SiLU, track_running_stats=False)
    model = sw.apply(copy.deepcopy(ref), "bn_act()")
    x = images()

    def loss(m):
        return lambda p: functional_call(m, {**p, **dict(m.named_buffers())}, (x,)).square().sum()

    want = torch.func.grad(loss(ref))(dict(ref.named_parameters()))
    got = torch.func.grad(loss(model))(dict(model.named_parameters()))
    assert_equal(want, got)


# -- 2. chunked_loss and a PEFT adapter on the head --------------------------------------------


def _causal_lm(kind: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # The cache off, as in training with checkpoint regions (a plain model writing its cache reaches the
    # same loss by another route, to rounding: test_compat.expected).
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                                use_cache=False))
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2, use_cache=False))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_lora_adapter_on_the_head_after_chunked_loss_is_refused_at_the_call(kind):
    peft = pytest.importorskip("peft")
    model = sw.apply(_causal_lm(kind), "chunked_loss(chunk_size=8)")
    lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["lm_head"], r=4))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match=r"^shrinkwrap: chunked_loss\(\) on \w+ForCausalLM|LMHeadModel.*lm_head is "
                                         r"peft\.tuners\.lora\.layer\.Linear, not a plain torch\.nn\.Linear.*"
                                         r"target_modules"):
        lora(input_ids=ids, labels=ids)
    lora.eval()
    assert lora(input_ids=ids, labels=ids).logits is not None  # outside training the model's own forward runs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_chunked_loss_after_a_lora_head_names_the_adapter_s_class(kind):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_causal_lm(kind), peft.LoraConfig(target_modules=["lm_head"], r=4))
    with pytest.raises(sw.SelectionError, match=r"its lm_head is peft\.tuners\.lora\.layer\.Linear, not a plain "
                                                r"torch\.nn\.Linear"):
        sw.apply(lora.base_model.model, "chunked_loss()")


def test_chunked_loss_with_adapters_elsewhere_trains_the_adapters():
    peft = pytest.importorskip("peft")
    ref = peft.get_peft_model(_causal_lm("llama").to(F64), peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4))
    model = copy.deepcopy(ref)
    sw.apply(model.base_model.model, "chunked_loss(chunk_size=8)")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    want, got = ({n: g for n, g in _lm_grads(m, ids).items() if "lora" in n} for m in (ref, model))
    assert want and want.keys() == got.keys()
    # Hugging Face's own loss runs in float32 (logits.float()) in a float64 model; the chunked one in float64.
    assert_equal(want, got, rtol=1e-5, atol=1e-7)


def _lm_grads(model: nn.Module, ids: torch.Tensor) -> dict:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- 3. isinstance over model.modules(): the BatchNorms bn_act fused ---------------------------


def test_a_wrapper_answers_isinstance_for_the_module_it_wraps():
    model = sw.apply(Net(), "checkpoint('layer1'), autocast(torch.bfloat16, 'layer2'), bn_act()")
    assert isinstance(model.layer1, type(Net().layer1)) and isinstance(model.layer1, sw.CheckpointModule)
    assert isinstance(model.stem[1], nn.BatchNorm2d) and isinstance(model.stem[2], nn.ReLU)
    assert type(model.stem[1]).__name__ == "BatchNorm2d" and str(model.stem[1]).startswith("FusedBatchNormAct[")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(copied.layer1, sw.CheckpointModule) and isinstance(copied.stem[1], nn.BatchNorm2d)
        assert type(copied.stem[1]) is type(model.stem[1])


def _freeze_batchnorms(model: nn.Module) -> None:
    """detectron2 / mmdetection: BatchNorms in eval mode with frozen affine parameters, found by type."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)


def test_batchnorms_frozen_by_type_stay_frozen_under_bn_act():
    ref, model = conv_bn_act(), sw.apply(conv_bn_act(), "bn_act()")
    for m in (ref, model):
        m.train()
        _freeze_batchnorms(m)
    x = images()
    assert_equal(grads(ref, x), grads(model, x), rtol=1e-12, atol=1e-14)
    assert_equal(dict(ref.named_buffers()), dict(model.named_buffers()))  # statistics not updated
    assert not model[1].weight.requires_grad and not model[1].training


def test_weight_decay_groups_by_type_are_the_plain_model_s():
    def no_decay(model):
        return sorted(f"{mn}.{pn}" for mn, m in model.named_modules()
                      if isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm)) for pn, _ in m.named_parameters())

    assert no_decay(sw.apply(conv_bn_act(), "bn_act()")) == no_decay(conv_bn_act()) != []


@pytest.mark.parametrize("convert", ["sync_batchnorm", "frozen_batchnorm"])
def test_a_tool_replacing_the_fused_batchnorms_keeps_the_activations(convert):
    def frozen(model):  # detectron2's FrozenBatchNorm2d.convert_frozen_batchnorm, reduced
        for name, m in list(model.named_children()):
            if isinstance(m, nn.BatchNorm2d):
                new = nn.BatchNorm2d(m.num_features, affine=m.affine).to(F64).eval()
                new.load_state_dict(m.state_dict())
                setattr(model, name, new)
        return model

    to = nn.SyncBatchNorm.convert_sync_batchnorm if convert == "sync_batchnorm" else frozen
    ref, model = to(conv_bn_act()), to(sw.apply(conv_bn_act(), "bn_act()"))
    assert [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        type(m) for m in ref.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    ref.eval(), model.eval()  # SyncBatchNorm trains only in a process group; eval runs its module
    x = images()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


def test_a_tool_replacing_the_activation_after_a_fused_batchnorm_gets_its_own():
    ref, model = conv_bn_act(), sw.apply(conv_bn_act(), "bn_act()")
    for m in (ref, model):
        for i, child in enumerate(m):
            if isinstance(child, nn.ReLU):
                m[i] = nn.SiLU()
    x = images()
    assert_equal(grads(ref, x), grads(model, x), rtol=1e-12, atol=1e-14)


# -- 4. the Hugging Face Trainer's weight-decay groups after half() ---------------------------


def test_the_trainer_decays_the_same_parameters_after_half():
    tf = pytest.importorskip("transformers")
    ref = _causal_lm("gpt2")
    model = sw.apply(copy.deepcopy(ref), sw.half(torch.bfloat16))
    decay = tf.Trainer.get_decay_parameter_names
    assert sorted(decay(None, model)) == sorted(decay(None, ref))
    assert len(decay(None, ref)) < len(list(ref.parameters()))


# -- 5. hooks registered on a wrapper -------------------------------------------------------


HOOKED = {  # a wrapper of each kind: (model, plan, the wrapped module, input)
    "checkpoint": (conv_bn_act, "checkpoint('1')", "1", images),
    "chain member": (conv_bn_act, r"checkpoint(r'1|2', chain=True)", "2", images),
    "fused batchnorm": (conv_bn_act, "bn_act()", "1", images),
    "fused activation": (conv_bn_act, "bn_act()", "2", images),
    "space_to_depth": (lambda: _stride2(), "space_to_depth()", "0", images),
    "swiglu": (lambda: _llama_mlp(), "swiglu(pattern='0')", "0", lambda: torch.randn(2, 4, 32, dtype=F64)),
    "autocast": (conv_bn_act, "autocast(torch.bfloat16, '3')", "3", images),
}


@pytest.mark.parametrize("case", sorted(HOOKED))
def test_a_hook_on_a_wrapper_runs_and_stays_on_the_module_after_revert(case):
    make, plan, name, batch = HOOKED[case]

    def scale(module, args, out):  # a hook that changes what the module returns
        return out * 2

    x = batch()
    ref = make()
    ref(x)  # a lazy module's first forward
    model = copy.deepcopy(ref)
    ref.get_submodule(name).register_forward_hook(scale)
    sw.apply(model, plan)
    assert isinstance(model.get_submodule(name), TransparentWrapper)
    handle = model.get_submodule(name).register_forward_hook(scale)
    tol = dict(rtol=1e-12, atol=1e-14) if case != "autocast" else dict(rtol=2e-2, atol=1e-2)
    for _ in range(2):
        assert_equal(grads(ref, x), grads(model, x), **tol)
    sw.revert(model)
    assert not isinstance(model.get_submodule(name), TransparentWrapper)
    assert_equal(grads(ref, x), grads(model, x), rtol=1e-12, atol=1e-14)  # still hooked
    handle.remove()
    assert not model.get_submodule(name)._forward_hooks


# -- 6. state a region keeps outside buffers and the global RNG --------------------------------


class Noisy(nn.Module):
    """Noise from a generator of its own, and a Python counter that picks a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.noise = torch.Generator().manual_seed(3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x) + torch.randn(x.shape, generator=self.noise, dtype=x.dtype)
        return y * 2 if self.calls % 2 else y.tanh()


@pytest.mark.parametrize("plan", ["checkpoint('1')", r"checkpoint(r'0|1', chain=True)"])
def test_a_region_s_own_generator_and_counter_run_once_per_step(plan):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), Noisy(), nn.Linear(8, 1)).to(F64)
    model = sw.apply(copy.deepcopy(ref), plan)
    x = torch.randn(6, 4, dtype=F64)
    for _ in range(3):
        assert_equal(grads(ref, x), grads(model, x))
        assert model[1].calls == ref[1].calls
        assert torch.equal(model[1].noise.get_state(), ref[1].noise.get_state())


# -- crashes with unclear errors ------------------------------------------------------------


def test_a_gradient_penalty_through_bn_act_equals_the_plain_model_s():
    def penalised(model, x):
        model.zero_grad()
        loss = model(x).square().sum()
        (g,) = torch.autograd.grad(loss, model[1].weight, create_graph=True)
        (loss + g.square().sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, model = conv_bn_act(nn.SiLU), sw.apply(conv_bn_act(nn.SiLU), "bn_act()")
    x = images()
    assert_equal(penalised(ref, x), penalised(model, x), rtol=1e-10, atol=1e-12)


def test_a_gradient_penalty_through_chunked_loss_is_refused_in_backward():
    model = sw.apply(_causal_lm("llama").to(F64), "chunked_loss(chunk_size=8)")
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match=r"^shrinkwrap: chunked_loss\(\) computes the head's gradients in the "
                                           r"forward.*create_graph=True"):
        torch.autograd.grad(loss, model.lm_head.weight, create_graph=True)


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("call, error, message", [
    (lambda: sw.offload(min_bytes=-1), ValueError, r"offload\(min_bytes=-1\): min_bytes is the size in bytes"),
    (lambda: sw.offload(min_bytes="1MB"), TypeError, r"offload\(\) takes min_bytes= an int; got str '1MB'"),
    (lambda: sw.offload(devices="cuda"), TypeError, r"offload\(\) takes devices= a tuple of str; got str 'cuda'"),
    (lambda: sw.checkpoint("layer1", chain=1), TypeError, r"checkpoint\(\) takes chain= True or False; got int 1"),
    (lambda: sw.checkpoint("layer1", clone=True), TypeError,
     r"checkpoint\('layer1', clone=True\): got an unexpected keyword argument 'clone'; checkpoint\(\) takes "
     r"\(pattern, clone_inputs=False, chain=False, save=\(\)\)"),
    (lambda: sw.checkpoint(), TypeError, r"checkpoint\(\): missing a required argument: 'pattern'"),
    (lambda: sw.chunked_loss(chunk_size="8"), TypeError, r"chunked_loss\(\) takes chunk_size= an int; got str '8'"),
])
def test_a_step_s_wrong_argument_is_a_shrinkwrap_error(call, error, message):
    with pytest.raises(error, match=r"^shrinkwrap: " + message):
        call()


def test_plan_text_and_python_give_one_error():
    with pytest.raises(TypeError) as python:
        sw.checkpoint("layer1", clone=True)
    with pytest.raises(sw.PlanError) as text:
        sw.Plan.parse("checkpoint('layer1', clone=True)")
    assert str(python.value) == str(text.value)


def test_half_on_a_half_model_keeps_the_norms_in_float32_and_reverts():
    model = Net().to(torch.float16)
    sw.apply(model, sw.half(torch.float16))
    assert model.layer1.conv1.weight.dtype == torch.float16 and model.layer1.bn1.weight.dtype == torch.float32
    assert model(images().float()).dtype == torch.float16
    sw.revert(model)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_a_torch_func_transform_over_an_offload_region_is_a_shrinkwrap_error_naming_it():
    model = sw.apply(mlp_with_bn(), "offload('1', devices=('cpu',), min_bytes=0, keep_last=False)")
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match=r"^shrinkwrap: offloaded module '1' cannot run under a torch\.func"):
        torch.func.grad(lambda p: functional_call(model, p, (torch.randn(4, 4, dtype=F64),)).sum())(params)


def _stride2() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Flatten(),
                         nn.LazyLinear(3)).to(F64)


def _llama_mlp() -> nn.Module:
    return nn.Sequential(_causal_lm("llama").model.layers[0].mlp.to(F64))


class NaiveSwish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


# (model, plan, input): every exact step under a second backward; chunked_loss is refused above.
PENALISED = {
    "checkpoint": (conv_bn_act, "checkpoint('1')", images),
    "chain": (conv_bn_act, r"checkpoint(r'[0-2]', chain=True)", images),
    "bn_act": (lambda: conv_bn_act(nn.SiLU), "bn_act()", images),
    "offload": (conv_bn_act, "offload(r'[0-4]', devices=('cpu',), min_bytes=0)", images),
    "space_to_depth": (_stride2, "space_to_depth()", images),
    "swiglu": (_llama_mlp, "swiglu(pattern='0')", lambda: torch.randn(2, 4, 32, dtype=F64)),
    "swish": (lambda: conv_bn_act(NaiveSwish), "swish()", images),
}


@pytest.mark.parametrize("case", sorted(PENALISED))
def test_a_gradient_penalty_through_each_exact_step_equals_the_plain_model_s(case):
    make, plan, batch = PENALISED[case]
    x = batch()
    ref = make()
    ref(x)  # a lazy module's first forward
    model = sw.apply(copy.deepcopy(ref), plan)
    assert sw.records(model)[-1].matched

    def penalised(m):
        m.zero_grad()
        loss = m(x).square().sum()
        gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        (loss + sum(g.square().sum() for g in gs)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    assert_equal(penalised(ref), penalised(model), rtol=1e-10, atol=1e-12)


# -- tools that compose: PEFT LoRA, EMA ------------------------------------------------------


LORA_PLANS = {"gpt2": r"checkpoint(r'transformer\.h\.\d+')", "llama": r"checkpoint(r'model\.layers\.\d+'), swiglu()"}


def _lora_train(model: nn.Module, ids: torch.Tensor, steps: int = 2) -> list[dict]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = []
    for _ in range(steps):
        torch.manual_seed(7)  # dropout
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return out


@pytest.mark.parametrize("kind", sorted(LORA_PLANS))
@pytest.mark.parametrize("order", ["plan, then LoRA", "LoRA, then plan"])
def test_lora_with_a_plan_trains_saves_and_merges_as_without(kind, order, tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(target_modules=["c_attn"] if kind == "gpt2" else ["q_proj", "up_proj"], r=4,
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(_causal_lm(kind).to(F64).train(), config)
    model = copy.deepcopy(ref)
    inner = model.base_model.model
    if order == "plan, then LoRA":  # the plan on the bare model, LoRA over it
        model = peft.get_peft_model(sw.apply(copy.deepcopy(_causal_lm(kind)).to(F64).train(), LORA_PLANS[kind]),
                                    config)
        model.load_state_dict(ref.state_dict())
    else:
        sw.apply(inner, LORA_PLANS[kind])
    assert any(isinstance(m, TransparentWrapper) for m in model.modules())
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    for want, got in zip(_lora_train(ref, ids), _lora_train(model, ids)):
        assert_equal(want, got)
    model.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(_causal_lm(kind).to(F64), tmp_path / "adapter")
    assert_equal({n: p for n, p in loaded.named_parameters() if "lora" in n},
                 {n: p for n, p in ref.named_parameters() if "lora" in n})
    merged, plain = model.merge_and_unload(), ref.merge_and_unload()
    assert_equal(dict(merged.named_parameters()), dict(plain.named_parameters()))


def test_an_ema_of_a_transformed_model_averages_the_same_parameters():
    ref, model = conv_bn_act(nn.SiLU), sw.apply(conv_bn_act(nn.SiLU), "checkpoint('1'), bn_act()")
    emas = [torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9),
                                                use_buffers=True) for m in (ref, model)]
    x = images()
    for _ in range(3):
        for m, ema in zip((ref, model), emas):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            grads(m, x)
            opt.step()
            ema.update_parameters(m)
    assert_equal(emas[0].module.state_dict(), emas[1].module.state_dict(), rtol=1e-12, atol=1e-14)
    assert_equal({"out": emas[0](x)}, {"out": emas[1](x)}, rtol=1e-12, atol=1e-14)


def test_the_harness_s_own_hooks_leave_fused_steps_fused():
    """The measuring harness logs every module through hooks that only read: bn_act still fuses
    under them (on a CPU its figure is read in that logged iteration), and chunked_loss, which
    refuses a head with hooks, runs."""
    batch = images()
    report = sw.plan_report("bn_act()", lambda: conv_bn_act(nn.SiLU), batch, device="cpu", iterations=1)
    plain, fused = (row.profile.saved for row in report.rows)
    assert fused < plain
    lm = sw.apply(_causal_lm("llama"), "chunked_loss(chunk_size=8)")
    ids = torch.randint(0, 64, (2, 8))
    assert sw.measure(lm, {"input_ids": ids, "labels": ids}, device="cpu", iterations=1).saved > 0
