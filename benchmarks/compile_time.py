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
that way), each through a frame of its own (``compile(pattern=...)`` over them). The
compiler's caches start empty (fresh directories for inductor and triton): run each in a process
of its own. Prints one JSON line from ``sw.measure`` (SGD, cross-entropy): the first iteration's seconds (the compilation), the
median of 15 steady steps and their spread, and the activation (the steady step's peak less
what was allocated before it).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # cold, set before torch reads them
    os.environ[var] = tempfile.mkdtemp(prefix=var.split("_")[0].lower() + "-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from shrinkwrap.select import innermost_blocks, pattern_for  # noqa: E402
from shrinkwrap.transforms.compile import _torchs_own  # noqa: E402

HOWS = ("whole", "per_block", "shared_call")


def main(name: str, how: str) -> None:
    import torchvision
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).cuda()
    side = 299 if name == "inception_v3" else 224
    x, y = torch.randn(64, 3, side, side), torch.randint(0, 1000, (64,), device="cuda")
    blocks = innermost_blocks(model)
    torchs_own = [b for b in blocks if _torchs_own(model.get_submodule(b))]
    # per_block is compile(pattern=...): each region through a frame of its own.
    regions = {"whole": None, "per_block": blocks, "shared_call": torchs_own}[how]
    compile_step = "compile()" if regions is None else f"compile(pattern=r'{pattern_for(model, regions)}')"
    sw.apply(model, f"autocast(torch.bfloat16), {compile_step}" if regions != [] else "autocast(torch.bfloat16)")
    if how == "shared_call":
        for block in set(blocks) - set(torchs_own):
            model.get_submodule(block).compile()
    profile = sw.measure(model, x, loss_fn=lambda out: F.cross_entropy(out, y), iterations=15, warmup=5,
                         optimizer=functools.partial(torch.optim.SGD, lr=1e-3), device="cuda")
    print(json.dumps({
        "model": name, "how": how, "blocks": len(blocks), "first_s": round(profile.first_ms / 1e3, 1),
        "step_ms": round(profile.step_ms, 2), "step_ms_low": round(min(profile.step_times_ms), 2),
        "step_ms_high": round(max(profile.step_times_ms), 2),
        "activation_mib": round((profile.peak - profile.static) / 2**20, 1),
        "graphs": counters["stats"]["unique_graphs"], "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}),
        flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in HOWS:
        sys.exit(__doc__)
    main(*sys.argv[1:])
