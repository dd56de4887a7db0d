"""Probe: inductor's C++ wrapper (``cpp_wrapper``) against its Python one, compiled plans and
compile + bf16, every row in one process (compiled.py's harness). The C++ wrapper launches the
kernels from generated C++, not Python: on launch-bound models that is host time saved.

    python benchmarks/probes/cpp_wrapper.py --model resnet18 [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from compiled import table  # noqa: E402
from run import MODELS, HandAutocast, _load, build, measure_same_run, same_run_main  # noqa: E402

PLANS = {
    "resnet18": {"sw_budget": r"channels_last(), autocast(torch.bfloat16), compile(memory_budget=0.6)",
                 "sw_conv1_budget": r"checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), "
                                    r"compile(memory_budget=0.6)"},
    "efficientnet_b0": {"sw_budget": r"autocast(torch.bfloat16), compile(memory_budget=0.6)"},
}


def _cpp(model_name: str, make):
    """``make``'s model, compiled (forward and backward) under ``cpp_wrapper`` by one warm-up step;
    dynamo's guards do not read inductor's settings, so later calls reuse that code."""
    def maker():
        import torch._inductor.config as inductor_config

        model = make()
        _, batch = _load(model_name, MODELS[model_name][1])
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        with inductor_config.patch(cpp_wrapper=True):
            model(x.cuda()).float().sum().backward()
        for p in model.parameters():
            p.grad = None
        return model
    return maker


def run(model_name: str, rounds: int, only=None):
    plan = lambda text: (lambda: sw.apply(build(model_name), text))  # noqa: E731
    hand = lambda: torch.compile(HandAutocast(build(model_name)))  # noqa: E731
    makers = {"fp32_eager": lambda: build(model_name), "compile_bf16": hand,
              "compile_bf16_cpp": _cpp(model_name, hand)}
    for name, text in PLANS[model_name].items():
        makers[name] = plan(text)
        makers[name + "_cpp"] = _cpp(model_name, plan(text))
    makers = {k: v for k, v in makers.items() if not only or k in only}
    return measure_same_run(model_name, makers, rounds, {**PLANS[model_name],
                            **{k + "_cpp": v for k, v in PLANS[model_name].items()}})


if __name__ == "__main__":
    same_run_main(__doc__, list(PLANS), run, table, rounds=10)
