"""Probe: does a batch-1 step pay cuDNN's first use of a layout and type for the real batch?
torchvision's efficientnet_b0, channels_last, bf16 autocast; one process per run.

    python benchmarks/probes/cudnn_warm.py [--warm]    # --warm: a batch-1 step first
"""

import sys
import time

import torch
import torchvision

model = torchvision.models.efficientnet_b0().cuda().to(memory_format=torch.channels_last)

def step(n):
    x = torch.randn(n, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    t = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t

if "--warm" in sys.argv:
    print(f"batch 1 first step {step(1):.2f} s, second {step(1):.3f} s")
print(f"batch 128 first step {step(128):.2f} s, second {step(128):.3f} s")
