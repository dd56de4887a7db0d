"""Probe: resnet18's stem convolution in its space-to-depth form, in the compiled stem plan.

    python benchmarks/probes/s2d_stem.py [--rounds 20] [--json out.json]

``probes/conv1.py`` timed the 7x7 stride-2 convolution over 3 channels at 0.92 ms (channels_last,
bf16), and the same sums as a 4x4 stride-1 convolution over the input's 2x2 space-to-depth (12
channels) at 0.52 ms plus 0.13 ms for the rearrangement, which inductor can fuse into the input's
bf16 cast. The stem plan (``checkpoint('conv1')``) runs the convolution twice, so the form could
pay twice. Here ``conv1`` is swapped for :class:`SpaceToDepthConv` (same weight, same
``state_dict``) before the plan; rows in one process (compiled.py's harness).

Result (H200, 2026-11-26, RESULTS.md): 5% faster in the plan that runs the convolution once, 9%
slower in the stem plan, which runs it twice; not built as a step. ``s2dcl_`` rows lay the
rearranged input out channels-last (``--configs`` picks rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))


class SpaceToDepthConv(nn.Module):
    """A stride-s convolution computed as a stride-1 one over the input's s x s space-to-depth."""

    def __init__(self, conv: nn.Conv2d, channels_last: bool = False) -> None:
        super().__init__()
        self.channels_last = channels_last  # lay the rearranged input out channels-last for cuDNN
        assert conv.groups == 1 and conv.dilation == (1, 1) and conv.padding_mode == "zeros"
        assert conv.stride[0] == conv.stride[1] > 1 and not isinstance(conv.padding, str)
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.padding, self.kernel_size = conv.stride[0], conv.padding, conv.kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        kh2, kw2 = -(-kh // s) * s, -(-kw // s) * s  # the kernel zero-padded to multiples of s
        oh, ow = (x.shape[2] + 2 * ph - kh) // s + 1, (x.shape[3] + 2 * pw - kw) // s + 1
        lh, lw = s * (oh - 1) + kh2, s * (ow - 1) + kw2  # the padded input's extent the kernels read
        x = F.pad(x, (pw, lw - x.shape[3] - pw, ph, lh - x.shape[2] - ph))
        n, c = x.shape[:2]
        x = x.reshape(n, c, lh // s, s, lw // s, s).permute(0, 1, 3, 5, 2, 4).reshape(n, c * s * s, lh // s, lw // s)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = F.pad(self.weight, (0, kw2 - kw, 0, kh2 - kh))
        o = w.shape[0]
        w = w.reshape(o, c, kh2 // s, s, kw2 // s, s).permute(0, 1, 3, 5, 2, 4).reshape(o, c * s * s, kh2 // s, kw2 // s)
        return F.conv2d(x, w, self.bias)


def _check() -> None:
    torch.manual_seed(0)
    for (c, k, s, p, h, w) in ((3, 7, 2, 3, 224, 224), (3, 7, 2, 3, 33, 40), (4, 3, 2, 1, 17, 16), (3, 4, 4, 0, 32, 32),
                               (2, 5, 3, 2, 20, 23)):
        conv = nn.Conv2d(c, 8, k, s, p).double()
        x = torch.randn(2, c, h, w, dtype=torch.float64)
        ref, alt = conv(x), SpaceToDepthConv(conv)(x)
        assert ref.shape == alt.shape, (ref.shape, alt.shape)
        assert torch.allclose(ref, alt, atol=1e-12), (ref - alt).abs().max()
    print("space-to-depth form equals the convolution (float64)")


def run(model_name: str, rounds: int, only=None):
    import shrinkwrap as sw
    from run import HandAutocast, build, measure_same_run

    def s2d(model, channels_last=False):
        model.conv1 = SpaceToDepthConv(model.conv1, channels_last)
        return model

    cg = "compile(mode='reduce-overhead', memory_budget=0.6)"
    plans = {"sw_stem_budget_cg": f"checkpoint('conv1'), channels_last(), autocast(torch.bfloat16), {cg}",
             "sw_budget_cg": f"channels_last(), autocast(torch.bfloat16), {cg}"}
    makers = {"compile_bf16": lambda: torch.compile(HandAutocast(build(model_name)))}
    for name, text in plans.items():
        makers[name] = lambda text=text: sw.apply(build(model_name), text)
        makers["s2d_" + name] = lambda text=text: sw.apply(s2d(build(model_name)), text)
        makers["s2dcl_" + name] = lambda text=text: sw.apply(s2d(build(model_name), True), text)
    makers["s2d_compile_bf16"] = lambda: torch.compile(HandAutocast(s2d(build(model_name))))
    makers = {k: v for k, v in makers.items() if not only or k in only}
    return measure_same_run(model_name, makers, rounds, plans)


if __name__ == "__main__":
    _check()
    if torch.cuda.is_available():
        from run import breaks, ratio_table, same_run_main

        same_run_main(__doc__, ["resnet18"], run,
                      lambda rows: ratio_table(rows, {"compile+bf16": "compile_bf16"}, {"graph breaks": breaks}), 20)
