"""swiglu: a SiLU- or GELU-gated MLP's product keeping two tensors for backward (transforms/swiglu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.transforms.swiglu import _GatedProduct

tf = pytest.importorskip("transformers")

F64 = torch.float64
BLOCKS = r"model\.layers\.\d+"


def _llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1), **overrides})
    return tf.LlamaForCausalLM(config).to(F64).train()


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
# GELU-gated (Gemma's tanh GELU, by default) and fused-projection (Phi-3, GLM) language models.
GATED = {
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**_SMALL)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**_SMALL, sliding_window=8)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_SMALL, sliding_window=8)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**_SMALL)),
    "phi3_gelu_tanh": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**_SMALL, hidden_act="gelu_pytorch_tanh")),
    "glm": lambda: tf.GlmForCausalLM(tf.GlmConfig(**_SMALL)),
    "llama_exact_gelu": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, hidden_act="gelu")),
}


def _gated(name: str) -> nn.Module:
    torch.manual_seed(0)
    return GATED[name]().to(F64).train()


def _batch(embeds: nn.Module | None = None) -> dict:
    """Token ids, or (``embeds``: the model's embedding) the embedded tokens, a leaf whose gradient
    :func:`_run` returns."""
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    if embeds is None:
        return dict(input_ids=ids, labels=ids)
    return dict(inputs_embeds=embeds(ids).detach(), labels=ids)


def _run(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(7)  # attention dropout draws the same masks
    batch = {k: v.clone().requires_grad_() if k == "inputs_embeds" else v for k, v in batch.items()}
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if "inputs_embeds" in batch:
        grads["inputs_embeds"] = batch["inputs_embeds"].grad
    return loss.detach(), grads


def _assert_bit_equal(ref: tuple, got: tuple) -> None:
    assert torch.equal(ref[0], got[0])
    assert list(ref[1]) == list(got[1])
    for name in ref[1]:
        assert torch.equal(ref[1][name], got[1][name]), name


@pytest.mark.parametrize("plan", ["swiglu()", rf"checkpoint(r'{BLOCKS}'), swiglu()"])
def test_llama_loss_and_gradients_bit_equal_in_float64(plan):
    model, batch = _llama(), _batch()
    ref = _run(copy.deepcopy(model), batch)
    sw.apply(model, plan)
    assert isinstance(model.model.layers[0].mlp, sw.MemoryEfficientSwiGLU)
    _assert_bit_equal(ref, _run(model, batch))


def test_bfloat16_autocast_bit_equal():
    """The same ops in the same order: bit for bit in bfloat16 too (CPU autocast)."""
    model, batch = _llama().float(), _batch()
    plain = copy.deepcopy(model)
    sw.apply(model, "swiglu()")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _run(plain, batch), _run(model, batch)
    _assert_bit_equal(ref, got)


@pytest.mark.parametrize("name", list(GATED))
def test_gated_models_bit_equal_in_float64(name):
    """Every parameter's gradient and the input's: the tanh- or exact-GELU gate and a fused
    gate_up_proj, whose gradient is one tensor made in its halves, as autograd's concatenation."""
    model = _gated(name)
    batch = _batch(model.get_input_embeddings())
    ref = _run(copy.deepcopy(model), batch)
    sw.apply(model, rf"checkpoint(r'{BLOCKS}'), swiglu()")
    assert isinstance(model.model.layers[0].mlp, sw.MemoryEfficientSwiGLU)
    got = _run(model, batch)
    assert "inputs_embeds" in got[1]  # and every parameter's but the embedding's (tied to the head or unused)
    assert {n for n, _ in model.named_parameters()} - set(got[1]) <= {"model.embed_tokens.weight"}
    _assert_bit_equal(ref, got)


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3", "phi3", "phi3_gelu_tanh"])
@pytest.mark.parametrize("how", ["autocast", "weights"])
def test_gated_models_bit_equal_in_bfloat16(name, how):
    """Rounded in bfloat16 at every op as autograd's are (bfloat16 weights, or CPU autocast)."""
    model = _gated(name).to(torch.bfloat16 if how == "weights" else torch.float32)
    batch = _batch(model.get_input_embeddings())
    plain = copy.deepcopy(model)
    sw.apply(model, "swiglu()")
    assert isinstance(model.model.layers[0].mlp, sw.MemoryEfficientSwiGLU)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        ref, got = _run(plain, batch), _run(model, batch)
    _assert_bit_equal(ref, got)


@pytest.mark.parametrize("name", ["gemma", "phi3"])
def test_gated_models_save_one_intermediate_tensor_fewer_per_mlp(name):
    """Gemma: the gate, tanh-GELU of it and the up projection, less the activation. Phi-3: the
    fused projection's output (gate and up, one storage) and the activation, less the activation:
    the fused output is kept as it is, not copied."""
    model = _gated(name)
    model.config.attention_dropout = 0.0
    batch = _batch()
    plain = sw.saved_tensor_bytes(model, **batch)
    sw.apply(model, "swiglu()")
    tokens, width, layers = 2 * 12, model.config.intermediate_size, model.config.num_hidden_layers
    assert plain - sw.saved_tensor_bytes(model, **batch) == layers * tokens * width * 8


def test_saves_one_intermediate_tensor_fewer_per_mlp():
    model, batch = _llama(attention_dropout=0.0), _batch()
    plain = sw.saved_tensor_bytes(model, **batch)
    sw.apply(model, "swiglu()")
    tokens, width, layers = 2 * 12, model.config.intermediate_size, model.config.num_hidden_layers
    assert plain - sw.saved_tensor_bytes(model, **batch) == layers * tokens * width * 8


@pytest.mark.parametrize("kind", ["swish", "gelu_tanh", "gelu"])
def test_gradient_of_gradient(kind):
    gate = torch.randn(3, 5, dtype=F64, requires_grad=True)
    up = torch.randn(3, 5, dtype=F64, requires_grad=True)
    for fn, args in ((lambda g, u: _GatedProduct.apply(kind, g, u), (gate, up)),
                     (lambda gu: _GatedProduct.apply(kind, gu, None), (torch.cat([gate, up], -1),))):
        assert torch.autograd.gradcheck(fn, args)
        assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("frozen", ["up_proj", "gate_proj", "both"])
def test_frozen_projections(frozen):
    """Only what needs a gradient gets one (LoRA-style training freezes projections)."""
    model, batch = _llama(attention_dropout=0.0), _batch()
    for layer in model.model.layers:
        for part in (["up_proj", "gate_proj"] if frozen == "both" else [frozen]):
            getattr(layer.mlp, part).requires_grad_(False)
    ref = _run(copy.deepcopy(model), batch)
    _assert_bit_equal(ref, _run(sw.apply(model, "swiglu()"), batch))


@pytest.mark.parametrize("name, targets", [("gemma", ["gate_proj", "up_proj"]), ("phi3", ["gate_up_proj"])])
def test_lora_projections_with_dropout(name, targets):
    """LoRA's dropout in the projections draws its masks in the MLP's own order: the probe runs the
    MLP and the wrapper from one RNG state, and training gives the plain gradients."""
    peft = pytest.importorskip("peft")
    model, batch = _gated(name), _batch()
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, r=4, lora_dropout=0.3,
                                                       init_lora_weights=False)).train()
    ref = _run(copy.deepcopy(model), batch)
    rng = torch.get_rng_state()
    sw.apply(model, "swiglu()")
    assert torch.equal(torch.get_rng_state(), rng)  # the probe draws from its own stream
    assert len(sw.records(model)[0].matched) == 2
    _assert_bit_equal(ref, _run(model, batch))


def test_eval_and_no_grad_run_the_mlp_itself():
    model, batch = _llama(), _batch()
    sw.apply(model, "swiglu()")
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.wrapped.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch)
    assert len(calls) == 2


def test_names_text_revert_and_idempotence():
    model = _llama()
    keys = list(model.state_dict())
    plan = sw.Plan.parse("swiglu()")
    assert str(plan) == "swiglu()"
    sw.apply(model, plan)
    sw.apply(model, plan)
    assert list(model.state_dict()) == keys
    record = sw.records(model)[0]
    assert record.matched == ("model.layers.0.mlp", "model.layers.1.mlp")
    sw.revert(model)
    assert type(model.model.layers[0].mlp) is type(_llama().model.layers[0].mlp)


def test_passes_over_what_is_not_a_silu_or_gelu_gated_mlp():
    with pytest.raises(sw.SelectionError, match="is ReLU, not SiLU or GELU"):
        sw.apply(_llama(hidden_act="relu"), "swiglu()")
    # gelu_new: the tanh GELU written out, close to torch's but not bit for bit. Where the CPU's
    # kernels make it equal on the activation's probe (values in [-6, 6]), the MLP's probe, at rows
    # up to 1000x, still tells them apart.
    with pytest.raises(sw.SelectionError, match="is NewGELUActivation, not SiLU or GELU|does not compute down_proj"):
        sw.apply(_llama(hidden_act="gelu_new"), "swiglu()")
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    refusal = r"found no SiLU- or GELU-gated MLP \(gate_proj and up_proj, or gate_up_proj\) in GPT2LMHeadModel"
    with pytest.raises(sw.SelectionError, match=refusal):
        sw.apply(gpt2, "swiglu()")
    with pytest.raises(ValueError, match="MemoryEfficientSwiGLU cannot wrap GPT2MLP"):
        sw.MemoryEfficientSwiGLU(gpt2.transformer.h[0].mlp)
    phi3 = _gated("phi3")
    phi3.model.layers[1].mlp.activation_fn = nn.ReLU()
    sw.apply(phi3, "swiglu()")
    assert sw.records(phi3)[0].matched == ("model.layers.0.mlp",)
    assert sw.records(phi3)[0].skipped == (
        ("model.layers.1.mlp", "its activation_fn is ReLU, not SiLU or GELU (exact or tanh) as torch computes them"),)
    model = _llama()
    model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    sw.apply(model, "swiglu()")
    assert sw.records(model)[0].matched == ("model.layers.0.mlp",)
    assert sw.records(model)[0].skipped == (("model.layers.1.mlp", "has hooks, which the wrapper would not run"),)


class _DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn, self.drop = nn.SiLU(), nn.Dropout(0.5)

    def forward(self, x):
        return self.down_proj(self.drop(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class _FusedDropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(8, 32), nn.Linear(16, 8)
        self.activation_fn, self.drop = nn.GELU(approximate="tanh"), nn.Dropout(0.5)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.drop(up * self.activation_fn(gate)))


class _FusedUpFirstMLP(_FusedDropoutMLP):  # the halves the other way round
    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def test_an_mlp_that_computes_more_is_left_alone():
    model = nn.Sequential(_DropoutMLP(), _FusedDropoutMLP(), _FusedUpFirstMLP()).eval()  # dropout would be
    # skipped were it judged in eval
    with pytest.raises(sw.SelectionError, match="dropout, a clamp or more inside"):
        sw.apply(model, "swiglu()")
    model.insert(0, _PlainMLP())
    sw.apply(model, "swiglu()")
    assert [n for n, _ in sw.records(model)[0].skipped] == ["1", "2", "3"]


class _PlainMLP(_DropoutMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _ClampedMLP(_DropoutMLP):  # as transformers' DeepseekV4MLP (swiglu_limit)
    def forward(self, x):
        gate, up = self.gate_proj(x).clamp(max=10.0), self.up_proj(x).clamp(-10.0, 10.0)
        return self.down_proj(self.act_fn(gate) * up)


def test_an_mlp_that_clamps_large_values_is_left_alone():
    model = nn.Sequential(_ClampedMLP()).to(F64).train()
    with pytest.raises(sw.SelectionError, match="does not compute"):
        sw.apply(model, "swiglu()")
    deepseek = getattr(getattr(getattr(tf.models, "deepseek_v4", None), "modeling_deepseek_v4", None), "DeepseekV4MLP",
                       None)
    if deepseek is not None:  # transformers 5.x
        real = nn.Sequential(deepseek(tf.DeepseekV4Config(hidden_size=16, intermediate_size=32))).to(F64).train()
        with pytest.raises(sw.SelectionError, match="does not compute"):
            sw.apply(real, "swiglu()")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):  # large probe rows overflow both sides alike
        plain = sw.apply(nn.Sequential(_PlainMLP()).to(dtype), "swiglu()")
        assert sw.records(plain)[0].matched == ("0",), dtype


def test_an_activation_replaced_after_wrapping_runs_the_mlp_itself():
    model, batch = _gated("gemma"), _batch()
    sw.apply(model, "swiglu()")
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.ReLU()
    plain = sw.revert(copy.deepcopy(model))
    _assert_bit_equal(_run(plain, batch), _run(model, batch))


def test_traces_without_a_graph_break():
    model, batch = _llama(attention_dropout=0.0), _batch()
    ref = _run(copy.deepcopy(model), batch)
    sw.apply(model, "swiglu(), compile(fullgraph=True, backend='aot_eager')")
    torch._dynamo.reset()
    loss, grads = _run(model, batch)
    torch.testing.assert_close(loss, ref[0], rtol=1e-9, atol=1e-12)
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-12)


def test_autoplan_candidate_only_where_it_applies():
    assert [str(c) for c in sw.autoplan.__globals__["candidates"](_llama()) if "swiglu" in str(c)] == ["swiglu()"]
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    assert not [c for c in sw.autoplan.__globals__["candidates"](gpt2) if "swiglu" in str(c)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mlp_peak_on_cuda():
    """One bfloat16 MLP's forward and backward: the peak (in backward: six intermediate-size
    tensors alive, on an H100 6.1 of them with the weights' gradients) falls by one such tensor,
    within a tenth of one."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=1024, intermediate_size=4096)
    mlp = tf.models.llama.modeling_llama.LlamaMLP(config).cuda().to(torch.bfloat16)
    x = torch.randn(8, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    n = 8 * 1024 * 4096 * 2

    def peak(module: nn.Module) -> int:
        x.grad = None
        for p in module.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        module(x).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    plain = peak(mlp)
    fused = peak(sw.apply(nn.Sequential(mlp), "swiglu()"))
    assert plain - fused >= 0.9 * n, (plain / n, fused / n)
