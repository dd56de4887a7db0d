"""What bounds the optimizer step with its state on the CPU (``step_in_backward(state='cpu')``) on
the machine at hand: the link between host and GPU, the host's memory, or the CPU optimizer.

    python benchmarks/bandwidth.py --json benchmarks/bandwidth.json   # ~2 minutes on a 16-core host
    python benchmarks/bandwidth.py --elements 20000000                # smaller, e.g. without a GPU

Rows (``measure``, ``config``, ``threads``):

- ``link``: a 1 GiB copy from pinned host memory to the GPU and back (``h2d_pinned``,
  ``d2h_pinned``), both at once on two streams (``both_pinned``), and from pageable memory for
  reference; each on a side stream, timed with CUDA events. Skipped without CUDA.
- ``memory``: a float32 CPU ``copy_`` of 2 GiB (bytes read + written), a triad
  ``torch.add(a, b, alpha=2, out=c)`` and its in-place form ``c.add_(b, alpha=2)`` (three arrays'
  bytes), at torch's default threads and at one.
- ``adamw``: torch's fused CPU AdamW over float32 tensors laid out as a decoder's parameters
  (Qwen2-0.5B's layer shapes, the embedding taking what ``--elements`` leaves), one ``step()`` over
  all, after a warmup step: one optimizer over every tensor (``fused_one``), one optimizer a tensor
  stepped in turn as shrinkwrap does (``fused_per_tensor``), the same from the one worker thread of a
  ``ThreadPoolExecutor`` as shrinkwrap's (``worker``: torch's threads as the worker finds them;
  ``worker_set``: after ``torch.set_num_threads`` inside it), and ``foreach=True`` and the
  single-tensor path over every tensor (``foreach_one``, ``single_one``). GB/s at 28 bytes a
  parameter: the parameter, gradient and two moments read, the parameter and moments written.

GB/s are 10^9 bytes a second, at the median; low-high from the slowest and fastest repeat.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import JSON_HELP, ROW_KEYS, run_stamp, save_rows  # noqa: E402

GiB = 2**30
CORES = len(os.sched_getaffinity(0))
DEFAULT_THREADS = torch.get_num_threads()
ADAMW_BYTES = 28  # a parameter's bytes an AdamW step moves: 4 float32 read, 3 written
HIDDEN, FFN, KV = 896, 4864, 128  # Qwen2-0.5B's layer
LAYER = [(HIDDEN, HIDDEN), (HIDDEN,), (KV, HIDDEN), (KV,), (KV, HIDDEN), (KV,), (HIDDEN, HIDDEN),
         (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN), (HIDDEN,), (HIDDEN,)]  # q k v o, gate up down, 2 norms


def decoder_shapes(elements: int) -> list[tuple[int, ...]]:
    """A decoder's parameter shapes totalling about ``elements``: Qwen2-0.5B's layers (~72% of its
    parameters), an embedding of what they leave, a final norm."""
    per_layer = sum(torch.Size(s).numel() for s in LAYER)
    layers = max(1, round(elements * 0.725 / per_layer))
    vocab = max(1, (elements - layers * per_layer - HIDDEN) // HIDDEN)
    return [(vocab, HIDDEN), *LAYER * layers, (HIDDEN,)]


def spread(ms: list[float], nbytes: int) -> dict[str, Any]:
    """Repeats' milliseconds as a row's figures: the median and range, and GB/s of ``nbytes``."""
    mid = statistics.median(ms)
    return {"ms": round(mid, 3), "ms_low": round(min(ms), 3), "ms_high": round(max(ms), 3), "bytes": nbytes,
            "gb_s": round(nbytes / mid / 1e6, 2), "gb_s_low": round(nbytes / max(ms) / 1e6, 2),
            "gb_s_high": round(nbytes / min(ms) / 1e6, 2)}


def row(measure: str, config: str, threads: int | None, **figures: Any) -> dict[str, Any]:
    out = {"measure": measure, "config": config, "threads": threads, **figures, "host_cores": CORES,
           "torch_threads": DEFAULT_THREADS, **run_stamp()}
    print(f"{measure} {config} threads={threads}: {figures.get('ms')} ms, {figures.get('gb_s')} GB/s", flush=True)
    return out


def wall_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def at_threads(n: int, fn: Callable[[], Any]) -> Any:
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(DEFAULT_THREADS)


# -- the link ------------------------------------------------------------------------------------------
def link_rows(repeats: int) -> list[dict[str, Any]]:
    """Host <-> GPU copies of 1 GiB on side streams, each timed with CUDA events from its start."""
    n = GiB // 4
    dev_a, dev_b = torch.empty(n, device="cuda"), torch.ones(n, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []

    def copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The pairs' copies (dst, src) at once, one a stream: milliseconds to the last one's end."""
        start, ends = torch.cuda.Event(enable_timing=True), []
        start.record()
        for (dst, src), stream in zip(pairs, streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record(stream)
        torch.cuda.synchronize()
        return max(start.elapsed_time(e) for e in ends)

    for pinned in (True, False):
        host_a, host_b = torch.ones(n, pin_memory=pinned), torch.empty(n, pin_memory=pinned)
        host_b.fill_(0)  # touched: the first copy's page faults are not timed
        kind = "pinned" if pinned else "pageable"
        cases = {f"h2d_{kind}": [(dev_a, host_a)], f"d2h_{kind}": [(host_b, dev_b)]}
        if pinned:
            cases["both_pinned"] = [(dev_a, host_a), (host_b, dev_b)]
        for config, pairs in cases.items():
            copies(pairs)  # warmup
            ms = [copies(pairs) for _ in range(repeats)]
            rows.append(row("link", config, None, **spread(ms, GiB * len(pairs)), array_gib=1.0))
        del host_a, host_b
    return rows


# -- host memory ----------------------------------------------------------------------------------------
def memory_rows(gib: float, repeats: int) -> list[dict[str, Any]]:
    n = int(gib * GiB) // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.zeros(n)  # touched before any timing
    # A written array not read is read first too (write-allocate), unless the stores stream past the
    # caches: in_place (read a and b, write a) moves the bytes it counts, as AdamW's update does.
    cases = {"copy": (lambda: b.copy_(a), 2 * 4 * n), "triad": (lambda: torch.add(a, b, alpha=2, out=c), 3 * 4 * n),
             "in_place": (lambda: c.add_(b, alpha=2), 3 * 4 * n)}
    rows = []
    for threads in sorted({DEFAULT_THREADS, 1}, reverse=True):
        for config, (fn, nbytes) in cases.items():
            ms = at_threads(threads, lambda: [wall_ms(fn) for _ in range(repeats + 1)][1:])
            rows.append(row("memory", config, threads, **spread(ms, nbytes), array_gib=gib))
    return rows


# -- the CPU optimizer ---------------------------------------------------------------------------------
def adamw_rows(elements: int, repeats: int) -> list[dict[str, Any]]:
    shapes = decoder_shapes(elements)
    params = [torch.empty(s).uniform_(-1, 1).requires_grad_(True) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3)
    total = sum(p.numel() for p in params)
    nbytes = ADAMW_BYTES * total
    layout = {"elements": total, "tensors": len(params)}
    threads = sorted({t for t in (1, 4, 8, CORES) if t <= CORES})
    if threads != sorted({1, 4, 8, CORES}):
        print(f"{CORES} cores: threads {threads} only (no more threads than cores)", flush=True)
    options = {"lr": 1e-4, "weight_decay": 0.01}

    def timed(step: Callable[[], Any]) -> list[float]:
        step()  # warmup: the state is made
        return [wall_ms(step) for _ in range(repeats)]

    def each(optimizers: list[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            opt.step()

    rows = []
    for how, kwargs in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("single", {"foreach": False})):
        one = torch.optim.AdamW(params, **options, **kwargs)
        for n in threads if how == "fused" else [CORES]:
            ms = at_threads(n, lambda: timed(one.step))
            rows.append(row("adamw", f"{how}_one", n, **spread(ms, nbytes), **layout))
        del one

    per = [torch.optim.AdamW([p], **options, fused=True) for p in params]
    for n in threads:
        ms = at_threads(n, lambda: timed(lambda: each(per)))
        rows.append(row("adamw", "fused_per_tensor", n, **spread(ms, nbytes), **layout))

    # shrinkwrap's worker: one thread, a step submitted a tensor, the last waited on.
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        found = worker.submit(torch.get_num_threads).result()
        for config, n in (("worker", None), ("worker_set", CORES)):
            if n is not None:
                worker.submit(torch.set_num_threads, n).result()
            inside = worker.submit(torch.get_num_threads).result()

            def step() -> None:
                [worker.submit(opt.step) for opt in per][-1].result()

            ms = timed(step)
            rows.append(row("adamw", config, n, **spread(ms, nbytes), **layout, worker_threads=inside,
                            worker_threads_found=found))
    torch.set_num_threads(DEFAULT_THREADS)  # set in the worker, torch's count changed for this thread too
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'measure':8} {'config':18} {'threads':>7} {'ms (low-high)':>26} {'GB/s (low-high)':>24}"]
    for r in rows:
        threads = r.get("worker_threads", r["threads"])  # a worker's: as it found them or was set to
        lines.append(f"{r['measure']:8} {r['config']:18} {str(threads or '-'):>7} "
                     f"{r['ms']:>10.2f} ({r['ms_low']:.2f}-{r['ms_high']:.2f}) "
                     f"{r['gb_s']:>8.2f} ({r['gb_s_low']:.2f}-{r['gb_s_high']:.2f})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=500_000_000, help="the optimizer's parameters in all")
    parser.add_argument("--memory-gib", type=float, default=2.0, help="each array of the host memory rows")
    parser.add_argument("--json", help=JSON_HELP)
    args = parser.parse_args()
    print(f"{run_stamp()['gpu']}, torch {torch.__version__}: {CORES} cores, torch's threads {DEFAULT_THREADS}",
          flush=True)
    rows = []
    if torch.cuda.is_available():
        rows += link_rows(repeats=10)
    else:
        print("no CUDA: the link rows are left out", flush=True)
    rows += memory_rows(args.memory_gib, repeats=5)
    rows += adamw_rows(args.elements, repeats=5)
    if args.json:
        save_rows(args.json, rows, key=ROW_KEYS["bandwidth.json"])
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
