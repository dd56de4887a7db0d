"""benchmarks/RESULTS.md, made from the JSON rows the benchmark scripts write: the current figures
per model and capability, each with its GPU, torch version and date. History is in git.

    python benchmarks/results.py            # write RESULTS.md
    python benchmarks/results.py --check    # exit 1 if RESULTS.md is not what the rows make (CI)

A table shows the latest run of what it covers: a model's rows from one run (ratios are within a
run, never across), and where a script appends several runs, the newest.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
OUT = HERE / "RESULTS.md"
MODELS = ("resnet18", "efficientnet_b0", "resnet152", "gpt2", "bert")


def load(name: str) -> list[dict[str, Any]]:
    path = HERE / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


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


def stamp(rows: list[dict]) -> str:
    seen = sorted({(r.get("gpu") or r.get("device_name") or "?", r.get("torch", "?"), r.get("date", "?")) for r in rows})
    return "; ".join(f"{g}, torch {t}, {d}" for g, t, d in seen)


def code(text: str | None) -> str:
    return f"`{text}`" if text else "-"


# -- what fits ------------------------------------------------------------------------------------
def fits_section() -> list[str]:
    every = load("fits.json")
    # Estimates made apart from a fit run (fits.py --estimate-only, on a CPU) fill rows whose run made none.
    apart = {(r["model"], r["config"]): r for r in every if r.get("kind") == "estimate"}
    answers = latest([r for r in every if r.get("kind") == "autoplan"], lambda r: (r["model"], r["budget"]))
    rows = latest([r for r in every if r.get("kind") not in ("estimate", "autoplan")], lambda r: (r["model"], r["config"]))
    used = [apart[(r["model"], r["config"])] for r in rows if "estimate_mib" not in r and (r["model"], r["config"]) in apart]
    rows = [{**r, "estimate_mib": apart[(r["model"], r["config"])]["estimate_mib"]}
            if "estimate_mib" not in r and (r["model"], r["config"]) in apart else r for r in rows]
    out = ["## What fits", "",
           "Each configuration's reading (`shrinkwrap.measure`: the steady step's `max_memory_allocated`, in a "
           "fresh process) beside its fit (`shrinkwrap.fit`: the smallest allocator cap under which a fresh process "
           "trains its first 8 iterations, compilation and recording included, bisected; the largest cap that "
           "failed in brackets) and its estimate (`shrinkwrap.estimate`, on the same host's CPU; eager rows). "
           "`fp32_eager` is the plain `max_memory_allocated` control; `best` is the plan each model's claim against "
           "compile + bf16 rests on (`benchmarks/fits.py`); `recipe` the eager hand recipe.", ""]
    body = []
    for r in sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99)):
        if "error" in r:
            body.append([r["model"], r["config"], r["error"], *["-"] * 8])
            continue
        est = r.get("estimate_mib")
        body.append([r["model"], r["config"], num(r["reading_mib"]), num(r["static_mib"]),
                     f"{num(r['fit_mib'])} ({num(r['fit_below_mib'])})", f"{r['fit_x_reading']:.3f}",
                     num(r["uncapped_pools_mib"]) if r["cuda_graphs"] else "-",
                     f"{num(est)} ({ratio(est, r['reading_mib'], 3)})" if est else "-", r["device_name"]])
    out += table(["model", "config", "reading MiB", "static MiB", "fits in MiB (not under)", "fit x reading",
                  "graph pools MiB", "estimate MiB (x reading)", "GPU"], body)
    out += [f"Runs: {stamp(rows)}. Resolution: 1% of the uncapped reservation, at least 16 MiB."
            + (f" Estimates of {', '.join(r['model'] + ' ' + r['config'] for r in used)} made apart: {stamp(used)}."
               if used else ""), ""]
    # The claims against compile + bf16, on the fit figure: both sides measured the same way.
    by = {(r["model"], r["config"]): r for r in rows if "error" not in r}
    claims = []
    for m in MODELS:
        best, anchor = by.get((m, "best")), by.get((m, "compile_bf16"))
        if best and anchor:
            fit_act = ratio(best["fit_mib"] - best["static_mib"], anchor["fit_mib"] - anchor["static_mib"])
            read_act = ratio(best["activation_mib"], anchor["activation_mib"])
            claims.append([m, code(best["plan"]), read_act, fit_act])
        else:
            claims.append([m, "not measured in this run (the fit of its best plan did not finish)", "-", "-"])
    out += ["Each model's best plan against compile + bf16, above static memory (activation), as its reading and as "
            "its fit:", ""]
    out += table(["model", "best plan", "x compile+bf16, reading", "x compile+bf16, fit"], claims)
    return out + _answers_under_cap(answers)


def _answers_under_cap(rows: list[dict]) -> list[str]:
    """autoplan's budgeted answers and the cap each trained under (``fits.py --configs autoplan``)."""
    if not rows:
        return []
    body = []
    for r in sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 99, r["budget"])):
        said = [n for n in r["notes"] if n.startswith("no plan measured within the budget trained")]
        under = f"yes, {num(r['trained_under_mib'])} MiB" if r.get("trained_under_mib") else "; ".join(said) or "no"
        body.append([r["model"], f"{r['budget']} ({num(r['budget_mib'])} MiB)", code(r["plan"]),
                     r.get("error") or num(r.get("reading_mib")), under, num(r["autoplan_s"])])
    return ["autoplan's answer for a budget (a share of the model's reading as it is; bf16 allowed), trained under "
            "the budget's cap in a fresh process before autoplan returns it (`fits.py --configs autoplan`):", "",
            *table(["model", "budget", "answer", "reading MiB (steady step)", "trained under the cap", "autoplan s"], body),
            f"Runs: {stamp(rows)}.", ""]


# -- the whole memory bill ---------------------------------------------------------------------------
BILL_TARGETS = {"in_backward": 0.85, "state_cpu": 0.45, "lossy": 0.45}
BYTES_TARGETS = {"in_backward": 12, "state_cpu": 4, "bf16_state_cpu": 2, "lossy": 4}


def bill_section() -> list[str]:
    rows = load("bill.json")
    estimates = latest([r for r in rows if r.get("kind") == "estimate"], lambda r: (r["model"], r["plan"]))
    rows = [r for r in rows if r.get("kind") != "estimate"]
    mem = latest([r for r in rows if "peak_mib" in r or "error" in r and "losses" not in r], lambda r: (r["model"], r["config"]))
    timed = [r for r in rows if "tokens_per_s" in r]
    # The two latest runs (a run starts with best), apart: times compare within a run, and two runs
    # show how far one run's ratio can be trusted.
    starts = [i for i, r in enumerate(timed) if r["config"] == "best"] or [0]
    runs = [timed[a:b] for a, b in zip(starts, starts[1:] + [len(timed)])][-2:]
    times = [r for run in runs for r in run]
    curves = latest([r for r in rows if "losses" in r], lambda r: (r["model"], r["config"]))
    out = ["## The whole memory bill", "",
           "A Qwen2-0.5B-shaped model (`qwen05b`: 24 layers, hidden 896, 151,936 vocabulary, tied embeddings, 494M "
           "parameters, random init) at 4x2048 tokens with AdamW, and a Llama-3.2-3B-shaped one (`llama3b`: 28 "
           "layers, hidden 3072, 128,256 vocabulary, 3.2B parameters), `benchmarks/bill.py`. Every row has today's "
           "best activation plan (`checkpoint` of each layer, `swiglu`, `chunked_loss`, bf16 `autocast`); the "
           "terms are the steady step's peak split by kind (activations: what the rest leaves), each row in a "
           "fresh process. Bytes per parameter: the peak less activations, over the parameters.", ""]
    best = {r["model"]: r for r in mem if r["config"] == "best" and "peak_mib" in r}
    body = []
    for r in mem:
        if "peak_mib" not in r:
            body.append([r["model"], r["config"], r.get("error", "-"), *["-"] * 8])
            continue
        b = best.get(r["model"])
        body.append([r["model"], r["config"], num(r["peak_mib"]), ratio(r["peak_mib"], b and b["peak_mib"]),
                     num(r["parameters_mib"]), num(r["gradients_mib"]), num(r["optimizer_state_mib"]),
                     num(r["activations_mib"]), f"{r['bytes_per_parameter']:.2f}"])
    out += table(["model", "config", "peak MiB", "x best", "parameters", "gradients", "optimizer state",
                  "activations", "bytes/parameter"], body)
    out += [f"Runs: {stamp(mem)}. Plans: " + "; ".join(f"{r['config']}: {code(r['plan'])}" for r in mem
                                                      if r["model"] == "qwen05b") + ".", ""]
    if times:
        out += ["Step times of the qwen05b rows in turns in one process, the two latest runs (rounds of 2 "
                "iterations; tokens per second from the median):", ""]
        out += table(["run", "config", "step ms (rounds low-high)", "rounds", "x best", "tokens/s"],
                     [[str(i + 1), r["config"], spread(r, 1), str(r.get("rounds", "-")), f"{r['x_best']:.3f}",
                       str(r["tokens_per_s"])] for i, run in enumerate(runs) for r in run])
        out += [f"Runs: {stamp(times)}.", ""]
    heads = [r for r in mem if r["model"] == "llama3b" and "peak_mib" in r]
    if heads:
        out += ["The 3B model's rows: " + "; ".join(
            f"{r['config']}: {code(r['plan'])}, {num(r['step_ms'])} ms a step (one steady iteration), "
            f"{round(8192 / r['step_ms'] * 1e3)} tokens/s ({stamp([r])})" for r in heads) + ".", ""]
    if curves:
        out += ["Loss over 200 steps on real text at hand offline (the installed torch's `nn/modules/*.py`, "
                "byte-tokenized), the exact step in backward against the lossy row and its 8-bit state alone "
                "(state8: float32 weights), same init and data:", ""]
        out += table(["config", "loss, steps 1-3", "loss, mean of steps 181-200", "loss, step 200"],
                     [[r["config"], ", ".join(map(str, r["losses"][:3])), f"{sum(r['losses'][-20:]) / 20:.3f}",
                       str(r["losses"][-1])] for r in curves])
        out += [f"Run: {stamp(curves)}. Every step's loss: `bill.json`.", ""]
    if estimates:
        out += _bill_estimates(estimates)
    out += step_checks_section()
    checks = []
    for name, target in BILL_TARGETS.items():
        r = next((r for r in mem if r["model"] == "qwen05b" and r["config"] == name and "peak_mib" in r), None)
        if r and best.get("qwen05b"):
            x = r["peak_mib"] / best["qwen05b"]["peak_mib"]
            checks.append(f"- {name}: peak {x:.2f}x best (target at most {target}x): {'met' if x <= target else 'missed'}")
    for name, target in BYTES_TARGETS.items():
        r = next((r for r in mem if r["model"] == "qwen05b" and r["config"] == name and "peak_mib" in r), None)
        if r:
            ok = r["bytes_per_parameter"] <= target + 0.005
            checks.append(f"- {name}: {r['bytes_per_parameter']:.2f} bytes a parameter beside activations (target at "
                          f"most {target}): {'met' if ok else 'missed'}")
    for r in heads:
        limit = 10 if r["config"].startswith("bf16") else 16
        gib = r["peak_mib"] / 1024
        checks.append(f"- llama3b {r['config']}: peak {gib:.1f} GiB (target within {limit} GiB): "
                      f"{'met' if gib <= limit else 'missed'}")
    for i, run in enumerate(runs):
        theirs = {r["config"]: r for r in run}
        if "state_cpu" in theirs and "torchao_offload" in theirs:
            ours, ao = theirs["state_cpu"], theirs["torchao_offload"]
            checks.append(f"- state_cpu, run {i + 1}: {ours['tokens_per_s']} tokens/s against torchao's "
                          f"CPUOffloadOptimizer's {ao['tokens_per_s']} in the same run (target: at least match it): "
                          f"{'met' if ours['tokens_per_s'] >= ao['tokens_per_s'] else 'missed'}")
        for r in run:
            if r["config"] in ("in_backward", "lossy"):
                checks.append(f"- {r['config']}, run {i + 1}: {r['x_best']:.3f}x best's step time (target at most "
                              f"1.05x): {'met' if r['x_best'] <= 1.05 else 'missed'}")
    if checks:
        out += ["Against the targets:", "", *checks, ""]
    return out


def step_checks_section() -> list[str]:
    """The step in backward's checks (docs/steps/step_in_backward.md's loop table), timed against
    the code before them: both codes' models in turns in one process, the earlier imported as a
    second package."""
    rows = load("step_checks.json")
    if not rows:
        return []
    runs = list(OrderedDict.fromkeys(r["run"] for r in rows))
    configs = list(OrderedDict.fromkeys(r["config"] for r in rows))
    at = {(r["run"], r["config"]): r for r in rows}
    out = ["### The step in backward's checks, timed", "",
           "Step times of qwen05b's rows (`bill.py`'s plans at `chunk_size=256`) in turns in one process: the code "
           "with the checks against the code before them (`sw.time_interleaved` over both codes' models; rounds of "
           "2 iterations; median ms, new / before, and their ratio), for five forms of the checks, A-E:", ""]
    body = []
    for run in runs:
        first = next(r for r in rows if r["run"] == run)
        cells = []
        for c in configs:
            r = at.get((run, c))
            cells.append("-" if r is None else f"{num(r['step_ms'])} / {num(r['before_ms'])} "
                                               f"({ratio(r['step_ms'], r['before_ms'])}x)")
        body.append([run, first["code"], str(first["rounds"]), num(first["best_ms"]), *cells])
    out += table(["run", "code of the new rows", "rounds", "best", *configs], body)
    out += [f"Runs: {stamp(rows)}. The code shipped steps in backward as in C and D, `LowBitAdamW` as in B and C "
            "(its steps are checked on the host), a float32 weight with the state on the CPU as in A and a half "
            "one as in E (that combination was not timed).", ""]
    return out


def _bill_estimates(rows: list[dict]) -> list[str]:
    """The bill's rows estimated on the CPU, at each chunk size of the head's loss they ran with."""
    def chunk(plan: str) -> str:
        return plan.split("chunked_loss(chunk_size=")[1].split(")")[0] if "chunk_size=" in plan else "1024 (default)"

    best = {chunk(r["plan"]): r for r in rows if r["config"] == "best"}
    body = [[r["config"], chunk(r["plan"]), num(r["peak_mib"]), ratio(r["peak_mib"], best.get(chunk(r["plan"]), {}).get(
        "peak_mib")), num(r["parameters_mib"]), num(r["gradients_mib"]), num(r["optimizer_state_mib"]),
        num(r["activations_mib"]), f"{r['bytes_per_parameter']:.2f}"] for r in rows]
    return ["Estimated on the CPU, not measured (`bill.py estimate [--chunk-size N]`: `shrinkwrap.estimate`, fake "
            "tensors; it counts an optimizer step's temporaries as optimizer state; rows with `state='cpu'` cannot "
            "be estimated). For best and in_backward the estimate lies within 1% of the measured peak above, and "
            "peaks where it did: once the optimizer no longer holds the peak, the head's loss in the forward does, "
            "and the chunk of rows x 151,936 vocabulary it takes at a time decides it. The estimate counts "
            "`LowBitAdamW`'s eager update, 1M values a slice; the measured lossy row ran its compiled one, up to 16M:", "",
            *table(["config", "chunk_size", "peak MiB", "x best", "parameters", "gradients", "optimizer state",
                    "activations", "bytes/parameter"], body),
            f"Runs: {stamp(rows)}.", ""]


# -- per model: plans beside what users do ------------------------------------------------------------
def frontier_section() -> list[str]:
    rows = [r for r in load("frontier.json") if r.get("run")]
    out = ["## Per model: plans beside what users do", "",
           "Each model's latest run of `benchmarks/frontier.py` (or `frontier_split.sh`): the anchors as users "
           "write them, hand recipes, and autoplan's answers at `max_slowdown` 1.0 (`auto_fast`) and 1.5 "
           "(`auto_small`), every row of a model from one run; activation = reading - static; times in turns "
           "in one process, x compile + bf16 of the same run (the median of the rounds' ratios). Readings, not "
           "fits: for the fit of each model's best plan see What fits.", ""]
    for m in MODELS:
        ours = [r for r in rows if r["model"] == m]
        runs = list(dict.fromkeys(r["run"] for r in ours))
        # The latest run with the anchors (five rows and more), and a later, smaller one where there is one.
        full = [run for run in runs if sum(r["run"] == run for r in ours) >= 5][-1:]
        for run in full + [run for run in runs[-1:] if run not in full]:
            out += _frontier_table(m, run, latest([r for r in ours if r["run"] == run], lambda r: r["config"]))
    return out


def _frontier_table(m: str, run: str, mine: list[dict]) -> list[str]:
    """One run's rows of a model, x its compile + bf16 row."""
    anchor = next((r for r in mine if r["config"] in ("compile+bf16", "compile_bf16") and "activation_mib" in r), None)
    body = []
    for r in mine:
        if "activation_mib" not in r:
            body.append([r["config"], code(r.get("plan")), (r.get("error") or "-")[:80], "-", "-", "-", "-"])
            continue
        body.append([r["config"], code(r.get("plan")), num(r["activation_mib"]),
                     ratio(r["activation_mib"], anchor and anchor["activation_mib"]),
                     spread(r),
                     ratio(r["step_ms"], anchor and anchor["step_ms"]), ", ".join(r.get("dominated_by") or []) or "-"])
    return [f"### {m} (run {run}: {stamp(mine)})", "",
            *table(["config", "plan", "activation MiB", "x compile+bf16", "step ms (low-high)", "time x compile+bf16",
                    "dominated by"], body)]


def lm_section() -> list[str]:
    rows = latest(load("lm.json"), lambda r: (r["model"], r["config"]))
    if not rows:
        return []
    out = ["## Language models: activations", "", "`benchmarks/lm.py`: each row in a fresh process; held = what "
           "the forward leaves for backward.", ""]
    out += table(["model", "config", "plan", "peak MiB", "activation MiB", "held MiB", "step ms"],
                 [[r["model"], r["config"], code(r.get("plan")), num(r["peak_mib"]), num(r["activation_mib"]),
                   num(r.get("held_mib")), num(r["step_ms"])] for r in rows])
    return out + [f"Runs: {stamp(rows)}.", ""]


def multigpu_section() -> list[str]:
    rows = latest(load("multigpu.json"), lambda r: (r["model"], r["config"]))
    if not rows:
        return []
    out = ["## Two GPUs: FSDP2 and DDP", "", "`benchmarks/multigpu.py`: per rank, GPT-2 medium at 8x1024 tokens "
           "a rank.", ""]
    out += table(["model", "config", "plan", "activation MiB a rank", "peak MiB a rank", "step ms (low-high)"],
                 [[r["model"], r["config"], code(r.get("plan")), num(r["activation_mib"]),
                   num(max(r.get("peak_per_rank_mib") or [0])),
                   spread(r)]
                  for r in rows])
    return out + [f"Runs: {stamp(rows)}.", ""]


def compile_time_section() -> list[str]:
    hows = ("whole", "per_block", "shared_call")
    rows = sorted(latest(load("compile_time.json"), lambda r: (r["model"], r["how"])),
                  key=lambda r: (r["model"], hows.index(r["how"])))
    if not rows:
        return []
    out = ["## A cold compilation, whole or by regions", "",
           "`benchmarks/compile_time.py`: one torchvision classifier at batch 64 under bf16 autocast, the compiler's "
           "caches empty, each row a process of its own, one GPU a model, its rows one after another (in the order "
           "resnet152: whole, shared_call, per_block; efficientnet_b0: per_block, whole, shared_call; swin_t: "
           "shared_call, per_block, whole), three models side by side on one host beside an autoplan run: not "
           "under equal load. whole: `compile()`; per_block: autoplan's blocks compiled, each through a code "
           "object of its own, the rest eager (what `compile(pattern=...)` does); shared_call: the blocks compiled through one code object as "
           "torch's `nn.Module.compile()` does (those whose forward is torch's own, each through its own).", ""]
    out += table(["model", "how", "blocks", "graphs", "first iteration s", "step ms (low-high)", "activation MiB"],
                 [[r["model"], r["how"], str(r["blocks"]), str(r.get("graphs", "-")),
                   num(r.get("first_s")) if "error" not in r else f"error: {r['error']}",
                   spread(r) if "step_ms" in r else "-", num(r.get("activation_mib"))] for r in rows])
    return out + [f"Runs: {stamp(rows)}.", ""]


def compile_plans_section() -> list[str]:
    rows = load("compile_plans.json")  # in the order they ran: a comparison holds within one call
    if not rows:
        return []
    out = ["## What compile=True pays per plan", "",
           "`benchmarks/compile_plans.py`: four plans of the kinds autoplan's compile stage compiles, each in a fresh "
           "process as its processes ahead compile them (the zoo's batch; build, then warm-up and one more "
           "iteration): alone with empty caches, one after another in the same caches (after), four side by side. "
           "Rows in the order they ran. efficientnet_b0's rows and swin_t's first three come from one call, the two "
           "models side by side on one host, a GPU each; swin_t's last five from a second call on another host, "
           "its side_by_side run beside its second alone run. Seconds: the run's wall clock, the build, the first "
           "iteration, and of it, from dynamo's timers, the forward traced and compiled, the backward compiled, "
           "inductor in both, and kernel configurations tuned on the GPU.", ""]
    out += table(["model", "run", "plan", "at once", "run s", "build s", "first iteration s", "forward s", "backward s",
                  "inductor s", "tuning s"],
                 [[r["model"], r["run"], code(r["plan"]), str(r["at_once"]), num(r["wall_s"]),
                   *([f"error: {r['error']}"] + ["-"] * 5 if "error" in r else
                     [num(r.get(k)) for k in ("setup_s", "first_s", "forward_s", "backward_s", "inductor_s",
                                               "tuning_s")])] for r in rows])
    return out + [f"Runs: {stamp([r for r in rows if 'gpu' in r])}.", ""]


def per_round_section() -> list[str]:
    # A plan's newest timings: a run appended later replaces the earlier one's.
    rows = latest(load("per_round.json"), lambda r: (r["model"], r["plan"], r["timing"]))
    if not rows:
        return []
    from per_round import ITERATIONS, LIMITS, ROUNDS, replayed  # imports torch: only where there are rows

    from shrinkwrap.measure.ratios import MAX_ROUNDS, PER_ROUND

    models = sorted({r["model"] for r in rows})
    out = ["## Timing in turns: iterations a round", "",
           f"`benchmarks/per_round.py`: {len({(r['model'], r['plan']) for r in rows})} plans of {', '.join(models)} "
           f"(zoo batches), each timed twice in turns with the model as it is, {ROUNDS} rounds of {ITERATIONS} "
           f"iterations; autoplan's rules (five rounds, then one at a time until an 80% interval of the median ratio "
           f"lies on one side of the limit plus 3%, {MAX_ROUNDS} at most) replayed on the first k iterations of each "
           f"round, at {len(LIMITS)} limits ({LIMITS[0]}-{LIMITS[-1]}x), each decision checked against the same plan's other "
           f"timing (its median ratio over every iteration). autoplan times {PER_ROUND} iterations a round.", ""]
    out += table(["iterations a round", "iterations spent", "decided as the other timing reads", "undecided after "
                  f"{MAX_ROUNDS} rounds (the median decides)"],
                 [[f"{r['k']}{' (autoplan)' if r['k'] == PER_ROUND else ''}", str(r["iterations"]),
                   f"{r['agree']} of {r['decisions']}", str(r["undecided"])] for r in replayed(rows)])
    return out + [f"Runs: {stamp(rows)}.", ""]


# -- autoplan on the zoo -----------------------------------------------------------------------------
ZOO_ROWS = ("ckpt_every_block+bf16", "ckpt_every_block+bf16_compiled", "compile_budget0.5+bf16")
ZOO_AUTO = ("auto_fast", "auto_small", "auto_compile")
ZOO_TARGETS = {"auto_fast": 60, "auto_small": 60, "auto_compile": 120}  # autoplan's own seconds


def zoo_lines(rows: list[dict]) -> list[str]:
    """One line a model: each autoplan answer and each recipe as activation x fp32 @ step time x
    compile + bf16 (medians, timed in turns in the model's process), what dominates each answer,
    and autoplan's own seconds; then how many answers were dominated and ran over the time targets."""
    by_model: "OrderedDict[str, dict[str, dict]]" = OrderedDict()
    for r in rows:
        by_model.setdefault(r["model"], {})[r["config"]] = r
    body, dominated, by_compiled, slow, answers = [], [], [], [], 0

    def cell(r: dict | None, base: dict | None, ref: dict | None) -> str:
        if r is None:
            return "not run"
        if "error" in r or "activation_mib" not in r:
            return "error: " + r.get("error", "?")[:60]
        return f"{ratio(r['activation_mib'], base and base.get('activation_mib'))} @ " \
               f"{ratio(r.get('step_ms'), ref and ref.get('step_ms'))}"

    for model, got in by_model.items():
        if "all" in got:
            body.append([model, f"error: {got['all']['error']}", *[""] * (2 * len(ZOO_AUTO) + len(ZOO_ROWS) + 1)])
            continue
        base, ref = got.get("base_fp32"), got.get("compile+bf16")
        line = [model]
        for a in ZOO_AUTO:
            r = got.get(a)
            line += [cell(r, base, ref), ", ".join(r.get("dominated_by") or []) or "none" if r and "activation_mib" in r
                     else "-"]
            if r and "activation_mib" in r:
                answers += 1
                dominated += [f"{model} {a}"] if r.get("dominated_by") else []
                if a != "auto_compile" and r.get("dominated_by") and all("compile" in d for d in r["dominated_by"]):
                    by_compiled.append(f"{model} {a}")
            if r and r.get("autoplan_s") is not None and r["autoplan_s"] > ZOO_TARGETS[a]:
                slow.append(f"{model} {a} {r['autoplan_s']:.0f} s")
        line += [cell(got.get(c), base, ref) for c in ZOO_ROWS]
        line.append(" / ".join(num(got.get(a, {}).get("autoplan_s")) for a in ZOO_AUTO))
        gpus = {r.get("gpu") for r in got.values() if r.get("gpu")}
        line.append(", ".join(sorted(g.replace("NVIDIA ", "").split()[0] for g in gpus)) or "-")
        body.append(line)
    heads = ["model"] + [h for a in ("1.0x", "1.5x", "compile=True") for h in (f"autoplan {a}", "dominated by")]
    heads += ["every block + bf16", "the same compiled", "compile + bf16, budget 0.5", "autoplan s (1.0x / 1.5x / compile)",
              "GPU"]
    out = table(heads, body)
    out += [f"Dominated: {len(dominated)} of {answers} answers" + (f" ({', '.join(dominated)})" if dominated else "")
            + (f"; of the eager answers, {len(by_compiled)} only by a compiled row ({', '.join(by_compiled)})"
               if by_compiled else "")
            + ". Over autoplan's time targets (60 s eager, 120 s compile=True): "
            + (", ".join(slow) if slow else "none") + ".", ""]
    return out


def latest_runs(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each model's rows of its latest run, so that an error row of an earlier run cannot hide a
    later result: a run's rows lie together in the file (zoo.py appends a model's rows at once)
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
    latest_run, aside = latest_runs(rows)
    out = ["## autoplan on models it was not tuned on", "",
           "`benchmarks/zoo.py`: torchvision classifiers at batch 64 (inception_v3 at 299x299) and the bench models "
           "at their benchmark batch (efficientnet_b0: 128), each in a process of its own, one a GPU; autoplan "
           "eager unless a compile=True column has figures. Each cell: activation (peak less static) x fp32's @ step time x "
           "compile + bf16's, medians timed in turns in that process. Dominated: another row with at least 2% less "
           "activation whose slowest round is faster than the answer's fastest. \"every block\": torch's "
           "`checkpoint_wrapper` on the block classes a user names (`zoo.ZOO`) under bf16 autocast. A model's "
           "autoplan calls share one cache, in the order 1.0x, 1.5x, compile=True: the later calls' seconds leave "
           "out the candidates the first one measured.", ""]
    out += zoo_lines(latest_run)
    if aside:
        out += ["Later runs that ended without rows (the table keeps the model's earlier run): " + "; ".join(
            f"{r['model']} ({(r.get('run') or '?')[:10]}): {r['error']}" for r in aside) + ".", ""]
    return out + [f"Runs: {stamp([r for r in latest_run if 'gpu' in r])}.", ""]


def make() -> str:
    lines = ["# Results", "",
             "The current figures, made from the JSON rows beside this file by `benchmarks/results.py` (which "
             "also checks, in CI, that this file is what the rows make). Every table names its runs: GPU, torch "
             "version, date. Memory figures are stable between runs; a time ratio is within one run, measured in "
             "turns.", ""]
    for section in (fits_section, bill_section, frontier_section, zoo_section, compile_time_section,
                    compile_plans_section, per_round_section, lm_section, multigpu_section):
        lines += section()
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
