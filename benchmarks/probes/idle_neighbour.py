"""Probe: does a second process on the same GPU, idle, slow this process's steps? autoplan starts
the chosen plan's process ahead (``FreshProcesses.start_next``: imports, ``torch.cuda.init()``), and
it sits idle while the candidates are timed. Neighbour states, in turns, several times over:
``none``; ``init`` (``torch.cuda.init()`` only, as autoplan's); ``ran`` (it ran a model three
steps, emptied its cache and sits idle). Workloads: torchvision's efficientnet_b0 @128 eager
(channels_last, bf16 autocast, AdamW: launch-bound) and a chain of 8192^2 bf16 matmuls (GPU-bound).
Median ms of 10 steps per turn; each state's median over its turns and its range.

    python benchmarks/probes/idle_neighbour.py [--turns 4]
"""

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import torchvision


def effnet():
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


def matmuls():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step():
        b = a
        for _ in range(8):
            b = (b @ a) * 1e-4
    return step


def neighbour(state, ready, stop):
    torch.cuda.init()
    if state == "ran":
        step = effnet()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        del step
        torch.cuda.empty_cache()
    ready.set()
    stop.wait()


def turn(step):
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    steps = {"efficientnet_b0": effnet(), "matmuls": matmuls()}
    for step in steps.values():
        for _ in range(3):
            step()
    seen = {(w, s): [] for w in steps for s in ("none", "init", "ran")}
    for _ in range(args.turns):
        for state in ("none", "init", "ran"):
            process = None
            if state != "none":
                ready, stop = ctx.Event(), ctx.Event()
                process = ctx.Process(target=neighbour, args=(state, ready, stop))
                process.start()
                ready.wait()
            for w, step in steps.items():
                seen[w, state].append(turn(step))
            if process is not None:
                stop.set()
                process.join()
    for (w, s), ms in seen.items():
        print(f"{w:16s} neighbour {s:4s}: {statistics.median(ms):7.2f} ms (turns {min(ms):.2f}-{max(ms):.2f})")
