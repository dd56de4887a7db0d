"""Compatibility suite (issue 11): the packages users run, not copies of them, on tiny random-init
models on the CPU.

Models: Hugging Face transformers GPT-2, Llama, T5 and BERT from tiny configs (dropout on, a padded
``attention_mask``, labels; the decoders with their default ``use_cache=True`` and again with
``use_cache=False``), and efficientnet_pytorch's EfficientNet-B0 at 32x32. Each is checked, with
every block checkpointed, against the untransformed model:

1. training is bit-exact in float64: the loss and every parameter gradient of each step, then
   every parameter and buffer (BatchNorm running statistics, ``num_batches_tracked``);
2. ``state_dict`` keys, values and metadata are the plain model's, and load both ways;
3. ``revert`` gives the original module objects back, and training goes on as if never transformed;
4. ``copy.deepcopy``, ``pickle`` and ``torch.save(model)`` copies train like the original;
5. ``torch.compile(backend="aot_eager")`` trains a step to float64 tolerance (dynamo may reorder).

Then what is particular to each package: ``generate`` and ``save_pretrained`` for transformers;
``swish()``, ``bn_act()`` and ``set_swish`` for efficientnet_pytorch. A missing package skips its
models. GPU models (torchvision, timm) are in ``test_compat_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from equivalence import (
    COPIES, F64, ROUNDING, STEPS, Case, Trace, assert_equal, assert_same, check_checkpoint, check_copy,
    check_revert, check_state_dict, checkpointed, compiled_step, reference, train, wrappers,
)

VOCAB, SEQ, BATCH = 128, 16, 2


# -- the models, random init, float64, train mode ---------------------------------------------


def _hf(model_cls: str, config_cls: str, seed: int = 0, **config) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    return getattr(tf, model_cls)(getattr(tf, config_cls)(**config)).to(F64).train()


def _efficientnet(seed: int = 0, memory_efficient: bool = True) -> nn.Module:
    EfficientNet = pytest.importorskip("efficientnet_pytorch").EfficientNet
    torch.manual_seed(seed)
    # B0's seven stages (the first without an expansion conv), half width and depth: 10 blocks.
    model = EfficientNet.from_name(
        "efficientnet-b0", image_size=32, num_classes=10, width_coefficient=0.5, depth_coefficient=0.5
    )
    model.set_swish(memory_efficient)  # False: nn.SiLU, its export form
    return model.to(F64).train()


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5 :] = 0  # the second sequence is padded
    return ids, mask


def _lm_batch() -> dict:
    ids, mask = _tokens()
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _cls_batch() -> dict:
    ids, mask = _tokens()
    return dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 2]))


def _image_batch() -> dict:
    return dict(inputs=torch.randn(BATCH, 3, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(1)))


def _hf_loss(out) -> torch.Tensor:
    return out.loss


def _image_loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, torch.tensor([1, 7]))


_GPT2 = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)
_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
           relative_attention_num_buckets=8, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, num_labels=3)
_hf_case = functools.partial(Case, loss=_hf_loss)

CASES = {
    "gpt2": _hf_case(functools.partial(_hf, "GPT2LMHeadModel", "GPT2Config", **_GPT2), _lm_batch,
                     blocks=r"transformer\.h\.\d+", n_blocks=2),
    "llama": _hf_case(functools.partial(_hf, "LlamaForCausalLM", "LlamaConfig", **_LLAMA), _lm_batch,
                      blocks=r"model\.layers\.\d+", n_blocks=2),
    "t5": _hf_case(functools.partial(_hf, "T5ForConditionalGeneration", "T5Config", **_T5), _lm_batch,
                   blocks=r"(encoder|decoder)\.block\.\d+", n_blocks=4),
    "bert": _hf_case(functools.partial(_hf, "BertForSequenceClassification", "BertConfig", **_BERT), _cls_batch,
                     blocks=r"bert\.encoder\.layer\.\d+", n_blocks=2),
    "efficientnet-b0": Case(_efficientnet, _image_batch, _image_loss, r"_blocks\.\d+", 10),
}
DECODERS = ("gpt2", "llama", "t5")  # their config says use_cache=True: forward writes the KV cache
# The decoders again with the cache off, as HF's own activation checkpointing runs them in training.
CASES.update({
    f"{n}-no-cache": dataclasses.replace(CASES[n], build=functools.partial(CASES[n].build, use_cache=False))
    for n in DECODERS
})
MAIN = [n for n in CASES if not n.endswith("-no-cache")]
HF = [n for n in MAIN if n != "efficientnet-b0"]


def expected(name: str, steps: tuple[int, ...] = STEPS) -> Trace:
    """What training the checkpointed model must equal bit for bit: the untransformed model's, with
    the KV cache off for a decoder. Checkpointing turns the cache off in training, as HF's own does:
    the recompute would write it again. (With the cache on, GPT-2 and T5 reach the same loss by
    another route, torch.cat into the cache, and gradients that differ in the last bits.)"""
    return reference(CASES[f"{name}-no-cache" if name in DECODERS else name], steps)


# -- 1-5: the checks every model gets --------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_checkpoint_every_block_trains_bit_exact(name):
    got = check_checkpoint(CASES[name], expected(name))
    assert_same(reference(CASES[name]), got, **ROUNDING)  # the model as configured, cache on


@pytest.mark.parametrize("name", MAIN)
def test_selective_checkpoint_every_block_trains_bit_exact(name):
    """Keeping the matrix products', attention's and convolutions' outputs changes no number:
    dropout inside attention and after it draws the same masks (a random call is never kept)."""
    case = CASES[name]
    model = case.build()
    sw.apply(model, sw.checkpoint(case.blocks, save=("matmul", "attention", "conv")))
    assert_same(expected(name), train(model, case))


def _offloaded(case: Case) -> sw.Plan:
    """Every block checkpointed and offloaded (CPU copies standing in for the host's on a CPU)."""
    return sw.Plan([sw.checkpoint(case.blocks), sw.offload(case.blocks, devices=("cpu",), min_bytes=0)])


@pytest.mark.parametrize("name", MAIN)
def test_offload_trains_like_the_plain_model(name):
    """What the regions save, copied out and back: around checkpointed blocks (where offload moves
    the inputs the checkpoints keep) no number changes. Offload alone equals the plain model to
    rounding: on GPT-2 and T5 (CPU, float64) gradients differ by up to 1e-16 (the loss does not),
    for a reason not found; one thread for everything in a separate process made them bit-equal."""
    case = CASES[name]
    for plan, tol in ((_offloaded(case), {}), (sw.Plan([sw.offload(case.blocks, devices=("cpu",), min_bytes=0)]), ROUNDING)):
        model = sw.apply(case.build(), plan)
        assert_same(expected(name), train(model, case), **tol)
        assert sw.offload_traffic(model).offloaded > 0, plan


@pytest.mark.parametrize("name", CASES)
def test_state_dict_is_the_plain_models_and_loads_both_ways(name):
    check_state_dict(CASES[name])


@pytest.mark.parametrize("name", CASES)
def test_revert_gives_back_the_original_modules_and_training_goes_on(name):
    case = CASES[name]
    # The first step ran with the cache off: the rest goes on from within rounding of the plain model.
    model, go_on = check_revert(case, expected(name, STEPS[:1]), **(ROUNDING if name in DECODERS else {}))
    if hasattr(model, "config"):
        # Nothing done for the transform outlives it: HF's config (which its first forward writes
        # to as well: problem_type), and the outputs' fields (the KV cache is returned again).
        plain = case.build()
        train(plain, case, STEPS[:1])
        assert model.config.to_dict() == plain.config.to_dict()
        assert list(model(**case.batch()).keys()) == list(plain(**case.batch()).keys())
    go_on()


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", CASES)
def test_copies_of_a_transformed_model_train_like_the_original(name, how):
    check_copy(CASES[name], how, expected(name))


# Compiling takes seconds a model: the models as configured, not the -no-cache variants.
@pytest.mark.parametrize("name", MAIN)
def test_torch_compile_aot_eager_trains_like_eager(name):
    assert_same(expected(name, STEPS[:1]), compiled_step(CASES[name])[0], **ROUNDING)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("name", MAIN)
def test_torch_compile_fullgraph_sees_no_graph_break(name, offload):
    # DESIGN principle 6: every transform traces with no graph break. The untransformed models here
    # trace as one graph each. Compiled, offload regions run plainly (their hooks are eager only).
    case = CASES[name]
    trace, graph_break = compiled_step(case, _offloaded(case) if offload else None)
    assert graph_break is None, graph_break
    if offload:
        assert_same(expected(name, STEPS[:1]), trace, **ROUNDING)


# -- transformers: what users do next with the model ------------------------------------------


def _hf_checkpointing(model: nn.Module) -> nn.Module:
    """HF's own activation checkpointing, as ``Trainer(gradient_checkpointing=True)`` turns it on."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


@pytest.mark.parametrize("order", ["hf-first", "shrinkwrap-first"])
@pytest.mark.parametrize("name", HF)
def test_hf_activation_checkpointing_composes_with_a_plan(name, order):
    # HF's checkpointing alone is not bit-exact against the plain model for tied embeddings (it makes
    # the embedding output require grad, which reorders a sum), so HF's alone is the reference.
    case = CASES[name]
    hf_alone = dataclasses.replace(case, build=lambda seed=0: _hf_checkpointing(case.build(seed=seed)))
    model = case.build()
    if order == "hf-first":
        _hf_checkpointing(model)
    sw.apply(model, sw.Plan([sw.checkpoint(case.blocks)]))
    if order == "shrinkwrap-first":
        _hf_checkpointing(model)
    assert_same(reference(hf_alone), train(model, case))


@pytest.mark.parametrize("name", DECODERS)
def test_hf_generate_in_eval_is_unchanged(name):
    # Training turns the cache off in checkpointed regions; generation must still use it.
    case = CASES[name]
    ids, mask = _tokens()
    out = []
    for model in (case.build(), checkpointed(case)):
        model.eval()
        out.append(model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4,
                                  do_sample=False, pad_token_id=0))
    assert torch.equal(*out)


@pytest.mark.parametrize("name", HF)
def test_hf_save_pretrained_of_a_transformed_model_loads_into_the_plain_class(name, tmp_path):
    case = CASES[name]
    model = checkpointed(case)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=F64)
    assert not wrappers(loaded)
    assert_equal(case.build().state_dict(), loaded.state_dict(), "from_pretrained")


# -- efficientnet_pytorch: its Swish modules, its forward-wired BatchNorms, set_swish ----------


def _effnet_swishes(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("_swish")}


@pytest.mark.parametrize("plan", ["swish()", r"checkpoint(r'_blocks\.\d+'), swish()"])
def test_efficientnet_swish_replaces_its_memory_efficient_swish(plan):
    case = CASES["efficientnet-b0"]
    model = case.build()
    theirs = _effnet_swishes(model)  # efficientnet_pytorch.utils.MemoryEfficientSwish: x * sigmoid(x)
    assert len(theirs) == 11 and {type(m).__name__ for m in theirs.values()} == {"MemoryEfficientSwish"}
    sw.apply(model, plan)
    rec = sw.records(model)[-1]
    assert sorted(rec.matched) == sorted(theirs) and rec.skipped == ()
    assert all(type(m) is sw.MemoryEfficientSwish for m in _effnet_swishes(model).values())
    # Bit-equal to training with their own nn.SiLU (set_swish(False)): the same kernels. Against their
    # x * sigmoid(x) it differs by rounding, which BatchNorm over 2 values at 1x1 amplifies to ~1e-9.
    silu = dataclasses.replace(case, build=functools.partial(_efficientnet, memory_efficient=False))
    assert_same(reference(silu), train(model, case))
    sw.revert(model)
    assert all(model.get_submodule(n) is m for n, m in theirs.items())


def test_efficientnet_swish_passes_over_native_silu_after_set_swish_false():
    # set_swish(memory_efficient=False) puts nn.SiLU (efficientnet_pytorch's Swish) in: already
    # one saved tensor, so swish() skips each with the reason and swaps them only with include_silu.
    model = CASES["efficientnet-b0"].build()
    model.set_swish(memory_efficient=False)
    sw.apply(model, [sw.swish()])
    rec = sw.records(model)[-1]
    assert rec.matched == () and sorted(n for n, _ in rec.skipped) == sorted(_effnet_swishes(model))
    assert all("include_silu=True" in why for _, why in rec.skipped)
    sw.apply(model, [sw.swish(include_silu=True)])
    assert all(type(m) is sw.MemoryEfficientSwish for m in _effnet_swishes(model).values())


def test_efficientnet_bn_act_finds_no_pair_and_says_why():
    # EfficientNet-PyTorch wires BatchNorm and Swish in forward (self._swish(self._bn0(x))): the
    # pair is not visible as modules, so bn_act() has nothing it can fuse. It says so at apply time.
    model = CASES["efficientnet-b0"].build()
    before = dict(model.named_modules())
    with pytest.raises(sw.SelectionError, match=r"bn_act\(\) found no BatchNorm.*_bn0 its output's consumer "
                                                r"is not visible \(not inside an nn\.Sequential\)"):
        sw.apply(model, [sw.bn_act()])
    assert sw.records(model) == [] and all(model.get_submodule(n) is m for n, m in before.items() if n)


@pytest.mark.parametrize("where", ["", "_blocks.1"])
def test_efficientnet_revert_keeps_what_the_user_replaced_after_swish_and_warns(where):
    # Issue 11: revert must not silently put the pre-apply module back over the user's own.
    model = CASES["efficientnet-b0"].build()
    theirs = _effnet_swishes(model)
    sw.apply(model, [sw.swish()])
    model.get_submodule(where).set_swish(memory_efficient=False)  # the user's nn.SiLU, after apply
    now = _effnet_swishes(model)
    users = {n: m for n, m in now.items() if type(m) is nn.SiLU}
    assert users and len(users) == (11 if not where else 1)
    with pytest.warns(UserWarning, match="|".join(map(re.escape, users))):  # naming what it kept
        sw.revert(model)
    after = _effnet_swishes(model)
    assert all(after[n] is m for n, m in users.items())  # the user's modules stay
    assert all(after[n] is m for n, m in theirs.items() if n not in users)  # shrinkwrap's are reverted
    assert sw.records(model) == []


def test_efficientnet_set_swish_through_checkpointed_blocks_survives_revert():
    # set_swish walks model._blocks, which now holds Checkpoint wrappers: the change reaches the
    # wrapped blocks, and reverting the (still shrinkwrap's) wrappers keeps it, with no warning.
    case = CASES["efficientnet-b0"]
    model = checkpointed(case)
    model.set_swish(memory_efficient=False)
    users = _effnet_swishes(model)
    assert {type(m) for m in users.values()} == {nn.SiLU}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.revert(model)
    assert not wrappers(model) and all(model.get_submodule(n) is m for n, m in users.items())
