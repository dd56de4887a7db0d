"""Causal language models: the head, chunked loss and activation offload, every row in one process.

    python benchmarks/lm.py --model gpt2 [--rounds 4] [--json out.json]
    python benchmarks/lm.py --model llama128k

Models (random initialisation from a config, no downloads; labels = the inputs):

- ``gpt2``: transformers' ``GPT2Config()`` (124M parameters, vocabulary 50257) at 8 x 1024 tokens;
- ``llama128k``: a Llama-style model with a 128k vocabulary (hidden 2048, 16 layers, 32 heads,
  8 KV heads, MLP 8192, vocabulary 128256, tied embeddings: Llama-3.2-1B's shape) at 4 x 2048;
- ``llama128k_untied``: the same with its own head weight (transformers' default for Llama).

Every configuration is a fresh module tree over the SAME parameter tensors (one copy of the weights
on the GPU, whatever the number of rows). Memory: ``shrinkwrap.measure`` with AdamW, one
configuration at a time; see ``_figures`` for what activation and held for backward are. The head's share
of the training peak (forward, loss and backward): the same configuration called with ``logits_to_keep=1`` (the model's own way to skip
all but the last position's logits; its loss is the kept logits' mean), head share = (peak -
that peak) / peak. Step time: ``shrinkwrap.time_interleaved`` (configurations in turns, median of
the rounds and the fastest-slowest round), with SGD (no optimizer state: the rows share weights;
AdamW's step over the weights costs every row alike).

Anchors: ``hf_ckpt_bf16`` is Hugging Face's own ``gradient_checkpointing_enable()`` with
``torch.autocast`` by hand; ``hf_ckpt_offload_bf16`` adds transformers' activation offload
(``activation_checkpointing_enable(offload=True)``) where the installed version has it;
``compile_bf16`` is ``torch.compile`` of the model with ``torch.autocast`` around its forward.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import shrinkwrap as sw  # noqa: E402
from harness import HandAutocast, same_run_main, with_timings  # noqa: E402

MODELS: dict[str, tuple[Callable[[], Any], int, int, str]] = {
    # name: (config factory, batch, sequence, the blocks' regex)
    "gpt2": (lambda: __import__("transformers").GPT2Config(), 8, 1024, r"transformer\.h\.\d+"),
    "llama128k": (lambda: _llama128k(tied=True), 4, 2048, r"model\.layers\.\d+"),
    "llama128k_untied": (lambda: _llama128k(tied=False), 4, 2048, r"model\.layers\.\d+"),
}


def _llama128k(tied: bool) -> Any:
    # Tied, autograd holds the head's float32 weight gradient from the first node of backward to
    # the last (the embedding's), where the two are summed: a 1 GB term of the backward peak that
    # no activation step can touch. Untied (transformers' default, and Llama-3-8B's), it goes
    # to its own .grad at once.
    return __import__("transformers").LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=tied, max_position_embeddings=4096,
        rope_theta=500000.0)


def _first_blocks_plain(blocks: str) -> dict[str, str]:
    """The blocks from k on checkpointed, the first k plain, and offload on the first n of those
    (``offload`` selects n + 1: keep_last keeps the last selected on the device). Where the
    forward's end, not one block's backward, is the peak, what offload moves comes off the peak."""
    prefix = blocks.removesuffix(r"\d+")  # the blocks' regex without their number
    out = {}
    for k in (6, 8):
        plan = f"checkpoint(r'{prefix}(?:[{k}-9]|[1-9]\\d)'), "
        for tag, n in (("", 0), ("_offload0", 1), ("_offload01", 2), ("_offload012", 3)):
            offload = f"offload(r'{prefix}[0-{n}]'), " if n else ""
            out[f"ckpt{k}up_bf16_chunked{tag}"] = plan + offload + "chunked_loss(), autocast(torch.bfloat16)"
    return out


def plans(blocks: str) -> dict[str, str]:
    ckpt = f"checkpoint(r'{blocks}')"
    parts = f"checkpoint(r'{blocks}\\.(?:self_attn|attn|mlp)')"  # Llama's and GPT-2's names
    norms_mlp = f"{blocks}\\.(?:ln_1|ln_2|input_layernorm|post_attention_layernorm|mlp)"
    return {
        "bf16": "autocast(torch.bfloat16)",
        "swiglu_bf16": "swiglu(), autocast(torch.bfloat16)",
        "ckpt_bf16": f"{ckpt}, autocast(torch.bfloat16)",
        "ckpt_bf16_chunked": f"{ckpt}, chunked_loss(), autocast(torch.bfloat16)",
        "ckpt_bf16_chunked_offload": f"{ckpt}, offload(r'{blocks}'), chunked_loss(), autocast(torch.bfloat16)",
        # GPT-2's gelu_new written out (eight kernels each way, float32 under autocast) as nn.GELU('tanh').
        "ckpt_swish_bf16_chunked": f"{ckpt}, swish(), chunked_loss(), autocast(torch.bfloat16)",
        "swish_bf16_chunked": "swish(), chunked_loss(), autocast(torch.bfloat16)",
        # Selective recompute: the blocks keep their matrix products (and attention, where it
        # draws no dropout), and the recompute runs the norms, activations and dropout only.
        "ckpt_save_bf16_chunked": f"checkpoint(r'{blocks}', save=('matmul',)), chunked_loss(), "
                                  "autocast(torch.bfloat16)",
        "ckpt_save_all_bf16_chunked": f"checkpoint(r'{blocks}', save=('matmul', 'attention')), chunked_loss(), "
                                      "autocast(torch.bfloat16)",
        # The gated MLP's product keeping two tensors, not three (Llama-style models only): one
        # block's recompute and backward working set set the offload row's peak.
        "ckpt_swiglu_bf16_chunked": f"{ckpt}, swiglu(), chunked_loss(), autocast(torch.bfloat16)",
        "ckpt_swiglu_bf16_chunked_offload": f"{ckpt}, offload(r'{blocks}'), swiglu(), chunked_loss(), "
                                            "autocast(torch.bfloat16)",
        # Attention and MLP as regions of their own: backward's working set is half a block (with
        # offload, one block's backward set the Llama row's peak), at more held between passes.
        "ckpt_parts_bf16_chunked": f"{parts}, chunked_loss(), autocast(torch.bfloat16)",
        "ckpt_parts_bf16_chunked_offload": f"{parts}, offload(r'{blocks}'), chunked_loss(), autocast(torch.bfloat16)",
        **_first_blocks_plain(blocks),
        "chunked_bf16_compiled": "chunked_loss(), autocast(torch.bfloat16), compile()",
        # Regional: the norms and the MLP compiled, attention eager (bert under compile traced its
        # attention into unfused math that keeps the probabilities; eager runs the fused kernel).
        "chunked_bf16_regional": f"chunked_loss(), autocast(torch.bfloat16), compile(pattern=r'{norms_mlp}')",
        "chunked_bf16_compiled_budget0.5": "chunked_loss(), autocast(torch.bfloat16), compile(memory_budget=0.5)",
        "chunked_bf16_compiled_budget0.8": "chunked_loss(), autocast(torch.bfloat16), compile(memory_budget=0.8)",
        "chunked_bf16_compiled_budget0.9": "chunked_loss(), autocast(torch.bfloat16), compile(memory_budget=0.9)",
        "chunked_bf16_compiled_budget0.95": "chunked_loss(), autocast(torch.bfloat16), compile(memory_budget=0.95)",
        "chunked4096_bf16_compiled": "chunked_loss(chunk_size=4096), autocast(torch.bfloat16), compile()",
        "ckpt_bf16_chunked_compiled": f"{ckpt}, chunked_loss(), autocast(torch.bfloat16), compile()",
        "ckpt_save_bf16_chunked_compiled": f"checkpoint(r'{blocks}', save=('matmul',)), chunked_loss(), "
                                           "autocast(torch.bfloat16), compile()",
    }


def _hf_checkpointing(model: nn.Module, offload: bool) -> nn.Module:
    if offload:
        model.activation_checkpointing_enable(offload=True)  # TypeError where the version lacks it
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return HandAutocast(model)


def configurations(name: str) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Each configuration: shared model -> the module tree to measure."""
    blocks = MODELS[name][3]
    out: dict[str, Callable[[nn.Module], nn.Module]] = {"fp32": lambda m: m}
    out.update({k: functools.partial(lambda text, m: sw.apply(m, text), text) for k, text in plans(blocks).items()})
    out["hf_ckpt_bf16"] = lambda m: _hf_checkpointing(m, offload=False)
    out["hf_ckpt_offload_bf16"] = lambda m: _hf_checkpointing(m, offload=True)
    out["compile_bf16"] = lambda m: torch.compile(HandAutocast(m))
    return out


def build(name: str, weights: nn.Module | None) -> nn.Module:
    """A new model; with ``weights``, a new module tree whose parameters ARE those of ``weights``."""
    import transformers

    config = MODELS[name][0]()
    config.use_cache = False
    with torch.device("meta" if weights is not None else "cuda"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if name == "gpt2":
        model.loss_type = "ForCausalLM"  # else a warning at every forward breaks compiled graphs (harness.build)
    if weights is not None:
        model.load_state_dict(weights.state_dict(keep_vars=True), assign=True)
        if config.tie_word_embeddings:
            model.tie_weights()
        for mod_name, buf in weights.named_buffers():  # non-persistent buffers (rotary frequencies)
            owner, _, key = mod_name.rpartition(".")
            model.get_submodule(owner)._buffers[key] = buf
    return model


def _phase(prof: Any, name: str) -> Any:
    return next(p for p in prof.steady_step if p.name == name)


def _train_peak(prof: Any) -> int:
    return max(p.peak for p in prof.steady_step if p.name != "step")


def _figures(prof: Any) -> dict[str, Any]:
    """Activation: the peak of forward, loss and backward above what was allocated before the
    iteration (the optimizer's step is left out: AdamW's foreach temporaries, one parameter-sized
    set, set the whole iteration's peak of a 1B model whatever the activations); held for
    backward: allocated when forward and loss are done, above what was allocated once zero_grad
    had freed the gradients."""
    mib = 2**20
    train_peak = _train_peak(prof)
    return {"peak_mib": round(prof.peak / mib, 1), "static_mib": round(prof.static / mib, 1),
            "activation_mib": round((train_peak - prof.static) / mib, 1),
            "optimizer_step_mib": round((_phase(prof, "step").peak - prof.static) / mib, 1),
            "held_mib": round((_phase(prof, "loss").allocated - _phase(prof, "zero_grad").allocated) / mib, 1)}


def run(name: str, rounds: int, only: list[str] | None = None) -> list[dict[str, Any]]:
    _, batch_size, seq, _ = MODELS[name]
    shared = build(name, None)
    vocab = shared.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0)).cuda()
    batch, no_head = {"input_ids": ids, "labels": ids}, {"input_ids": ids, "logits_to_keep": 1}
    models, rows = {}, []
    for config, make in configurations(name).items():
        if only and config not in only:
            continue
        row: dict[str, Any] = {"model": name, "config": config, "batch": batch_size, "seq": seq,
                               "plan": plans(MODELS[name][3]).get(config)}
        try:
            model = make(build(name, shared))
            prof = sw.measure(model, batch, iterations=2, warmup=2, device="cuda")
            # Compiled rows skip it: another set of kwargs is another compilation.
            head_off = None if "compile" in config else sw.measure(model, no_head, iterations=1, warmup=1, device="cuda")
        except Exception as exc:  # noqa: BLE001 - an anchor the installed version lacks is a row
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            print(f"failed {config}: {rows[-1]['error']}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            continue
        models[config] = model
        mib = 2**20
        rows.append({**row, **_figures(prof),
                     "head_share": head_off and round((_train_peak(prof) - _train_peak(head_off)) / _train_peak(prof), 4),
                     "graph_breaks": prof.graph_breaks,
                     "transfers_mib": {k: round(v / mib, 1) for k, v in prof.transfers.items()},
                     "top_modules": [(n, round(b / mib, 1)) for n, b in prof.top_modules[:4]]})
        print(f"measured {config}: {rows[-1]['activation_mib']} MiB", file=sys.stderr, flush=True)
    options = sw.Options(device="cuda", warmup=1, optimizer=functools.partial(torch.optim.SGD, lr=1e-6))
    times = sw.time_interleaved(models, batch, options, rounds=rounds, per_round=2)
    return with_timings(rows, times)


def table(rows: list[dict[str, Any]]) -> str:
    by = {r["config"]: r for r in rows if "error" not in r}
    base = by.get("fp32")
    lines = ["| model | configuration | peak MiB | activation MiB | x fp32 | held for backward MiB | optimizer step MiB "
             "| head share of peak | step ms (rounds low-high) | x fp32 | PCIe MiB/iteration | graph breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | {r['error']} ||||||||||")
            continue
        ratio = lambda key: f"{r[key] / base[key]:.2f}" if base and r.get(key) else "-"  # noqa: E731
        head = "-" if r["head_share"] is None else f"{100 * r['head_share']:.1f}%"
        moved = ", ".join(f"{k} {v}" for k, v in r["transfers_mib"].items()) or "-"
        lines.append(f"| {r['model']} | {r['plan'] or r['config']} | {r['peak_mib']} | {r['activation_mib']} | "
                     f"{ratio('activation_mib')} | {r['held_mib']} | {r['optimizer_step_mib']} | {head} | {r.get('step_ms', '-')} "
                     f"({r.get('step_ms_low')}-{r.get('step_ms_high')}) | {ratio('step_ms')} | {moved} | "
                     f"{'-' if r['graph_breaks'] is None else r['graph_breaks']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    same_run_main(__doc__, list(MODELS), run, table, rounds=4)
