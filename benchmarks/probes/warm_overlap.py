"""Probe: does cuDNN's first use of a layout and type overlap between two processes? torchvision's
efficientnet_b0 @128, channels_last, bf16 autocast: the first step alone, then in two processes at
once (after both have started CUDA and built the model); wall and CPU seconds of each first step.

    python benchmarks/probes/warm_overlap.py
"""

import multiprocessing as mp
import time

import torch
import torchvision


def first_step(ready=None, go=None, out=None):
    model = torchvision.models.efficientnet_b0().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(128, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    torch.cuda.synchronize()
    if ready is not None:
        ready.set()
        go.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(x).float().sum()
    loss.backward()
    torch.cuda.synchronize()
    result = (time.perf_counter() - wall, time.process_time() - cpu)
    if out is not None:
        out.put(result)
    return result


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    alone = ctx.Queue()
    p = ctx.Process(target=first_step, kwargs=dict(out=alone))
    p.start()
    print("alone: first step %.2f s wall, %.2f s CPU" % alone.get())
    p.join()
    ready, go, out = [ctx.Event(), ctx.Event()], ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=first_step, args=(r, go, out)) for r in ready]
    for q in procs:
        q.start()
    for r in ready:
        r.wait()
    go.set()
    for i in range(2):
        print("pair %d: first step %.2f s wall, %.2f s CPU" % ((i,) + out.get()))
    for q in procs:
        q.join()
