"""The whole memory bill of fine-tuning a language model: parameters, gradients, optimizer state and
activations, row by row, on one GPU.

    python benchmarks/bill.py rows --json bill.json          # the ~0.5B rows, each measured in a fresh process
    python benchmarks/bill.py times --json bill.json         # their step times in turns in one process
    python benchmarks/bill.py curves --steps 200 --json ...  # loss over 200 steps: exact against lossy
    python benchmarks/bill.py headline --json bill.json      # a Llama-3.2-3B-shaped model under 16 and 10 GiB
    python benchmarks/bill.py estimate --json bill.json      # the ~0.5B rows estimated on the CPU (no GPU)
    python benchmarks/bill.py rows --model gemma2b --json bill.json  # a held-out decoder beside `plain`
    python benchmarks/bill.py profile --model smollm17b --configs state_cpu,in_backward --json bill.json

``--model`` takes rows, times and curves to another decoder: ``smollm17b`` (SmolLM2-1.7B's shape)
and ``gemma2b`` (Gemma 3 at Gemma-2-2B's size: a 262,208 vocabulary), whose rows add ``plain`` (what users do:
Hugging Face's gradient checkpointing, bf16 autocast, fused AdamW), the delayed update
(``state_cpu_delayed``, lossy; ``state_cpu_delayed_warm`` after 20 exact steps) and bf16 weights
rounded stochastically (``bf16_state_cpu_sr``).

``--chunk-size N`` runs every plan with ``chunked_loss(chunk_size=N)``: the head's chunk of rows x
vocabulary, not the layers, sets the forward's peak at a 152k vocabulary.

The ~0.5B model is Qwen2-0.5B's shape (24 layers, hidden 896, 151,936 vocabulary, tied embeddings,
494M parameters), random init, at 4x2048 tokens; AdamW. Rows (``PLANS``): today's best activation
plan (``best``), then the same with the optimizer step inside backward (``in_backward``), with its
state on the CPU (``state_cpu``), with bf16 weights and the float32 master copy and state on the
CPU (``bf16_state_cpu``), lossy all on the GPU (bf16 weights, 8-bit state, stochastic rounding:
``lossy``; ``state8``: its 8-bit state alone, float32 weights), and torchao's
``CPUOffloadOptimizer`` with the best plan (``torchao_offload``, where torchao is importable:
carried as a wheel). Memory from ``shrinkwrap.measure`` in a fresh process
per row (the steady step's peak, by kind); bytes per parameter on the GPU beside activations are
(peak - activations) / parameters, and an estimate's (parameters + gradients + optimizer state) / parameters. Times in turns in one process (``shrinkwrap.time_interleaved``),
tokens per second from the median. The loss curves train on real text at hand offline: the Python
source of the installed torch package, byte-tokenized.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shrinkwrap as sw  # noqa: E402
from shrinkwrap.transforms.optimizer.cpu import worker_threads  # noqa: E402
from harness import JSON_HELP, ROW_KEYS, save_rows  # noqa: E402

MiB, GiB = 2**20, 2**30
DEVICE = "cuda"
BATCH, SEQ = 4, 2048
ACT = r"checkpoint(r'model\.layers\.\d+'), swiglu(), chunked_loss(), autocast(torch.bfloat16)"
LR = "{'lr': 0.0001, 'weight_decay': 0.01}"
PLANS = {
    "best": ACT,
    "in_backward": f"{ACT}, step_in_backward(torch.optim.AdamW, options={LR})",
    "state_cpu": f"{ACT}, step_in_backward(torch.optim.AdamW, options={LR}, state='cpu')",
    "bf16_state_cpu": f"half(torch.bfloat16), {ACT}, step_in_backward(torch.optim.AdamW, options={LR}, state='cpu')",
    "lossy": f"half(torch.bfloat16), {ACT}, step_in_backward(shrinkwrap.LowBitAdamW, options={LR})",
    # lossy's 8-bit state alone, float32 weights: which of its two changes the loss curve shows
    "state8": f"{ACT}, step_in_backward(shrinkwrap.LowBitAdamW, options={LR})",
    # the CPU's step of iteration i during iteration i+1 (lossy), and bf16 weights rounded stochastically
    "state_cpu_delayed": f"{ACT}, step_in_backward(torch.optim.AdamW, options={LR}, state='cpu', delayed=True)",
    # the same after 20 exact steps (ZeRO-Offload's warm-up): a tenth of a 200-step curve
    "state_cpu_delayed_warm": f"{ACT}, step_in_backward(torch.optim.AdamW, options={LR}, state='cpu', delayed=True, "
                              "delay_after=20)",
    "bf16_state_cpu_sr": f"half(torch.bfloat16), {ACT}, step_in_backward(torch.optim.AdamW, options={LR}, "
                         "state='cpu', rounding='stochastic')",
    # what users do without us: Hugging Face's gradient checkpointing, bf16 autocast, fused AdamW
    "plain": "autocast(torch.bfloat16)",
}
# The layers' checkpointed inputs offloaded too: at 3B they are the largest term beside the parameters.
OFFLOAD = r"offload(r'model\.layers\.\d+')"
PLANS.update({f"{k}_offload": f"{PLANS[k]}, {OFFLOAD}" for k in ("state_cpu", "bf16_state_cpu")})
ROWS = "best,in_backward,state_cpu,bf16_state_cpu,lossy,torchao_offload"  # what rows and times run by default
CURVES = "in_backward,lossy"  # the exact plan and the lossy one
HEADLINE = ("state_cpu", "bf16_state_cpu", "state_cpu_offload", "bf16_state_cpu_offload")


def qwen05b_config() -> Any:
    import transformers

    return transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                    max_position_embeddings=SEQ, use_cache=False)


def llama3b_config() -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                    num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                                    max_position_embeddings=SEQ, use_cache=False)


def smollm17b_config() -> Any:
    """SmolLM2-1.7B's shape: a Llama of 1.7B parameters, 49,152 vocabulary (not a benchmark model elsewhere)."""
    import transformers

    return transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                    num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=True,
                                    max_position_embeddings=SEQ, use_cache=False)


def gemma2b_config() -> Any:
    """Gemma 3's text decoder at Gemma-2-2B's size (transformers' Gemma3TextConfig defaults): 2.6B
    parameters, a 262,208 vocabulary, tanh-GELU gated MLPs, sliding-window attention."""
    import transformers

    return transformers.Gemma3TextConfig(max_position_embeddings=SEQ, use_cache=False)


CONFIGS = {"qwen05b": lambda: qwen05b_config(), "llama3b": lambda: llama3b_config(),
           "smollm17b": lambda: smollm17b_config(), "gemma2b": lambda: gemma2b_config()}
# The decoders the CPU path is measured on beside what users do (`plain`), each row a fresh process.
DECODER_ROWS = ("plain,best,in_backward,state_cpu,state_cpu_delayed,bf16_state_cpu,bf16_state_cpu_sr,lossy,"
                "torchao_offload")


def build(config_name: str) -> nn.Module:
    """The model built on the GPU (no host copy; buffers its modules compute in ``__init__``, a
    rotary frequency or an embedding's scale, as they make them), its weights initialised there."""
    import transformers

    config = CONFIGS[config_name]()
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    model.tie_weights()
    return model


def planned(config_name: str, plan: str) -> nn.Module:
    return sw.apply(build(config_name), plan)


def hf_checkpointed(config_name: str, plan: str) -> nn.Module:
    """The model with Hugging Face's own gradient checkpointing of its layers (``plain``)."""
    model = build(config_name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return sw.apply(model, plan)


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def torchao_offload(params: Any) -> torch.optim.Optimizer:
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-4, weight_decay=0.01)


def batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _stamp() -> dict:
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    return {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def _figures(name: str, plan: str, prof: Any, params: int) -> dict:
    if prof.peak is None:  # no CUDA: what the harness counts there
        return {"config": name, "plan": plan, "saved_mib": round(prof.saved / MiB, 1), **_stamp()}
    at = prof.breakdown()
    act = at["activations_other"]
    return {"config": name, "plan": plan, "peak_mib": round(prof.peak / MiB, 1),
            "parameters_mib": round(at["parameters"] / MiB, 1), "gradients_mib": round(at["gradients"] / MiB, 1),
            "optimizer_state_mib": round(at["optimizer_state"] / MiB, 1), "activations_mib": round(act / MiB, 1),
            "bytes_per_parameter": round((prof.peak - act) / params, 2), "step_ms": round(prof.step_ms, 1),
            "transfers_mib": {k: round(v / MiB, 1) for k, v in prof.transfers.items()}, **_stamp()}


def estimates(config_name: str, names: list[str]) -> list[dict]:
    """Each row's peak by kind, estimated on the CPU (``shrinkwrap.estimate``: fake tensors, no GPU).
    ``state='cpu'`` rows cannot be estimated (estimate() says why) and are left out."""
    out = []
    params = sum(p.numel() for p in build_meta(config_name).parameters())
    for name in names:
        if name == "torchao_offload" or "state='cpu'" in PLANS[name]:
            continue
        est = sw.estimate(functools.partial(build, config_name), batch(CONFIGS[config_name]().vocab_size), PLANS[name])
        terms = {k: round(v / MiB, 1) for k, v in est.breakdown().items()}
        out.append({"model": config_name, "config": name, "plan": PLANS[name], "kind": "estimate",
                    "peak_mib": round(est.peak / MiB, 1), **{f"{k}_mib": v for k, v in terms.items()},
                    "bytes_per_parameter": round((est.parameters + est.gradients + est.optimizer_state) / params, 2),
                    "seconds": round(est.seconds, 1), **_stamp()})
        print(json.dumps(out[-1]), flush=True)
    return out


def rows(config_name: str, names: list[str], iterations: int = 3, warmup: int = 2) -> list[dict]:
    """Each row measured in a fresh process (shrinkwrap's isolated rows)."""
    out = []
    vocab = CONFIGS[config_name]().vocab_size
    for name in names:
        options = sw.Options(device=DEVICE, iterations=iterations, warmup=warmup)
        build_as = planned
        if name == "torchao_offload":
            options = sw.Options(device=DEVICE, iterations=iterations, warmup=warmup, optimizer=torchao_offload)
            plan = PLANS["best"]
        elif name == "plain":
            options = sw.Options(device=DEVICE, iterations=iterations, warmup=warmup, optimizer=fused_adamw)
            plan, build_as = PLANS[name], hf_checkpointed
        else:
            plan = PLANS[name]
        make = functools.partial(build_as, config_name, plan)
        report = sw.compare.measure_plans(make, [sw.Plan()], batch(vocab), options, isolate=True, fit=False)
        row = report.rows[0]
        params = sum(p.numel() for p in build_meta(config_name).parameters())
        if row.profile is None:
            out.append({"model": config_name, "config": name, "plan": plan, "error": row.error, **_stamp()})
        else:
            out.append({"model": config_name, **_figures(name, plan, row.profile, params)})
        print(json.dumps(out[-1]), flush=True)
    return out


@functools.lru_cache(None)
def build_meta(config_name: str) -> nn.Module:
    import transformers

    config = CONFIGS[config_name]()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def times(config_name: str, names: list[str], rounds: int) -> list[dict]:
    """Step times in turns in this process; tokens per second from the medians."""
    models = {}
    for name in names:
        plan = PLANS["best" if name == "torchao_offload" else name]
        models[name] = planned(config_name, plan)
    vocab = CONFIGS[config_name]().vocab_size
    out = []
    # time_interleaved makes each model's optimizer with one factory: torchao's row gets its own,
    # told apart by its parameters, and every row is timed in the same rounds as best's.
    theirs = {id(p) for p in models["torchao_offload"].parameters()} if "torchao_offload" in models else set()

    def optimizer(params: Any) -> Any:
        params = list(params)
        return (torchao_offload if params and id(params[0]) in theirs else torch.optim.AdamW)(params)

    timing = sw.time_interleaved(models, batch(vocab), sw.Options(device=DEVICE, warmup=2, optimizer=optimizer),
                                 rounds=rounds, per_round=2)
    base = timing["best"].median
    for name, t in timing.items():
        out.append({"model": config_name, "config": name, "step_ms": round(t.median, 1),
                    "step_ms_low": round(min(t.rounds_ms), 1), "step_ms_high": round(max(t.rounds_ms), 1),
                    "tokens_per_s": round(BATCH * SEQ / t.median * 1e3), "x_best": round(t.median / base, 3),
                    "rounds": len(t.rounds_ms), **_stamp()})
        print(json.dumps(out[-1]), flush=True)
    return out


def profile(config_name: str, names: list[str], steps: int = 6) -> list[dict]:
    """Where a step's time goes, each plan in turn in this process: forward, backward and
    ``step()`` (synchronised between them), and what the CPU path's worker did meanwhile: its
    seconds stepping, and the seconds the loop waited for it. Medians past two warm-up steps."""
    vocab = CONFIGS[config_name]().vocab_size
    ids = batch(vocab)["input_ids"].to(DEVICE)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    out = []
    for name in names:
        model = planned(config_name, PLANS[name])
        opt = sw.optimizer(model)
        phases: dict = {"forward": [], "backward": [], "optimizer_step": []}
        for i in range(steps):
            if i == 2:
                opt.worker_s = opt.waited_s = 0.0
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            opt.step()
            sync()
            t3 = time.perf_counter()
            if i >= 2:
                for v, t in zip(phases.values(), (t1 - t0, t2 - t1, t3 - t2)):
                    v.append(t)
        n = steps - 2
        ms = {k: round(statistics.median(v) * 1e3, 1) for k, v in phases.items()}
        out.append({"model": config_name, "config": name, "plan": PLANS[name], "kind": "profile", **{
            f"{k}_ms": v for k, v in ms.items()}, "step_ms": round(sum(ms.values()), 1),
            "worker_ms": round(opt.worker_s / n * 1e3, 1), "waited_ms": round(opt.waited_s / n * 1e3, 1),
            "threads": torch.get_num_threads(), "worker_threads": worker_threads(), "parameters": sum(p.numel() for p in model.parameters()),
            "steps": n, **_stamp()})
        print(json.dumps(out[-1]), flush=True)
        del model, opt, loss
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def text_tokens() -> torch.Tensor:
    """Real text at hand offline: the installed torch package's Python source, as bytes."""
    root = Path(torch.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(root.glob("nn/modules/*.py")))
    return torch.tensor(list(data), dtype=torch.long)


def curves(config_name: str, steps: int, names: list[str]) -> list[dict]:
    """The loss of each step over ``steps`` steps of real text, for each plan of ``names``: the
    exact plan against the lossy ones."""
    tokens = text_tokens()
    per = BATCH * SEQ
    out = []
    for name in names:
        plan = PLANS[name]
        model = planned(config_name, plan)
        opt = sw.optimizer(model)
        losses = []
        for step in range(steps):
            start = (step * per) % (len(tokens) - per - 1)
            ids = tokens[start:start + per].view(BATCH, SEQ).to(DEVICE)
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 4))
        out.append({"model": config_name, "config": name, "plan": plan, "losses": losses, "steps": steps,
                    "text": "torch/nn/modules/*.py, bytes", **_stamp()})
        print(json.dumps({k: v for k, v in out[-1].items() if k != "losses"} | {"first": losses[:3],
                          "last": losses[-3:]}), flush=True)
        del model, opt
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["rows", "times", "curves", "headline", "estimate", "profile"])
    parser.add_argument("--configs", help=f"the rows, comma-separated (default: {ROWS}; for curves {CURVES})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help=JSON_HELP)
    parser.add_argument("--chunk-size", type=int, help="chunked_loss(chunk_size=N) in every plan")
    parser.add_argument("--model", default="qwen05b", choices=sorted(CONFIGS),
                        help="the model of rows, times and curves (headline: llama3b)")
    args = parser.parse_args()
    if args.chunk_size:
        for key, plan in PLANS.items():
            PLANS[key] = plan.replace("chunked_loss()", f"chunked_loss(chunk_size={args.chunk_size})")
    default = CURVES if args.what == "curves" else DECODER_ROWS if args.model in ("smollm17b", "gemma2b") else ROWS
    names = (args.configs or default).split(",")
    if "torchao_offload" in names:
        try:
            import torchao.optim  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - not installed here: the row is left out, and said so
            print(f"torchao not importable ({type(exc).__name__}: {exc}); its row is left out", flush=True)
            names.remove("torchao_offload")
    if args.what == "rows":
        result = rows(args.model, names)
    elif args.what == "times":
        result = times(args.model, names, args.rounds)
    elif args.what == "estimate":
        global DEVICE  # the model is built on the CPU, where the estimate runs
        DEVICE = "cpu"
        result = estimates(args.model, names)
    elif args.what == "curves":
        result = curves(args.model, args.steps, names)
    elif args.what == "profile":
        result = profile(args.model, names)
    else:
        # The CPU steps 3.2B parameters an iteration (seconds each): the fewest iterations that read a steady one.
        result = rows("llama3b", [n for n in names if n in HEADLINE], iterations=1, warmup=1)
    if args.json:
        save_rows(args.json, result, key=ROW_KEYS["bill.json"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
