"""Auto-plan: the plan that fits a memory budget at the highest speed, found by measuring.

The usual advice — "measure the effect at various levels and locations, then choose a set of
checkpointed modules so that you fit within your memory budget but incur the smallest throughput
impact" — done for the user, in stages, each a function below:

1. Candidates come from the steps themselves (:meth:`shrinkwrap.step.Step.candidates`), found in
   the module tree, not in a list of model names: checkpoint regions over stages and groups of
   blocks, ``swish()`` and ``bn_act()`` where they apply, ``autocast(bfloat16)`` when lossy
   steps are allowed and the device runs bfloat16.
2. Each whole-model step (swish, bn_act, autocast) is measured alone against the baseline; the
   best of them within the limits (chosen as in 3.) form a base, and every other candidate is
   measured on top of it (on CUDA the peak and step time; without CUDA the bytes saved for
   backward and step time). A region's recompute is priced by its forward time on the base,
   every module timed in the same iterations (one row per region is noisier than the recompute),
   times the median of what the regions' rows read over their forwards.
3. The set of candidates is chosen exactly over what was measured (branch and bound): the fastest
   set predicted to fit the budget, or the smallest within the time limit; candidates that cover
   the same modules exclude each other. A plan over the time limit in step 4 scales every
   region's price by what its own recompute took over its forward, and the search runs again.
4. The chosen plan is measured in this process, and where it fits there, in a fresh process (the
   baseline too, unless it was measured first in this process with nothing else on the GPU); where
   it misses the budget or the slowdown limit (savings and costs do not add exactly) it is
   refined — one more candidate, or the costliest dropped, base steps last — and measured again.
   Without a budget, a plan within the time limit is grown from its own measured time while
   rounds are left (a candidate's single row can overstate its cost).
5. With ``compile``, the verified plan and the smallest set measured are measured again with
   ``compile()`` as their last step, in this process, and the verified plan without its recompute
   steps with ``compile(memory_budget=0.6)``, where the compiler's partitioner chooses what to
   recompute; the best of every plan measured wins. Three compilations, not one per candidate:
   compiled, every plan runs faster than eager, so the smallest set usually fits a step-time
   limit that it missed eager. With inductor the plans are first compiled side by side in fresh
   processes, whose work this process then takes from the compiler's on-disk caches.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import re
import statistics
import time
from typing import Any, Callable, Iterator, Union

import torch
import torch.nn as nn

from ._tree import tensors, tree_map
from .compare import Progress, describe_batch, measure_plans
from .fit import ITERATIONS, Probe, trains_under
from .processes import FreshProcesses, _build, _Copies, _unsendable, compile_ahead, model_maker
from .measure.step import (LossFn, OptimizerFactory, Options, Timing, device_name, forward_times, resolve_device,
                           time_interleaved)
from .plan import Plan
from .report import Report, Row
from .select import pattern_for
from .step import Candidate, Context, Step, _inside, registered
from .transforms.checkpoint import Checkpoint
from .transforms.compile import PARTITIONING
from .transforms.layout import ChannelsLast, SpaceToDepth

Budget = Union[int, float, str, None]
SAME_MEMORY = 0.02  # plans whose memory differs by less are alike in it: the faster is the answer
PARTITIONER_BUDGET = 0.6  # the compile stage's memory budget for the partitioner (see _budgeted)
CONFIDENCE = 0.8  # a step-time limit is decided once the ratio's interval of this confidence is on one side,
MAX_ROUNDS = 15  # or after this many rounds in turns, by the median
CAP_TRIES = 3  # plans trained under the budget's cap before autoplan answers with none that trained
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclasses.dataclass
class Effect:
    """A candidate measured alone: bytes saved and milliseconds added against the baseline."""

    candidate: Candidate
    saving: float
    cost: float
    error: str | None = None
    priced_by_forward: bool = False  # cost is the region's forward time (scaled as verification learns)

    @property
    def efficiency(self) -> float:
        if self.saving <= 0:
            return -math.inf
        return math.inf if self.cost <= 0 else self.saving / self.cost


def parse_budget(budget: Budget, baseline: float) -> float | None:
    """Bytes from an int (``8_000_000_000``) or a size with its unit (``"8GiB"``, ``"500MB"``, ``"100B"``),
    or a fraction of ``baseline`` from a number in (0, 1] (``0.5``, ``"0.5"``). A number above 1
    without a unit (``1.5``, ``"1.5"``) is refused: as bytes it would be nothing, as a fraction
    more than the baseline; the message names both readings."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"shrinkwrap: a budget is bytes (an int, or text such as '8GiB') or a fraction of the "
                        f"baseline (0.5); got {budget!r}")
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]i?b|b)?\s*", budget.lower())
        if not m:
            raise ValueError(f"shrinkwrap: cannot read budget {budget!r}; write e.g. '4GiB', '500MB' or 0.5")
        if m.group(2):
            return float(m.group(1)) * _UNITS[m.group(2)]
        budget = float(m.group(1))
    if budget <= 0:
        raise ValueError(f"shrinkwrap: a budget must be positive, got {budget!r}")
    if isinstance(budget, float):
        if budget > 1:
            raise ValueError(f"shrinkwrap: budget {budget!r} has no unit: a fraction of the baseline's memory is at "
                             f"most 1, and bytes need a unit: write e.g. '{budget:g}GiB', or 0.5 for half the baseline")
        return budget * baseline
    return float(budget)


# -- candidates -------------------------------------------------------------------------------------
def candidates(model: nn.Module, *, allow_lossy: bool = False, device: str | torch.device | None = None,
               max_groups: int = 4) -> list[Candidate]:
    """What autoplan may try on ``model``: every registered step's candidates, in plan order."""
    context = Context(allow_lossy, resolve_device(device), max_groups)
    return [c for cls in registered() for c in cls.candidates(model, context)]


def _plan(chosen: list[Candidate], model: nn.Module) -> Plan:
    """The candidates' steps, merged by their class (regions by name become one regex), in the
    order each step class says (checkpoints first, precision last)."""
    steps = [s for c in chosen for s in c.steps]
    classes = registered()
    merged = [m for cls in classes for m in cls.merge([s for s in steps if type(s) is cls], model)]
    return Plan(sorted(merged + [s for s in steps if type(s) not in classes], key=lambda s: s.order))


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


def _search(effects: list[Effect], base_mem: float, base_t: float, target: float | None,
            max_t: float | None, speedups: bool = True) -> list[Effect]:
    """The set of candidates to add, predicted by adding their measured savings and costs, that is
    best exactly (branch and bound over every set whose candidates cover no module twice):

    - with a ``target``: the fastest set within it (and within ``max_t``); where no set within
      ``max_t`` reaches the target, the fastest that does, whatever its time; where none does,
      the smallest within ``max_t``;
    - without: the smallest within ``max_t``, the faster of equals.

    A candidate that saves no memory but runs faster (``channels_last()``) is in the search too:
    the time it wins pays for a checkpoint that would not fit the limit otherwise; not with
    ``speedups=False`` (a CPU, where the memory is the bytes saved for backward and a step's
    time is not the GPU's: a faster row there is noise, not a reason to take a step).

    Greedy orders miss sets that exist: a whole stage that saves the most shuts out the groups
    that, together, fit the budget faster.
    """
    # A candidate that saves nothing but runs faster (channels_last) buys time for others.
    usable = sorted((e for e in effects if not e.error and (e.saving > 0 or (speedups and e.cost < 0))),
                    key=lambda e: -e.saving)
    n = len(usable)
    save_left = [sum(max(e.saving, 0.0) for e in usable[i:]) for i in range(n + 1)]
    gain_left = [sum(min(e.cost, 0.0) for e in usable[i:]) for i in range(n + 1)]  # time it could still win back

    def key(mem: float, t: float) -> tuple:
        if target is not None and mem <= target:
            return (0, t, mem)
        return (1, mem, t)

    best: list = [key(base_mem, base_t) if max_t is None or base_t <= max_t else (2,), []]

    def visit(i: int, mem: float, t: float, chosen: list[Effect]) -> None:
        if (max_t is None or t <= max_t) and key(mem, t) < best[0]:
            best[:] = [key(mem, t), list(chosen)]
        if i == n:
            return
        lowest_mem, lowest_t = mem - save_left[i], t + gain_left[i]
        if max_t is not None and lowest_t > max_t:
            return
        if best[0][0] == 0 and (lowest_mem > target or lowest_t >= best[0][1]):
            return  # a set within the budget is known: only a faster one within it can beat it
        # (a set as small as the best but faster still wins: a candidate that only saves time)
        if best[0][0] == 1 and (target is None or lowest_mem > target) and (lowest_mem, lowest_t) >= best[0][1:]:
            return
        e = usable[i]
        if not any(e.candidate.overlaps(c.candidate) for c in chosen):
            visit(i + 1, mem - e.saving, t + e.cost, chosen + [e])
        visit(i + 1, mem, t, chosen)

    visit(0, base_mem, base_t, [])
    if target is not None and max_t is not None and best[0][0] != 0:
        # No set within both limits: one within the budget, however slow, before one within the time
        # limit over it (over the budget the run fails; over the time limit it runs slower).
        relaxed = _search(effects, base_mem, base_t, target, None, speedups)
        if base_mem - sum(e.saving for e in relaxed) <= target:
            return relaxed
    return best[1]


def paired_ratio(baseline: Timing, plan: Timing) -> tuple[float, float]:
    """``plan``'s step time as a multiple of ``baseline``'s, and the spread of that ratio.

    Timed in turns, round i of the plan and of the baseline ran side by side: the ratio is the
    median of the rounds' ratios (drift falls on both alike), and its spread their range over the
    ratio, without the highest and the lowest where there are five rounds or more, so that one
    hiccup of the shared GPU is not taken for noise. Timings of unequal rounds: the medians' ratio
    and the wider of their spreads."""
    ratios = _round_ratios(baseline, plan)
    if ratios is None:
        return plan.median / baseline.median, max(baseline.spread, plan.spread)
    ratio = statistics.median(ratios)
    kept = ratios[1:-1] if len(ratios) >= 5 else ratios
    return ratio, (kept[-1] - kept[0]) / ratio


def _round_ratios(baseline: Timing, plan: Timing) -> list[float] | None:
    """The rounds' ratios plan/baseline, sorted; None for timings of unequal rounds (not paired)."""
    if len(baseline.rounds_ms) != len(plan.rounds_ms):
        return None
    return sorted(p / b for p, b in zip(plan.rounds_ms, baseline.rounds_ms))


def ratio_interval(baseline: Timing, plan: Timing, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``plan``'s step time as a multiple of ``baseline``'s (the median of the rounds' ratios, as
    :func:`paired_ratio`), with an interval that holds the true median with at least
    ``confidence``, whatever the rounds' distribution: the k-th lowest and k-th highest ratio, k as
    large as the binomial distribution allows (5 rounds: their whole range; 10: the 3rd to the 8th;
    15: the 5th to the 11th; fewer than 4 rounds reach 80% with no k). It narrows as rounds are
    added, which a spread of the rounds does not. Timings of unequal rounds: the medians' ratio,
    +- half the wider of their spreads.

    Example::

        >>> ratio_interval(Timing((10.0,) * 5), Timing((10.5, 10.2, 10.4, 10.3, 13.0)))
        (1.04, 1.02, 1.3)
    """
    ratios = _round_ratios(baseline, plan)
    if ratios is None:
        ratio, half = plan.median / baseline.median, max(baseline.spread, plan.spread) / 2
        return ratio, ratio * (1 - half), ratio * (1 + half)
    n, k = len(ratios), 1
    while k < (n + 1) // 2 and 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n >= confidence:
        k += 1
    return statistics.median(ratios), ratios[k - 1], ratios[n - k]


def within_slowdown(baseline: Timing, plan: Timing, max_slowdown: float, tolerance: float = 0.03) -> bool:
    """Whether ``plan`` runs within ``max_slowdown`` times ``baseline``'s step time (``tolerance``
    over it still counts as within), both timed in turns: decided on the median of the rounds'
    ratios. Whether that median can be trusted is :func:`slowdown_decided`'s question; autoplan
    times more rounds until it can, and says when it could not.

    Example::

        >>> within_slowdown(Timing((10.0, 10.2)), Timing((10.3, 10.4)), 1.0)   # 1.025x: within 3%
        True
    """
    return ratio_interval(baseline, plan)[0] <= max_slowdown * (1 + tolerance)


def slowdown_decided(baseline: Timing, plan: Timing, max_slowdown: float, tolerance: float = 0.03) -> bool:
    """Whether the rounds so far decide :func:`within_slowdown` beyond the noise: the interval of
    :func:`ratio_interval` lies wholly within the limit or wholly over it (never with fewer than
    four paired rounds, whose widest interval holds the median with less than 80%). On an H100,
    five rounds of resnet152 in turns gave ratios spread over 36%: a plan at 1.108x by its median
    was taken as within a 1.0x limit, since the old rule let half the spread excuse it."""
    if len(baseline.rounds_ms) == len(plan.rounds_ms) < 4:
        return False
    _, low, high = ratio_interval(baseline, plan)
    limit = max_slowdown * (1 + tolerance)
    return high <= limit or low > limit


class _Rows:
    """Measured rows, each plan measured once (keyed by its text and whether it ran isolated).

    Rows in this process are built from copies of one model the factory made (on an H100,
    building a random-initialised bert took 1.7 of the 4.2 s each candidate row took) and skip
    the per-module log; isolated rows run in fresh processes, the chosen plan's started while
    this process measures the candidates (see :class:`FreshProcesses`)."""

    def __init__(self, make: Callable[[], nn.Module], model: nn.Module, batch: Any, options: Options, cuda: bool,
                 cache: dict, warmup: int | None = None) -> None:
        self.make, self.batch, self.options, self.cuda, self.cache = make, batch, options, cuda, cache
        self.warmup = warmup
        self.local = _copies_of(make, model)
        # The model to read names from: the copy kept on the CPU, where there is one, so that the
        # factory's model, which may be on the GPU, can go (it is never moved: a factory may hand
        # out one shared model).
        self.probe = self.local.model if isinstance(self.local, _Copies) and self.local is not make else model
        self.fresh = FreshProcesses(make, sorted({type(m).__module__ for m in model.modules()}))
        self.measured_here = False  # whether a row has run in this process

    def options_for(self, plan: Plan) -> Options:
        """The options ``plan``'s rows are measured and timed with. Unless the caller set ``warmup``:
        one warm-up iteration for an eager plan, whose first iteration makes what the optimizer
        keeps, so that the second, the one measured, is steady (a CUDA test checks that its peak is
        two warm-ups' to the byte); two for a compiled plan, which dynamo may compile again on its
        second call. One iteration less per candidate: on an H100, resnet152's 33 candidates ran
        6 iterations each of about 0.1 s."""
        if self.warmup is not None:
            return dataclasses.replace(self.options, warmup=self.warmup)
        compiled = any(s.name == "compile" for s in plan.steps)
        return dataclasses.replace(self.options, warmup=2 if compiled else 1)

    def untouched(self) -> bool:
        """Whether nothing of this process is on the GPU: CUDA not started, or nothing allocated
        (a factory that builds on the GPU starts CUDA; the copies are on the CPU and its model
        is let go). A process that has run a matmul holds cuBLAS workspaces, and a caller's
        tensors count too."""
        if not self.cuda or not torch.cuda.is_initialized():
            return self.cuda
        if torch.cuda.memory_allocated(self.options.device):
            gc.collect()  # a model in a reference cycle waits for the collector
        return torch.cuda.memory_allocated(self.options.device) == 0

    def __call__(self, plans: list[Plan], isolate: bool) -> list[Row]:
        isolate = isolate and self.cuda  # a subprocess buys nothing without CUDA
        todo = [p for p in plans if (str(p), isolate) not in self.cache]
        empty = next((p for p in todo if not p.steps), None)
        if isolate and empty is not None and not self.measured_here and self.untouched():
            # The baseline, before any row in this process and with nothing of it on the GPU: it
            # sees what a fresh process would (every byte of its peak its own), without the 12-20
            # s a process takes to start (bert on an H100). The row serves both keys.
            row = measure_plans(self.local, [empty], self.batch, self.options_for(empty), isolate=False,
                                keep_going=True).rows[0]
            self.cache[str(empty), True] = self.cache[str(empty), False] = row
            self.measured_here = True
            todo.remove(empty)
        for plan in todo:
            if isolate:
                row = measure_plans(self.make, [plan], self.batch, self.options_for(plan), isolate=True,
                                    keep_going=True, processes=self.fresh).rows[0]
            else:
                row = self._here(plan)
            self.cache[str(plan), isolate] = row
        return [dataclasses.replace(self.cache[str(p), isolate]) for p in plans]

    def model(self, plan: Plan) -> nn.Module:
        """A copy of the model on the device, with ``plan`` applied: what this process runs."""
        return _build(self.local, resolve_device(self.options.device), plan)

    def warm_up(self, plan: Plan) -> None:
        """Run ``plan`` for a few iterations in this process, unless its row ran here already:
        what its layout and types use first (cuDNN's choice of kernels) is then not in its row.
        On an H100 the first efficientnet_b0 row with ``channels_last(), autocast(bf16)`` in a
        process stepped in 48 ms and the next in 39 ms (its first step took 14.5 s: cuDNN's first
        use of that layout and type); measured cold, the base read slow, and every candidate on
        top of it read faster than it, down to -17 ms, so the search took them all. resnet18's
        first ``autocast(bf16)`` row read +31.6 ms over a 28 ms baseline, and the search left it."""
        if (str(plan), False) not in self.cache:
            self.measured_here = True
            try:
                time_interleaved({"warm-up": self.model(plan)}, self.batch, self.options_for(plan), rounds=1,
                                 per_round=2)
            except Exception:  # noqa: BLE001 - the plan's row records what failed, as a row and a note
                pass

    def _here(self, plan: Plan) -> Row:
        """``plan``'s row in this process, on a copy of the model, without the per-module log."""
        options = dataclasses.replace(self.options_for(plan), module_log=False)
        self.measured_here = True
        return measure_plans(self.local, [plan], self.batch, options, isolate=False, keep_going=True).rows[0]

    def forward_ms(self, plan: Plan) -> dict[str, float]:
        """Each module's forward time under ``plan`` in this process (:func:`forward_times`), or
        nothing where the plan cannot run."""
        self.measured_here = True
        try:
            return forward_times(self.model(plan), self.batch, self.options_for(plan))
        except Exception:  # noqa: BLE001 - the base's row records what failed; regions are then priced by their rows
            return {}

    @property
    def baseline_here(self) -> bool:
        """Whether the isolated baseline was measured in this process (by this call or an earlier
        one that shared the cache): the one row that serves both keys."""
        row = self.cache.get(("", True))
        return row is not None and row is self.cache.get(("", False))

    def close(self) -> None:
        self.fresh.close()


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """The objects alive when autoplan starts set aside from the garbage collector meanwhile
    (``gc.freeze``): every row empties the CUDA cache after a full collection, in case cycles
    hold tensors, and in a process that has imported transformers a full collection took 0.3 s
    on an H100 machine, 18 of the 40 s bert's candidates took. What a row leaves behind is made
    after the start, so it is still collected. Everything frozen is unfrozen at the end, what the
    caller may have frozen before too (Python 3.12 starts with objects frozen): back in the oldest
    generation, collected as usual; only a process that froze objects to keep memory pages shared
    with its forks would notice."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _isolation(rows: _Rows, isolate_candidates: bool) -> str:
    """Where the report's rows were measured, for its header."""
    if not rows.cuda:
        return "in this process"
    where = "in subprocesses" if isolate_candidates else "candidates in this process, chosen plans in subprocesses"
    return where + ("; the baseline first in this process, with nothing else on the GPU" if rows.baseline_here
                    else "; the baseline in a subprocess")


def _copies_of(make: Callable[[], nn.Module], model: nn.Module) -> Callable[[], nn.Module]:
    """Fresh models for rows in this process: copies of ``model``, new from ``make`` and untouched,
    kept on the CPU; ``make`` itself where the model cannot be copied."""
    if isinstance(make, _Copies):
        return make
    try:
        return _Copies(copy.deepcopy(model).to("cpu"))
    except Exception:  # noqa: BLE001 - deepcopy fails in many ways (locks, open files, C handles)
        return make


@dataclasses.dataclass
class _Ahead:
    """The compile stage's plans compiled ahead (:meth:`_Search.compile_ahead`), and what this
    process then compiled from the caches (AOTAutograd's, one per graph)."""

    plans: int
    at_once: int
    seconds: float
    errors: list[str]
    hits: int = 0
    misses: int = 0


def _cache_counts() -> tuple[int, int]:
    """AOTAutograd's cache hits and misses so far in this process (a graph compiled from the
    caches or anew)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]


@dataclasses.dataclass
class _Search:
    """What the stages share: how to measure, the limits, and the baseline they are read against."""

    rows: _Rows
    model: nn.Module  # one fresh model, to read names from (plans are measured on others)
    metric: Callable[[Row], Any]
    base_mem: float
    base_t: float
    target: float | None
    max_t: float | None
    isolate_candidates: bool
    by_memory: bool  # maximize="batch": the least memory within max_t, whatever the budget
    max_slowdown: float | None = None
    tolerance: float = 0.03
    ratios: dict = dataclasses.field(default_factory=dict)  # plan text -> (baseline, plan) Timings
    sets: dict = dataclasses.field(default_factory=dict)  # verified plan text -> the Effects it was made of
    ahead: _Ahead | None = None  # the compile stage's plans compiled ahead

    def fits_time(self, row: Row) -> bool:
        """Within the step-time limit: for a chosen plan, timed in turns with the baseline in one
        process, as many rounds as the decision needed (:func:`within_slowdown`); else by its own
        median, with the tolerance."""
        if self.max_t is None:
            return True
        timings = self.ratios.get(str(row.plan))
        if timings is not None:
            return within_slowdown(*timings, self.max_slowdown, self.tolerance)
        return row.profile is not None and row.profile.step_ms <= self.max_t * (1 + self.tolerance)

    def fits(self, row: Row) -> bool:
        return row.profile is not None and (self.target is None or self.metric(row) <= self.target) and self.fits_time(row)

    def holds(self, row: Row) -> bool:
        """Whether ``row`` meets the limit that comes first where no plan meets both: the budget
        (over it the run fails; over the time limit it runs slower), or the time limit where there
        is no budget, or with ``maximize="batch"``, whose batch size meets the budget later."""
        if row.profile is None:
            return False
        if self.target is None or self.by_memory:
            return self.fits_time(row)
        return self.metric(row) <= self.target

    def time_against_baseline(self, plan: Plan) -> None:
        """Time ``plan`` and the baseline in turns in this process: the ratio a step-time limit is
        decided on (times from separate processes drift 10-20% on a shared GPU)."""
        if self.max_t is None or str(plan) in self.ratios:
            return
        models = {"baseline": self.rows.model(Plan()), "plan": self.rows.model(plan)}
        timings = time_interleaved(
            models, self.rows.batch, self.rows.options_for(plan), rounds=5, per_round=self.rows.options.iterations,
            until=lambda t: slowdown_decided(t["baseline"], t["plan"], self.max_slowdown, self.tolerance),
            max_rounds=MAX_ROUNDS)
        self.ratios[str(plan)] = (timings["baseline"], timings["plan"])

    def measure_chosen(self, plan: Plan, isolate: bool = True) -> Row:
        """A plan autoplan may answer with: measured in a fresh process (on CUDA, unless ``isolate``
        is false), and where it fits the budget, timed in turns with the baseline for the
        step-time limit."""
        row = self.rows([plan], isolate)[0]
        if row.profile is not None and (self.target is None or self.metric(row) <= self.target):
            self.time_against_baseline(plan)
        return row

    def search(self, effects: list[Effect], mem: float, t: float, target: float | None = None) -> list[Effect]:
        return _search(effects, mem, t, target, self.max_t, self.speedups)

    @property
    def speedups(self) -> bool:
        """Whether a candidate that saves nothing may be taken for its time: on CUDA (see :func:`_search`)."""
        return getattr(self.rows, "cuda", True)

    def base(self, whole: list[Candidate]) -> tuple[list[Effect], list[Row], Row]:
        """Stage 1: each whole-model step alone; the best of them within the limits (bf16 autocast,
        usually) form the base that every other candidate is then measured on top of, so that what
        autocast does to a checkpoint's saving and cost is measured, not guessed. Returns the
        chosen effects, the rows, and the baseline measured as the candidates are."""
        if self.rows.cuda and not self.isolate_candidates:
            for c in whole:
                self.rows.warm_up(Plan(c.steps))
        rows = self.rows([Plan()] + [Plan(c.steps) for c in whole], self.isolate_candidates)
        effects = _effects(whole, rows[1:], rows[0], self.metric)
        # Predictions start from the isolated baseline and add the measured deltas: the limits are
        # isolated figures, and a baseline measured in this process can read higher or lower.
        chosen = self.search(effects, self.base_mem, self.base_t, None if self.by_memory else self.target)
        return chosen, rows[1:], rows[0]

    def on_top(self, base_steps: tuple, rest: list[Candidate], baseline: Row
               ) -> tuple[list[Effect], list[Row], float, float, dict[str, float]]:
        """Stage 2: the base measured as a whole (steps that absorb each other, swish and bn_act,
        save less together than their sum), and every other candidate measured on top of it.
        Returns the effects, the rows, the base's predicted memory and time, and each module's
        forward time on the base (what recomputing it costs: see :func:`_priced`)."""
        if base_steps and self.rows.cuda and not self.isolate_candidates:
            self.rows.warm_up(Plan(base_steps))  # every candidate is read against the base's row
        rows = self.rows([Plan(base_steps)] + [Plan(base_steps + c.steps) for c in rest], self.isolate_candidates)
        base = rows[0]
        if base.profile is None or baseline.profile is None:
            mem, t = self.base_mem, self.base_t
        else:
            mem = self.base_mem + self.metric(base) - self.metric(baseline)
            t = self.base_t + base.profile.step_ms - baseline.profile.step_ms
        forward = self.rows.forward_ms(Plan(base_steps)) if any(c.covers for c in rest) else {}
        return _effects(rest, rows[1:], base, self.metric), (rows if base_steps else rows[1:]), mem, t, forward

    def measured_t(self, row: Row, upper: bool = False) -> float:
        """A chosen plan's step time as the limit is decided on it: the baseline's times its ratio
        timed in turns with it (``upper``: the top of the ratio's interval, what the plan takes at
        most, with :data:`CONFIDENCE`), or else its row's own."""
        timings = self.ratios.get(str(row.plan))
        if timings is None:
            return row.profile.step_ms
        ratio, _, high = ratio_interval(*timings)
        return (high if upper else ratio) * self.base_t

    def verify(self, chosen: list[Effect], in_base: list[Effect], effects: list[Effect], rounds: int,
               progress: Progress | None, done: int, start: tuple[float, float] | None = None) -> list[Row]:
        """Stage 4: measure the chosen plan, in this process and, where it fits there, in a fresh
        one; refine where it misses.

        - Over the time limit: the candidates' costs were read from one row each, and the chosen
          ones partly because their rows read cheap. What the plan took beyond its prediction
          (from ``start``, the base's predicted memory and time) raises the costs
          (:func:`_raised`: every region priced by its forward time scaled alike, or else a
          share for each candidate chosen on top of the base), and the search runs again: on an H100,
          resnet152's first plan for a 1.5x limit timed 2.59x, and dropping the costliest
          candidate one round at a time still left 1.67x after four rounds. Where that finds
          nothing new, the costliest is dropped (what was measured on top of the base first:
          the base is what those measurements assume).
        - Over budget: the next candidates are added.
        - Without a budget (the least memory within the time limit), a plan that fits is grown
          while rounds are left: the smallest set of what is left, predicted from the plan's own
          measured time (the top of its ratio's interval, where it was timed in turns), is
          added, since the prices may have overstated the cost; the smallest plan that fitted
          is then the one measured fresh.

        Costs are only raised, what was dropped is not added back, and a plan is not grown back
        into a set that was measured over the time limit, so rounds cannot swing between two
        plans; a plan is measured once."""
        tried: list[Row] = []
        dropped: list[Effect] = []
        over: list[frozenset[str]] = []  # what the plans measured over the time limit covered (_covered)
        grow = self.target is None and not self.by_memory and self.max_t is not None
        start_mem, start_t = (self.base_mem, self.base_t) if start is None else start
        for r in range(rounds):
            plan = _plan([e.candidate for e in chosen], self.model)
            self.sets.setdefault(str(plan), list(chosen))
            if progress:
                progress(done + r, done + rounds, f"verify {plan}")
            # Refined in this process (seconds: a copy of the model), answered from a fresh one (on
            # an H100, 12 s a resnet152 row, most of it the process's start and first kernels).
            row = self.measure_chosen(plan, isolate=False)
            # Grown into the room the plan surely leaves: its row's own time, or even its median in
            # turns, left resnet152 room at 1.013x a 1.0x limit, and three grown plans went over it.
            nxt = self.search(self._rest(effects, chosen, dropped), self.metric(row), self.measured_t(row, upper=True)) \
                if grow and self.fits(row) and r + 1 < rounds else []
            if any(slow <= _covered(chosen + nxt) for slow in over):
                nxt = []  # back into a set already over the time limit (more recompute only adds time)
            if not nxt and (self.fits(row) or self.by_memory):
                row = self.measure_chosen(plan)
            row.role, row.round = "chosen", r + 1
            tried.append(row)
            if nxt:
                chosen += nxt
                continue
            if self.fits(row) or self.by_memory:
                break
            if row.profile is not None and not self.fits_time(row) and chosen:
                over.append(_covered(chosen))
                extra = [e for e in chosen if e not in in_base]
                excess = self.measured_t(row) - start_t - sum(e.cost for e in extra)
                if extra and excess > 0:
                    raised = _raised(effects, extra, excess)
                    effects = [raised.get(id(e.candidate), e) for e in effects]
                    chosen = [raised.get(id(e.candidate), e) for e in chosen]
                    again = in_base + self.search(_without(effects, in_base + dropped), start_mem, start_t,
                                                  None if self.by_memory else self.target)
                    if _plan([e.candidate for e in again], self.model) not in {t.plan for t in tried}:
                        chosen = again
                        continue
                pool = [e for e in chosen if e not in in_base] or chosen
                worst = max(pool, key=lambda e: e.cost)
                chosen.remove(worst)
                dropped.append(worst)
                continue
            # Over budget: the best set of what is left that covers nothing chosen, from the verified figures.
            mem = self.metric(row) if row.profile else self.base_mem
            nxt = self.search(self._rest(effects, chosen, dropped), mem,
                              row.profile.step_ms if row.profile else self.base_t,
                              None if self.by_memory else self.target)
            if not nxt:
                break
            chosen += nxt
        return self._fresh_answer(tried)

    @staticmethod
    def _rest(effects: list[Effect], chosen: list[Effect], dropped: list[Effect]) -> list[Effect]:
        """The candidates not chosen, not dropped, and covering nothing chosen."""
        return [e for e in _without(effects, chosen + dropped)
                if not any(e.candidate.overlaps(c.candidate) for c in chosen)]

    def _fresh_answer(self, tried: list[Row]) -> list[Row]:
        """``tried`` with the answer's figures from a fresh process: a grown plan that fitted,
        followed by a larger one that did not, was measured in this process only (measured fresh
        now); one measured again after a drop has both rows (the fresh one kept). A fresh row
        that no longer fits (its process read more than this one) hands the answer on to the
        next best plan, which is measured fresh in turn: each plan once, so this ends. An answer over
        the time limit but within the budget (:meth:`holds`) is measured fresh too."""
        done: set[str] = set()
        while self.rows.cuda:
            best = self.final(tried)
            if not self.holds(best) or str(best.plan) in done:
                break
            done.add(str(best.plan))
            fresh = self.measure_chosen(best.plan)  # from the cache where it was measured fresh already
            fresh.role, fresh.round = "chosen", best.round
            last = max(i for i, r in enumerate(tried) if r.plan == best.plan)
            tried = [fresh if i == last else r for i, r in enumerate(tried) if r.plan != best.plan or i == last]
        return tried

    def compiled(self, tried: list[Row], effects: list[Effect], mem: float, t: float, step: Plan,
                 progress: Progress | None = None) -> list[Row]:
        """Stage 5: the verified plan and the smallest set of candidates (whatever its eager time),
        each with ``step`` (a plan of one compile step) last, and the verified plan's budgeted form
        (:func:`_budgeted`), and the smallest set's where it keeps a region, measured as the verified plans are
        (:meth:`measure_chosen`) but in this process: the timing in turns compiles the plan here
        anyway, and a fresh process would compile it a second time (on an H100 that was most of
        autoplan's time: 114 of 149 s on resnet18). With inductor they are compiled ahead, side by
        side (:meth:`compile_ahead`). A plan that fails to compile is a row with its error."""
        final = self.final(tried).plan
        smallest = _plan([e.candidate for e in _search(effects, mem, t, None, None, self.speedups)], self.model)
        # The smallest set's budgeted form only where it keeps a region (a ResNet stem's
        # convolution): otherwise it differs from the verified plan's by whole-model steps at
        # most, and each plan here is a compilation (resnet152's take minutes).
        budgeted = [_budgeted(final, step, self.model)]
        kept = _budgeted(smallest, step, self.model)
        if kept is not None and any(s.recomputes for s in kept.steps):
            budgeted.append(kept)
        plans = [p + step for p in (final, smallest)] + [p for p in budgeted if p is not None]
        plans = list(dict.fromkeys(plans))  # the same plan once
        self.compile_ahead(plans, step.steps[0], progress)
        before = _cache_counts() if self.ahead else None
        rows = []
        for i, plan in enumerate(plans):
            if progress:
                progress(i, len(plans), f"compiled: {plan}")
            row = self.measure_chosen(plan, isolate=False)
            row.role = "compiled"
            rows.append(row)
        if before is not None:
            self.ahead.hits, self.ahead.misses = (a - b for a, b in zip(_cache_counts(), before))
        if progress:
            progress(len(plans), len(plans), "compiled plans measured")
        return rows

    def compile_ahead(self, plans: list[Plan], step: Step, progress: Progress | None) -> None:
        """Compile ``plans`` (those not measured in this process yet) in processes side by side
        first (:func:`~shrinkwrap.processes.compile_ahead`), as many at once as the GPU's free memory
        holds at the baseline's peak each, so that this process compiles each from the on-disk
        caches: on CUDA, with inductor (the backend whose work is kept on disk), unless ``step``'s
        mode tunes kernels as it compiles (``max-autotune``: chosen beside other processes, the
        choice would be kept in the cached graph). On an H100, resnet152's plans took 97-119 s
        each to compile cold and 6-8 s from the caches."""
        if step.backend != "inductor" or "max-autotune" in (step.mode or "") or not self.rows.cuda:
            return
        plans = [p for p in plans if (str(p), False) not in self.rows.cache]  # measured here already: compiled
        if len(plans) < 2:
            return
        if progress:
            progress(0, len(plans), f"compiling {len(plans)} plans ahead in processes side by side")
        started = time.perf_counter()
        base = self.rows.cache.get(("", True))
        room = max(base.profile.peak or 0, base.profile.first_peak or 0) if base and base.profile else None
        at_once, errors = compile_ahead(self.rows.make, plans, self.rows.batch, self.rows.options_for(plans[0]), room)
        if at_once:
            self.ahead = _Ahead(len(plans), at_once, time.perf_counter() - started, [e for e in errors if e])

    def final(self, tried: list[Row]) -> Row:
        """The fastest plan that fits a budget, the smallest that fits a time limit. Where none fits
        both, the same of those that meet the limit that comes first (:meth:`holds`): the fastest
        within the budget; else the smallest. :func:`_answer` answers a time limit that no plan
        met, without a budget, with the model as it is."""
        ok = [r for r in tried if self.fits(r)] or [r for r in tried if self.holds(r)]
        if ok and self.target is not None and not self.by_memory:
            return min(ok, key=lambda r: (r.profile.step_ms, self.metric(r)))
        if ok:  # the smallest, and of plans within 2% of it (memory alike), the fastest
            least = min(self.metric(r) for r in ok)
            return min((r for r in ok if self.metric(r) <= least * (1 + SAME_MEMORY)), key=lambda r: r.profile.step_ms)
        measured = [r for r in tried if r.profile is not None] or tried
        return min(measured, key=lambda r: self.metric(r) if r.profile else math.inf)


def _priced(effects: list[Effect], forward: dict[str, float]) -> list[Effect]:
    """``effects`` as the search weighs them. A region that recomputes costs its forward time on
    the base (``forward``: every module timed in the same iterations; the recompute runs that
    forward again) times what the regions' rows read over their forwards, taken as the median
    of those ratios and no less than 1: checkpointing has its own overhead (on a CPU its rows read
    about 3 times their forward). Where the forward was not timed, a region costs what its row
    read, but no less than nothing.

    A row is three iterations, and on an H100 one row differs from the next by more than a
    region's recompute: resnet152's 33 candidate rows read from -14 to +28 ms on top of a base
    of about 80 ms (two single blocks of layer2, alike in every way, +27.6 and -9.0 ms), and
    efficientnet_b0's down to -11 ms. Taken as free, the search chose them all; its first plans
    timed 2.1-2.3x the baseline against the 1.0-1.5x predicted."""
    def region(e: Effect) -> bool:
        return bool(e.candidate.covers) and all(s.recomputes for s in e.candidate.steps) and not e.error

    # Each region's forward time, where all its modules were timed and it took any.
    timed = [sum(forward[n] for n in e.candidate.covers) if region(e) and all(n in forward for n in e.candidate.covers)
             else 0.0 for e in effects]
    ratios = [e.cost / t for e, t in zip(effects, timed) if t > 0]
    scale = max(1.0, statistics.median(ratios)) if ratios else 1.0
    out = []
    for e, t in zip(effects, timed):
        if t > 0:
            e = dataclasses.replace(e, cost=scale * t, priced_by_forward=True)
        elif region(e) and e.cost < 0:
            e = dataclasses.replace(e, cost=0.0)
        out.append(e)
    return out


def _raised(effects: list[Effect], extra: list[Effect], excess: float) -> dict[int, Effect]:
    """The effects whose costs a plan over its time limit raises, by candidate: ``excess`` (what
    the plan took beyond its prediction) shared among ``extra``, the candidates it added to the
    base. Where some were priced by their forward time, the excess is put on those: the
    recompute took ``1 + excess / their cost`` times its forward, and so, the search assumes, do
    the regions not chosen (raised only among the chosen, those would look cheap next to them,
    and the next plan would swap one set for another). Else each gets a like share.

    Example: regions priced 4 and 6 ms by their forward, a plan of both 5 ms over its prediction:
    every region priced by its forward now costs 1.5 times it."""
    total = sum(e.cost for e in extra if e.priced_by_forward)
    if total > 0:
        factor = 1 + excess / total
        return {id(e.candidate): dataclasses.replace(e, cost=e.cost * factor) for e in effects if e.priced_by_forward}
    return {id(e.candidate): dataclasses.replace(e, cost=e.cost + excess / len(extra)) for e in extra}


def _covered(effects: list[Effect]) -> frozenset[str]:
    """What a set of candidates does, by the modules each covers (a whole-model step by its text):
    two sets alike here make the same plan, though their candidates differ (a chunk of two blocks,
    or the two blocks alone)."""
    return frozenset(n for e in effects for n in (e.candidate.covers or (str(e.candidate),)))


def _without(effects: list[Effect], exclude: list[Effect]) -> list[Effect]:
    """``effects`` but those of the candidates in ``exclude`` (by candidate: a cost raised in
    verification makes a new Effect of the same candidate)."""
    gone = {id(e.candidate) for e in exclude}
    return [e for e in effects if id(e.candidate) not in gone]


def _budgeted(plan: Plan, step: Plan, model: nn.Module) -> Plan | None:
    """``plan`` without the steps that recompute (checkpoint, swish, bn_act, swiglu), compiled with
    the partitioner's memory budget, which then chooses the recompute itself; ``None`` where the
    compile step sets a budget already, its backend is not known to partition by one, or it
    compiles some modules only (``pattern``: outside them nothing would recompute). A step keeps
    what its :meth:`~shrinkwrap.step.Step.under_budget` says: a ResNet stem's chain region keeps
    its convolution, which the partitioner never recomputes.

    On an H100 (torch 2.11, 2026-11-24) ``autocast(bf16), compile(memory_budget=0.6)`` kept 1830
    MiB of efficientnet_b0 @128's activations at 0.63x fp32 eager's step time, where autoplan's
    compiled checkpoint plan kept 1956 MiB at 0.83x; resnet18 (with channels_last) 804 MiB at
    0.50x against 875 MiB at 0.52x. Budgets of 0.5 and 0.4 kept more on resnet18, not less: the
    partitioner's choice is not monotonic in it, so one budget, not a search over it."""
    (compile_step,) = step.steps
    if compile_step.memory_budget is not None or compile_step.backend not in PARTITIONING or compile_step.pattern:
        return None
    budgeted = dataclasses.replace(compile_step, memory_budget=PARTITIONER_BUDGET)
    kept = [s for s in (s.under_budget(model) for s in plan.steps) if s is not None]
    return Plan(_fast_stem(kept, model) + [budgeted])


def _fast_stem(steps: list[Step], model: nn.Module) -> list[Step]:
    """``steps``, with the stem convolutions that they recompute (``checkpoint('conv1')``) under
    ``channels_last()`` put first in the space-to-depth form (``space_to_depth('conv1')``): such a
    convolution runs twice, and that form is the faster. resnet18 @128 under ``checkpoint('conv1'),
    channels_last(), autocast(bf16), compile(mode='reduce-overhead', memory_budget=0.6)`` ran
    0.97-1.01x compile + bf16's step time, and 0.88-0.92x with it, at the same memory (H100, torch
    2.11, 2026-11-26, three runs)."""
    regions = [n for s in steps if isinstance(s, Checkpoint) for n in s.targets(model).matched]
    if any(isinstance(s, SpaceToDepth) for s in steps) or not (
            regions and any(isinstance(s, ChannelsLast) for s in steps)):
        return steps
    try:
        stems = SpaceToDepth().targets(model).payload
    except (ValueError, TypeError):  # no stem convolution the form applies to
        return steps
    convs = [c for c in stems if any(_inside(c, r) for r in regions)]
    return [SpaceToDepth(pattern_for(model, convs)), *steps] if convs else steps


def _effect_notes(effects: list[Effect], chosen: list[Effect], in_base: list[Effect], base_steps: tuple,
                  priced: list[Effect]) -> list[str]:
    """Why each candidate was taken or left (``chosen``: the verified answer's; ``priced``: the
    costs the search first weighed, :func:`_priced`)."""
    notes = []
    taken = {id(c.candidate) for c in chosen}
    forward = {id(e.candidate): e.cost for e in priced if e.priced_by_forward}
    for e in effects:
        where = "alone" if e in in_base or not base_steps else f"on top of {Plan(base_steps)}"
        why = ("taken" if id(e.candidate) in taken else "left") + f": {e.candidate} saves " \
              f"{e.saving / 2**20:.1f} MiB, {e.cost:+.1f} ms {where}"
        if id(e.candidate) in forward:
            why += f" (priced at {forward[id(e.candidate)]:.1f} ms: its forward time, scaled)"
        if e.error:
            why = f"left: {e.candidate} failed ({e.error})"
        elif id(e.candidate) not in taken and e.saving <= 0:
            why += " (saves nothing)"
        elif id(e.candidate) not in taken and any(e.candidate.overlaps(c.candidate) for c in chosen):
            why += " (covers modules a chosen candidate covers)"
        if e.candidate.lossy:
            why += " (lossy)"
        notes.append(why)
    return notes


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
    iterations: int = 3,
    warmup: int | None = None,
    rounds: int = 4,
    tolerance: float = 0.03,
    isolate_candidates: bool = False,
    cache: dict | None = None,
    progress: Progress | None = None,
    compile: bool | str = False,
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
        loss_fn, optimizer, device, iterations: as :func:`shrinkwrap.measure`.
        warmup: iterations before a row is measured, as :func:`shrinkwrap.measure`; by default one
            for an eager plan (its second iteration is steady) and two for a compiled one.
        tolerance: how far over ``max_slowdown`` a plan may time and still count as within it.
            A chosen plan is timed in turns with the baseline in one process, five rounds and more
            until an 80% interval of the ratio lies within or over the limit (at most 15), and the
            limit is decided on the median ratio (:func:`slowdown_decided`).
        isolate_candidates: measure each candidate in its own process too. By default candidates
            are measured in this process (a fresh model each, caches emptied: seconds instead of
            a process start each), and every chosen plan that fits in this process again in a
            fresh process on CUDA, so the figures autoplan answers with are isolated ones.
        cache: a dict to keep measurements in, keyed by plan text; pass the same dict to calls
            with the same model and batch (say ``max_slowdown=1.0`` then ``1.5``) to measure each
            candidate once.
        compile: also try the plans compiled (stage 5 above): ``True`` for ``compile()``, or the
            compile step's text (``"compile(mode='max-autotune')"``). The answer may then end in
            ``compile()`` (or ``compile(memory_budget=0.6)``, the plan's recompute steps left to
            the compiler, where the step sets no budget, compiles the whole model and its backend
            partitions: see ``_budgeted``); candidates are still measured eager.

    Returns ``(plan, report)``: the report lists the baseline, every candidate measured alone, the
    chosen plan's measurements and, in its notes, why each candidate was taken or left. A budget
    that cannot be reached is an answer, not an error: the notes say so and name the smallest
    memory found, which is the returned plan's. Where plans fit the budget but none the time
    limit, the answer is the fastest of them; a time limit without a budget that no plan meets
    is answered with the empty plan (the model as it is). The notes say which.

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
    compile_step = _compile_step(compile)
    make = model_maker(model_or_factory, "autoplan()")
    options = Options(loss_fn, optimizer, iterations, 2 if warmup is None else warmup, device)
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    with _gc_frozen(), contextlib.closing(_Rows(make, make(), batch, options, cuda, {} if cache is None else cache,
                                                warmup)) as rows:
        return _autoplan(rows, rows.probe, dev, budget, max_slowdown, allow_lossy, maximize, rounds, tolerance,
                         isolate_candidates, progress, compile_step)


def _answer(search: _Search, tried: list[Row], base: Row) -> tuple[Row, list[str]]:
    """The row autoplan answers with, and a note where it meets not every limit. A time limit
    that no plan met, without a budget (or with ``maximize="batch"``), is answered with the model
    as it is (``base``): it takes 1.0x its own time, and a plan over the limit would be a
    slowdown the caller ruled out."""
    final = search.final(tried)
    if search.fits(final):
        return final, []
    found = (f"{(search.metric(final) or 0) / 2**20:.1f} MiB at "
             f"{final.profile.step_ms if final.profile else 0:.1f} ms, with plan: {final.plan}")
    if not search.holds(final) and (search.target is None or search.by_memory):
        return base, ["no plan found within the step-time limit; the answer is the empty plan (the model as it "
                      "is)" + (f"; the smallest memory verified is {found}" if len(final.plan) else "")]
    if search.holds(final) and not search.by_memory:
        return final, [f"no plan found within both limits; the fastest within the budget is {found}"]
    return final, [f"no plan found within the limits; the smallest memory found is {found}"]


def _autoplan(rows: _Rows, probe: nn.Module, dev: torch.device, budget: Budget, max_slowdown: float | None,
              allow_lossy: bool, maximize: str, rounds: int, tolerance: float, isolate_candidates: bool,
              progress: Progress | None, compile_step: Plan | None) -> tuple[Plan, Report]:
    make, batch, options, cuda = rows.make, rows.batch, rows.options, rows.cuda
    cands = candidates(probe, allow_lossy=allow_lossy, device=dev)
    if progress:
        progress(0, len(cands) + rounds, "baseline and candidates")
    # Candidates are compared with a baseline measured the same way (in this process unless asked
    # otherwise); the budget and the chosen plans with a baseline measured as the chosen plans are,
    # each in a fresh process on CUDA, or as fresh: first in this process, where nothing of it is
    # on the GPU yet (see _Rows).
    base = rows([Plan()], True)[0]
    if cuda:  # the chosen plan's process, started while the candidates are measured (none without CUDA)
        rows.fresh.start_next()
    if base.profile is None:
        raise RuntimeError(f"shrinkwrap: the baseline itself could not be measured: {base.error}")
    report = Report([base], str(dev), device_name(dev), torch.__version__,
                    model=getattr(make, "__name__", type(make).__name__), batch=describe_batch(batch),
                    isolation=_isolation(rows, isolate_candidates))
    base_mem, base_t = float(report.value(base)), base.profile.step_ms
    target = parse_budget(budget, base_mem)
    if target is not None and base_mem <= target and maximize == "speed":
        report.notes = [f"baseline: {base_mem / 2**20:.1f} MiB within the budget of {target / 2**20:.1f} MiB: "
                        "the empty plan"]
        checked, said = _under_cap([base], rows, target) if dev.type == "cuda" else (base, [])
        report.notes += said
        if checked is not None:
            return Plan(), report
        report.notes.append("the model as it is did not train under the budget's cap: autoplan searches on")
    search = _Search(rows, probe, report.value, base_mem, base_t, target,
                     None if max_slowdown is None else max_slowdown * base_t, isolate_candidates, maximize == "batch",
                     max_slowdown, tolerance)

    started = time.perf_counter()
    in_base, whole_rows, baseline = search.base([c for c in cands if not c.covers])
    base_steps = tuple(s for e in in_base for s in e.candidate.steps)
    rest = [c for c in cands if all(c is not e.candidate for e in in_base)]
    effects, top_rows, start_mem, start_t, forward = search.on_top(base_steps, rest, baseline)
    report.rows += [*whole_rows, *top_rows]
    # Stage 3: the search, exact over what was measured.
    priced = _priced(effects, forward)  # the measured figures stay in `effects`, for the notes
    chosen = in_base + search.search(priced, start_mem, start_t, None if search.by_memory else target)
    effects = in_base + effects
    measured = time.perf_counter()
    tried = search.verify(list(chosen), in_base, in_base + priced, rounds, progress, len(cands), (start_mem, start_t))
    chosen = search.sets.get(str(search.final(tried).plan), chosen)  # what the verified answer is made of
    if compile_step is not None:
        tried += search.compiled(tried, effects, start_mem, start_t, compile_step, progress)
    verified = time.perf_counter()
    final, unmet = _answer(search, tried, base)
    capped: list[str] = []
    if dev.type == "cuda" and target is not None and maximize == "speed" and search.fits(final):
        # Read within the budget is not trained within it: the answer is trained under a cap of the
        # budget first, and the next plan is tried where it does not.
        left = [r for r in tried if search.fits(r)]
        order = []
        while left and len(order) < CAP_TRIES:
            order.append(search.final(left))
            left = [r for r in left if r is not order[-1]]
        checked, capped = _under_cap(order, rows, target)
        if checked is None:
            least = min((r for r in tried if r.profile is not None), key=search.metric)
            unmet = [f"no plan measured within the budget trained under a cap of it ({len(order)} tried); "
                     f"the answer is the one that reads the least memory, {search.metric(least) / 2**20:.1f} MiB"]
            final = least
        else:
            final = checked
    if final is base:
        chosen = []  # no candidate is taken

    # What answers the question first (the limits, whether they were met, the plan); then why.
    notes = [f"baseline: {base_mem / 2**20:.1f} MiB ({report.metric}), {base_t:.1f} ms per step", *report.notes]
    if target is not None:
        notes.append(f"budget: {target / 2**20:.1f} MiB")
    if search.max_t is not None:
        notes.append(f"step-time limit: {search.max_t:.1f} ms ({max_slowdown}x the baseline)")
    notes += [*unmet, *capped, f"plan: {final.plan or '(none: the model as it is)'}"]
    if not cuda:
        notes.append("on a CPU the memory is the bytes saved for backward, and steps are taken for what they save: "
                     "a faster CPU step is no reason to take one")
    for row in tried:
        if str(row.plan) in search.ratios:
            timings = search.ratios[str(row.plan)]
            ratio, low, high = ratio_interval(*timings)
            row.time_ratio = ratio
            undecided = "" if slowdown_decided(*timings, max_slowdown, tolerance) else \
                " (the interval straddles it after the most rounds: decided by the median)"
            notes.append(f"{row.label}: {ratio:.3f}x the baseline's step time, timed in turns with it "
                         f"(median of {len(timings[0].rounds_ms)} rounds' ratios, {CONFIDENCE:.0%} interval "
                         f"{low:.3f}-{high:.3f}x): {'within' if search.fits_time(row) else 'over'} the limit "
                         f"of {max_slowdown}x{undecided}")
    notes += _effect_notes(effects, chosen, in_base, base_steps, priced)
    notes.append(f"autoplan's own time: {measured - started:.1f} s measuring {len(cands)} candidates "
                 f"(in {'subprocesses' if isolate_candidates and cuda else 'this process'}), "
                 f"{verified - measured:.1f} s verifying {len(tried)} plan(s) (in this process, and one that "
                 "fits there again in a fresh process on CUDA, compiled ones in this process only; each timed in "
                 "turns with the baseline)")
    if search.ahead:
        ahead = search.ahead
        notes.append(f"of which {ahead.seconds:.1f} s compiling {ahead.plans} plan(s) ahead, {ahead.at_once} processes "
                     f"at once, into the compiler's on-disk caches; this process then compiled {ahead.hits} graph(s) "
                     f"from them and {ahead.misses} anew"
                     + (f"; {len(ahead.errors)} failed there, the first with {ahead.errors[0]}" if ahead.errors else ""))
    report.rows = _last_of_each(report.rows + tried)
    report.notes = notes
    if maximize == "batch":
        return final.plan, _largest_batch(make, final.plan, batch, target, report, options)
    return final.plan, report


def _last_of_each(rows: list[Row]) -> list[Row]:
    """``rows`` with one row per plan, its last (a plan verified in a fresh process, not its
    candidate row), the baseline first."""
    last = {str(r.plan): r for r in rows[1:]}
    return rows[:1] + [r for r in rows[1:] if last[str(r.plan)] is r and str(r.plan) != str(rows[0].plan)]


def _under_cap(rows_in_order: list[Row], rows: _Rows, cap: float) -> tuple[Row | None, list[str]]:
    """The first of ``rows_in_order`` whose plan trains its first iterations on a fresh model in a
    fresh process whose allocator may reserve at most ``cap`` bytes (:func:`shrinkwrap.trains_under`),
    marked on the row, and a note per plan tried. (None, notes) where none does, or where the rows
    cannot be sent to a fresh process (a note says so)."""
    notes = []
    if _unsendable((rows.make, rows.batch, rows.options)):
        return rows_in_order[0] if rows_in_order else None, [
            "not trained under the budget's cap: the model factory, batch or options cannot be sent to a fresh process"]
    for row in rows_in_order:
        probe: Probe = trains_under(rows.make, rows.batch, int(cap), row.plan, rows.options_for(row.plan))
        if probe.ok:
            row.trained_under = int(cap)
            notes.append(f"fits in {cap / 2**20:.0f} MiB: {row.plan or 'the model as it is'} trained {ITERATIONS} iterations "
                         f"under a {cap / 2**20:.0f} MiB cap (the allocator reserved at most {probe.reserved / 2**20:.0f} MiB)")
            return row, notes
        notes.append(f"{row.plan or 'the model as it is'} reads within the budget but did not train under a "
                     f"{cap / 2**20:.0f} MiB cap: {probe.error}")
    return None, notes


def scale_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples: tensors are cut or repeated along their first dimension."""
    return tree_map(lambda t: t.repeat(math.ceil(n / t.shape[0]), *([1] * (t.dim() - 1)))[:n], batch)


def _largest_batch(make: Callable[[], nn.Module], plan: Plan, batch: Any, target: float | None, report: Report,
                   options: Options, tries: int = 8) -> Report:
    first = next(tensors(batch))
    lo, hi = 0, None
    n = first.shape[0]
    for _ in range(tries):
        row = measure_plans(make, [plan], scale_batch(batch, n), options).rows[0]
        ok = row.profile is not None and target is not None and report.value(row) <= target
        row.role, row.batch_size, row.fits = "batch", n, ok
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

