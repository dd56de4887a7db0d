"""benchmarks/RESULTS.md, made from the JSON rows the benchmark scripts write (``harness.save_rows``:
the current row of each configuration; the history is in git).

    python benchmarks/results.py            # write RESULTS.md
    python benchmarks/results.py --check    # exit 1 if RESULTS.md is not what the rows make (CI)

One table a capability. Above each table, its run: the GPU, the torch version and the date; under
it, a line saying what it compares. A ratio is within one run, never across runs.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import bill_kind, load_rows  # noqa: E402
from shrinkwrap.autoplan.choose import BEATEN  # noqa: E402  autoplan's own rule, read by beaten_by

OUT = HERE / "RESULTS.md"
MODELS = ("resnet18", "efficientnet_b0", "resnet152", "gpt2", "bert")
# The JSON files and the sections that render them: a test checks every JSON file here is one of them.
RENDERED = ("fits.json", "bill.json", "step_checks.json", "frontier.json", "graphs.json", "zoo.json",
            "compile_time.json", "compile_plans.json", "per_round.json", "lm.json", "multigpu.json", "bandwidth.json")


def load(name: str) -> list[dict[str, Any]]:
    assert name in RENDERED, name
    return load_rows(HERE / name)


def latest(rows: list[dict], key: Callable[[dict], Any]) -> list[dict]:
    """The last row written for each ``key``, in the order the keys first appear."""
    out: "OrderedDict[Any, dict]" = OrderedDict()
    for r in rows:
        out.pop(key(r), None)
        out[key(r)] = r
    return list(out.values())


def num(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "-" if a is None or not b else f"{a / b:.{digits}f}"


def spread(r: dict, digits: int = 2) -> str:
    """A row's median step time with its fastest and slowest round: ``12.34 (11.90-13.01)``."""
    return f"{num(r['step_ms'], digits)} ({num(r.get('step_ms_low'), digits)}-{num(r.get('step_ms_high'), digits)})"


def table(headers: list[str], rows: Iterable[list[str]]) -> list[str]:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(esc(c) for c in r) + " |" for r in rows), ""]


def gpu(r: dict) -> str:
    return r.get("gpu") or r.get("device_name") or "?"


def run_line(rows: list[dict]) -> str:
    """The line above a table: its run's GPU, torch version and date (where its rows come from
    more than one run, each GPU and version and the range of dates)."""
    gpus = sorted({gpu(r) for r in rows if "date" in r})
    torches = sorted({r["torch"] for r in rows if "torch" in r})
    dates = sorted({r["date"] for r in rows if "date" in r})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
    return f"Run: {' and '.join(gpus) or '?'}, torch {', '.join(torches) or '?'}, {when}."


def section(title: str, rows: list[dict], body: list[str], compares: str) -> list[str]:
    """A capability's section: its title, the run, the table, the line saying what it compares."""
    return [f"## {title}", "", run_line(rows), "", *body, compares, ""]


def code(text: str | None) -> str:
    return f"`{text}`" if text else "-"


def by_model(r: dict) -> int:
    return MODELS.index(r["model"]) if r["model"] in MODELS else 99


# -- what fits ------------------------------------------------------------------------------------
def fits_section() -> list[str]:
    every = load("fits.json")
    # Estimates made apart from a fit run (fits.py --estimate-only, on a CPU) fill rows whose run made none.
    apart = {(r["model"], r["config"]): r for r in every if r.get("kind") == "estimate"}
    rows = [r for r in every if r.get("kind") not in ("estimate", "autoplan")]
    rows = [{**r, "estimate_mib": apart[(r["model"], r["config"])]["estimate_mib"]}
            if "estimate_mib" not in r and (r["model"], r["config"]) in apart else r for r in rows]
    anchors = {r["model"]: r for r in rows if r["config"] == "compile_bf16" and "fit_mib" in r}
    body = []
    for r in sorted(rows, key=by_model):
        if "error" in r:
            body.append([r["model"], r["config"], r["error"], *["-"] * 8])
            continue
        est, anchor = r.get("estimate_mib"), anchors.get(r["model"])
        plan = code(r.get("plan")) if r.get("plan") != r["config"] else "-"  # an anchor's plan is its name
        body.append([r["model"], r["config"], plan, num(r["reading_mib"]), num(r["static_mib"]),
                     f"{num(r['fit_mib'])} ({num(r['fit_below_mib'])})", f"{r['fit_x_reading']:.3f}",
                     ratio(r["activation_mib"], anchor and anchor["activation_mib"]),
                     ratio(r["fit_mib"] - r["static_mib"], anchor and anchor["fit_mib"] - anchor["static_mib"]),
                     f"{num(est)} ({ratio(est, r['reading_mib'], 3)})" if est else "-", gpu(r)])
    estimates = [apart[k] for k in apart]
    return section("What fits", rows, table(
        ["model", "config", "plan", "reading MiB", "static MiB", "fits in MiB (not under)", "fit x reading",
         "activation x compile_bf16", "fit above static x compile_bf16", "estimate MiB (x reading)", "GPU"], body),
        "Each configuration's reading (`shrinkwrap.measure`: the steady step's `max_memory_allocated`, in a fresh "
        "process) beside its fit (`shrinkwrap.fit`: the smallest allocator cap under which a fresh process trains its "
        "first 8 iterations, compilation included; the largest cap that failed in brackets) and its estimate "
        "(`shrinkwrap.estimate`, on the CPU" + (f" with torch {', '.join(sorted({r['torch'] for r in estimates}))}"
                                                 if estimates else "") + "). "
        "`fp32_eager` is the model as it is, `compile_bf16` torch.compile with bf16 autocast by hand, `best` the "
        "least-memory plan, `recipe` the eager hand recipe (`benchmarks/fits.py`). Against compile_bf16: the "
        "reading and the fit above static memory.")


def autoplan_budget_section() -> list[str]:
    """autoplan's budgeted answers and the cap each trained under (``fits.py --configs autoplan``)."""
    rows = [r for r in load("fits.json") if r.get("kind") == "autoplan"]
    if not rows:
        return []
    body = []
    for r in sorted(rows, key=lambda r: (by_model(r), r["budget"])):
        said = [n for n in r["notes"] if n.startswith("no plan measured within the budget trained")]
        under = f"yes, {num(r['trained_under_mib'])} MiB" if r.get("trained_under_mib") else "; ".join(said) or "no"
        body.append([r["model"], f"{r['budget']} ({num(r['budget_mib'])} MiB)", code(r["plan"]),
                     r.get("error") or num(r.get("reading_mib")), under, num(r["autoplan_s"])])
    return section("autoplan under a memory budget", rows, table(
        ["model", "budget", "answer", "reading MiB (steady step)", "trained under the cap", "autoplan s"], body),
        "autoplan's answer for a budget (a share of the model's reading as it is; bf16 allowed), trained under the "
        "budget's cap in a fresh process before autoplan returns it (`fits.py --configs autoplan`).")


# -- the whole memory bill ---------------------------------------------------------------------------
TOKENS = 4 * 2048  # the bill's batch: tokens a step


def bill_section() -> list[str]:
    rows = load("bill.json")
    mem = [r for r in rows if bill_kind(r) == "rows"]
    # Against what users do (``plain``) where the model has that row, else the activation plan alone.
    best = {r["model"]: r for r in mem if r["config"] == "best" and "peak_mib" in r}
    best.update({r["model"]: r for r in mem if r["config"] == "plain" and "peak_mib" in r})
    body = []
    for r in sorted(mem, key=lambda r: (r["model"] != "qwen05b", r["model"])):
        if "peak_mib" not in r:
            body.append([r["model"], r["config"], r.get("error", "-"), *["-"] * 10])
            continue
        b = best.get(r["model"])
        body.append([r["model"], r["config"], code(r.get("plan")), num(r["peak_mib"]),
                     ratio(r["peak_mib"], b and b["peak_mib"]), num(r["parameters_mib"]), num(r["gradients_mib"]),
                     num(r["optimizer_state_mib"]), num(r["activations_mib"]), f"{r['bytes_per_parameter']:.2f}",
                     num(r.get("step_ms")), str(round(TOKENS / r["step_ms"] * 1e3)) if r.get("step_ms") else "-"])
    out = section("The whole memory bill", mem, table(
        ["model", "config", "plan", "peak MiB", "x plain (else best)", "parameters", "gradients", "optimizer state",
         "activations", "bytes/parameter", "step ms (its process)", "tokens/s"], body),
        "The steady step's peak of fine-tuning with AdamW, split by kind (activations: what the rest leaves), each "
        "row in a fresh process (`benchmarks/bill.py rows`, `headline` for llama3b): `qwen05b` is Qwen2-0.5B's "
        "shape (494M parameters, 151,936 vocabulary) at 4x2048 tokens, `llama3b` Llama-3.2-3B's (3.2B parameters). "
        "`best` is the activation plan alone; the others step in backward, with the state on the GPU, on the CPU "
        "(`_delayed`: the CPU's step of iteration i during iteration i+1), 8-bit (`lossy`), or torchao's "
        "`CPUOffloadOptimizer`. Held-out decoders (`bill.py rows --model`): `smollm17b` (SmolLM2-1.7B's shape) and "
        "`gemma2b` (Gemma 3 at Gemma-2-2B's size, 2.6B parameters, 262,208 vocabulary), beside `plain`: Hugging "
        "Face's gradient checkpointing, bf16 autocast, fused AdamW. Bytes per parameter: the peak less activations, "
        "over the parameters.")
    return out + bill_times_section(rows) + bill_profile_section(rows) + bill_curves_section(rows) \
        + bill_estimates_section(rows) + step_checks_section()


def bill_profile_section(rows: list[dict]) -> list[str]:
    """Where a step's time goes with the state on the CPU (``bill.py profile``)."""
    prof = [r for r in rows if bill_kind(r) == "profile"]
    if not prof:
        return []
    return section("Where a step goes with the state on the CPU", prof, table(
        ["model", "config", "forward ms", "backward ms", "step() ms", "step ms", "CPU stepping ms", "loop waited ms",
         "threads", "tokens/s"],
        [[r["model"], r["config"], num(r["forward_ms"]), num(r["backward_ms"]), num(r["optimizer_step_ms"]),
          num(r["step_ms"]), num(r["worker_ms"]), num(r["waited_ms"]), str(r["threads"]),
          str(round(TOKENS / r["step_ms"] * 1e3))] for r in prof]),
        "A step of each plan in its own loop (`bill.py profile`; synchronised between forward, backward and "
        "`step()`; medians of 4 steps after 2): the CPU path's worker thread's seconds a step (stepping, and waiting "
        "for its gradient's copy down), and the seconds the loop waited for it (at `step()`, or, delayed, at a "
        "parameter's hook); threads: torch's, of which the worker steps on two fewer. The host's link, memory and CPU AdamW are in [The host](#the-host-link-memory-and-the-cpu-optimizer).")


def bill_times_section(rows: list[dict]) -> list[str]:
    times = [r for r in rows if bill_kind(r) == "times"]
    if not times:
        return []
    return section("The memory bill's step times", times, table(
        ["config", "step ms (rounds low-high)", "rounds", "x best (same run)", "tokens/s"],
        [[r["config"], spread(r, 1), str(r.get("rounds", "-")), f"{r['x_best']:.3f}", str(r["tokens_per_s"])]
         for r in times]),
        "qwen05b's rows timed in turns in one process with `best` (`bill.py times`; rounds of 2 iterations): "
        "the median step, its ratio to `best` in the same run, and tokens per second from the median.")


def bill_curves_section(rows: list[dict]) -> list[str]:
    curves = [r for r in rows if bill_kind(r) == "curves"]
    if not curves:
        return []

    def late(r: dict) -> float:
        return sum(r["losses"][-20:]) / 20

    exact = {r["model"]: late(r) for r in curves if r["config"] == "in_backward"}
    return section("Loss over 200 steps: the exact step against the lossy ones", curves, table(
        ["model", "config", "loss, steps 1-3", "loss, mean of steps 181-200", "vs in_backward", "loss, step 200"],
        [[r["model"], r["config"], ", ".join(map(str, r["losses"][:3])), f"{late(r):.3f}",
          f"{late(r) / exact[r['model']] - 1:+.2%}" if r["model"] in exact else "-", str(r["losses"][-1])]
         for r in curves]),
        "Each model's loss over 200 steps on text at hand offline (the installed torch's `nn/modules/*.py`, "
        "byte-tokenized; `bill.py curves`), same init and data: the exact step in backward (`in_backward`), the "
        "lossy row (bf16 weights, 8-bit state) and its 8-bit state alone (`state8`), the delayed CPU update "
        "(`state_cpu_delayed`; `_warm`: after 20 exact steps), and bf16 weights from a float32 master on the CPU rounded to nearest "
        "(`bf16_state_cpu`) or stochastically (`bf16_state_cpu_sr`). Every step's loss is in `bill.json`.")


def bill_estimates_section(rows: list[dict]) -> list[str]:
    """The bill's rows estimated on the CPU, at each chunk size of the head's loss they ran with."""
    rows = [r for r in rows if bill_kind(r) == "estimate"]
    if not rows:
        return []

    def chunk(plan: str) -> str:
        return plan.split("chunked_loss(chunk_size=")[1].split(")")[0] if "chunk_size=" in plan else "1024 (default)"

    best = {chunk(r["plan"]): r for r in rows if r["config"] == "best"}
    body = [[r["config"], chunk(r["plan"]), num(r["peak_mib"]), ratio(r["peak_mib"], best.get(chunk(r["plan"]), {}).get(
        "peak_mib")), num(r["parameters_mib"]), num(r["gradients_mib"]), num(r["optimizer_state_mib"]),
        num(r["activations_mib"]), f"{r['bytes_per_parameter']:.2f}"] for r in rows]
    return section("The memory bill, estimated on the CPU", rows, table(
        ["config", "chunk_size", "peak MiB", "x best", "parameters", "gradients", "optimizer state", "activations",
         "bytes/parameter"], body),
        "qwen05b's rows estimated, not measured (`bill.py estimate [--chunk-size N]`: `shrinkwrap.estimate` on fake "
        "tensors, which counts an optimizer step's temporaries as optimizer state; rows with `state='cpu'` cannot be "
        "estimated), at two chunk sizes of the head's loss: past the optimizer, the chunk of rows x vocabulary the "
        "loss takes at a time sets the peak. The estimate counts `LowBitAdamW`'s eager update; the measured lossy row "
        "ran its compiled one.")


def step_checks_section() -> list[str]:
    """The step in backward's checks (docs/steps/step_in_backward.md's loop table), timed against
    the code before them: both codes' models in turns in one process, the earlier imported as a
    second package."""
    rows = load("step_checks.json")
    if not rows:
        return []
    return section("The step in backward's checks, timed", rows, table(
        ["config", "rounds", "best ms", "with the checks ms", "without ms", "x without"],
        [[r["config"], str(r["rounds"]), num(r["best_ms"]), num(r["step_ms"]), num(r["before_ms"]),
          ratio(r["step_ms"], r["before_ms"])] for r in rows]),
        "qwen05b's rows (`bill.py`'s plans at `chunk_size=256`) with the step in backward's checks against the same "
        "code without them, both codes' models timed in turns in one process (`sw.time_interleaved`; rounds of 2 "
        "iterations; median ms).")


# -- activations per model: plans beside what users do ---------------------------------------------
def per_model_table(rows: list[dict]) -> list[str]:
    """Rows of same-run tables (``frontier.py``), each x its model's compile + bf16 row of the same run."""
    anchors = {r["model"]: r for r in rows if r["config"] in ("compile+bf16", "compile_bf16") and "activation_mib" in r}
    body = []
    for r in rows:
        anchor = anchors.get(r["model"])
        if "activation_mib" not in r:
            body.append([r["model"], r["config"], code(r.get("plan")), (r.get("error") or "-")[:80], "-", "-", "-", "-"])
            continue
        body.append([r["model"], r["config"], code(r.get("plan")), num(r["activation_mib"]),
                     ratio(r["activation_mib"], anchor and anchor["activation_mib"]), spread(r),
                     ratio(r["step_ms"], anchor and anchor["step_ms"]), ", ".join(r.get("dominated_by") or []) or "-"])
    return table(["model", "config", "plan", "activation MiB", "x compile+bf16", "step ms (low-high)",
                  "time x compile+bf16", "dominated by"], body)


def frontier_section() -> list[str]:
    rows = sorted(load("frontier.json"), key=by_model)
    return section("Per model: plans beside what users do", rows, per_model_table(rows),
                   "Each bench model's anchors as users write them (`harness.ANCHORS`: bf16 autocast by hand, torch's "
                   "`checkpoint_wrapper` on every block, selective checkpointing, `torch.compile`), the hand recipes "
                   "eager and compiled, and autoplan's answers at `max_slowdown` 1.0 (`auto_fast`) and 1.5 "
                   "(`auto_small`), a model's rows in one process (`benchmarks/frontier.py`): activation = peak less "
                   "static, step times in turns, both x the same model's compile + bf16. Readings, not fits (see "
                   "What fits).")


def graphs_section() -> list[str]:
    rows = sorted(load("graphs.json"), key=by_model)
    if not rows:
        return []
    return section("CUDA graphs: compiled plans under reduce-overhead", rows, per_model_table(rows),
                   "Plans compiled with `mode='reduce-overhead'` (CUDA graphs) beside compile + bf16, a model's rows "
                   "in one process (`frontier.py --configs ... --plan NAME=TEXT --json benchmarks/graphs.json`): "
                   "activation = peak less static, the graphs' recorded allocations included; step times in turns. "
                   "Readings, not fits: what a graphed plan needs to train is in What fits.")


# -- autoplan on the zoo -----------------------------------------------------------------------------
ZOO_ROWS = ("ckpt_every_block+bf16", "ckpt_every_block+bf16_compiled", "compile_budget0.5+bf16")
ZOO_AUTO = ("auto_fast", "auto_small", "auto_compile")
ZOO_SLOWDOWN = {"auto_fast": 1.0, "auto_small": 1.5, "auto_compile": 1.0}  # zoo.py's AUTOPLAN


def beaten_by(config: str, got: dict[str, dict]) -> list[str]:
    """The rows of a model (``got``, by configuration) that beat its autoplan answer ``config`` by
    autoplan's rule: within 10% of its activation and at least 10% faster, or at least 10% less
    activation within its time limit (``ZOO_SLOWDOWN`` x fp32's step time), medians timed in turns.
    An eager answer is read against the eager rows only: compiled rows are compile=True's to answer;
    another answer of the same plan is no other plan."""
    a, base = got[config], got.get("base_fp32")
    limit = ZOO_SLOWDOWN[config] * base["step_ms"] if base and base.get("step_ms") else None
    out = []
    for name, r in got.items():
        if name == config or not r.get("step_ms") or "activation_mib" not in r or \
                (config != "auto_compile" and "compile" in name) or (r.get("plan") and r.get("plan") == a.get("plan")):
            continue
        faster = r["activation_mib"] <= (1 + BEATEN) * a["activation_mib"] and r["step_ms"] <= (1 - BEATEN) * a["step_ms"]
        smaller = r["activation_mib"] <= (1 - BEATEN) * a["activation_mib"] and limit is not None and r["step_ms"] <= limit
        out += [name] if faster or smaller else []
    return out


def zoo_lines(rows: list[dict]) -> list[str]:
    """One line a model: each autoplan answer and each recipe as activation x fp32 @ step time x
    compile + bf16 (medians, timed in turns in the model's process), what dominates each answer,
    and autoplan's own seconds; then how many answers were dominated."""
    by_model: "OrderedDict[str, dict[str, dict]]" = OrderedDict()
    for r in rows:
        by_model.setdefault(r["model"], {})[r["config"]] = r
    body, dominated, by_compiled, beat, answers = [], [], [], [], 0

    def cell(r: dict | None, base: dict | None, ref: dict | None) -> str:
        if r is None:
            return "not run"
        if "error" in r or "activation_mib" not in r:
            return "error: " + r.get("error", "?")[:60]
        return f"{ratio(r['activation_mib'], base and base.get('activation_mib'))} @ " \
               f"{ratio(r.get('step_ms'), ref and ref.get('step_ms'))}"

    for model, got in by_model.items():
        if "all" in got:
            body.append([model, f"error: {got['all']['error']}", *[""] * (3 * len(ZOO_AUTO) + len(ZOO_ROWS) + 2)])
            continue
        base, ref = got.get("base_fp32"), got.get("compile+bf16")
        line = [model]
        for a in ZOO_AUTO:
            r = got.get(a)
            answered = bool(r and "activation_mib" in r)
            beaten = beaten_by(a, got) if answered and r.get("step_ms") else []
            line += [cell(r, base, ref), ", ".join(r.get("dominated_by") or []) or "none" if answered else "-",
                     ", ".join(beaten) or "none" if answered else "-"]
            if answered:
                answers += 1
                dominated += [f"{model} {a}"] if r.get("dominated_by") else []
                beat += [f"{model} {a}"] if beaten else []
                if a != "auto_compile" and r.get("dominated_by") and all("compile" in d for d in r["dominated_by"]):
                    by_compiled.append(f"{model} {a}")
        line += [cell(got.get(c), base, ref) for c in ZOO_ROWS]
        line.append(" / ".join(num(got.get(a, {}).get("autoplan_s")) for a in ZOO_AUTO))
        cold = (got.get("compile+bf16") or {}).get("first_ms")
        compiled = got.get("auto_compile") or {}
        stage = compiled.get("compile_stage_s")
        seconds = f"{num(stage)} / {num(cold and cold / 1000)}" if stage is not None else "-"
        if "again_s" in compiled:
            seconds += f" (again: {num(compiled['again_s'])}, its stage {num(compiled.get('again_stage_s'))})"
        elif "again_error" in compiled:
            seconds += f" (again: {compiled['again_error'][:60]})"
        line.append(seconds)
        gpus = {r.get("gpu") for r in got.values() if r.get("gpu")}
        line.append(", ".join(sorted(g.replace("NVIDIA ", "").split()[0] for g in gpus)) or "-")
        body.append(line)
    heads = ["model"] + [h for a in ("1.0x", "1.5x", "compile=True") for h in (f"autoplan {a}", "dominated by",
                                                                                "beaten by")]
    heads += ["every block + bf16", "the same compiled", "compile + bf16, budget 0.5", "autoplan s (1.0x / 1.5x / compile)",
              "compile stage s / cold compile s (a second call s)", "GPU"]
    out = table(heads, body)
    out += [f"Dominated: {len(dominated)} of {answers} answers" + (f" ({', '.join(dominated)})" if dominated else "")
            + ("; each only by a compiled row" if by_compiled and by_compiled == dominated else
               f"; of the eager answers, {len(by_compiled)} only by a compiled row ({', '.join(by_compiled)})"
               if by_compiled else "") + ".",
            f"Beaten by autoplan's rule: {len(beat)} of {answers} answers" + (f" ({', '.join(beat)})" if beat else "")
            + ".", ""]
    return out


def latest_runs(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each model's rows of its latest run, so that an error row of an earlier run cannot hide a
    later result: a run's rows lie together in the file (zoo.py writes a model's rows at once)
    and name their run (``run``). A run stopped without rows (one error for the model: it outran
    ``--timeout``, or the run's deadline stopped it, ``cut``) does not replace an earlier run that
    has rows, nor does a cut run replace an earlier error; the latest such run of each model comes
    second (what it had answered, and in how many seconds), unless the deadline left it unstarted.
    A run that failed (its process exited) replaces the earlier one: the table shows the error."""
    groups: list[list[dict]] = []
    for i, r in enumerate(rows):
        if i == 0 or (rows[i - 1]["model"], rows[i - 1].get("run")) != (r["model"], r.get("run")):
            groups.append([])
        groups[-1].append(r)
    runs: "OrderedDict[str, list[dict]]" = OrderedDict()
    aside: dict[str, dict] = {}

    def ended(group: list[dict]) -> bool:
        return all(r["config"] == "all" for r in group)

    def stopped(group: list[dict]) -> bool:  # zoo.py's words for a model it stopped
        return all(r["config"] == "all" and (r.get("cut") or r["error"].startswith("timed out after")) for r in group)

    for group in groups:
        model = group[0]["model"]
        if model in runs and stopped(group) and (all(r.get("cut") for r in group) or not ended(runs[model])):
            aside.update((model, r) for r in group if not r["error"].startswith("not started"))
            continue
        runs.pop(model, None)
        aside.pop(model, None)
        runs[model] = group
    return [r for group in runs.values() for r in group], list(aside.values())


def zoo_section() -> list[str]:
    rows = load("zoo.json")
    if not rows:
        return []
    current, _ = latest_runs(rows)
    return section("autoplan on models it was not tuned on", [r for r in current if "gpu" in r], zoo_lines(current),
                   "`benchmarks/zoo.py`: torchvision classifiers at batch 64 (inception_v3 at 299x299), timm models "
                   "at their batch (`harness.TIMM`) and the bench models at theirs, each in a process of its own, one "
                   "a GPU. A cell: activation (peak less static) x fp32's @ step time x compile + bf16's, medians "
                   "timed in turns. Dominated: a row with 2% less activation whose slowest round beats the answer's "
                   "fastest. Beaten (autoplan's rule, `results.beaten_by`): a row within 10% of the answer's "
                   "activation and 10% faster, or 10% smaller within its time limit; an eager answer against eager "
                   "rows only. \"every block\": torch's `checkpoint_wrapper` on the block classes a user names "
                   "(`harness.ZOO`) under bf16 autocast.\n\nThe autoplan calls share one cache, in the order 1.0x, 1.5x, "
                   "compile=True: later calls' seconds leave out what the first measured. Compile stage: its seconds "
                   "beside compile + bf16's first iteration (the model's own compile), and a second compile=True "
                   "call's in a fresh process, torch's caches warm.")


# -- compilation -----------------------------------------------------------------------------------------
def compile_time_section() -> list[str]:
    hows = ("whole", "per_block", "shared_call")
    rows = sorted(load("compile_time.json"), key=lambda r: (r["model"], hows.index(r["how"])))
    if not rows:
        return []
    return section("A cold compilation, whole or by regions", rows, table(
        ["model", "how", "blocks", "graphs", "first iteration s", "step ms (low-high)", "activation MiB"],
        [[r["model"], r["how"], str(r["blocks"]), str(r.get("graphs", "-")),
          num(r.get("first_s")) if "error" not in r else f"error: {r['error']}",
          spread(r) if "step_ms" in r else "-", num(r.get("activation_mib"))] for r in rows]),
        "`benchmarks/compile_time.py regions`: one torchvision classifier at batch 64 under bf16 autocast, the "
        "compiler's caches empty, each row a process of its own. whole: `compile()`; per_block: autoplan's blocks "
        "compiled, each through a code object of its own, the rest eager (what `compile(pattern=...)` does); "
        "shared_call: the blocks compiled through one code object, as torch's `nn.Module.compile()` does.")


def compile_plans_section() -> list[str]:
    rows = load("compile_plans.json")  # in the order they ran: a comparison holds within one call
    if not rows:
        return []
    return section("What compile=True pays per plan", rows, table(
        ["model", "run", "plan", "at once", "run s", "build s", "first iteration s", "forward s", "backward s",
         "inductor s", "tuning s"],
        [[r["model"], r["run"], code(r["plan"]), str(r["at_once"]), num(r["wall_s"]),
          *([f"error: {r['error']}"] + ["-"] * 5 if "error" in r else
            [num(r.get(k)) for k in ("setup_s", "first_s", "forward_s", "backward_s", "inductor_s", "tuning_s")])]
         for r in rows]),
        "`benchmarks/compile_time.py plans`: four plans of the kinds autoplan's compile stage compiles, each in a "
        "fresh process as its processes ahead compile them: alone with empty caches, one after another in the same "
        "caches (after), four side by side. Seconds: the run's wall clock, the build, the first iteration, and of it, "
        "from dynamo's timers, the forward traced and compiled, the backward compiled, inductor in both, and kernel "
        "configurations tuned on the GPU.")


def per_round_section() -> list[str]:
    rows = load("per_round.json")
    if not rows:
        return []
    from per_round import ITERATIONS, LIMITS, ROUNDS, replayed  # imports torch: only where there are rows

    from shrinkwrap.measuring.ratios import MAX_ROUNDS, PER_ROUND

    models = sorted({r["model"] for r in rows})
    return section("Timing in turns: iterations a round", rows, table(
        ["iterations a round", "iterations spent", "decided as the other timing reads",
         f"undecided after {MAX_ROUNDS} rounds (the median decides)"],
        [[f"{r['k']}{' (autoplan)' if r['k'] == PER_ROUND else ''}", str(r["iterations"]),
          f"{r['agree']} of {r['decisions']}", str(r["undecided"])] for r in replayed(rows)]),
        f"`benchmarks/per_round.py`: {len({(r['model'], r['plan']) for r in rows})} plans of {', '.join(models)} "
        f"(zoo batches), each timed twice in turns with the model as it is, {ROUNDS} rounds of {ITERATIONS} "
        f"iterations; autoplan's rules (five rounds, then one at a time until an 80% interval of the median ratio "
        f"lies on one side of the limit plus 3%, {MAX_ROUNDS} at most) replayed on the first k iterations of each "
        f"round, at {len(LIMITS)} limits ({LIMITS[0]}-{LIMITS[-1]}x), each decision checked against the same plan's "
        f"other timing. autoplan times {PER_ROUND} iterations a round.")


# -- language models, several GPUs --------------------------------------------------------------------
def lm_section() -> list[str]:
    rows = sorted(load("lm.json"), key=lambda r: r["model"])
    if not rows:
        return []
    return section("Language models: activations", rows, table(
        ["model", "config", "plan", "peak MiB", "activation MiB", "held MiB", "step ms"],
        [[r["model"], r["config"], code(r.get("plan")), num(r["peak_mib"]), num(r["activation_mib"]),
          num(r.get("held_mib")), num(r["step_ms"])] for r in rows]),
        "`benchmarks/lm.py`: causal language models from their configs (gpt2 at 8x1024 tokens; llama128k, "
        "Llama-3.2-1B's shape with a 128k vocabulary, tied or not, at 4x2048), a model's rows in one process over "
        "the same weights: the steady step's peak with AdamW, activation = peak less static, held = what the "
        "forward leaves for backward, step times in turns (SGD).")


def multigpu_section() -> list[str]:
    rows = load("multigpu.json")
    if not rows:
        return []
    return section("Two GPUs: FSDP2 and DDP", rows, table(
        ["model", "config", "plan", "activation MiB a rank", "peak MiB a rank", "step ms (low-high)"],
        [[r["model"], r["config"], code(r.get("plan")), num(r["activation_mib"]),
          num(max(r.get("peak_per_rank_mib") or [0])), spread(r)] for r in rows]),
        "`benchmarks/multigpu.py` under torchrun on two GPUs of one host: GPT-2 medium at 8x1024 tokens a rank, "
        "sharded with FSDP2 (`shrinkwrap.parallel.fsdp`) or replicated with DDP, the hand recipes (bf16 autocast, "
        "torch's `checkpoint_wrapper`) beside plans; memory per rank, step times in turns in step on both ranks.")


# -- the host ------------------------------------------------------------------------------------------
def bandwidth_section() -> list[str]:
    """What bounds the step with its state on the CPU: the link, host memory, the CPU AdamW."""
    rows = load("bandwidth.json")
    if not rows:
        return []

    def threads(r: dict) -> str:
        if "worker_threads" in r:  # the worker's threads, as it found them or after set_num_threads
            return f"{r['worker_threads']} ({'found' if r['threads'] is None else 'set'})"
        return num(r["threads"])

    def size(r: dict) -> str:
        if "elements" in r:
            return f"{r['elements'] / 1e6:.0f}M parameters ({r['tensors']} tensors)"
        return f"{num(r.get('array_gib'))} GiB an array"

    def fig(r: dict, key: str) -> str:
        return f"{num(r[key], 2)} ({num(r[key + '_low'], 2)}-{num(r[key + '_high'], 2)})"

    return section("The host: link, memory and the CPU optimizer", rows, table(
        ["measure", "config", "threads", "ms (low-high)", "GB/s (low-high)", "size",
         "host cores / torch's threads", "GPU"],
        [[r["measure"], r["config"], threads(r), fig(r, "ms"), fig(r, "gb_s"),
          size(r),
          f"{r['host_cores']} / {r['torch_threads']}", gpu(r)] for r in rows]),
        "`benchmarks/bandwidth.py`: what bounds `step_in_backward(state='cpu')`. link: a copy between pinned "
        "host memory and the GPU each way on a side stream, both at once on two streams, and from pageable memory "
        "(CUDA events, 10 repeats). memory: a float32 `copy_` (bytes read and written), a triad `torch.add(a, "
        "b, alpha=2, out=c)` and its in-place form `c.add_(b, alpha=2)` (three arrays' bytes), 5 repeats. adamw: "
        "one `step()` of torch's CPU AdamW over float32 tensors shaped as a decoder's parameters (Qwen2-0.5B's "
        "layers), after a warmup step, 5 repeats: one optimizer (`fused_one`, `foreach_one`, `single_one`), one a "
        "tensor in turn (`fused_per_tensor`), and that from a one-thread `ThreadPoolExecutor` as shrinkwrap's "
        "worker (threads found in it, or set in it); GB/s at 28 bytes a parameter. GB/s are 10^9 bytes a second.")


SECTIONS = (fits_section, autoplan_budget_section, bill_section, frontier_section, graphs_section, zoo_section,
            compile_time_section, compile_plans_section, per_round_section, lm_section, multigpu_section,
            bandwidth_section)


def make() -> str:
    lines = ["# Results", "",
             "The current figures, one table a capability, made from the JSON rows beside this file by "
             "`benchmarks/results.py` (CI checks this file is what the rows make). Above each table, the run it "
             "comes from: GPU, torch version, date. Memory figures are stable between runs; a time ratio is within "
             "one run, measured in turns.", ""]
    for make_section in SECTIONS:
        lines += make_section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md is not what the rows make")
    args = parser.parse_args()
    text = make()
    if args.check:
        if OUT.read_text() != text:
            print("benchmarks/RESULTS.md is not what the JSON rows make: run python benchmarks/results.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
