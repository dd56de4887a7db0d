"""Probe: what inductor's on-disk caches save a compiled plan's first iterations, and whether
compilations in parallel processes fill them faster than one after another.

    python benchmarks/probes/compile_cache.py --model resnet152 --plan "autocast(torch.bfloat16), compile()"

Builds the model, applies the plan and runs its first two training iterations (where dynamo,
AOTAutograd and inductor compile, forward and backward), then prints the seconds they took and
the cache counters. Run it twice with one ``TORCHINDUCTOR_CACHE_DIR`` for cold against warm, and
several at once for compilations side by side (the driver is the shell command in RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from run import MODELS, _load, build  # noqa: E402
from shrinkwrap.measure.step import time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--plan", required=True)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    started = time.perf_counter()
    _, batch = _load(args.model, MODELS[args.model][1])
    model = sw.apply(build(args.model), args.plan)
    ready = time.perf_counter()
    time_interleaved({"first": model}, batch, sw.Options(device="cuda", warmup=2), rounds=1, per_round=1)
    done = time.perf_counter()
    from torch._dynamo.utils import counters

    hits = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    keep = {k: {n: c for n, c in v.items() if "cache" in n} for k, v in hits.items()}
    print(f"{args.tag} {args.model} [{args.plan}]: build {ready - started:.1f} s, first iterations "
          f"{done - ready:.1f} s; {keep}", flush=True)


if __name__ == "__main__":
    main()
