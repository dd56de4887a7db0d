"""Compatibility suite on the GPU (issue 11): torchvision and timm models, random init, trained in
float64 on CUDA against the untransformed model (the CPU suite, with the machinery, is
test_compat.py and equivalence.py).

Tolerances: checkpointing, revert, copies and ``swish(include_silu=True)`` are bit-exact (cuDNN in
deterministic mode; the recompute runs the same kernels on the same inputs, and
MemoryEfficientSwish runs nn.SiLU's kernels). ``torch.compile`` may reorder sums: compared at
float64 rounding, rtol 1e-9 and atol 1e-12 (``ROUNDING``). ``bn_act()`` recomputes the BatchNorm
output in another order of operations, and the difference grows through a second step: rtol 1e-9
and atol 1e-10 (``FUSED``; on an H100, torchvision efficientnet_b0's worst element after two steps
was 1.3e-11 off, 1.5e-9 relative, in a gradient of 512 elements whose sum cancels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from equivalence import (
    COPIES, F64, ROUNDING, STEPS, Case, assert_same, check_checkpoint, check_copy, check_revert,
    check_state_dict, compiled_step, reference, train,
)

pytestmark = pytest.mark.cuda

SIZE = (2, 3, 64, 64)
CLASSES = 10
FUSED = dict(rtol=1e-9, atol=1e-10)


@dataclasses.dataclass(frozen=True)
class Vision:
    package: str  # torchvision | timm
    name: str
    blocks: str  # the checkpoint pattern: every block
    n_blocks: int
    bn_act: bool  # has BatchNorm + activation pairs bn_act() can see (nn.Sequential, timm BatchNormAct2d)
    dropout: bool = True
    options: tuple = ()  # (name, value) pairs for the model's constructor

    @property
    def id(self) -> str:
        return f"{self.package}-{self.name}"


_TIMM_DROP = (("drop_rate", 0.2), ("drop_path_rate", 0.1))
TABLE = [
    # torchvision: its defaults keep dropout (classifier) and stochastic depth (EfficientNet) on.
    Vision("torchvision", "resnet18", r"layer[1-4]\.\d+", 8, bn_act=False, dropout=False),
    Vision("torchvision", "efficientnet_b0", r"features\.[1-7]\.\d+", 16, bn_act=True),
    Vision("torchvision", "mobilenet_v3_large", r"features\.(?:[1-9]|1[0-5])", 15, bn_act=True),
    Vision("timm", "efficientnet_b0", r"blocks\.\d+\.\d+", 16, bn_act=True, options=_TIMM_DROP),
    Vision("timm", "resnet50", r"layer[1-4]\.\d+", 16, bn_act=False, options=_TIMM_DROP),
    Vision("timm", "convnext_tiny", r"stages\.\d+\.blocks\.\d+", 18, bn_act=False, options=_TIMM_DROP),
]
IDS = [v.id for v in TABLE]


def build_model(v: Vision, seed: int = 0) -> nn.Module:
    pkg = pytest.importorskip(v.package)
    torch.manual_seed(seed)
    if v.package == "torchvision":
        model = pkg.models.get_model(v.name, weights=None, num_classes=CLASSES, **dict(v.options))
    else:
        model = pkg.create_model(v.name, pretrained=False, num_classes=CLASSES, **dict(v.options))
    return model.to("cuda", F64).train()


def _batch() -> dict:
    x = torch.randn(*SIZE, dtype=F64, generator=torch.Generator().manual_seed(1))
    return {"x": x.cuda()}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, torch.tensor([1, 7], device=out.device))


@functools.cache
def case(v: Vision) -> Case:
    return Case(functools.partial(build_model, v), _batch, _loss, v.blocks, v.n_blocks, dropout=v.dropout)


@pytest.fixture(autouse=True)
def deterministic():
    flags = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags


params = pytest.mark.parametrize("v", TABLE, ids=IDS)


@params
def test_checkpoint_every_block_trains_bit_exact(v):
    check_checkpoint(case(v), reference(case(v)))


@params
def test_state_dict_is_the_plain_models_and_loads_both_ways(v):
    check_state_dict(case(v))


@params
def test_revert_gives_back_the_original_modules_and_training_goes_on(v):
    _, go_on = check_revert(case(v), reference(case(v), STEPS[:1]))
    go_on()


@pytest.mark.parametrize("how", COPIES)
@params
def test_copies_of_a_transformed_model_train_like_the_original(v, how):
    check_copy(case(v), how, reference(case(v)))


def _build_no_randomness(v: Vision, seed: int = 0) -> nn.Module:
    """The model with its random modules (dropout, drop path, stochastic depth) in eval mode and
    BatchNorm still training. On CUDA a compiled graph draws its random numbers otherwise than
    eager (in forward and its recompute alike), so compiled and eager are compared without them."""
    model = build_model(v, seed)
    for m in model.modules():
        if "drop" in type(m).__name__.lower() or type(m).__name__ == "StochasticDepth":
            m.eval()
    return model


@params
def test_torch_compile_aot_eager_trains_like_eager(v):
    c = dataclasses.replace(case(v), build=functools.partial(_build_no_randomness, v), dropout=False)
    assert_same(reference(c, STEPS[:1]), compiled_step(c)[0], **ROUNDING)


@params
def test_torch_compile_fullgraph_sees_no_graph_break(v):
    graph_break = compiled_step(case(v))[1]  # DESIGN principle 6
    assert graph_break is None, graph_break


@params
def test_swish_include_silu_swaps_each_silu_bit_exact(v):
    # These packages write Swish as nn.SiLU: swish() swaps those only with include_silu=True, and
    # never an in-place one (the code around it may read the overwritten input). ReLU, Hardswish
    # and GELU models have nothing to swap: swish() raises, or skips native Hardswish with the reason.
    c = case(v)
    model = c.build()
    silus = [n for n, m in model.named_modules() if type(m) is nn.SiLU and not m.inplace]
    with contextlib.suppress(sw.SelectionError):
        sw.apply(model, [sw.swish(include_silu=True)])
    assert [n for n, m in model.named_modules() if type(m) is sw.MemoryEfficientSwish] == silus
    if silus:  # MemoryEfficientSwish runs nn.SiLU's kernels
        assert_same(reference(c), train(model, c))


@params
def test_bn_act_fuses_what_it_sees_to_rounding(v):
    c = case(v)
    model = c.build()
    if not v.bn_act:  # BatchNorm and activation wired in forward (ResNet blocks), or no BatchNorm
        with pytest.raises(sw.SelectionError, match=r"bn_act\(\) found no BatchNorm followed by an activation"):
            sw.apply(model, [sw.bn_act()])
        return
    before = dict(model.named_modules())
    sw.apply(model, [sw.bn_act()])
    fused = [n for n, m in model.named_modules() if isinstance(m, sw.FusedBatchNormAct)]
    assert fused and sorted(fused) == sorted(sw.records(model)[-1].matched)
    got = train(model, c)
    assert_same(reference(c), got, **FUSED)
    counts = {n: int(t) for n, t in got.state.items() if n.endswith("num_batches_tracked")}
    assert set(counts.values()) == {len(STEPS)}, counts
    sw.revert(model)
    after = dict(model.named_modules())
    assert list(after) == list(before) and all(after[n] is m for n, m in before.items())
