"""Probe: what resnet's stem convolution (7x7, stride 2, 3 input channels) costs on the GPU, bf16,
at resnet18 @128 (128x3x224x224), against a layer1 convolution, with the input's channels padded
to 4 and 8, and as a stride-1 4x4 convolution over the input's 2x2 space-to-depth (12 channels;
the kernel zero-padded to 8x8: the same sums in another order, checked in float64 first).

    python benchmarks/probes/conv1.py [--benchmark]    # --benchmark: torch.backends.cudnn.benchmark
"""

import sys

import torch
import torch.nn.functional as F

torch.backends.cudnn.benchmark = "--benchmark" in sys.argv
DEV = "cuda"
CL = torch.channels_last


def bench(fn, n=50):
    """Milliseconds per call, by CUDA events over ``n`` calls after 5 warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def weight_grad(g, x, w, stride, padding):
    return torch.ops.aten.convolution_backward(g, x, w, None, stride, padding, (1, 1), False, (0, 0), 1,
                                               (False, True, False))


def s2d_weight(w):
    o, c = w.shape[:2]
    return F.pad(w, (0, 1, 0, 1)).view(o, c, 4, 2, 4, 2).permute(0, 1, 3, 5, 2, 4).reshape(o, c * 4, 4, 4)


def s2d_input(x):
    n, c, h, w = x.shape
    xp = F.pad(x, (3, 3, 3, 3))
    return xp.view(n, c, (h + 6) // 2, 2, (w + 6) // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(
        n, c * 4, (h + 6) // 2, (w + 6) // 2)


for cl in (False, True):
    for c in (3, 4, 8):
        x = torch.randn(128, c, 224, 224, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(64, c, 7, 7, device=DEV, dtype=torch.bfloat16)
        if cl:
            x, w = x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)
        g = torch.randn_like(F.conv2d(x, w, stride=2, padding=3))
        print(f"channels_last={cl} C={c}: forward {bench(lambda: F.conv2d(x, w, stride=2, padding=3)):.3f} ms, "
              f"weight grad {bench(lambda: weight_grad(g, x, w, (2, 2), (3, 3))):.3f} ms")

x = torch.randn(128, 64, 56, 56, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
w = torch.randn(64, 64, 3, 3, device=DEV, dtype=torch.bfloat16).contiguous(memory_format=CL)
print(f"layer1 conv 64->64 3x3 @56: forward {bench(lambda: F.conv2d(x, w, padding=1)):.3f} ms")

x64 = torch.randn(2, 3, 224, 224, device=DEV, dtype=torch.float64)
w64 = torch.randn(64, 3, 7, 7, device=DEV, dtype=torch.float64)
ref, alt = F.conv2d(x64, w64, stride=2, padding=3), F.conv2d(s2d_input(x64), s2d_weight(w64))
print("space-to-depth equals the 7x7 stride-2 conv (float64):", alt.shape == ref.shape, (alt - ref).abs().max().item())
for cl in (False, True):
    x = torch.randn(128, 3, 224, 224, device=DEV, dtype=torch.bfloat16)
    xs, ws = s2d_input(x), s2d_weight(torch.randn(64, 3, 7, 7, device=DEV, dtype=torch.bfloat16))
    if cl:
        xs, ws = xs.contiguous(memory_format=CL), ws.contiguous(memory_format=CL)
    g = torch.randn_like(F.conv2d(xs, ws))
    print(f"space-to-depth channels_last={cl}: transform {bench(lambda: s2d_input(x)):.3f} ms, "
          f"forward {bench(lambda: F.conv2d(xs, ws)):.3f} ms, "
          f"weight grad {bench(lambda: weight_grad(g, xs, ws, (1, 1), (0, 0))):.3f} ms")

# The space-to-depth input's 12 channels zero-padded to 16 (weight likewise): the same sums.
x = torch.randn(128, 3, 224, 224, device=DEV, dtype=torch.bfloat16)
xs, ws = s2d_input(x), s2d_weight(torch.randn(64, 3, 7, 7, device=DEV, dtype=torch.bfloat16))
xs16 = F.pad(xs, (0, 0, 0, 0, 0, 4)).contiguous(memory_format=CL)
ws16 = F.pad(ws, (0, 0, 0, 0, 0, 4)).contiguous(memory_format=CL)
g = torch.randn_like(F.conv2d(xs16, ws16))
print(f"space-to-depth padded to 16 channels, channels_last: forward {bench(lambda: F.conv2d(xs16, ws16)):.3f} ms, "
      f"weight grad {bench(lambda: weight_grad(g, xs16, ws16, (1, 1), (0, 0))):.3f} ms")
