"""The compile stage's pieces: the compile step read from autoplan's argument, a plan's form
under the partitioner's memory budget (with a recomputed stem in its fast form), and plans
compiled ahead in processes side by side, each then measured there."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..compare import as_row, measure_row
from ..measuring.ratios import timed_against, within_slowdown
from ..measuring.profile import Options
from ..plan import Plan
from ..processes.copies import build_model
from ..report import Row
from ..select import lies_inside, pattern_for
from ..step import Step
from ..transforms.checkpoint import Checkpoint
from ..transforms.compile import PARTITIONING
from ..transforms.layout import ChannelsLast, SpaceToDepth
from .choose import _timing_decides

PARTITIONER_BUDGET = 0.6  # the compile stage's memory budget for the partitioner (see _budgeted)


def _compile_step(compile: bool | str) -> Plan | None:
    """``autoplan``'s ``compile`` argument as a plan of one compile step, read before anything is
    measured (a typo found after an hour of measuring would waste the hour)."""
    if compile is False:
        return None
    text = "compile()" if compile is True else compile
    plan = Plan.parse(text) if isinstance(text, str) else None
    if plan is None or len(plan) != 1 or plan.steps[0].name != "compile":
        raise ValueError(f"shrinkwrap: autoplan(compile=...) takes True or a compile step's text such as "
                         f"\"compile(mode='max-autotune')\"; got {compile!r}")
    return plan


def _budgeted(plan: Plan, step: Plan, model: nn.Module) -> Plan | None:
    """``plan`` without the steps that recompute (checkpoint, swish, bn_act, swiglu), compiled with
    the partitioner's memory budget, which then chooses the recompute itself; ``None`` where the
    compile step sets a budget already, its backend is not known to partition by one, or it
    compiles some modules only (``pattern``: outside them nothing would recompute). A step keeps
    what its :meth:`~shrinkwrap.step.Step.under_budget` says: a ResNet stem's chain region keeps
    its convolution, which the partitioner never recomputes.

    The partitioner's form can keep less than a compiled checkpoint plan at a faster step; its
    choice is not monotonic in the budget (lower budgets can keep more), so one budget, not a
    search over it (benchmarks/RESULTS.md, "Per model: plans beside what users do")."""
    (compile_step,) = step.steps
    if compile_step.memory_budget is not None or compile_step.backend not in PARTITIONING or compile_step.pattern:
        return None
    budgeted = dataclasses.replace(compile_step, memory_budget=PARTITIONER_BUDGET)
    kept = [s for s in (s.under_budget(model) for s in plan.steps) if s is not None]
    return Plan(_fast_stem(kept, model) + [budgeted])


def _every_block(plan: Plan, step: Plan, model: nn.Module, blocks: list[str]) -> Plan | None:
    """``plan`` with its regions replaced by ``blocks``, each a region of its own, and ``step``
    last: the one-line recipe (torch's ``checkpoint_wrapper`` on every block, compiled) as a plan,
    made for each grain of :func:`~shrinkwrap.select.blocks_by_depth` (a ConvNeXt's stages, then
    their blocks), so that the compile stage measures them beside its own answer and a stage is
    never the only grain on offer: on a transformer the recipe can beat an eager answer on both
    memory and time, on a ConvNeXt a compiled answer of whole stages (benchmarks/RESULTS.md,
    "autoplan on models it was not tuned on"). None where the regions do not apply."""
    every = Checkpoint(pattern_for(model, blocks))
    if not every.applies(model):
        return None
    kept = [s for s in plan.steps if not isinstance(s, Checkpoint)]
    return Plan(sorted([every, *kept], key=lambda s: s.order)) + step


def _fast_stem(steps: list[Step], model: nn.Module) -> list[Step]:
    """``steps``, with the stem convolutions that they recompute (``checkpoint('conv1')``) under
    ``channels_last()`` put first in the space-to-depth form (``space_to_depth('conv1')``): such a
    convolution runs twice, and that form is the faster at the same memory (benchmarks/RESULTS.md,
    resnet18's rows)."""
    regions = [n for s in steps if isinstance(s, Checkpoint) for n in s.targets(model).matched]
    if any(isinstance(s, SpaceToDepth) for s in steps) or not (
            regions and any(isinstance(s, ChannelsLast) for s in steps)):
        return steps
    try:
        stems = SpaceToDepth().targets(model).payload
    except (ValueError, TypeError):  # no stem convolution the form applies to
        return steps
    convs = [c for c in stems if any(lies_inside(c, r) for r in regions)]
    return [SpaceToDepth(pattern_for(model, convs)), *steps] if convs else steps


@dataclasses.dataclass
class _Ahead:
    """The compile stage's plans compiled ahead (:meth:`_Search.compile_ahead`): how many, how
    many at once, in how long, what failed there, how many were measured there, and what this
    process then compiled from the caches (AOTAutograd's, one per graph) for the others. Where
    they were measured there: the seconds until every plan had compiled, each plan's first
    iterations (its compilation), and each one's turn (its row, and its timing in turns)."""

    plans: int
    at_once: int
    seconds: float
    errors: list[str]
    compiling: float | None = None
    first: list[float] = dataclasses.field(default_factory=list)
    cached: tuple[int, ...] = ()  # graphs the processes ahead compiled from the on-disk caches, and anew
    turns: list[tuple[float, float | None]] = dataclasses.field(default_factory=list)  # (row s, timing s or None)
    hits: int = 0
    misses: int = 0

    @property
    def measured(self) -> int:
        """How many plans were measured where they compiled (one turn each)."""
        return len(self.turns)


@dataclasses.dataclass(frozen=True)
class _Turn:
    """What a process ahead does once every plan has compiled, one process at a time
    (:func:`~shrinkwrap.processes.compile_ahead`'s ``then`` and ``after``): :meth:`row`, then in a
    second turn, least memory first, :meth:`timed`. Plain values, sent to the processes: how rows
    are read (``metric``), the step-time limit (``slowdown``, None: none, and its ``tolerance``),
    the budget (``target``), and where the answer is the least memory within the limits, what the
    rows already within them read (``within``; None where the answer is the fastest plan within
    the budget: every plan within it is timed).

    The plan's graphs compiled there already: neither the row nor the timing compiles them again
    (dynamo traces the new model from the process's own caches), so the row's first iteration is
    a steady one, not a compilation. Measured in the autoplan process instead, each plan is
    compiled a second time from the on-disk caches (what that costs: docs/architecture.md,
    "autoplan's processes")."""

    metric: Callable[[Row], Any]
    slowdown: float | None
    tolerance: float
    target: float | None
    within: tuple[float, ...] | None

    def row(self, make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options) -> tuple[tuple, float]:
        """``plan``'s row as a fresh process measures it (:func:`~shrinkwrap.compare.measure_row`), with
        the seconds it took and what it reads; and what it reads again, the key of the second
        turns (a row without a figure last)."""
        started = time.perf_counter()
        result, matched, skipped = measure_row(make, plan, batch, options, None, keep_going=True)
        mem = self.metric(as_row(plan, result, matched, skipped, "compiled"))
        return (result, matched, skipped, time.perf_counter() - started, mem), math.inf if mem is None else float(mem)

    def timed(self, make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options, first: tuple,
              before: list[float]) -> tuple[tuple, float]:
        """The second turn: ``plan`` timed in turns with the baseline (a few seconds, against a
        compilation where the autoplan process times it), unless its row decides nothing by its
        time (:func:`~.choose._timing_decides`): no figure, over the budget, or outdone by a row
        within the limits, measured before or timed in a turn ``before`` this one. Returns the row, the
        timings (None: not timed) and the seconds of each turn, as :meth:`_Search.compiled` reads
        them; and, where the answer is the least memory within the limits, what this plan reads
        if it is now within them (else infinity)."""
        result, matched, skipped, row_s, mem = first
        started = time.perf_counter()
        timings = None
        if self.slowdown is not None and _timing_decides(mem, self.target,
                                                         None if self.within is None else [*self.within, *before]):
            device = torch.device(options.device)
            timings = timed_against(build_model(make, device, Plan()), build_model(make, device, plan), batch, options,
                                    self.slowdown, self.tolerance)
        within = timings is not None and self.within is not None and \
            within_slowdown(*timings, self.slowdown, self.tolerance)
        seconds = (row_s, None if timings is None else time.perf_counter() - started)
        return (result, matched, skipped, timings, seconds), mem if within else math.inf

