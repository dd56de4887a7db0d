"""Probe: does a second process that has run the same model and then sits idle (its CUDA context
and cuDNN state alive, its cache emptied) slow this process's steps? torchvision's efficientnet_b0
@128, channels_last, bf16 autocast, AdamW; median step ms of 3x20 steps before, while and after.

    python benchmarks/probes/idle_neighbour.py
"""

import multiprocessing as mp
import statistics
import time

import torch
import torchvision


def setup():
    model = torchvision.models.efficientnet_b0().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(128, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def neighbour(ready, stop):
    step = setup()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ready.set()
    stop.wait()


def timed(step, label):
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / 20 * 1e3)
    print(f"{label}: {statistics.median(rounds):.2f} ms ({min(rounds):.2f}-{max(rounds):.2f})", flush=True)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    step = setup()
    for _ in range(3):
        step()
    for i in range(2):
        timed(step, f"alone {i}")
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=neighbour, args=(ready, stop))
        p.start()
        ready.wait()
        timed(step, f"idle neighbour {i}")
        stop.set()
        p.join()
    timed(step, "alone again")
