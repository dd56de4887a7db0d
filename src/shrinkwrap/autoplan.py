"""Auto-plan: the plan that fits a memory budget at the highest speed, found by measuring.

The seed advice — "measure the effect at various levels and locations, then choose a set of
checkpointed modules so that you fit within your memory budget but incur the smallest throughput
impact" — done for the user:

1. Candidates come from the module tree, not from a list of model names: every ``Sequential`` or
   ``ModuleList`` holding two or more blocks of one type (residual blocks, transformer layers,
   EfficientNet stages) gives "checkpoint the whole stage" (where it has a forward) and
   "checkpoint each block" (in groups of consecutive blocks when there are many); plus
   ``swish()`` and ``bn_act()`` where they apply, and ``autocast(bfloat16)`` when lossy steps
   are allowed and the device runs bfloat16.
2. Each whole-model step (swish, bn_act, autocast) is measured alone against the baseline; the
   best of them within the limits (chosen as in 3.) form a base, and every other candidate is
   measured on top of it (on CUDA the peak and step time; without CUDA the bytes saved for
   backward and step time).
3. Candidates are taken greedily by memory saved per millisecond added (free savings first) until
   the prediction fits; candidates that cover the same modules exclude each other.
4. The chosen plan is measured in a fresh process; where it misses the budget or the slowdown
   limit (savings and costs do not add exactly) it is refined — one more candidate, or the
   costliest dropped, base steps last — and measured again.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Union

import torch
import torch.nn as nn

from .measure.compare import Progress, describe_batch, measure_plans, model_maker
from .measure.step import LossFn, OptimizerFactory, _tensors, device_name, resolve_device
from .plan import Plan, Step
from .report import Report, Row
from .transforms.activations import BnAct, Swish
from .transforms.checkpoint import Checkpoint
from .transforms.precision import Autocast

Budget = Union[int, float, str, None]
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One thing autoplan may add: ``steps``, the modules they cover (``covers``: two candidates
    that share a module exclude each other), and ``lossy`` (changes the numbers)."""

    steps: tuple[Step, ...]
    covers: tuple[str, ...] = ()
    lossy: bool = False

    def __str__(self) -> str:
        return str(Plan(self.steps))

    def overlaps(self, other: "Candidate") -> bool:
        return any(a == b or a.startswith(b + ".") or b.startswith(a + ".") for a in self.covers for b in other.covers)


@dataclasses.dataclass
class Effect:
    """A candidate measured alone: bytes saved and milliseconds added against the baseline."""

    candidate: Candidate
    saving: float
    cost: float
    error: str | None = None

    @property
    def efficiency(self) -> float:
        if self.saving <= 0:
            return -math.inf
        return math.inf if self.cost <= 0 else self.saving / self.cost


def parse_budget(budget: Budget, baseline: float) -> float | None:
    """Bytes from ``4_000_000_000``, ``"4GiB"``/``"500MB"``, or a fraction of ``baseline`` (``0.5``)."""
    if budget is None:
        return None
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]i?b|b)?\s*", budget.lower())
        if not m:
            raise ValueError(f"shrinkwrap: cannot read budget {budget!r}; write e.g. '4GiB', '500MB' or 0.5")
        return float(m.group(1)) * _UNITS[m.group(2) or "b"]
    if isinstance(budget, float) and 0 < budget <= 1:
        return budget * baseline
    if budget <= 0:
        raise ValueError(f"shrinkwrap: a budget must be positive, got {budget!r}")
    return float(budget)


# -- candidates -------------------------------------------------------------------------------------
def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def block_groups(model: nn.Module) -> list[tuple[str, list[str], bool]]:
    """``(container, [block names], nested)`` for every Sequential/ModuleList holding two or more
    blocks of one type (modules with children and parameters). Groups inside a block that is not
    itself a plain container (inside a residual block or a transformer layer) are left out: their
    parts are too small to be worth a measurement. ``nested``: the group lies inside another
    group's block (an EfficientNet stage inside ``features``)."""
    out: list[tuple[str, list[str], bool]] = []
    real_blocks: list[str] = []
    for name, c in model.named_modules():
        if not isinstance(c, (nn.Sequential, nn.ModuleList)):
            continue
        if any(name.startswith(b + ".") for b in real_blocks):
            continue
        kids = [(f"{name}.{k}" if name else k, m) for k, m in c.named_children()]
        types = [type(m) for _, m in kids]
        blocks = [(n, m) for n, m in kids if types.count(type(m)) >= 2 and _has_params(m) and any(True for _ in m.children())]
        if len(blocks) < 2:
            continue
        nested = any(name == b or name.startswith(b + ".") for _, bs, _ in out for b in bs)
        out.append((name, [n for n, _ in blocks], nested))
        real_blocks += [n for n, m in blocks if not isinstance(m, (nn.Sequential, nn.ModuleList))]
    return out


def _chunks(items: list[str], n: int) -> list[list[str]]:
    size = math.ceil(len(items) / n)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _applies(step: Step, model: nn.Module) -> bool:
    try:
        step.check(model)
    except (ValueError, TypeError):  # SelectionError is a ValueError: nothing to do, or unsafe
        return False
    return True


def candidates(model: nn.Module, *, allow_lossy: bool = False, device: str | torch.device | None = None,
               max_groups: int = 4) -> list[Candidate]:
    """What autoplan may try on ``model``: checkpoint regions, then swish, bn_act, autocast."""
    out: list[Candidate] = []
    seen: set[tuple[str, ...]] = set()
    for container, blocks, nested in block_groups(model):
        stage = bool(container) and isinstance(model.get_submodule(container), nn.Sequential)
        regions = [[container]] if stage else []
        if not (nested and stage):  # an inner stage: the whole stage is candidate enough
            regions += _chunks(blocks, 2 if nested else max_groups)
        for names in regions:
            step = Checkpoint(tuple(names))
            if tuple(names) not in seen and _applies(step, model):
                seen.add(tuple(names))
                out.append(Candidate((step,), tuple(names)))
    for step in (Swish(), BnAct()):
        if _applies(step, model):
            out.append(Candidate((step,)))
    dev = resolve_device(device)
    bf16 = dev.type != "cuda" or torch.cuda.is_bf16_supported()
    if allow_lossy and bf16:
        out.append(Candidate((Autocast(torch.bfloat16),), lossy=True))
    return out


def _plan(chosen: list[Candidate]) -> Plan:
    # Checkpoints first, then activation swaps, precision last: the order the plan text reads best.
    order = {Checkpoint: 0, Swish: 1, BnAct: 2, Autocast: 3}
    steps = sorted((s for c in chosen for s in c.steps), key=lambda s: order.get(type(s), 4))
    return Plan(steps)


# -- choosing -----------------------------------------------------------------------------------------
def _effects(cands: list[Candidate], rows: list[Row], base: Row, metric: Callable[[Row], Any]) -> list[Effect]:
    """What each candidate's row saved and cost against ``base``'s row."""
    out = []
    for cand, row in zip(cands, rows):
        if row.profile is None or base.profile is None:
            out.append(Effect(cand, 0.0, 0.0, error=row.error or "failed"))
        else:
            out.append(Effect(cand, float(metric(base) - metric(row)), row.profile.step_ms - base.profile.step_ms))
    return out


def _greedy(effects: list[Effect], base_mem: float, base_t: float, target: float | None,
            max_t: float | None) -> list[Effect]:
    """Candidates to add, predicted by adding their measured savings and costs: taken in order of
    memory saved per millisecond, and again in order of memory saved, keeping the better pick
    (within the budget: the faster; otherwise: the smaller). One order alone fails on overlaps: a
    whole stage that saves the most loses to its cheap single blocks, or the reverse."""
    picks = []
    for order in ((lambda e: (-e.efficiency, -e.saving)), (lambda e: (-e.saving, e.cost))):
        chosen: list[Effect] = []
        mem, t = base_mem, base_t
        for e in sorted(effects, key=order):
            if target is not None and mem <= target:
                break
            if e.error or e.saving <= 0 or any(e.candidate.overlaps(c.candidate) for c in chosen):
                continue
            if max_t is not None and t + max(e.cost, 0) > max_t:
                continue
            chosen.append(e)
            mem -= e.saving
            t += e.cost
        picks.append((target is not None and mem > target, t if target is not None else mem, chosen))
    return min(picks, key=lambda p: p[:2])[2]


def autoplan(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    batch: Any,
    budget: Budget = None,
    max_slowdown: float | None = None,
    *,
    allow_lossy: bool = False,
    maximize: str = "speed",
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    device: str | torch.device | None = None,
    steps: int = 3,
    warmup: int = 2,
    rounds: int = 4,
    isolate_candidates: bool = False,
    cache: dict | None = None,
    progress: Progress | None = None,
) -> tuple[Plan, Report]:
    """Find, by measuring, the plan that fits ``budget`` with the least slowdown.

    Args:
        model_or_factory: a function returning a fresh model, or a model (copied, never changed).
        batch: as :func:`shrinkwrap.measure`.
        budget: bytes, a string such as ``"4GiB"``, or a fraction of the baseline (``0.5``). The
            memory is the CUDA peak, or without CUDA the bytes saved for backward.
        max_slowdown: the most step time allowed, as a multiple of the baseline's (``1.0``: no
            slower). Without a budget: the least memory within this limit.
        allow_lossy: also try lossy steps (``autocast(bfloat16)``).
        maximize: ``"speed"`` (default), or ``"batch"``: the largest batch (scaling ``batch`` along
            its first dimension) that fits ``budget`` with the least-memory plan within
            ``max_slowdown``.
        isolate_candidates: measure each candidate in its own process too. By default candidates
            are measured in this process (a fresh model each, caches emptied: seconds instead of
            a process start each), and every chosen plan in a fresh process on CUDA, so the
            figures autoplan answers with are isolated ones.
        cache: a dict to keep measurements in, keyed by plan text; pass the same dict to calls
            with the same model and batch (say ``max_slowdown=1.0`` then ``1.5``) to measure each
            candidate once.

    Returns ``(plan, report)``: the report lists the baseline, every candidate measured alone, the
    chosen plan's measurements and, in its notes, why each candidate was taken or left. A budget
    that cannot be reached is an answer, not an error: the notes say so and name the smallest
    memory found, which is the returned plan's.

    Example::

        >>> plan, report = sw.autoplan(make_model, batch, budget=0.6, max_slowdown=1.3)
        >>> print(report); sw.apply(model, plan)
    """
    if budget is None and max_slowdown is None:
        raise ValueError("shrinkwrap: autoplan needs a budget, a max_slowdown, or both")
    if maximize not in ("speed", "batch"):
        raise ValueError(f"shrinkwrap: maximize is 'speed' or 'batch', got {maximize!r}")
    if maximize == "batch" and budget is None:
        raise ValueError("shrinkwrap: maximize='batch' needs a budget")
    make = model_maker(model_or_factory, "autoplan()")
    options = dict(loss_fn=loss_fn, optimizer=optimizer, steps=steps, warmup=warmup, device=device)
    cache = {} if cache is None else cache

    dev = resolve_device(device)

    cuda = dev.type == "cuda"

    def measure(plans: list[Plan], isolate: bool) -> list[Row]:
        isolate = isolate and cuda  # a subprocess buys nothing without CUDA
        todo = [p for p in plans if (str(p), isolate) not in cache]
        if todo:
            rows = measure_plans(make, todo, batch, isolate=isolate, **options).rows
            cache.update({(str(p), isolate): row for p, row in zip(todo, rows)})
        return [dataclasses.replace(cache[str(p), isolate]) for p in plans]

    cands = candidates(make(), allow_lossy=allow_lossy, device=dev)
    whole = [c for c in cands if not c.covers]  # swish, bn_act, autocast: steps on the whole model
    if progress:
        progress(0, len(cands) + rounds, "baseline and candidates")
    # Candidates are compared with a baseline measured the same way (in this process unless asked
    # otherwise); the budget and the chosen plans with a baseline measured as the chosen plans are,
    # each in a fresh process on CUDA.
    base = measure([Plan()], True)[0]
    if base.profile is None:
        raise RuntimeError(f"shrinkwrap: the baseline itself could not be measured: {base.error}")
    report = Report([base], str(dev), device_name(dev), torch.__version__,
                    model=getattr(make, "__name__", type(make).__name__), batch=describe_batch(batch),
                    isolation="candidates in this process, the baseline and chosen plans in subprocesses"
                    if cuda and not isolate_candidates else "in subprocesses" if cuda else "in this process")
    metric = report.value
    base_mem, base_t = float(metric(base)), base.profile.step_ms
    target = parse_budget(budget, base_mem)
    max_t = None if max_slowdown is None else max_slowdown * base_t
    if target is not None and base_mem <= target and maximize == "speed":
        report.notes = [f"baseline: {base_mem / 2**20:.1f} MiB within the budget of {target / 2**20:.1f} MiB: "
                        "the empty plan"]
        return Plan(), report
    # Stage 1: each whole-model step alone. The best of them within the limits (bf16 autocast,
    # usually) form the base that every other candidate is then measured on top of, so that what
    # autocast does to a checkpoint's saving and cost is measured, not guessed.
    rows = measure([Plan()] + [Plan(c.steps) for c in whole], isolate_candidates)
    whole_effects = _effects(whole, rows[1:], rows[0], metric)
    # Predictions start from the isolated baseline and add the measured deltas: the limits are
    # isolated figures, and a baseline measured in this process can read higher or lower.
    in_base = _greedy(whole_effects, base_mem, base_t, None if maximize == "batch" else target, max_t)
    base_steps = tuple(s for e in in_base for s in e.candidate.steps)
    rest = [c for c in cands if all(c is not e.candidate for e in in_base)]
    # Stage 2: every other candidate on top of the base.
    on_base = measure([Plan(base_steps)] + [Plan(base_steps + c.steps) for c in rest], isolate_candidates)
    effects = _effects(rest, on_base[1:], on_base[0], metric)
    report.rows += [*rows[1:], *(on_base if base_steps else on_base[1:])]
    notes = [f"baseline: {base_mem / 2**20:.1f} MiB ({report.metric}), {base_t:.1f} ms per step"]
    if target is not None:
        notes.append(f"budget: {target / 2**20:.1f} MiB")
    if max_t is not None:
        notes.append(f"step-time limit: {max_t:.1f} ms ({max_slowdown}x the baseline)")

    fits = lambda row: row.profile is not None and (target is None or metric(row) <= target) and (  # noqa: E731
        max_t is None or row.profile.step_ms <= max_t)
    start_mem = base_mem - sum(e.saving for e in in_base)
    start_t = base_t + sum(e.cost for e in in_base)
    chosen = in_base + _greedy(effects, start_mem, start_t, None if maximize == "batch" else target, max_t)
    effects = in_base + effects
    tried: list[Row] = []
    dropped: list[Effect] = []
    for r in range(rounds):
        plan = _plan([e.candidate for e in chosen])
        if progress:
            progress(len(cands) + r, len(cands) + rounds, f"verify {plan}")
        row = measure([plan], True)[0]
        row.step = f"chosen (round {r + 1})"
        tried.append(row)
        if fits(row) or maximize == "batch":
            break
        # Refine: over the time limit -> drop the costliest, from what was measured on top of the
        # base first (the base is what those measurements assume); over budget -> add the next
        # candidate. What was dropped is not added back, so rounds cannot swing between two plans.
        if row.profile is not None and max_t is not None and row.profile.step_ms > max_t and chosen:
            pool = [e for e in chosen if e not in in_base] or chosen
            worst = max(pool, key=lambda e: e.cost)
            chosen.remove(worst)
            dropped.append(worst)
            continue
        rest = [e for e in effects if e not in chosen and e not in dropped]
        nxt = _greedy(rest, metric(row) if row.profile else base_mem, row.profile.step_ms if row.profile else base_t,
                      None, max_t)
        nxt = [e for e in nxt if not any(e.candidate.overlaps(c.candidate) for c in chosen)][:1]
        if not nxt:
            break
        chosen.append(nxt[0])

    for e in effects:
        where = "alone" if e in in_base or not base_steps else f"on top of {Plan(base_steps)}"
        why = ("taken" if e in chosen else "left") + f": {e.candidate} saves {e.saving / 2**20:.1f} MiB, " \
              f"{e.cost:+.1f} ms {where}"
        if e.error:
            why = f"left: {e.candidate} failed ({e.error})"
        elif e not in chosen and e.saving <= 0:
            why += " (saves nothing)"
        elif e not in chosen and any(e.candidate.overlaps(c.candidate) for c in chosen):
            why += " (covers modules a chosen candidate covers)"
        if e.candidate.lossy:
            why += " (lossy)"
        notes.append(why)
    # The fastest plan that fits a budget, the smallest that fits a time limit, else the smallest.
    ok = [r for r in tried if fits(r)]
    measured = [r for r in tried if r.profile is not None] or tried
    final = (min(ok, key=lambda r: r.profile.step_ms if target is not None else metric(r)) if ok
             else min(measured, key=lambda r: metric(r) if r.profile else math.inf))
    final_plan = Plan.parse(final.plan) if final.plan else Plan()
    if not fits(final):
        notes.append(
            f"no plan found within the limits; the smallest memory found is "
            f"{(metric(final) or 0) / 2**20:.1f} MiB at {final.profile.step_ms if final.profile else 0:.1f} ms, "
            f"with plan: {final_plan}")
    notes.append(f"plan: {final_plan}")
    report.rows += tried
    report.notes = notes
    if maximize == "batch":
        return final_plan, _largest_batch(make, final_plan, batch, target, report, options)
    return final_plan, report


def scale_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples: tensors are cut or repeated along their first dimension."""
    if isinstance(batch, torch.Tensor):
        reps = math.ceil(n / batch.shape[0])
        return batch.repeat(reps, *([1] * (batch.dim() - 1)))[:n]
    if isinstance(batch, dict):
        return {k: scale_batch(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(scale_batch(v, n) for v in batch)
    return batch


def _largest_batch(make: Callable[[], nn.Module], plan: Plan, batch: Any, target: float | None, report: Report,
                   options: dict, tries: int = 8) -> Report:
    first = next(_tensors(batch))
    lo, hi = 0, None
    n = first.shape[0]
    for _ in range(tries):
        row = measure_plans(make, [plan], scale_batch(batch, n), **options).rows[0]
        ok = row.profile is not None and target is not None and report.value(row) <= target
        row.step = f"batch {n}: {'fits' if ok else 'too large'}"
        report.rows.append(row)
        if ok:
            lo = n
            n = n * 2 if hi is None else (n + hi) // 2
        else:
            hi = n
            n = (lo + n) // 2
        if hi is not None and hi - lo <= max(1, lo // 16) or n <= 0:
            break
    report.notes.append(f"largest batch that fits the budget: {lo} (plan: {plan})" if lo else
                        "no batch size fits the budget with this plan")
    return report

