"""cuDNN's first use in a fresh process, with and without the calls replayed first: what a fresh
row's process saves by :func:`shrinkwrap.measuring.first_use.replay` while it waits for its row.

    python benchmarks/first_use.py                                   # efficientnet_b0 @128, two runs
    python benchmarks/first_use.py --plan "bn_act(), channels_last(), autocast(torch.bfloat16)" --runs 3

One process records the calls of an iteration of torchvision's efficientnet_b0 under ``--plan``
(:func:`~shrinkwrap.measuring.first_use.recorded`); then, each in a process of its own and in turns,
``cold`` builds the model and times its first two steps, and ``replay`` makes the recorded calls
first (timed), then does the same. Prints each process's figures: the first step's seconds, the
second's, and the peak (``max_memory_allocated``), which the replay must leave unchanged. On CUDA;
without it the same runs on the CPU (its figures say nothing of cuDNN).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

import shrinkwrap as sw  # noqa: E402
from harness import fresh_processes  # noqa: E402
from shrinkwrap.measuring.first_use import recorded, replay  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(plan: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return sw.apply(torchvision.models.efficientnet_b0().to(DEVICE), sw.Plan.parse(plan))


def step(model: torch.nn.Module, x: torch.Tensor) -> float:
    started = time.perf_counter()
    model(x).float().mean().backward()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def one(mode: str, plan: str, calls_path: str, batch: int, size: int) -> None:
    """In this process: ``record`` the calls to ``calls_path``, or time a ``cold`` or ``replay`` process."""
    x = torch.randn(batch, 3, size, size, device=DEVICE)
    if mode == "record":
        model = build(plan)
        step(model, x)
        with recorded() as calls:
            step(model, x)
        Path(calls_path).write_bytes(pickle.dumps(calls))
        print(f"recorded {len(calls)} calls", flush=True)
        return
    said = ""
    if mode == "replay":
        started = time.perf_counter()
        made = replay(pickle.loads(Path(calls_path).read_bytes()))
        said = f", replay of {made} calls {time.perf_counter() - started:.2f} s"
    model = build(plan)
    first, second = step(model, x), step(model, x)
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None
    print(f"{mode}: first step {first:.2f} s, second {second:.3f} s, peak {peak}{said}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="channels_last(), autocast(torch.bfloat16)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--calls", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.plan, args.calls, args.batch, args.size)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        calls = os.path.join(folder, "calls.pkl")
        print(f"efficientnet_b0 @{args.batch}x{args.size} under {args.plan} on {DEVICE}, torch {torch.__version__}")
        for mode in ["record"] + ["cold", "replay"] * args.runs:
            process = fresh_processes([[__file__, "--one", mode, "--calls", calls, "--plan", args.plan,
                                        "--batch", str(args.batch), "--size", str(args.size)]], capture=False)[0]
            if process.returncode:
                return process.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
