"""chunked_loss: a causal LM's head and loss chunk by chunk over tokens (transforms/lm_head/)."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shrinkwrap as sw

tf = pytest.importorskip("transformers")

F64 = torch.float64
BATCH, SEQ = 2, 12
EXACT = dict(rtol=1e-12, atol=1e-12)


def _gpt2(vocab: int = 64) -> nn.Module:  # tied embeddings, lm_head without bias
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                           eos_token_id=0)
    return tf.GPT2LMHeadModel(config).to(F64).train()


def _llama(vocab: int = 64) -> nn.Module:  # untied
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            attention_dropout=0.1, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(config).to(F64).train()


def _opt(vocab: int = 64) -> nn.Module:  # its forward calls the base model's decoder, self.model.decoder(...)
    torch.manual_seed(0)
    config = tf.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.1, pad_token_id=0)
    return tf.OPTForCausalLM(config).to(F64).train()


MODELS = {"gpt2": _gpt2, "llama": _llama, "opt": _opt}


def _batch(vocab: int = 64) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0  # the second sequence is padded
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # and one token of the first is not counted
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _reference_loss(model: nn.Module, batch: dict, num_items=None) -> torch.Tensor:
    """The model's own loss in float64: its logits, shifted labels, cross-entropy (HF's loss
    upcasts to float32 only, which would not do for a float64 comparison)."""
    batch = dict(batch)
    labels = batch.pop("labels")
    logits = model(**batch).logits
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    if num_items is None:
        return F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    return F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum") / num_items


def _loss_and_grads(model: nn.Module, fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    torch.manual_seed(100)  # dropout draws the same masks
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("chunk", [5, 7, 24, 1024])  # 7 does not divide the 24 tokens
def test_float64_loss_and_every_gradient_equal_the_models_own(arch, chunk):
    model, batch = MODELS[arch](), _batch()
    ref_loss, ref_grads = _loss_and_grads(model, lambda: _reference_loss(model, batch))
    torch.manual_seed(100)
    own = model(**batch).loss  # HF's own loss (in float32): the reference is the same loss
    torch.testing.assert_close(own.double(), ref_loss, rtol=1e-6, atol=1e-6)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=chunk)]))
    loss, grads = _loss_and_grads(model, lambda: model(**batch).loss)
    assert loss.dtype == F64
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **EXACT, msg=name)


@pytest.mark.parametrize("arch", MODELS)
def test_num_items_in_batch_divides_the_sum(arch):
    model, batch = MODELS[arch](), _batch()
    n = torch.tensor(37)
    ref_loss, ref_grads = _loss_and_grads(model, lambda: _reference_loss(model, batch, num_items=n))
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=5)]))
    loss, grads = _loss_and_grads(model, lambda: model(**batch, num_items_in_batch=n).loss)
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **EXACT, msg=name)


@pytest.mark.parametrize("frozen", ["head", "hidden", None])
def test_the_head_loss_itself_with_bias_scaled_output_and_frozen_inputs(frozen):
    from shrinkwrap.transforms.lm_head import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = (torch.randn(*s, generator=g, dtype=F64) for s in ((23, 8), (50, 8), (50,)))
    labels = torch.randint(0, 50, (23,), generator=g)
    labels[[2, 9]] = -100
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    for name, t in leaves.items():
        t.requires_grad_(frozen not in (name, "head" if name in ("weight", "bias") else ""))
    ref = F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=-100) * 3  # a scaled loss
    ref_grads = torch.autograd.grad(ref, [t for t in leaves.values() if t.requires_grad])
    out = chunked_cross_entropy(hidden, weight, bias, labels, chunk_size=5) * 3
    grads = torch.autograd.grad(out, [t for t in leaves.values() if t.requires_grad])
    torch.testing.assert_close(out, ref, **EXACT)
    assert len(grads) == len(ref_grads) > 0
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [5, 8, 64])  # 24 rows: odd groups of two chunks, whole groups, one chunk
def test_bf16_chunks_match_a_float64_head_of_the_same_bf16_inputs(chunk, with_bias):
    """Under bfloat16 autocast the chunk gradients are masked and narrowed in one pass and summed into
    the weight's float32 gradient two chunks at a time (without a bias): every row reaches the sum
    once, ignored rows not at all."""
    from shrinkwrap.transforms.lm_head import chunked_cross_entropy

    g = torch.Generator().manual_seed(1)
    hidden, weight, bias = (torch.randn(*s, generator=g) for s in ((24, 16), (40, 16), (40,)))
    bias = bias if with_bias else None
    labels = torch.randint(0, 40, (24,), generator=g)
    labels[[0, 7, 23]] = -100
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_cross_entropy(hidden, weight, bias, labels, chunk_size=chunk)
    grads = torch.autograd.grad(out, leaves)
    # The reference: the same bf16-rounded operands, the rest in float64.
    wide = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in leaves]
    ref = F.cross_entropy(F.linear(wide[0], wide[1], wide[2] if with_bias else None), labels)
    ref_grads = torch.autograd.grad(ref, wide)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-3)
    for a, b, leaf in zip(grads, ref_grads, leaves):
        assert a.dtype == leaf.dtype
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("half, kept", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_gradients_wait_for_backward_in_bfloat16_as_the_plain_autocast_model_rounds_them(half, kept):
    """Under bfloat16 autocast the head's gradients wait for backward in bfloat16 (the plain model's
    matmuls give them in bfloat16 too; a 128k-vocabulary head's float32 weight gradient is 1 GiB);
    under float16 in float32, which the GradScaler's factor has not reached yet. The gradients
    that reach the parameters have the parameters' dtype."""
    from shrinkwrap.transforms.lm_head import chunked_cross_entropy

    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(12, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 30, (12,), generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        with torch.autocast("cpu", dtype=half):
            loss = chunked_cross_entropy(hidden, weight, None, labels, chunk_size=5)
    assert ((30, 8), kept) in saved and ((12, 8), kept) in saved
    assert not any(shape == (12, 30) or shape == (5, 30) for shape, _ in saved)  # no logits
    loss.backward()
    assert weight.grad.dtype == hidden.grad.dtype == torch.float32


def test_tied_weight_gets_both_gradients():
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=5)]))
    model(**_batch()).loss.backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("arch", MODELS)
def test_logits_unchanged_without_labels_and_in_eval(arch):
    model, batch = MODELS[arch](), _batch()
    plain = copy.deepcopy(model)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=5)]))
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    torch.manual_seed(3)
    a = model(**no_labels).logits
    torch.manual_seed(3)
    torch.testing.assert_close(a, plain(**no_labels).logits, rtol=0, atol=0)
    model.eval(), plain.eval()
    out, ref = model(**batch), plain(**batch)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    model.train()
    assert model(**batch).logits is None  # chunked training returns no logits


def test_return_dict_false_gives_a_tuple_with_the_models_positions():
    model, batch = _gpt2(), _batch()
    plain = model(**batch, return_dict=False, use_cache=True)
    sw.apply(model, sw.Plan([sw.chunked_loss()]))
    out = model(**batch, return_dict=False, use_cache=True)
    assert isinstance(out, tuple) and len(out) == len(plain) and out[0].dim() == 0
    assert out[1] is None and plain[1].shape[-1] == 64  # the logits' place, empty in chunked training
    assert type(out[2]) is type(plain[2])  # the cache where it was


@pytest.mark.parametrize("frozen_head", [False, True])
def test_saved_bytes_drop_by_the_logits(frozen_head):
    vocab, hidden, tokens = 2000, 32, 4 * 64
    model = _llama(vocab).float()
    model.lm_head.weight.requires_grad_(not frozen_head)
    ids = torch.randint(1, vocab, (4, 64), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids)
    logits_bytes = tokens * vocab * 4
    before = sw.saved_tensor_bytes(lambda: model(**batch).loss)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=8)]))
    after = sw.saved_tensor_bytes(lambda: model(**batch).loss)
    # The plain model keeps the log-softmax of the whole logits. The chunked one keeps no tensor of
    # tokens x vocabulary: it keeps the gradient of the hidden states, which replaces the head's
    # saved input, and the head weight's gradient (vocabulary x hidden, made by backward in any
    # case), which a frozen head does not get.
    weight_grad, hidden_grad = (0 if frozen_head else vocab * hidden * 4), tokens * hidden * 4
    dropped = before - after
    assert 0.99 * logits_bytes - weight_grad - hidden_grad <= dropped <= 1.01 * logits_bytes - weight_grad + hidden_grad


def test_revert_gives_the_plain_forward_back_and_keys_stay():
    model, batch = _llama(), _batch()
    keys = list(model.state_dict())
    sw.apply(model, sw.Plan([sw.chunked_loss()]))
    assert list(model.state_dict()) == keys
    assert type(model).__name__ in repr(model) and "ChunkedLoss[" in repr(model)
    assert sw.records(model)[0].matched == ("", "lm_head")
    sw.revert(model)
    assert "forward" not in model.__dict__ and "_get_name" not in model.__dict__
    assert model(**batch).logits is not None


def test_plan_text_round_trip_and_applying_twice():
    plan = sw.Plan([sw.chunked_loss(chunk_size=256)])
    assert str(plan) == "chunked_loss(chunk_size=256)"
    assert sw.Plan.parse(str(plan)) == plan
    assert str(sw.chunked_loss()) == "chunked_loss()"
    model = _gpt2()
    sw.apply(model, plan)
    sw.apply(model, plan)  # skipped: applied already
    assert len(sw.records(model)) == 1
    with pytest.raises(ValueError, match="already has chunked_loss"):
        sw.chunked_loss(chunk_size=8).apply(model)
    with pytest.raises(ValueError, match="chunk_size"):
        sw.chunked_loss(chunk_size=0)


def test_deepcopy_and_pickle_keep_the_step():
    model, batch = _gpt2(), _batch()
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=5)]))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin(**batch).logits is None
        torch.testing.assert_close(twin.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                   model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits)
        model.train()


def test_refuses_models_it_cannot_handle_exactly():
    with pytest.raises(sw.SelectionError, match="lm_head"):
        sw.chunked_loss().apply(nn.Linear(3, 3))
    model = _gpt2()
    model.loss_function = lambda *a, **k: None
    with pytest.raises(sw.SelectionError, match="loss_function of its own"):
        sw.chunked_loss().apply(model)
    cohere = tf.CohereForCausalLM(tf.CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(sw.SelectionError, match="logit_scale"):
        sw.chunked_loss().apply(cohere)
    assert sw.chunked_loss.candidates(_gpt2(), sw.step.Context()) and not sw.chunked_loss.candidates(
        nn.Linear(3, 3), sw.step.Context())


class _Toy(nn.Module):
    """A causal LM as Hugging Face writes one, small enough to vary its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
        self.config, self.vocab_size = tf.PretrainedConfig(), 64

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def loss_function(self, logits, labels, vocab_size, **kwargs):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        hidden_states = outputs[..., :]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _ScaledHidden(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        hidden_states = outputs / 4
        logits = self.lm_head(hidden_states)
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _SlicedVocab(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        logits = logits[..., :60]
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _ZLoss(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        loss = self.loss_function(logits, labels, self.vocab_size)
        loss = loss + 1e-4 * logits.logsumexp(-1).pow(2).mean()
        return loss, logits


class _OtherSoftcap(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        logits = torch.tanh(logits / 30.0) * 30.0
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _HeadInsideMore(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = 2 * self.lm_head(outputs)
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _InPlace(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        logits.mul_(0.25)
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _MaskedVocab(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        logits[..., 60:] = -1e4
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _HalfSoftcap(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        logits = logits / self.config.final_logit_softcapping
        loss = self.loss_function(logits, labels, self.vocab_size)
        return loss, logits


class _SumOfLosses(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        lm_loss = self.loss_function(logits, labels, self.vocab_size)
        total = lm_loss + 1e-4 * logits.logsumexp(-1).pow(2).mean()
        return total, logits


class _OtherArguments(_Toy):
    def forward(self, input_ids, labels=None):
        outputs = self.model(input_ids)
        logits = self.lm_head(outputs)
        loss = self.loss_function(logits, labels, self.vocab_size, ignore_index=0)
        return loss, logits


@pytest.mark.parametrize("toy, quoted", [
    (_InPlace, "logits.mul_(0.25)"), (_MaskedVocab, "logits[..., 60:] = -10000.0"),
    (_HalfSoftcap, "(divide)"), (_SumOfLosses, "total = lm_loss + 0.0001"), (_OtherArguments, "ignore_index=0"),
    (_ScaledHidden, "hidden_states = outputs / 4"), (_SlicedVocab, "logits = logits[..., :60]"),
    (_ZLoss, "loss = loss + 0.0001 * logits.logsumexp"), (_OtherSoftcap, "logits = torch.tanh(logits / 30.0) * 30.0"),
    (_HeadInsideMore, "2 * self.lm_head(")])
def test_refuses_a_forward_that_does_more_to_its_logits_or_loss_and_quotes_it(toy, quoted):
    sw.chunked_loss().apply(_Toy())  # the plain form is taken
    model = toy()
    with pytest.raises(sw.SelectionError, match=re.escape(quoted)):
        sw.chunked_loss().apply(model)
    assert not sw.records(model) and "forward" not in model.__dict__  # refused before any change


def _mixtral(router: bool) -> nn.Module:
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              output_router_logits=router, router_aux_loss_coef=0.5)
    return tf.MixtralForCausalLM(config).train()


def test_a_mixture_of_experts_router_loss_is_refused_and_without_it_the_loss_is_the_models():
    with pytest.raises(sw.SelectionError, match=re.escape("loss += self.router_aux_loss_coef")):
        sw.chunked_loss().apply(_mixtral(router=True))
    model, batch = _mixtral(router=False), _batch()
    ref_loss, ref_grads = _loss_and_grads(model, lambda: model(**batch).loss)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=7)]))
    loss, grads = _loss_and_grads(model, lambda: model(**batch).loss)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)  # float32: Mixtral's experts refuse float64
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="output_router_logits"):
        model(**batch, output_router_logits=True)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        model(**batch)
    assert model(**batch, output_router_logits=False).loss is not None


def test_soft_capping_as_gemma2():
    torch.manual_seed(0)
    config = tf.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5,
                             attn_implementation="eager")
    model, batch = tf.Gemma2ForCausalLM(config).to(F64).train(), _batch()
    ref_loss, ref_grads = _loss_and_grads(model, lambda: _reference_loss(model, batch))
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=7)]))
    loss, grads = _loss_and_grads(model, lambda: model(**batch).loss)
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **EXACT, msg=name)


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the matmuls run inside it, and their output widths."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: dict[int, set] = {}  # output width: dtypes
        self.count: dict[int, int] = {}  # output width: matmuls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.setdefault(out.shape[-1], set()).add(out.dtype)
            self.count[out.shape[-1]] = self.count.get(out.shape[-1], 0) + 1
        return out


@pytest.mark.parametrize("chunked_first", [True, False])
def test_composes_with_checkpoint_and_autocast(chunked_first):
    VOCAB = 96  # no other matmul of the model is this wide
    model, batch = _llama(VOCAB), _batch(VOCAB)
    model.float()
    plain = copy.deepcopy(model)
    steps = [sw.chunked_loss(chunk_size=7), sw.autocast(torch.bfloat16)]
    sw.apply(model, sw.Plan([sw.checkpoint(r"model\.layers\.\d+"), *(steps if chunked_first else steps[::-1])]))
    sw.apply(plain, sw.Plan([sw.autocast(torch.bfloat16)]))
    torch.manual_seed(5)
    ref = plain(**batch).loss
    torch.manual_seed(5)
    with _MatmulDtypes() as seen:
        loss = model(**batch).loss
    assert loss.dtype == torch.float32
    # The chunks' matmuls ran under autocast: the chunked forward sits under autocast's.
    assert seen.dtypes[VOCAB] == {torch.bfloat16}
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    sw.revert(model)
    assert "forward" not in model.__dict__ and "_get_name" not in model.__dict__


def test_compiled_trains_a_step_as_eager():
    model, batch = _gpt2(), _batch()
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=7)]))
    twin = copy.deepcopy(model)
    eager_loss, eager_grads = _loss_and_grads(model, lambda: model(**batch).loss)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)  # no graph break
    loss, grads = _loss_and_grads(twin, lambda: compiled(**batch).loss)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-9, atol=1e-12)
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.cuda
def test_cuda_bf16_chunked_loss_and_gradients_match_the_float32_head():
    """Under bf16 autocast on CUDA the weight's gradient is summed over chunks in float32 (addmm's
    out_dtype): it stays as close to a float32 head's as the unchunked bf16 loss's does."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, batch = _llama(512), {k: v.cuda() for k, v in _batch(512).items()}
    model = model.float().cuda()
    plain, bf16 = copy.deepcopy(model), copy.deepcopy(model)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=5), sw.autocast(torch.bfloat16)]))
    sw.apply(bf16, sw.Plan([sw.autocast(torch.bfloat16)]))
    ref_loss, ref = _loss_and_grads(plain, lambda: plain(**batch).loss)  # float32 throughout
    base_loss, base = _loss_and_grads(bf16, lambda: bf16(**batch).loss)
    loss, grads = _loss_and_grads(model, lambda: model(**batch).loss)
    assert abs(loss - ref_loss) <= 2 * abs(base_loss - ref_loss) + 1e-3
    for name in ("lm_head.weight", "model.norm.weight"):
        err, base_err = (grads[name] - ref[name]).norm(), (base[name] - ref[name]).norm()
        assert err <= 2 * base_err + 1e-6 * ref[name].norm(), (name, err, base_err)


def test_float16_gradients_do_not_underflow_before_the_loss_scale():
    """The scale 1 / tokens comes after the float16 matmuls: scaled first, a float16 softmax-minus-
    one-hot over thousands of tokens underflows before the GradScaler's factor arrives."""
    from shrinkwrap.transforms.lm_head import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8192, 16, generator=g).requires_grad_()
    weight = (torch.randn(1024, 16, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, 1024, (8192,), generator=g)
    ref = F.cross_entropy(F.linear(hidden.double(), weight.double()), labels)
    ref_h, ref_w = torch.autograd.grad(ref * 65536, [hidden, weight])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = chunked_cross_entropy(hidden, weight, None, labels, chunk_size=512)
    got_h, got_w = torch.autograd.grad(loss * 65536, [hidden, weight])  # a GradScaler's factor
    assert got_w.dtype == weight.dtype
    for got, want in ((got_h, ref_h), (got_w, ref_w)):
        assert ((got.double() - want).norm() / want.norm()) < 1.5e-3  # 3e-4 here; 5e-3 scaled first


def test_no_gradient_work_without_grad_mode():
    model, batch = _llama(96), _batch(96)
    sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=7)]))
    with _MatmulDtypes() as with_grad:
        model(**batch)
    with torch.no_grad(), _MatmulDtypes() as without:
        model(**batch)
    # The head's matmuls (output width 96 for the logits, 32 for the hidden states' gradient; the
    # weight's gradient is 32 wide too): with grad mode all three, without it the logits only.
    assert with_grad.count[96] == without.count[96] > 0
    assert without.count.get(32, 0) < with_grad.count[32]
