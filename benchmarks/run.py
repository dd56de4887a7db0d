"""The benchmark suite: shrinkwrap beside what users would do instead, on one GPU, in one run.

    python benchmarks/run.py --model resnet18            # one model, every configuration
    python benchmarks/run.py --model bert --configs base_fp32,fast,small
    python benchmarks/run.py --all                       # every model (several GPU runs' worth)
    python benchmarks/run.py --report                    # results.json as a table, and plots

Each configuration runs in its own process (nothing cached by an earlier configuration leaks into
a later row) and is measured by ``shrinkwrap.measure``: one training step (zero_grad, forward,
loss, backward, AdamW step) after warm-up; peak = ``max_memory_allocated`` over the steady step,
static = allocated before it, activation = peak - static, median step time. Results append to
``benchmarks/results.json``, one object per row, each with the GPU, the torch version and the date.

Anchors (``kind: "anchor"``) are the recipes of the project's anchor table (ANCHORS.md), written the way users write
them by hand: ``torch.autocast`` around the forward, torch's own ``apply_activation_checkpointing``
with ``checkpoint_wrapper``, selective checkpointing, ``torch.compile``; and torch's own automatic
selective-checkpoint planner (``auto_sac.py``; it needs ``pulp`` and ``pwlf``). Shrinkwrap rows
(``kind: "shrinkwrap"``) are plans, as text that ``shrinkwrap profile --plan`` accepts.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"

# name: (model spec for shrinkwrap.cli.load_model, batch size, block class names for the anchors)
MODELS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "resnet18": ("torchvision:resnet18", 128, ("BasicBlock",)),
    "efficientnet_b0": ("torchvision:efficientnet_b0", 128, ("MBConv",)),
    "resnet152": ("torchvision:resnet152", 64, ("Bottleneck",)),
    "bert": ("transformers:BertConfig", 32, ("BertLayer",)),
    "gpt2": ("transformers:GPT2Config", 8, ("GPT2Block",)),
}
SEQ = {"bert": 512, "gpt2": 1024}

# Hand-written shrinkwrap recipes (the auto-planner automates this choice).
# fast: least memory at no more than the fp32 baseline's step time; small: least memory within 1.5x.
RECIPES: dict[str, dict[str, str]] = {
    # torchvision's ResNets wire BatchNorm -> ReLU inside forward(), where bn_act cannot see it.
    "resnet18": {
        "fast": r"checkpoint(r'layer1'), autocast(torch.bfloat16)",
        "small": r"checkpoint(r'layer\d\.\d+'), autocast(torch.bfloat16)",
    },
    "efficientnet_b0": {
        "fast": r"bn_act(), autocast(torch.bfloat16)",
        "small": r"checkpoint(r'features\.[1-7]\.\d+'), bn_act(), autocast(torch.bfloat16)",
    },
    "resnet152": {
        "fast": r"checkpoint(r'layer[12]'), autocast(torch.bfloat16)",
        "small": r"checkpoint(r'layer[1-4]\.\d+'), autocast(torch.bfloat16)",
    },
    "bert": {
        "fast": r"checkpoint(r'bert\.encoder\.layer\.\d+'), autocast(torch.bfloat16)",
        "small": r"checkpoint(r'bert\.encoder\.layer\.\d+'), autocast(torch.bfloat16)",
    },
    "gpt2": {
        "fast": r"checkpoint(r'transformer\.h\.\d+'), autocast(torch.bfloat16)",
        "small": r"checkpoint(r'transformer\.h\.\d+'), autocast(torch.bfloat16)",
        # The model computes its loss inside; a float32 copy of the 8x1024x50257 logits is waste.
        "fast_bf16_out": r"checkpoint(r'transformer\.h\.\d+'), autocast(torch.bfloat16, keep_output_dtype=True)",
    },
}


# -- the anchors: what users write by hand ---------------------------------------------------------
class HandAutocast(nn.Module):
    """``with torch.autocast("cuda", bfloat16): out = model(x)``, as a user's loop does it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def _is_block(names: tuple[str, ...]) -> Callable[[nn.Module], bool]:
    return lambda m: type(m).__name__ in names


def torch_checkpoint_blocks(model: nn.Module, blocks: tuple[str, ...], selective: bool = False) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if selective:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        keep = {torch.ops.aten.convolution.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default}

        def policy(ctx: Any, op: Any, *args: Any, **kw: Any) -> Any:
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, **kwargs), check_fn=_is_block(blocks))
    return model


def compiled(model: nn.Module, budget: float | None = None) -> nn.Module:
    if budget is not None:
        torch._functorch.config.activation_memory_budget = budget
    return torch.compile(model)


def auto_sac(model: nn.Module, batch: Any, share: float, bf16: bool) -> nn.Module:
    """torch's own planner for selective checkpointing (``auto_sac.py``), under bf16 autocast or
    in float32 (its runtime estimator fails on bf16 attention: the fused kernels' outputs have two
    float dtypes)."""
    from auto_sac import torch_auto_sac

    if bf16:
        return HandAutocast(torch_auto_sac(model, batch, share, dtype=torch.bfloat16))
    return torch_auto_sac(model, batch, share)


# name -> (model, the anchors' block class names, the batch) -> the model to train
ANCHORS: dict[str, Callable[[nn.Module, tuple[str, ...], Any], nn.Module]] = {
    "base_fp32": lambda m, b, x: m,
    "amp_bf16": lambda m, b, x: HandAutocast(m),
    "ckpt_every_block": lambda m, b, x: torch_checkpoint_blocks(m, b),
    "ckpt_every_block+bf16": lambda m, b, x: HandAutocast(torch_checkpoint_blocks(m, b)),
    "sac_every_block+bf16": lambda m, b, x: HandAutocast(torch_checkpoint_blocks(m, b, selective=True)),
    # Its budget: this share of the planner's own estimate of the activation peak.
    "auto_sac0.5": lambda m, b, x: auto_sac(m, x, 0.5, bf16=False),
    "auto_sac0.25": lambda m, b, x: auto_sac(m, x, 0.25, bf16=False),
    "auto_sac0.5+bf16": lambda m, b, x: auto_sac(m, x, 0.5, bf16=True),
    "auto_sac0.25+bf16": lambda m, b, x: auto_sac(m, x, 0.25, bf16=True),
    "compile": lambda m, b, x: compiled(m),
    "compile_budget0.5": lambda m, b, x: compiled(m, 0.5),
    "compile+bf16": lambda m, b, x: compiled(HandAutocast(m)),
}


def recipes(model: str) -> dict[str, str]:
    """The hand recipes, and each compiled (``compile()`` is a plan's last step)."""
    return {**RECIPES[model], **{f"{name}_compiled": f"{text}, compile()" for name, text in RECIPES[model].items()}}


def configurations(model: str) -> list[str]:
    return list(ANCHORS) + list(recipes(model)) + ["auto"]


# -- one configuration, in this process ---------------------------------------------------------------
def _load(model_name: str, batch_size: int) -> tuple[Callable[[], nn.Module], Any]:
    from shrinkwrap.cli import load_model

    return load_model(MODELS[model_name][0], (SEQ[model_name],) if model_name in SEQ else None, batch_size)


def build(model_name: str) -> nn.Module:
    """A fresh model on the GPU (module-level, so autoplan can send it to subprocesses)."""
    factory, _ = _load(model_name, 1)
    torch.manual_seed(0)
    model = factory().cuda()
    if model_name in SEQ:
        model.config.use_cache = False  # a KV cache has no use in training and would be recomputed
        if model_name == "gpt2":
            # GPT2LMHeadModel's name does not tell transformers its loss, which then logs a warning
            # at every forward: a graph break under torch.compile in every compiled row.
            model.loss_type = "ForCausalLM"
    return model


def _figures(prof: Any) -> dict[str, Any]:
    mib = 2**20
    return dict(
        peak_mib=round(prof.peak / mib, 1),
        static_mib=round(prof.static / mib, 1),
        activation_mib=round((prof.peak - prof.static) / mib, 1),
        step_ms=round(prof.step_ms, 2),
        top_modules=[(n, round(b / mib, 1)) for n, b in prof.top_modules[:5]],
        gpu=prof.device_name,
        torch=prof.torch_version,
        date=datetime.date.today().isoformat(),
    )


def run_one(model_name: str, config: str) -> list[dict[str, Any]]:
    import shrinkwrap as sw

    _, batch_size, blocks = MODELS[model_name]
    batch = _load(model_name, batch_size)[1]
    row: dict[str, Any] = {"model": model_name, "batch": batch_size, "config": config}
    if config == "auto":
        return run_autoplan(model_name, batch)
    model = build(model_name)
    if config in ANCHORS:
        row.update(kind="anchor", plan=None)
        model = ANCHORS[config](model, blocks, batch)
    else:
        plan = sw.Plan.parse(recipes(model_name)[config])
        row.update(kind="shrinkwrap", plan=str(plan))
        sw.apply(model, plan)
    try:
        prof = sw.measure(model, batch, iterations=8, warmup=3, device="cuda")
    except torch.cuda.OutOfMemoryError as exc:
        return [{**row, "error": f"out of memory: {str(exc).splitlines()[0]}"}]
    return [{**row, **_figures(prof)}]


def run_autoplan(model_name: str, batch: Any) -> list[dict[str, Any]]:
    """autoplan with max_slowdown 1.0 (auto_fast) and 1.5 (auto_small), lossy steps allowed,
    sharing the candidates' measurements; each row records the seconds autoplan took."""
    import time

    import shrinkwrap as sw

    cache: dict = {}
    rows = []
    for config, slowdown in (("auto_fast", 1.0), ("auto_small", 1.5)):
        t0 = time.perf_counter()
        plan, report = sw.autoplan(functools.partial(build, model_name), batch, max_slowdown=slowdown,
                                   allow_lossy=True, device="cuda", iterations=8, warmup=3, cache=cache)
        seconds = time.perf_counter() - t0
        final = next((r for r in report.rows[::-1] if r.plan == plan and r.role != "candidate"), report.rows[0])
        row = {"model": model_name, "batch": MODELS[model_name][1], "config": config, "kind": "shrinkwrap",
               "plan": str(plan), "autoplan_s": round(seconds, 1),
               "candidates": sum(r.role == "candidate" for r in report.rows),
               "notes": report.notes}
        rows.append({**row, **_figures(final.profile)} if final.profile else {**row, "error": final.error})
    return rows


def run_model(model_name: str, configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    for i, config in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {model_name} {config}", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--one", model_name, config], capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            new = [{"model": model_name, "config": config, "error": tail[:300]}]
        else:
            new = json.loads(lines[-1])
        rows += new
        with RESULTS.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in new)
    return rows


# -- report ----------------------------------------------------------------------------------------------
def load_results(path: Path = RESULTS) -> list[dict[str, Any]]:
    """The newest row of each (model, config), in file order."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[(row["model"], row["config"])] = row
    return list(rows.values())


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["model"]: r for r in rows if r["config"] == "base_fp32" and "error" not in r}
    out = ["| model | batch | configuration | kind | peak MiB | static MiB | activation MiB | activation x base "
           "| step ms | step x base | GPU | torch | date |", "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r.get('batch', '')} | {r['config']} | {r.get('kind', '')} | "
                       f"{r['error']} |||||||||")
            continue
        b = base.get(r["model"])
        act = f"{r['activation_mib'] / b['activation_mib']:.2f}" if b else ""
        step = f"{r['step_ms'] / b['step_ms']:.2f}" if b else ""
        out.append(f"| {r['model']} | {r['batch']} | {r['config']} | {r['kind']} | {r['peak_mib']:.0f} | "
                   f"{r['static_mib']:.0f} | {r['activation_mib']:.0f} | {act} | {r['step_ms']:.1f} | {step} | "
                   f"{r['gpu']} | {r['torch']} | {r['date']} |")
    plans = [r for r in rows if r.get("plan") and "error" not in r]
    if plans:
        out += ["", "| model | configuration | plan | autoplan seconds (candidates measured) |", "|---|---|---|---|"]
        for r in plans:
            auto = f"{r['autoplan_s']} ({r['candidates']})" if "autoplan_s" in r else ""
            out.append(f"| {r['model']} | {r['config']} | `{r['plan']}` | {auto} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["model"] != model or "error" in r:
            continue
        mark = "o" if r["kind"] == "anchor" else "*"
        ax.scatter(r["step_ms"], r["peak_mib"], marker=mark, s=80 if mark == "*" else 40,
                   color="tab:gray" if r["kind"] == "anchor" else "tab:red")
        ax.annotate(r["config"], (r["step_ms"], r["peak_mib"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"{model}: anchors (o) and shrinkwrap (*)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure_same_run(model_name: str, makers: dict[str, Callable[[], nn.Module]], rounds: int,
                     plans: dict[str, str] | None = None, batch: Any = None) -> list[dict[str, Any]]:
    """Every configuration of one model in this process: memory from ``shrinkwrap.measure`` one at a
    time (activation = steady-state peak - allocated before it, so the other configurations'
    weights, lying in memory meanwhile, are left out), then step times from
    ``shrinkwrap.time_interleaved`` (configurations in turns, ``rounds`` rounds of 5 iterations).
    A configuration that fails is a row with its error. ``batch``: for a model not in ``MODELS``."""
    import shrinkwrap as sw

    size = MODELS[model_name][1] if model_name in MODELS else len(batch)
    if batch is None:
        _, batch = _load(model_name, size)
    options = sw.Options(device="cuda", iterations=3, warmup=3)
    models, rows = {}, []
    for name, make in makers.items():
        row: dict[str, Any] = {"model": model_name, "config": name, "plan": (plans or {}).get(name)}
        try:
            model = make()
            prof = sw.measure(model, batch, iterations=options.iterations, warmup=options.warmup, device="cuda")
            inner = getattr(model, "model", model)  # inside HandAutocast
            if hasattr(inner, "auto_sac"):
                from auto_sac import describe

                row.update(plan=describe(inner), autoplan_s=inner.auto_sac_s)
        except Exception as exc:  # noqa: BLE001 - out of memory, or an anchor this torch lacks: a row
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            torch.cuda.empty_cache()
            continue
        models[name] = model
        rows.append({**row, "activation_mib": round((prof.peak - prof.static) / 2**20, 1),
                     "peak_mib": round(prof.peak / 2**20, 1), "graph_breaks": prof.graph_breaks,
                     "recompiles": prof.recompiles, "first_ms": round(prof.first_ms, 1)})
        print(f"measured {name}: {rows[-1]['activation_mib']} MiB", file=sys.stderr, flush=True)
    times = sw.time_interleaved(models, batch, options, rounds=rounds, per_round=5)
    return with_timings(rows, times, 2, batch=size, seq=SEQ.get(model_name))


def ratio_table(rows: list[dict[str, Any]], refs: dict[str, str],
                extra: dict[str, Callable[[dict[str, Any]], Any]]) -> str:
    """The same-run scripts' markdown table: activation and step time (median, fastest-slowest
    round), each with its ratio to every reference row (``refs``: column label -> configuration),
    then the ``extra`` columns (label -> the cell of a row). Time ratios of rows timed in the same
    rounds are paired (``shrinkwrap.measure.ratios.paired_ratio``: the median of the rounds' ratios,
    what autoplan decides on), with their spread (+-, half the range of the rounds' ratios)."""
    from shrinkwrap.measure.ratios import paired_ratio
    from shrinkwrap.measure import Timing

    by = {r["config"]: r for r in rows if "error" not in r}

    def time_ratio(r: dict[str, Any], ref: dict[str, Any]) -> str:
        if r.get("step_ms_rounds") and ref.get("step_ms_rounds"):
            ratio, spread = paired_ratio(Timing(tuple(ref["step_ms_rounds"])), Timing(tuple(r["step_ms_rounds"])))
            return f"{ratio:.2f}" if r is ref else f"{ratio:.2f} +-{ratio * spread / 2:.2f}"
        return f"{r['step_ms'] / ref['step_ms']:.2f}" if ref.get("step_ms") and r.get("step_ms") else "-"

    heads = [f"x {label}" for label in refs]
    lines = ["| " + " | ".join(["model", "configuration", "activation MiB", *heads, "step ms (rounds low-high)",
                                *heads, *extra]) + " |", "|---" * (4 + 2 * len(refs) + len(extra)) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | {r['error']} |" + "|" * (1 + 2 * len(refs) + len(extra)))
            continue

        def ratios(key: str) -> list[str]:
            return [f"{r[key] / by[c][key]:.2f}" if c in by and by[c].get(key) and r.get(key) else "-"
                    for c in refs.values()]

        cells = [r["model"], r["config"], r["activation_mib"], *ratios("activation_mib"),
                 f"{r.get('step_ms', '-')} ({r.get('step_ms_low')}-{r.get('step_ms_high')})",
                 *(time_ratio(r, by[c]) if c in by else "-" for c in refs.values()),
                 *(cell(r) for cell in extra.values())]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def breaks(row: dict[str, Any]) -> Any:
    return "-" if row.get("graph_breaks") is None else row["graph_breaks"]


def with_timings(rows: list[dict[str, Any]], times: dict[str, Any], digits: int = 1, **extra: Any) -> list[dict[str, Any]]:
    """The same-run scripts' rows with their interleaved step times (median, fastest and slowest
    round: ``shrinkwrap.Timing``), the GPU, the torch version, the date and ``extra``."""
    for row in rows:
        t = times.get(row["config"])
        if t is not None:
            row.update(step_ms=round(t.median, digits), step_ms_low=round(min(t.rounds_ms), digits),
                       step_ms_high=round(max(t.rounds_ms), digits), step_ms_rounds=[round(x, 3) for x in t.rounds_ms])
        row.update(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none", torch=torch.__version__, date=datetime.date.today().isoformat(),
                   **extra)
    return rows


def same_run_main(doc: str, models: list[str], run: Callable[..., list[dict[str, Any]]],
                  table: Callable[[list[dict[str, Any]]], str], rounds: int) -> None:
    """The command line of the same-run scripts (compiled.py, lm.py): one model, every row in one
    process, rows appended to ``--json``, the table printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(models))
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", help="append the rows to this file, one JSON object a line")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all)")
    args = parser.parse_args()
    rows = run(args.model, args.rounds, args.configs.split(",") if args.configs else None)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS))
    p.add_argument("--configs", help="comma-separated configuration names (default: all)")
    p.add_argument("--all", action="store_true", help="every model")
    p.add_argument("--report", action="store_true", help="print the markdown table of results.json and write plots "
                   "(benchmarks/results.py writes RESULTS.md)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one)))  # a list of rows
        return 0
    if args.report:
        rows = load_results()
        text = table(rows)
        print(text)
        for model in sorted({r["model"] for r in rows}):
            plot(rows, model, HERE / f"plot_{model}.png")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/run.py needs a CUDA GPU", file=sys.stderr)
        return 2
    models = list(MODELS) if args.all else [args.model] if args.model else []
    if not models:
        p.error("give --model NAME, --all or --report")
    for model in models:
        configs = args.configs.split(",") if args.configs else configurations(model)
        unknown = [c for c in configs if c not in configurations(model)]
        if unknown:
            p.error(f"unknown configuration(s) {unknown}; known: {configurations(model)}")
        print(table(run_model(model, configs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
