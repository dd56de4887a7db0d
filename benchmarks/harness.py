"""The benchmarks' shared harness: the models, the anchors users write by hand, the row measuring
(every configuration in one process, or each in a process of its own) and the JSON rows.

A benchmark script lists its configurations as data (a dict of name -> plan text or model maker),
measures them with :func:`measure_same_run` or :func:`fresh_processes`, and writes its rows with
:func:`save_rows`: one row per configuration, a new run's row replacing the earlier one (the history
is in git). ``benchmarks/results.py`` makes RESULTS.md from the rows.

    from harness import ANCHORS, MODELS, build, measure_same_run, save_rows
    CONFIGS = {"base_fp32": lambda: build("resnet18"),
               "amp_bf16": lambda: ANCHORS["amp_bf16"](build("resnet18"), MODELS["resnet18"][2], None)}
    rows = measure_same_run("resnet18", CONFIGS, rounds=5)
    save_rows("benchmarks/frontier.json", rows)

A new benchmark is a script beside the others, copied from its nearest neighbour: its
configurations as a dict at its top, ``--configs`` to pick some, ``--json`` to write their rows, and
a section of ``results.py`` that renders the file.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


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


# -- building the models ------------------------------------------------------------------------------
def load_bench(model_name: str, batch_size: int) -> tuple[Callable[[], nn.Module], Any]:
    """A bench model's factory and a batch of ``batch_size`` (``shrinkwrap.cli.load_model``)."""
    from shrinkwrap.cli import load_model

    return load_model(MODELS[model_name][0], (SEQ[model_name],) if model_name in SEQ else None, batch_size)


def build(model_name: str) -> nn.Module:
    """A fresh model on the GPU (module-level, so autoplan can send it to subprocesses)."""
    factory, _ = load_bench(model_name, 1)
    torch.manual_seed(0)
    model = factory().cuda()
    if model_name in SEQ:
        model.config.use_cache = False  # a KV cache has no use in training and would be recomputed
        if model_name == "gpt2":
            # GPT2LMHeadModel's name does not tell transformers its loss, which then logs a warning
            # at every forward: a graph break under torch.compile in every compiled row.
            model.loss_type = "ForCausalLM"
    return model


# -- the zoo: torchvision classifiers autoplan was not tuned on -------------------------------------
BATCH = 64
# torchvision name: the block classes a user would checkpoint
ZOO: dict[str, tuple[str, ...]] = {
    "resnet50": ("Bottleneck",),
    "resnet101": ("Bottleneck",),
    "resnext50_32x4d": ("Bottleneck",),
    "wide_resnet50_2": ("Bottleneck",),
    "densenet121": ("_DenseLayer",),
    "googlenet": ("Inception",),
    "inception_v3": ("InceptionA", "InceptionB", "InceptionC", "InceptionD", "InceptionE"),
    "mobilenet_v2": ("InvertedResidual",),
    "mobilenet_v3_large": ("InvertedResidual",),
    "mnasnet1_0": ("_InvertedResidual",),
    "shufflenet_v2_x1_0": ("InvertedResidual",),
    "squeezenet1_1": ("Fire",),
    "efficientnet_v2_s": ("MBConv", "FusedMBConv"),
    "regnet_y_1_6gf": ("ResBottleneckBlock",),
    "convnext_tiny": ("CNBlock",),
    "swin_t": ("SwinTransformerBlock",),
    "swin_v2_t": ("SwinTransformerBlockV2",),
    "vit_b_16": ("EncoderBlock",),
    "maxvit_t": ("MaxVitLayer",),
    "mobilenet_v3_small": ("InvertedResidual",),
}
# timm models of families the torchvision ones lack: name -> (block classes, batch)
TIMM: dict[str, tuple[tuple[str, ...], int]] = {
    "efficientnetv2_rw_s": (("DepthwiseSeparableConv", "EdgeResidual", "InvertedResidual"), 64),
    "convnext_nano": (("ConvNeXtBlock",), 128),
    "vit_small_patch16_224": (("Block",), 128),
    "fastvit_t8": (("RepMixerBlock", "AttentionBlock"), 128),
    "mixer_s16_224": (("MixerBlock",), 128),
    "poolformer_s12": (("MetaFormerBlock",), 128),
    "ghostnet_100": (("GhostBottleneck",), 128),
    "cspdarknet53": (("DarkBlock", "BottleneckBlock"), 64),
    "hrnet_w18_small": (("BasicBlock", "Bottleneck"), 64),
    "mobilevit_s": (("MobileVitBlock", "BottleneckBlock"), 64),
}
ZOO.update({name: blocks for name, (blocks, _) in TIMM.items()})
SHAPES = {"inception_v3": (3, 299, 299)}  # one sample's shape, where not 3x224x224


def build_zoo(name: str) -> nn.Module:
    """A fresh torchvision or timm model on the GPU (module-level: autoplan sends it to fresh
    processes). A timm model must hold a block class its ``TIMM`` entry names: the one-line
    recipe checkpoints those."""
    torch.manual_seed(0)
    if name in TIMM:
        import timm

        model = timm.create_model(name, pretrained=False)
        found = {type(m).__name__ for m in model.modules()}
        if not found & set(TIMM[name][0]):
            raise ValueError(f"{name} holds none of the block classes {TIMM[name][0]} (timm {timm.__version__})")
        return model.cuda()
    import torchvision

    return torchvision.models.get_model(name, weights=None).cuda()


def setup(name: str) -> tuple[Callable[[], nn.Module], Any, tuple[str, ...]]:
    """The model's factory, its batch (seeded, on the CPU) and its block classes."""
    if name in MODELS:
        _, batch = load_bench(name, MODELS[name][1])
        return functools.partial(build, name), batch, MODELS[name][2]
    shape, size = SHAPES.get(name, (3, 224, 224)), TIMM[name][1] if name in TIMM else BATCH
    return functools.partial(build_zoo, name), torch.randn(size, *shape, generator=torch.Generator().manual_seed(0)), ZOO[name]


# -- every configuration in one process ---------------------------------------------------------------
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
        _, batch = load_bench(model_name, size)
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
    rounds are paired (``shrinkwrap.measuring.ratios.paired_ratio``: the median of the rounds' ratios,
    what autoplan decides on), with their spread (+-, half the range of the rounds' ratios)."""
    from shrinkwrap.measuring.ratios import paired_ratio
    from shrinkwrap.measuring import Timing

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
    """The command line of the same-run scripts (frontier.py, lm.py): one model, every row in one
    process, rows written to ``--json`` (:func:`save_rows`), the table printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(models))
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--configs", help="comma-separated configuration names (default: all)")
    args = parser.parse_args()
    rows = run(args.model, args.rounds, args.configs.split(",") if args.configs else None)
    if args.json:
        save_rows(args.json, rows)
    print(table(rows))


def dominated_by(row: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The configurations that dominate ``row``: less activation by more than 2%, and a slowest
    round faster than ``row``'s fastest."""
    if "step_ms_low" not in row:  # failed, or not timed
        return []
    return [r["config"] for r in rows if "step_ms_high" in r and r is not row
            and r["activation_mib"] < 0.98 * row["activation_mib"] and r["step_ms_high"] < row["step_ms_low"]]


# -- each row in a process of its own ------------------------------------------------------------------
def fresh_processes(commands: list[list[str]], at_once: int = 1, env: dict[str, str] | None = None,
                    capture: bool = True) -> list[subprocess.CompletedProcess]:
    """Run each command (``python SCRIPT ...``: a row that nothing cached by an earlier one may
    reach) in a fresh process, ``at_once`` side by side, and return them in order, finished.

    Args:
        commands: the argument lists, each run with this interpreter (``sys.executable`` first).
        at_once: how many run side by side.
        env: the environment of every process (default: this one's).
        capture: keep their stdout and stderr (else they go to this process's).

    Returns:
        One ``CompletedProcess`` a command, with its exit status and, captured, its output.
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *cmd], env=env, capture_output=capture, text=True)

    with ThreadPoolExecutor(max_workers=at_once) as pool:  # threads: each waits on its own process
        return list(pool.map(one, commands))


def last_row(process: subprocess.CompletedProcess) -> dict[str, Any]:
    """The JSON row a fresh process printed last, or a row with its error (its last stderr line)."""
    lines = [line for line in (process.stdout or "").splitlines() if line.startswith("{")]
    if process.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"error": ((process.stderr or "").strip().splitlines() or [f"exit {process.returncode}"])[-1][:300]}


@dataclass
class Ended:
    """A process :func:`on_gpus` ran, ended: by itself, or killed past its time (``late``; ``over``:
    past ``timeout``, not the deadline)."""

    name: str
    gpu: str
    returncode: int | None
    seconds: float
    late: bool
    over: bool
    stderr: str


def on_gpus(commands: dict[str, list[str]], gpus: list[str], timeout: float, deadline: float | None,
            ended: Callable[[Ended], None]) -> list[str]:
    """Run each command (``python`` and ``commands[name]``) in a process of its own on one GPU
    (``CUDA_VISIBLE_DEVICES``), one a GPU at a time, as many at once as ``gpus``.

    A process that outruns ``timeout`` seconds, or the ``deadline`` (seconds from now), is killed
    with its session (the processes it spawned go with it).

    Args:
        commands: name -> the arguments after the interpreter.
        gpus: the GPU indices to run on.
        timeout: the seconds a process may take.
        deadline: seconds from now after which nothing starts and what runs is stopped, or None.
        ended: called with each process as it ends (its stderr, whole).

    Returns:
        The names the deadline left unstarted.
    """
    waiting, free, unstarted = list(commands), list(gpus), []
    running: dict[str, tuple[subprocess.Popen, str, str, float]] = {}
    end = None if deadline is None else time.monotonic() + deadline
    folder = tempfile.mkdtemp(prefix="on-gpus-")
    while waiting or running:
        while waiting and free and (end is None or time.monotonic() < end):
            name, gpu = waiting.pop(0), free.pop(0)
            log = os.path.join(folder, f"{name}.log")
            with open(log, "w") as err:  # the child's stderr: its last line says why it failed
                # A session of its own: the processes it spawns go with it when it is stopped.
                running[name] = (subprocess.Popen([sys.executable, *commands[name]], stderr=err,
                                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu},
                                                  start_new_session=True), gpu, log, time.monotonic())
        if end is not None and time.monotonic() >= end:
            unstarted, waiting = unstarted + waiting, []
        time.sleep(1)
        for name, (process, gpu, log, started) in list(running.items()):
            over = time.monotonic() - started > timeout
            late = process.poll() is None and (over or (end is not None and time.monotonic() >= end))
            if process.poll() is None and not late:
                continue
            if late:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            del running[name]
            free.append(gpu)
            ended(Ended(name, gpu, process.returncode, time.monotonic() - started, late, over,
                        Path(log).read_text(errors="replace")))
    return unstarted


# -- the JSON rows ---------------------------------------------------------------------------------------
JSON_HELP = "write the rows to this file (one JSON object a line), replacing its rows of the same configurations"


def run_stamp() -> dict[str, str]:
    """What a row names of its run: the GPU, the torch version and the date."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def bill_kind(r: dict[str, Any]) -> str:
    """Which of ``bill.py``'s measurements a row of bill.json is."""
    return r.get("kind") or ("times" if "tokens_per_s" in r else "curves" if "losses" in r else "rows")


def _model_config(r: dict[str, Any]) -> tuple:
    return r.get("model"), r.get("config")


# What names a row's configuration, in each benchmark's JSON file: a file holds one row of each.
ROW_KEYS: dict[str, Callable[[dict[str, Any]], Any]] = {
    # an estimate, an autoplan answer for a budget, or a reading with its fit
    "fits.json": lambda r: (r["model"], r.get("kind"), r["budget"] if r.get("kind") == "autoplan" else r["config"]),
    # an estimate's plan names its chunk size
    "bill.json": lambda r: (r["model"], r["config"], bill_kind(r), r["plan"] if bill_kind(r) == "estimate" else None),
    "step_checks.json": _model_config,
    "frontier.json": _model_config,
    "graphs.json": _model_config,
    "zoo.json": _model_config,  # zoo.py replaces a model's rows whole: one run a model
    "compile_time.json": lambda r: (r["model"], r["how"]),
    "compile_plans.json": lambda r: (r["model"], r["run"], r["index"]),
    "per_round.json": lambda r: (r["model"], r["plan"], r["timing"]),
    "lm.json": _model_config,
    "multigpu.json": _model_config,
    "bandwidth.json": lambda r: (r["measure"], r["config"], r["threads"]),
}


def save_rows(path: str | Path, rows: Iterable[dict[str, Any]],
              key: Callable[[dict[str, Any]], Any] = _model_config) -> None:
    """Write ``rows`` to ``path``, one JSON object a line: each replaces the file's rows of the same
    ``key`` (a configuration), so the file holds the current row of each. The rows' earlier runs are
    in git."""
    rows = list(rows)
    new = {key(r) for r in rows}
    kept = [r for r in load_rows(path) if key(r) not in new]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in kept + rows))
