"""The contract every registered step keeps, checked on a small float64 model where it applies:

- revert: apply, then ``sw.revert``, gives back the very module objects the model had;
- names: apply keeps the parameter and buffer names and the ``state_dict`` keys and values;
- exact: one training forward and backward give the untransformed model's outputs, parameter
  gradients and buffers (bit for bit, or to the rounding the case states), unless the step says it
  is lossy (``step.lossy``);
- refused: one call the step refuses, with a message starting ``shrinkwrap:``, before the model changes.

A step registered without a case here fails :func:`test_every_registered_step_has_a_case`. Every
clause runs on the CPU (offload's regions offload CPU tensors when ``devices`` names the CPU); the
steps' CUDA paths are their own test files' ``cuda`` tests.
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import importlib
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from equivalence import ROUNDING, assert_equal
from toymodels import net64, resnet64

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = {"lr": 0.01, "weight_decay": 0.1}
# Exact steps that compute in another order or with other kernels than the plain model (a layout,
# a fused activation, a loss in chunks): float64 to rounding, as their own test files hold them. A
# compiled graph against eager: equivalence.ROUNDING.
TO_ROUNDING = dict(rtol=1e-12, atol=1e-12)


def images(batch: int = 4, size: int = 16) -> dict:
    return {"x": torch.randn(batch, 3, size, size, dtype=F64, generator=torch.Generator().manual_seed(1))}


def tokens() -> dict:
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


class _Swish(nn.Module):
    """Swish as EfficientNet code writes it, the module swish() replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class SwishNet(nn.Module):
    """Conv, BatchNorm, Swish and Dropout in a Sequential (bn_act sees what follows a BatchNorm there)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), _Swish(), nn.Dropout(0.25),
                                      nn.Conv2d(8, 8, 3, padding=1), _Swish(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def swish_net() -> nn.Module:
    torch.manual_seed(0)
    return SwishNet().to(F64)


def linear() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4)).to(F64)


def llama() -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            attention_dropout=0.1, use_cache=False)
    return tf.LlamaForCausalLM(config).to(F64).train()


def gpt2() -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    return tf.GPT2LMHeadModel(config).to(F64).train()


def logits(out: Any, inputs: dict) -> torch.Tensor:
    return out.logits


def lm_loss(out: Any, inputs: dict) -> torch.Tensor:
    """The causal LM loss in float64: the chunked loss as the model returns it, and the plain
    model's from its logits (Hugging Face computes its own in float32 even in a float64 model)."""
    if out.logits is None:
        return out.loss
    shifted = F.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)


def adamw(model: nn.Module) -> None:
    """The plain loop's step for step_in_backward's case: AdamW one tensor at a time, as the
    per-parameter optimizers compute."""
    torch.optim.AdamW(model.parameters(), foreach=False, **OPTIONS).step()


@dataclasses.dataclass(frozen=True)
class Case:
    """A step on a model where it applies, and a call it refuses."""

    build: Callable[[], nn.Module]  # the plain model: float64, train mode, the same each call
    step: sw.Step
    inputs: Callable[[], dict]  # a training forward's keyword arguments
    refused: tuple[Callable[[], nn.Module], Callable[[], sw.Step]]  # a model and a step it refuses
    # What is compared of the model's output (its squares sum to the loss), given the inputs.
    output: Callable[[Any, dict], torch.Tensor] = lambda out, inputs: out
    exact: dict = dataclasses.field(default_factory=dict)  # the tolerance: none, bit for bit
    kept: dict = dataclasses.field(default_factory=dict)  # the tolerance on state_dict values after apply
    # For a step that applies each gradient inside backward and drops it: the plain loop's optimizer
    # step, after which the parameters are compared where the gradients would be.
    update: Callable[[nn.Module], None] | None = None


CASES: dict[str, Case] = {
    "space_to_depth": Case(resnet64, sw.space_to_depth(), lambda: images(size=32), (net64, sw.space_to_depth),
                           exact=TO_ROUNDING),
    "checkpoint": Case(net64, sw.checkpoint(r"layer\d"), images, (net64, lambda: sw.checkpoint("nothing"))),
    "offload": Case(net64, sw.offload(r"layer\d", min_bytes=0, keep_last=False, devices=("cpu",)), images,
                    (net64, lambda: sw.offload("nothing", devices=("cpu",)))),
    "swish": Case(swish_net, sw.swish(), images, (linear, sw.swish), exact=TO_ROUNDING),
    "swiglu": Case(llama, sw.swiglu(), tokens, (gpt2, sw.swiglu), output=logits),
    "bn_act": Case(swish_net, sw.bn_act(), images, (linear, sw.bn_act), exact=TO_ROUNDING),
    "channels_last": Case(resnet64, sw.channels_last(), images, (linear, sw.channels_last), exact=TO_ROUNDING),
    "autocast": Case(net64, sw.autocast(torch.bfloat16), images,
                     (net64, lambda: sw.autocast(torch.bfloat16, pattern="nothing"))),
    # Its weights are cast: the state_dict's values are the plain model's to bfloat16's rounding.
    "half": Case(net64, sw.half(torch.bfloat16), images, (net64, lambda: sw.half(torch.bfloat16, keep="nothing")),
                 kept=dict(rtol=2 ** -8, atol=0)),
    "chunked_loss": Case(gpt2, sw.chunked_loss(chunk_size=5), tokens, (linear, sw.chunked_loss), output=lm_loss,
                         exact=TO_ROUNDING),
    "step_in_backward": Case(net64, sw.step_in_backward(torch.optim.AdamW, OPTIONS), images,
                             (lambda: net64().requires_grad_(False), sw.step_in_backward), update=adamw),
    "compile": Case(net64, sw.compile(backend="aot_eager"), images,
                    (net64, lambda: sw.compile(backend="aot_eager", pattern="nothing")), exact=ROUNDING),
}


def package_steps() -> list[type[sw.Step]]:
    """The registered steps of the package (a test's or a user's own step registers too)."""
    return [cls for cls in sw.registered() if cls.__module__.startswith("shrinkwrap.")]


def test_every_registered_step_has_a_case():
    assert set(CASES) == {cls.name for cls in package_steps()}
    for name, case in CASES.items():
        assert type(case.step).name == name


def _modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(model.named_modules(remove_duplicate=False))


def assert_same_modules(model: nn.Module, before: list[tuple[str, nn.Module]]) -> None:
    """``model`` has the module objects ``before`` lists, under the same names, and no record."""
    after = _modules(model)
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    assert sw.records(model) == []


def _train(case: Case, model: nn.Module, reference: bool) -> dict[str, dict[str, torch.Tensor]]:
    """One training forward and backward (and the plain loop's update, for a step that updates in
    backward): the output, the parameters' gradients, then the parameters and buffers."""
    inputs = case.inputs()
    torch.manual_seed(100)  # dropout draws the same masks
    out = case.output(model(**inputs), inputs)
    out.square().sum().backward()
    seen = {"output": {"output": out.detach()}}
    if case.update is None:
        seen["gradients"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    elif reference:
        case.update(model)
    seen["parameters"] = {n: p.detach() for n, p in model.named_parameters()}
    seen["buffers"] = {n: b for n, b in model.named_buffers()}
    return seen


@pytest.mark.parametrize("name", CASES)
def test_revert_gives_back_the_original_modules(name):
    case = CASES[name]
    model = case.build()
    before = _modules(model)
    assert sw.apply(model, [case.step]) is model and sw.records(model)[-1].matched
    _train(case, model, reference=False)  # what a step sets up as the model runs is undone too
    sw.revert(model)
    assert_same_modules(model, before)


@pytest.mark.parametrize("name", CASES)
def test_apply_keeps_names_and_state_dict(name):
    case = CASES[name]
    plain, model = case.build(), case.build()
    sw.apply(model, [case.step])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in plain.named_buffers()]
    want, got = plain.state_dict(), model.state_dict()
    assert_equal(want, {k: v.to(want[k].dtype) for k, v in got.items()} if case.kept else got, "state_dict",
                 **case.kept)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.step.lossy])
def test_a_training_step_is_the_untransformed_models(name):
    case = CASES[name]
    plain = case.build()
    model = sw.apply(copy.deepcopy(plain), [case.step])
    want, got = _train(case, plain, reference=True), _train(case, model, reference=False)
    assert list(got) == list(want)
    for what in want:
        assert_equal(want[what], got[what], what, **case.exact)


def test_the_lossy_steps_say_so():
    # Their training step is not compared with the plain model's: they change the numbers on purpose.
    assert {name for name, case in CASES.items() if case.step.lossy} == {"autocast", "half"}
    assert not sw.step_in_backward().lossy and sw.step_in_backward(sw.LowBitAdamW).lossy


@pytest.mark.parametrize("name", CASES)
def test_a_refusal_says_shrinkwrap_and_changes_nothing(name):
    build, step = CASES[name].refused
    model = build()
    before = _modules(model)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        sw.apply(model, [step()])
    assert str(info.value).startswith("shrinkwrap:"), str(info.value)
    assert_same_modules(model, before)


# -- the namespace: one public name a step, no builtin shadowed -------------------------------


def test_a_step_has_one_public_name_the_call_its_text_writes():
    for cls in package_steps():
        assert getattr(sw, cls.name) is cls and not hasattr(sw, cls.__name__)
        assert getattr(importlib.import_module(cls.__module__), cls.__name__) is cls  # the class: its family's
    public = [getattr(sw, name) for name in sw.__all__]
    assert len({id(obj) for obj in public}) == len(public)  # nothing exported twice
    with pytest.raises(AttributeError, match=r"^shrinkwrap: a step has one public name, its call: sw\.checkpoint"):
        sw.Checkpoint


def test_a_star_import_rebinds_no_builtin_and_compile_is_still_a_step():
    names: dict = {}
    exec("from shrinkwrap import *", names)
    assert not (set(names) - {"__builtins__"}) & set(dir(builtins))
    assert {cls.name for cls in package_steps()} - set(names) == {"compile"}
    assert sw.compile is type(sw.Plan.parse("compile()").steps[0]) and sw.compile().name == "compile"
