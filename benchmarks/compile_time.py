"""A model's cold compilation, whole or by regions: what one compiled plan costs autoplan's
``compile=True`` before anything is measured.

    python benchmarks/compile_time.py resnet152 whole
    python benchmarks/compile_time.py efficientnet_b0 per_block

One torchvision classifier at batch 64 under ``autocast(torch.bfloat16)`` on CUDA, compiled one
of three ways: ``whole`` (``compile()``); ``per_block``, the blocks autoplan finds
(:func:`~shrinkwrap.select.innermost_blocks`) each compiled through a frame whose code object is
its own, the rest eager; ``shared_call``, those blocks compiled the way torch's
``nn.Module.compile()`` does, through ``nn.Module._call_impl``, one code object for all, but for
the blocks whose forward is torch's own (an ``nn.Sequential``'s, which dynamo would run eagerly
that way), each through a frame of its own. The compiler's caches start empty (fresh
directories for inductor and triton): run each in a process of its own. Prints one JSON line:
the first SGD iteration's seconds (the compilation), the median of 15 steady steps (CUDA events,
after 4), and the activation (one step's peak less what was allocated before it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # cold, set before torch reads them
    os.environ[var] = tempfile.mkdtemp(prefix=var.split("_")[0].lower() + "-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from shrinkwrap.select import innermost_blocks  # noqa: E402

HOWS = ("whole", "per_block", "shared_call")


def _own_frame(call):
    """``call`` behind a frame whose code object is its own (dynamo's compiled code, and its
    limit of recompiles, are per code object)."""
    def frame(*args, **kwargs):
        return call(*args, **kwargs)
    frame.__code__ = frame.__code__.replace(co_name=f"frame_{id(call)}")
    return frame


def main(name: str, how: str) -> None:
    import torchvision
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).cuda()
    side = 299 if name == "inception_v3" else 224
    x, y = torch.randn(64, 3, side, side, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    blocks = innermost_blocks(model)
    sw.apply(model, "autocast(torch.bfloat16), compile()" if how == "whole" else "autocast(torch.bfloat16)")
    for block in map(model.get_submodule, blocks if how != "whole" else []):
        torchs_own = (type(block).forward.__module__ or "").startswith("torch.")
        if how == "shared_call" and not torchs_own:
            block.compile()
        else:
            block.__dict__["_compiled_call_impl"] = torch.compile(_own_frame(block._call_impl))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        out = model(x)
        F.cross_entropy(out.logits if hasattr(out, "logits") else out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    started = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    for _ in range(4):
        step()
    ms = []
    for _ in range(15):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        ms.append(begin.elapsed_time(end))
    ms.sort()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    print(json.dumps({
        "model": name, "how": how, "blocks": len(blocks), "first_s": round(first, 1), "step_ms": round(ms[7], 2),
        "step_ms_low": round(ms[0], 2), "step_ms_high": round(ms[-1], 2),
        "activation_mib": round((torch.cuda.max_memory_allocated() - before) / 2**20, 1),
        "graphs": counters["stats"]["unique_graphs"], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}),
        flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in HOWS:
        sys.exit(__doc__)
    main(*sys.argv[1:])
