"""What is live at a configuration's memory peak, grouped by the code that allocated it.

    python benchmarks/peak.py --model llama128k --configs ckpt_bf16_chunked,ckpt_bf16_chunked_offload
    python benchmarks/peak.py --model resnet18 --plan "channels_last(), autocast(torch.bfloat16), compile()"

A diagnosis, not a benchmark: each configuration trains two warm-up iterations (SGD with lr 0, so
that no optimizer state or temporaries count and the weights stay as they were), then one with
the CUDA allocator's history recorded (``torch.cuda.memory._record_memory_history``). From the
trace: allocated bytes over the iteration (relative to its start), the moment of the peak, the
phase it falls in, and the allocations live then, grouped by their innermost frame outside
torch's own files (the model's line, or shrinkwrap's), largest first. The peak here is the
iteration's own (zero_grad frees the gradients first, so it reads lower than ``activation`` in
lm.py, which counts from before zero_grad).

``--model`` is one of lm.py's models (``--configs`` names its configurations) or run.py's
(``--plan`` gives plan texts, ``;``-separated; ``base`` is the model as it is).
"""

from __future__ import annotations

import argparse
import collections
import functools
import linecache
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from shrinkwrap.measure.step import default_loss  # noqa: E402

MiB = 2**20


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of the model's or shrinkwrap's code (not torch's, not this file's)."""
    for f in frames:
        name = f.get("filename", "")
        if not name.endswith(".py") or "/torch/" in name or name.endswith("peak.py"):
            continue
        where = f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
        if "torchinductor" in name:  # generated code: its line names the buffer, its shape and dtype
            where += "  " + linecache.getline(name, f.get("line", 0)).strip()[:110]
        return where
    return "torch internals"


def analyse(trace: list[dict[str, Any]], marks: list[tuple[int, str]], top: int = 14) -> list[str]:
    """Allocated bytes over ``trace`` (the allocator's events), the peak, and what is live then."""
    live: dict[int, tuple[int, str, int]] = {}
    now = peak = peak_at = 0
    snapshot: dict = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])), i)
            now += e["size"]
        elif e["action"] == "free_requested":  # blocks from before the recording count too
            live.pop(e["addr"], None)
            now -= e["size"]
        else:
            continue
        if now > peak:
            peak, peak_at, snapshot = now, i, dict(live)
    phase = next((name for at, name in reversed(marks) if at <= peak_at), "?")
    groups: dict[str, int] = collections.Counter()
    for size, where, _ in snapshot.values():
        groups[where] += size
    lines = [f"  peak {peak / MiB:.1f} MiB above the iteration's start, in {phase} (event {peak_at} of {len(trace)})"]
    lines += [f"    {size / MiB:9.1f} MiB  {where}" for where, size in groups.most_common(top)]
    return lines


def record(model: nn.Module, batch: Any) -> list[str]:
    """Two warm-up iterations, then one recorded; the analysis of the recorded one."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    marks: list[tuple[int, str]] = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        marks.append((len(torch.cuda.memory._snapshot()["device_traces"][0]), name))

    def iteration(recording: bool) -> None:
        step = mark if recording else (lambda name: None)
        opt.zero_grad(set_to_none=True)
        step("forward")
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = default_loss(out)
        step("backward")
        loss.backward()
        step("step")
        opt.step()

    model.train()
    for _ in range(2):
        iteration(False)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        iteration(True)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return analyse(trace, marks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", default="", help="lm.py configurations, comma-separated")
    parser.add_argument("--plan", default="", help="plan texts for run.py's models, ';'-separated")
    args = parser.parse_args()
    import lm
    import run

    if args.model in lm.MODELS:
        _, batch_size, seq, _ = lm.MODELS[args.model]
        shared = lm.build(args.model, None)
        ids = torch.randint(0, shared.config.vocab_size, (batch_size, seq),
                            generator=torch.Generator().manual_seed(0)).cuda()
        batch: Any = {"input_ids": ids, "labels": ids}
        makers = {c: functools.partial(lambda c: lm.configurations(args.model)[c](lm.build(args.model, shared)), c)
                  for c in args.configs.split(",") if c}
    else:
        _, batch = run._load(args.model, run.MODELS[args.model][1])
        batch = batch.cuda() if isinstance(batch, torch.Tensor) else {k: v.cuda() for k, v in batch.items()}
        makers = {t: functools.partial(lambda t: run.build(args.model) if t == "base" else
                                       sw.apply(run.build(args.model), t), t.strip())
                  for t in args.plan.split(";") if t.strip()}
    for name, make in makers.items():
        model = make()
        print(name)
        print("\n".join(record(model, batch)), flush=True)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
