"""Plans under FSDP2 and DDP on two GPUs, measured per rank, every row in one run.

    torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py [--rounds 5] [--json out.json]

GPT-2 medium from its config (24 layers, hidden 1024, 355M parameters, random initialisation) at
8 x 1024 tokens per rank, labels = the inputs, AdamW. Each row is a model built, transformed
(shrinkwrap rows: the plan first), then sharded with ``shrinkwrap.parallel.fsdp`` (FSDP2's
``fully_shard`` per block, then the root) or replicated with ``shrinkwrap.parallel.ddp``.
Memory from ``shrinkwrap.measure`` on every rank (activation = steady peak - allocated before it),
step times from ``shrinkwrap.time_interleaved`` (every row in turns, in step on both ranks).
Rows: the user's hand recipes (``torch.autocast`` bf16 around the forward; the same with torch's
``checkpoint_wrapper`` around every block) and shrinkwrap plans. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import JSON_HELP, HandAutocast, ratio_table, save_rows, torch_checkpoint_blocks, with_timings  # noqa: E402
from shrinkwrap import parallel  # noqa: E402

BLOCKS = r"(?:model\.)?transformer\.h\.\d+"  # the blocks to shard, under HandAutocast's wrapper too
BATCH, SEQ = 8, 1024
SMALL = dict(n_embd=64, n_layer=2, n_head=2)  # --small: a smoke test of the script, on CPU ranks too
PLANS = {
    "sw_ckpt_bf16": r"checkpoint(r'transformer\.h\.\d+'), autocast(torch.bfloat16)",
    "sw_ckpt_chunked_bf16": r"checkpoint(r'transformer\.h\.\d+'), chunked_loss(), autocast(torch.bfloat16)",
}


def gpt2_medium(device: torch.device, small: bool = False) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    size = SMALL if small else dict(n_embd=1024, n_layer=24, n_head=16)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**size))
    model.config.use_cache = False
    model.loss_type = "ForCausalLM"
    return model.to(device)


def configurations(device: torch.device, small: bool = False) -> dict[str, Callable[[], nn.Module]]:
    wraps = {"fsdp": lambda m: parallel.fsdp(m, device, blocks=BLOCKS), "ddp": lambda m: parallel.ddp(m, device)}
    bases: dict[str, Callable[[], nn.Module]] = {
        "hand_bf16": lambda: HandAutocast(gpt2_medium(device, small)),
        "hand_bf16_ckpt": lambda: HandAutocast(torch_checkpoint_blocks(gpt2_medium(device, small), ("GPT2Block",))),
        **{name: (lambda t: lambda: sw.apply(gpt2_medium(device, small), t))(text) for name, text in PLANS.items()},
    }
    return {f"{w}_{name}": (lambda w, b: lambda: wraps[w](b()))(w, base)
            for w in wraps for name, base in bases.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help=JSON_HELP)
    p.add_argument("--small", action="store_true", help="a 2-layer model at 2 x 64 tokens: checks the script")
    args = p.parse_args()
    batch_size, seq = (2, 64) if args.small else (BATCH, SEQ)
    device = parallel.init()
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, 50257, (batch_size, seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    models, rows = {}, []
    for name, make in configurations(device, args.small).items():
        model = make()
        prof = sw.measure(model, batch, device=device, iterations=3, warmup=2)
        models[name] = model
        # CPU ranks (--small) have no allocator to read: the bytes saved for backward stand in.
        per_rank = [round((r.peak - r.static if r.peak is not None else r.saved) / 2**20, 1) for r in prof.ranks]
        rows.append({"model": "gpt2_medium", "config": name, "plan": PLANS.get(name.split("_", 1)[1]),
                     "activation_mib": max(per_rank), "activation_per_rank_mib": per_rank,
                     "peak_per_rank_mib": [round((r.peak or 0) / 2**20, 1) for r in prof.ranks],
                     "parameters_per_rank_mib": [round(r.parameters / 2**20, 1) for r in prof.ranks]})
        if rank == 0:
            print(f"measured {name}: {per_rank} MiB", file=sys.stderr, flush=True)
    times = sw.time_interleaved(models, batch, sw.Options(device=device, warmup=2), rounds=args.rounds, per_round=3)
    rows = with_timings(rows, times, 2, batch=batch_size, seq=seq, ranks=torch.distributed.get_world_size())
    if rank == 0:
        if args.json:
            save_rows(args.json, rows)
        for wrap in ("fsdp", "ddp"):
            some = [r for r in rows if r["config"].startswith(wrap)]
            print(ratio_table(some, {"hand bf16": f"{wrap}_hand_bf16", "hand bf16+ckpt": f"{wrap}_hand_bf16_ckpt"},
                              {"activation per rank MiB": lambda r: r["activation_per_rank_mib"]}), "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
