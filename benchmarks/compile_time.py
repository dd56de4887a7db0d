"""A model's cold compilation, whole or by regions: what one compiled plan costs autoplan's
``compile=True`` before anything is measured.

    python benchmarks/compile_time.py resnet152 whole
    python benchmarks/compile_time.py efficientnet_b0 regional

One torchvision classifier at batch 64 under ``autocast(torch.bfloat16)`` on CUDA, compiled one
of three ways: ``whole`` (``compile()``), ``regional`` (``compile(pattern=...)`` over the blocks
autoplan finds, :func:`~shrinkwrap.select.innermost_blocks`: each block a code object of its
own), and ``module_compile`` (torch's ``nn.Module.compile()`` on each of those blocks: one code
object, ``nn.Module._call_impl``, for all of them). The compiler's caches start empty (fresh
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
from shrinkwrap.select import innermost_blocks, pattern_for  # noqa: E402


def main(name: str, how: str) -> None:
    import torchvision
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).cuda()
    side = 299 if name == "inception_v3" else 224
    x, y = torch.randn(64, 3, side, side, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")
    blocks = innermost_blocks(model)
    pattern = pattern_for(model, blocks)
    sw.apply(model, {"whole": "autocast(torch.bfloat16), compile()",
                     "regional": f"autocast(torch.bfloat16), compile(pattern=r'{pattern}')",
                     "module_compile": "autocast(torch.bfloat16)"}[how])
    if how == "module_compile":
        for block in blocks:
            model.get_submodule(block).compile()
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
    if len(sys.argv) != 3 or sys.argv[2] not in ("whole", "regional", "module_compile"):
        sys.exit(__doc__)
    main(*sys.argv[1:])
