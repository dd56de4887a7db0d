"""Compiled plans against torch.compile + bf16, one model per run, every row in the same process.

    python benchmarks/compiled.py --model resnet18 [--rounds 5] [--json out.json]

Each configuration is built, transformed, compiled (inductor, default mode) and measured by
``shrinkwrap.measure`` for memory (activation = steady-state peak - allocated before it; the other
configurations' weights lie in memory meanwhile, which the difference leaves out) and dynamo's
graph breaks. Step times come from ``shrinkwrap.time_interleaved``: every configuration in turns,
``--rounds`` rounds, so drift of the shared GPU falls on all alike; each time is the median of
the rounds with the fastest and slowest round beside it. Ratios are against fp32 eager and
against ``compile + bf16`` (the user's hand recipe: ``torch.compile`` of the model with
``torch.autocast`` around its forward).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from run import HandAutocast, breaks, build, measure_same_run, ratio_table, same_run_main  # noqa: E402

BERT_NOT_ATTENTION = r"bert\.encoder\.layer\.\d+\.(?:attention\.output|intermediate|output)"
STEM = r"checkpoint(r'conv1|bn1|relu|maxpool', chain=True)"  # torchvision ResNets' stem, one region
# Per model: shrinkwrap plans that end in compile(); the anchors are fp32 eager and compile + bf16.
PLANS: dict[str, dict[str, str]] = {
    "resnet18": {
        "sw_bf16_cl": r"channels_last(), autocast(torch.bfloat16), compile()",
        "sw_bf16_cl_budget0.7": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.7)",
        "sw_bf16_cl_budget0.6": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_bf16_cl_budget0.55": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.55)",
        "sw_bf16_budget0.6": r"autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_bf16_cl_budget0.5": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.5)",
        "sw_bf16_cl_budget0.4": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.4)",
        # Checkpoint regions under the partitioner's budget: the budget alone kept 0.62-0.63x of
        # compile + bf16's activation, lower budgets more (2026-11-23).
        "sw_ckpt_layer1_bf16_cl_budget0.6": r"checkpoint(r'layer1\.\d+'), channels_last(), autocast(torch.bfloat16), "
                                            r"compile(memory_budget=0.6)",
        "sw_ckpt_blocks_bf16_cl_budget0.6": r"checkpoint(r'layer\d\.\d+'), channels_last(), autocast(torch.bfloat16), "
                                            r"compile(memory_budget=0.6)",
        "sw_stem_bf16_cl_budget0.6": STEM + r", channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_ckpt_blocks_bf16_cl": r"checkpoint(r'layer\d\.\d+'), channels_last(), autocast(torch.bfloat16), compile()",
        "sw_stem_bf16_cl": STEM + r", channels_last(), autocast(torch.bfloat16), compile()",
        "sw_stem_ckpt_first_blocks_bf16_cl": STEM + r", checkpoint(r'layer\d\.0'), channels_last(), "
                                             r"autocast(torch.bfloat16), compile()",
        "sw_stem_ckpt_blocks_bf16_cl": STEM + r", checkpoint(r'layer\d\.\d+'), channels_last(), "
                                       r"autocast(torch.bfloat16), compile()",
        # The first convolution alone as a region: its 128x64x112x112 output (196 MiB in bf16, what bn1's
        # backward reads) and the input's bf16 copy were the largest tensors live at the budgeted
        # plan's peak (benchmarks/peak.py); recomputing a 3-channel convolution costs little.
        "sw_conv1_bf16_cl_budget0.6": r"checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), "
                                      r"compile(memory_budget=0.6)",
        "sw_conv1_bf16_budget0.6": r"checkpoint('conv1'), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_conv1_bf16_cl": r"checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), compile()",
        # conv1 as a region that keeps its convolution's output: all it recomputes is the input's bf16
        # cast, from the float32 batch that is alive anyway, so the 36.8 MiB copy is not held.
        "sw_conv1_saveconv_bf16_cl_budget0.6": r"checkpoint('conv1', save=('conv',)), channels_last(), "
                                               r"autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_conv1_saveconv_bf16_budget0.6": r"checkpoint('conv1', save=('conv',)), autocast(torch.bfloat16), "
                                            r"compile(memory_budget=0.6)",
        # Inductor's autotuned kernels (Triton convolution templates among them), to buy back the
        # recompute's time.
        "sw_bf16_cl_budget0.6_autotune": r"channels_last(), autocast(torch.bfloat16), "
                                         r"compile(mode='max-autotune-no-cudagraphs', memory_budget=0.6)",
        "sw_conv1_bf16_cl_budget0.6_autotune": r"checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), "
                                               r"compile(mode='max-autotune-no-cudagraphs', memory_budget=0.6)",
        "sw_conv1_bn1_relu_bf16_cl_budget0.6": r"checkpoint('conv1|bn1|relu', chain=True), channels_last(), "
                                               r"autocast(torch.bfloat16), compile(memory_budget=0.6)",
    },
    "efficientnet_b0": {
        "sw_bn_act_bf16": r"bn_act(), autocast(torch.bfloat16), compile()",
        "sw_bf16_budget0.5": r"autocast(torch.bfloat16), compile(memory_budget=0.5)",
        "sw_bf16_cl_budget0.5": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.5)",
        "sw_bn_act_bf16_cl": r"bn_act(), channels_last(), autocast(torch.bfloat16), compile()",
        "sw_ckpt_blocks_bf16_cl": r"checkpoint(r'features\.[1-7]\.\d+'), bn_act(), channels_last(), "
                                  r"autocast(torch.bfloat16), compile()",
        "sw_swish_bn_act_bf16": r"swish(), bn_act(), autocast(torch.bfloat16), compile()",
        "sw_bf16_budget0.6": r"autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_bf16_budget0.7": r"autocast(torch.bfloat16), compile(memory_budget=0.7)",
        "sw_bf16_cl_budget0.6": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_bn_act_bf16_budget0.7": r"bn_act(), autocast(torch.bfloat16), compile(memory_budget=0.7)",
    },
    "resnet152": {
        "sw_bf16_cl": r"channels_last(), autocast(torch.bfloat16), compile()",
        "sw_bf16_cl_budget0.6": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
        "sw_ckpt_blocks_bf16_cl": r"checkpoint(r'layer\d\.\d+'), channels_last(), autocast(torch.bfloat16), compile()",
    },
    "bert": {
        "sw_bf16": r"autocast(torch.bfloat16), compile()",
        "sw_bf16_budget0.5": r"autocast(torch.bfloat16), compile(memory_budget=0.5)",
        "sw_ckpt_blocks_bf16": r"checkpoint(r'bert\.encoder\.layer\.\d+'), autocast(torch.bfloat16), compile()",
        # The attention core alone (q, k, v projections, softmax, dropout): under compile its
        # probabilities and dropout mask are what bert keeps most of.
        "sw_ckpt_attn_bf16": r"checkpoint(r'bert\.encoder\.layer\.\d+\.attention\.self'), autocast(torch.bfloat16), "
                             r"compile()",
        # Regional: every part of the layer but the attention core compiled; the core stays eager,
        # on the fused kernel that keeps neither the probabilities nor the dropout mask.
        "sw_bf16_regional": f"autocast(torch.bfloat16), compile(pattern=r'{BERT_NOT_ATTENTION}')",
        "sw_bf16_regional_cls": f"autocast(torch.bfloat16), compile(pattern=r'{BERT_NOT_ATTENTION}|cls')",
    },
    "gpt2": {
        "sw_ckpt_blocks_bf16": r"checkpoint(r'transformer\.h\.\d+'), autocast(torch.bfloat16, keep_output_dtype=True), "
                               r"compile()",
    },
}


def configurations(model_name: str) -> dict[str, Callable[[], nn.Module]]:
    def hand_compile_bf16() -> nn.Module:
        return torch.compile(HandAutocast(build(model_name)))

    def plan(text: str) -> Callable[[], nn.Module]:
        return lambda: sw.apply(build(model_name), text)

    return {"fp32_eager": lambda: build(model_name), "compile_bf16": hand_compile_bf16,
            **{name: plan(text) for name, text in PLANS[model_name].items()}}


def run(model_name: str, rounds: int, only: list[str] | None = None) -> list[dict[str, Any]]:
    makers = {k: v for k, v in configurations(model_name).items() if not only or k in only}
    return measure_same_run(model_name, makers, rounds, PLANS[model_name])


def table(rows: list[dict[str, Any]]) -> str:
    return ratio_table(rows, {"fp32": "fp32_eager", "compile+bf16": "compile_bf16"}, {"graph breaks": breaks})


if __name__ == "__main__":
    same_run_main(__doc__, list(PLANS), run, table, rounds=5)
