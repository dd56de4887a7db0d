"""The measuring stages: rows measured once each (in this process or fresh ones), and the search
that runs the stages over them (base, candidates on top, the verified answer, the compiled
plans) against the limits."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ..compare import Progress, _as_row, _warm_process, measure_plans
from ..measure import first_use
from ..measure.profile import Options
from ..measure.ratios import ratio_interval, timed_against, within_slowdown
from ..measure.step import resolve_device
from ..measure.turns import forward_times, time_interleaved
from ..plan import Plan
from ..processes import AHEAD, PROCESS_MARGIN, FreshProcesses, _build, _Copies, _unsendable, compile_ahead
from ..report import Row
from ..select import innermost_blocks
from ..step import Candidate, Step
from ..transforms.checkpoint import Checkpoint
from .choose import (SAME_MEMORY, Effect, _plan, _effects, _search, _raised, _covered, _outdone, _timing_decides,
                     _without)
from .compiled import _budgeted, _every_block, _Ahead, _cache_counts, _Turn

BEATEN = 0.10  # a row this much faster than the answer, in alike memory, is verified (one row's time is noisy);
# and this much of the time limit is added to the room regions are left unmeasured against (on_top)


class _Rows:
    """Measured rows, each plan measured once (keyed by its text and whether it ran isolated).

    Rows in this process are built from copies of one model the factory made (on an H100,
    building a random-initialised bert took 1.7 of the 4.2 s each candidate row took) and skip
    the per-module log; isolated rows run in fresh processes, started ahead: two (:data:`AHEAD`)
    while this process measures the candidates, each next one as a row starts, each making the
    calls of cuDNN's first use before its row (see :class:`FreshProcesses`, :meth:`start_ahead`
    and :meth:`prime`)."""

    def __init__(self, make: Callable[[], nn.Module], model: nn.Module, batch: Any, options: Options, cuda: bool,
                 cache: dict, warmup: int | None = None) -> None:
        self.make, self.batch, self.options, self.cuda, self.cache = make, batch, options, cuda, cache
        self.warmup = warmup
        self.local = _copies_of(make, model)
        # The model to read names from: the copy kept on the CPU, where there is one, so that the
        # factory's model, which may be on the GPU, can go (it is never moved: a factory may hand
        # out one shared model).
        self.probe = self.local.model if isinstance(self.local, _Copies) and self.local is not make else model
        self.fresh = FreshProcesses(make, sorted({type(m).__module__ for m in model.modules()}), ahead=True)
        # Why no fresh process can start (see _unsendable), or None: every row is then measured here.
        self.unsendable = _unsendable((make, batch, options)) if cuda else None
        self.measured_here = False  # whether a row has run in this process
        self.foreign: int | None = None  # what the process held on the GPU before the first row (see held)
        self.primed: set[str] = set()  # the plans whose calls the fresh processes make (see prime)
        self.primed_none = False  # the first plan recorded made no call to prime

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
        if self.foreign is None:
            self.foreign = self.held()
        isolate = isolate and self.cuda and not self.unsendable  # a subprocess buys nothing without CUDA
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

    def _keep(self) -> int | None:
        """What the fresh processes' replays leave free on the GPU: two of the baseline's peaks
        and the margins of this process, a row's and those waiting (a row here, and one in a
        fresh process beside it, may still grow to the peak); None off CUDA, before the baseline,
        or where the device has no more than that beyond what this process held before its
        first row."""
        base, device = self.cache.get(("", True)), resolve_device(self.options.device)
        if base is None or base.profile is None or device.type != "cuda":
            return None
        keep = (2 + AHEAD) * PROCESS_MARGIN + 2 * max(base.profile.peak or 0, base.profile.first_peak or 0)
        total = torch.cuda.get_device_properties(device).total_memory
        return keep if total - (self.foreign or 0) > keep else None

    def start_ahead(self) -> None:
        """Start the fresh processes that wait for the verified plans' rows (:class:`FreshProcesses`):
        :data:`AHEAD` where the GPU has the room :meth:`_keep` asks for, else one (each holds
        a CUDA context)."""
        self.fresh.depth = AHEAD if self._keep() is not None else 1
        self.fresh.start_next()

    def prime(self, plan: Plan) -> None:
        """Record the library calls one iteration of ``plan`` makes here (cuDNN's, whose first use
        at each shape, layout and type costs a process seconds: see
        :mod:`~shrinkwrap.measure.first_use`), and have the fresh processes started ahead make
        those they were not given yet before their rows (:meth:`FreshProcesses.prime`). The base
        is recorded as the candidates' rows end, and each plan verified as its row here is read,
        while the plan is timed in turns and before its row in a fresh process: a plan adds calls
        the base never made (a checkpoint's recompute runs its convolutions on autograd's thread,
        whose plans are its own; ``channels_last`` measured on top of a base without it). On an
        H100, efficientnet_b0's verified plans took 0.18-0.24 s in their first iteration in a
        process primed with their own calls, 0.72-0.74 s with the base's alone, and 11.5 s where
        the base lacked their layout. A replay makes a call only where its device has room for
        it beyond :meth:`_keep`. On CUDA only, where rows run in fresh processes; not for a
        compiled plan (its iteration here would compile it), and not once the first plan
        recorded made no such call."""
        keep = self._keep()  # None off CUDA
        if keep is None or self.unsendable or not first_use.SUPPORTED or str(plan) in self.primed or self.primed_none \
                or any(s.name == "compile" for s in plan.steps):
            return
        self.measured_here = True
        self.primed.add(str(plan))
        with first_use.recorded() as calls:
            ran = _warm_process(self.local, plan, self.batch, dataclasses.replace(self.options_for(plan), warmup=1))
        # A model without convolutions or cuDNN attention makes none under any plan: one iteration
        # a verified plan would be spent recording nothing.
        self.primed_none = ran and not calls and len(self.primed) == 1
        if calls:
            self.fresh.prime(calls, keep)

    def _here(self, plan: Plan) -> Row:
        """``plan``'s row in this process, on a copy of the model, without the per-module log. On
        CUDA the peaks are read above what the process held before its first row (:meth:`held`):
        a fresh process would not hold it, and the limits are a fresh process's figures. What the
        rows themselves leave (cuBLAS's workspace) stays in: a fresh process makes its own."""
        options = dataclasses.replace(self.options_for(plan), module_log=False)
        self.measured_here = True
        held = self.foreign or 0
        row = measure_plans(self.local, [plan], self.batch, options, isolate=False, keep_going=True).rows[0]
        p = row.profile
        if held and p is not None and p.peak is not None:
            row.profile = dataclasses.replace(p, peak=p.peak - held, static=None if p.static is None else p.static - held,
                                              first_peak=None if p.first_peak is None else p.first_peak - held)
        return row

    def held(self) -> int:
        """The bytes this process holds on the GPU now: before the first row, a caller's tensors,
        a model it passed as an instance, what earlier work left (not cuBLAS's workspaces). A row
        measured here would read them as its own (in a test process after two other tests, on an
        H100, resnet18's rows read about 386 MiB above their fresh figures: ``channels_last()``
        965.1 MiB against a fresh baseline of 579.8, and autoplan found no plan within a budget of
        376.9 MiB). Nothing without CUDA, or before CUDA has started."""
        if not self.cuda or not torch.cuda.is_initialized():
            return 0
        gc.collect()  # a model in a reference cycle waits for the collector
        # cuBLAS's workspaces from the caller's matmuls would be the rows' own in a fresh process:
        # let go, they are made again by the first row that needs them, and count there.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # a CUDA build's
        if clear is not None:
            clear()
        return torch.cuda.memory_allocated(self.options.device)

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


def _finer(chosen: list[Effect], model: nn.Module) -> list[Effect] | None:
    """``chosen`` with each region over a module that holds a stack of blocks (a stage, a
    transformer's layers; alone or among a candidate's other regions) replaced by a region per
    block inside it (the innermost blocks: a
    stage of stages gives its stages' blocks); None where there is none. A stage's region
    recomputes the whole stage at once in backward and holds its activations then, a region per
    block one block's; alone, their rows can read alike, and summed savings cannot tell them
    apart where other regions move the peak. On ConvNeXt-T @64 the search takes stages whole in
    candidates over two of features' children (a stage and its downsample): unrefined, the 1.0x
    answer keeps 0.29x fp32's activation where torch's ``checkpoint_wrapper`` on every block keeps
    0.16x at a faster step; refined module by module, it keeps 0.16x too (H200, torch 2.11). The
    replacement's figures stand in as the region's until its plan is measured."""
    out, changed = [], False
    for e in chosen:
        covers, steps = e.candidate.covers, e.candidate.steps
        regions = bool(covers) and all(isinstance(s, Checkpoint) and not s.chain for s in steps)
        # A candidate over several modules (ConvNeXt's stage and downsample, a pair of features'
        # children) is refined module by module; a module without a stack inside stays whole.
        names = [b for c in covers for b in (innermost_blocks(model, c) if regions else []) or [c]]
        step = Checkpoint(tuple(names)) if regions and len(names) > len(covers) else None
        if step is not None and step.applies(model):
            out.append(dataclasses.replace(e, candidate=Candidate((step,), tuple(names))))
            changed = True
        else:
            out.append(e)
    return out if changed else None


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """The objects alive when autoplan starts set aside from the garbage collector meanwhile
    (``gc.freeze``): every row empties the CUDA cache after a full collection, in case cycles
    hold tensors, and in a process that has imported transformers a full collection took 0.3 s
    on an H100 machine, 18 of the 40 s bert's candidates took. What a row leaves behind is made
    after the start, so it is still collected. Everything frozen is unfrozen at the end, what the
    caller may have frozen before too (Python 3.12 starts with objects frozen): back in the oldest
    generation, collected as usual; only a process that froze objects to keep memory pages shared
    with its forks would notice. autoplan freezes once more after the baseline's row, what it
    imported meanwhile (see ``_autoplan``)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _isolation(rows: _Rows, isolate_candidates: bool) -> str:
    """Where the report's rows were measured, for its header."""
    if not rows.cuda or rows.unsendable:
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
    # Regions not measured, each with its forward time and the room the time limit left (on_top)
    unmeasured: list = dataclasses.field(default_factory=list)

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

    @property
    def least_memory(self) -> bool:
        """Whether the answer is the least memory within the time limit (no budget, or
        ``maximize="batch"``, whose batch size meets the budget later); else it is the fastest
        plan within the budget."""
        return self.target is None or self.by_memory

    def fits(self, row: Row) -> bool:
        return row.profile is not None and (self.target is None or self.metric(row) <= self.target) and self.fits_time(row)

    def holds(self, row: Row) -> bool:
        """Whether ``row`` meets the limit that comes first where no plan meets both: the budget
        (over it the run fails; over the time limit it runs slower), or the time limit where there
        is no budget, or with ``maximize="batch"``, whose batch size meets the budget later."""
        if row.profile is None:
            return False
        if self.least_memory:
            return self.fits_time(row)
        return self.metric(row) <= self.target

    def time_against_baseline(self, plan: Plan) -> None:
        """Time ``plan`` and the baseline in turns in this process: the ratio a step-time limit is
        decided on (times from separate processes drift 10-20% on a shared GPU)."""
        if self.max_t is None or str(plan) in self.ratios:
            return
        self.ratios[str(plan)] = timed_against(self.rows.model(Plan()), self.rows.model(plan), self.rows.batch,
                                               self.rows.options_for(plan), self.max_slowdown, self.tolerance)

    def measure_chosen(self, plan: Plan, isolate: bool = True, beside: list[Row] = ()) -> Row:
        """A plan autoplan may answer with: measured in a fresh process (on CUDA, unless ``isolate``
        is false), and where it fits the budget, timed in turns with the baseline for the
        step-time limit, unless a row ``beside`` it already answers before it (:meth:`outdone`)."""
        if isolate:  # a plan not verified here first (undominated's): the later processes at least
            self.rows.prime(plan)
        row = self.rows([plan], isolate)[0]
        if not isolate and row.profile is not None and (self.target is None or self.metric(row) <= self.target):
            self.rows.prime(plan)  # its fresh row, where it fits, comes after its timing in turns
        if _timing_decides(self.metric(row) if row.profile is not None else None, self.target, self.within(beside)):
            self.time_against_baseline(plan)
        return row

    def within(self, rows: list[Row]) -> list[float] | None:
        """What the ``rows`` within the limits read, where the answer is the least memory within
        them (a plan reading more than :data:`SAME_MEMORY` more is outdone); None where it is the
        fastest plan within the budget."""
        return [self.metric(r) for r in rows if self.fits(r)] if self.least_memory else None

    def outdone(self, row: Row, beside: list[Row]) -> bool:
        """Whether :meth:`final` answers with a row of ``beside`` before ``row`` whatever ``row``'s
        time: where the least memory within the time limit is the answer, one within the limits
        that reads more than :data:`SAME_MEMORY` less. Its timing in turns then decides nothing
        (a compiled plan's is a second compilation, from the caches, and rounds of the eager
        baseline beside it)."""
        within = self.within(beside)
        return within is not None and _outdone(self.metric(row), within)

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

    def on_top(self, base_steps: tuple, rest: list[Candidate], baseline: Row, prune: bool = False
               ) -> tuple[list[Effect], list[Row], float, float, dict[str, float]]:
        """Stage 2: the base measured as a whole (steps that absorb each other, swish and bn_act,
        save less together than their sum), and every other candidate measured on top of it.
        Returns the effects, the rows, the base's predicted memory and time, and each module's
        forward time on the base (what recomputing it costs: see :func:`_priced`).

        With ``prune`` (the least memory within a time limit, no budget, nothing compiled), a
        region whose forward alone takes longer than the room the limit leaves is not measured
        (:attr:`unmeasured`), unless its row is in the cache already: the search prices a region
        at its forward time or more. The room is the limit less the base's time, plus what the
        other candidates (measured first) win back, plus ``BEATEN`` of the limit, as a plan grown
        in verifying is given the room its time in turns leaves, and one row's time is noisier
        than that. The regions' price scale (:func:`_priced`) is then the median over the
        regions measured. On an H100 at a 1.0x limit efficientnet_v2_s measured 35 candidates in
        64.6 s, 28 of them regions, and answered with none."""
        if base_steps and self.rows.cuda and not self.isolate_candidates:
            self.rows.warm_up(Plan(base_steps))  # every candidate is read against the base's row
        cached = getattr(self.rows, "cache", {})
        regions = [c for c in rest if c.covers and all(s.recomputes for s in c.steps)
                   and (str(Plan(base_steps + c.steps)), self.isolate_candidates and self.rows.cuda) not in cached]
        pruning = prune and self.max_t is not None and bool(regions)
        first = [c for c in rest if c not in regions] if pruning else rest
        rows = self.rows([Plan(base_steps)] + [Plan(base_steps + c.steps) for c in first], self.isolate_candidates)
        base = rows[0]
        if base.profile is None or baseline.profile is None:
            mem, t = self.base_mem, self.base_t
        else:
            mem = self.base_mem + self.metric(base) - self.metric(baseline)
            t = self.base_t + base.profile.step_ms - baseline.profile.step_ms
        forward = self.rows.forward_ms(Plan(base_steps)) if any(c.covers for c in rest) else {}
        measured = dict(zip(map(id, first), rows[1:]))
        if pruning:
            won = sum(min(0.0, e.cost) for e in _effects(first, rows[1:], base, self.metric) if not e.error)
            room = self.max_t * (1 + self.tolerance + BEATEN) - t - won
            timed = {id(c): sum(forward[n] for n in c.covers) for c in regions if all(n in forward for n in c.covers)}
            dear = [c for c in regions if timed.get(id(c), 0.0) > room]
            self.unmeasured += [(c, timed[id(c)], room) for c in dear]
            left = [c for c in regions if c not in dear]
            measured.update(zip(map(id, left), self.rows([Plan(base_steps + c.steps) for c in left],
                                                         self.isolate_candidates)))
        kept = [c for c in rest if id(c) in measured]
        top = [measured[id(c)] for c in kept]
        # The plans verified in fresh processes are built on the base. Primed after the candidates'
        # rows, whose own times the search reads: verified plans are timed in turns with the
        # baseline, where what runs beside them falls on both.
        if self.rows.cuda:
            self.rows.prime(Plan(base_steps))
        return _effects(kept, top, base, self.metric), ([base] if base_steps else []) + top, mem, t, forward

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
          added, since the prices may have overstated the cost, unless the two would be alike
          in memory (:data:`SAME_MEMORY`: :meth:`final` answers with the faster plan, and a
          round is a copy of the model measured and timed in turns); the smallest plan that
          fitted is then the one measured fresh.

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
            if nxt and sum(e.saving for e in nxt) < SAME_MEMORY / (1 + SAME_MEMORY) * self.metric(row):
                nxt = []  # memory alike (final()'s band): it would answer with the faster plan, this one
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
        if tried and not self.least_memory and self.fits(tried[-1]):
            tried += self._pruned(chosen, in_base, tried[-1], rounds)
        finer = _finer(self.sets.get(str(self.final(tried).plan), chosen) if tried else chosen, self.model)
        plan = _plan([e.candidate for e in finer], self.model) if finer else None
        if plan is not None and plan not in {t.plan for t in tried}:
            self.sets.setdefault(str(plan), finer)
            row = self.measure_chosen(plan, isolate=False)
            row.role, row.round = "chosen", 1 + max([r.round or 0 for r in tried])
            tried.append(row)
        return self._fresh_answer(tried)

    def _pruned(self, chosen: list[Effect], in_base: list[Effect], row: Row, rounds: int) -> list[Row]:
        """A plan that fits the budget, measured with its costliest candidate dropped, while what
        is left fits measured and the one dropped would leave it within the budget even if its
        own saving counted in full. Savings were added to choose the set; a peak moves when a
        region is added, so two regions can save more together than apart, and the sum then
        asks for a candidate the budget does not need (and its recompute time). The rows
        measured here say; a set whose measured memory is what its sum said is not touched."""
        out: list[Row] = []
        last = row.round or 0
        for _ in range(rounds):
            extra = [e for e in chosen if e not in in_base]
            if not extra:
                break
            worst = max(extra, key=lambda e: e.cost)
            if self.metric(row) + worst.saving > self.target:
                break
            chosen = [e for e in chosen if e is not worst]
            plan = _plan([e.candidate for e in chosen], self.model)
            self.sets.setdefault(str(plan), list(chosen))
            row = self.measure_chosen(plan, isolate=False)
            last += 1
            row.role, row.round = "chosen", last
            out.append(row)
            if not self.fits(row):
                break
        return out

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
            fresh.role, fresh.round = ("compiled" if best.role == "compiled" else "chosen"), best.round
            last = max(i for i, r in enumerate(tried) if r.plan == best.plan)
            tried = [fresh if i == last else r for i, r in enumerate(tried) if r.plan != best.plan or i == last]
        return tried

    def undominated(self, tried: list[Row], measured: list[Row], tries: int = 2) -> list[Row]:
        """``tried`` with the rows that would beat the answer verified: a row autoplan measured but
        did not verify (a candidate on top of the base, a plan an earlier call with the same cache
        verified) that reads as little memory (within :data:`SAME_MEMORY`, and within the budget)
        in :data:`BEATEN` less time is measured as a chosen plan is (:meth:`measure_chosen`), and
        the answer is chosen again. No row of its own search then beats the answer on both axes
        beyond one row's noise, and a looser limit cannot answer with a plan that a tighter
        limit's answer beats (on an H200 the 1.5x answer for efficientnet_b0 once kept the 1.0x
        answer's memory at 1.5x its time). Where the least memory within a time limit is the
        answer (no budget, or ``maximize="batch"``), a row that reads at least
        :data:`SAME_MEMORY` less than the answer within the limit by its own time is verified
        too, the least memory first, once no faster row of alike memory is left to verify: the
        plans verified grow from the search's choice and shrink from it by dropping, and a
        candidate's own row may fit where none of them did (on an H100, efficientnet_v2_s at
        1.0x answered with the model as it is beside its ``autocast(bf16)`` row, which read 47%
        less memory in 10% less time). Where no plan verified meets the time limit, the answer
        is the model as it is (:func:`_answer`), and the rows are read against it, fresh too.
        Other answers outside the limits are not guarded. At most ``tries`` plans in all: each is
        a fresh process and a timing in turns."""
        least_within = self.max_t is not None and self.least_memory
        asked: set[str] = set()
        for _ in range(tries if self.speedups else 0):  # a CPU's step time decides nothing (see _search)
            best = self.final(tried)
            seen = {str(r.plan) for r in tried} | asked
            known = [r for r in measured
                     if r.profile is not None and str(r.plan) not in seen and self.metric(r) is not None]
            if self.fits(best):
                mem, faster = self.metric(best), best.profile.step_ms
            elif least_within:  # over the budget with maximize="batch" (scaled later), or over the time limit
                mem, faster = (self.metric(best) if self.holds(best) else self.base_mem), None
            else:
                break
            better = [r for r in known if faster is not None and self.metric(r) <= (1 + SAME_MEMORY) * mem
                      and (self.target is None or self.metric(r) <= self.target)
                      and r.profile.step_ms < (1 - BEATEN) * faster]
            better = better or [r for r in known if least_within and self.metric(r) <= (1 - SAME_MEMORY) * mem
                                and self.fits_time(r)]
            if not better:
                break
            row = self.measure_chosen(min(better, key=self.metric).plan)
            asked.add(str(row.plan))
            if faster is None and not self.holds(best) and \
                    (row.profile is None or self.metric(row) > (1 - SAME_MEMORY) * mem):
                continue  # read fresh, no less than the model as it is: the answer there, not among the rows
            row.role, row.round = "chosen", 1 + max([r.round or 0 for r in tried])
            tried = tried + [row]
        return tried

    def compiled(self, tried: list[Row], effects: list[Effect], mem: float, t: float, step: Plan,
                 progress: Progress | None = None) -> list[Row]:
        """Stage 5: the verified plan and the smallest set of candidates (whatever its eager time),
        each with ``step`` (a plan of one compile step) last, the verified plan's budgeted form
        (:func:`_budgeted`), and the smallest set's where it keeps a region, and the verified
        plan with every block checkpointed instead of its regions (:func:`_every_block`). With
        inductor on CUDA they compile side by side in fresh processes, and where two or more run
        at once and the plans run no CUDA graphs, each is measured in its own, and timed in turns
        there where its time can decide (:meth:`compile_ahead`). Otherwise each is measured as the
        verified plans are (:meth:`measure_chosen`) but in this process: the timing in turns
        compiles the plan here anyway, and a fresh process would compile it a second time (on an
        H100 that was most of autoplan's time: 114 of 149 s on resnet18); without a budget (or
        with ``maximize="batch"``) one that reads more memory than a plan already within the
        limits is then not timed in turns (:meth:`outdone`). A plan that fails to compile is a
        row with its error."""
        final = self.final(tried).plan
        smallest = _plan([e.candidate for e in _search(effects, mem, t, None, None, self.speedups)], self.model)
        # The smallest set's budgeted form only where it keeps a region (a ResNet stem's
        # convolution): otherwise it differs from the verified plan's by whole-model steps at
        # most, and each plan here is a compilation (resnet152's take minutes).
        budgeted = [_budgeted(final, step, self.model)]
        kept = _budgeted(smallest, step, self.model)
        if kept is not None and any(s.recomputes for s in kept.steps):
            budgeted.append(kept)
        every = _every_block(final, step, self.model)  # the one-line recipe, compiled
        plans = [p + step for p in (final, smallest)] + [p for p in [*budgeted, every] if p is not None]
        plans = list(dict.fromkeys(plans))  # the same plan once
        there = self.compile_ahead(plans, step.steps[0], progress, tried)
        before = _cache_counts() if self.ahead else None
        rows = []
        for i, plan in enumerate(plans):
            if progress:
                progress(i, len(plans), f"compiled: {plan}")
            if plan in there:
                result, matched, skipped, timings, _ = there[plan]
                row = self.rows.cache[str(plan), True] = _as_row(plan, result, matched, skipped, "compiled")
                if timings is not None:
                    self.ratios[str(plan)] = timings
                row = dataclasses.replace(row)
            else:
                row = self.measure_chosen(plan, isolate=False, beside=tried + rows)
            row.role = "compiled"
            rows.append(row)
        if before is not None:
            self.ahead.hits, self.ahead.misses = (a - b for a, b in zip(_cache_counts(), before))
        if progress:
            progress(len(plans), len(plans), "compiled plans measured")
        return rows

    def compile_ahead(self, plans: list[Plan], step: Step, progress: Progress | None,
                      beside: list[Row] = ()) -> dict[Plan, tuple]:
        """Compile ``plans`` (those not measured yet) in processes side by side first
        (:func:`~shrinkwrap.processes.compile_ahead`), as many at once as the GPU's free memory
        holds at the baseline's peak each: on CUDA, with inductor (the backend whose work is kept
        on disk), unless ``step``'s mode tunes kernels as it compiles (``max-autotune``: chosen
        beside other processes, the choice would be kept in the cached graph). On an H100,
        resnet152's plans took 97-119 s each to compile cold and 6-8 s from the caches.

        Unless the plans run CUDA graphs, each is then measured there, one process at a time once
        all have compiled (in waves of as many as run at once, where fewer do), and timed in
        turns there, least memory first (within its wave), unless a row ``beside`` them or timed
        before it answers first (:class:`_Turn`): returns those plans' rows and timings in turns.
        The others this process compiles from the on-disk caches. On an H100 (80 GB, torch 2.11)
        the free memory, read with this process's cached blocks still held, held two processes
        at maxvit_t @64's baseline peak (19311 MiB): its four plans went in two waves, the last
        compiled after 541 s; with them handed back it holds three (see ``_held``)."""
        if step.backend != "inductor" or "max-autotune" in (step.mode or "") or not self.rows.cuda:
            return {}
        plans = [p for p in plans if (str(p), False) not in self.rows.cache]  # measured here already: compiled
        if len(plans) < 2:
            return {}
        if progress:
            progress(0, len(plans), f"compiling {len(plans)} plans ahead in processes side by side")
        started = time.perf_counter()
        self.rows.fresh.stop_next()  # their CUDA contexts are no room for a plan
        base = self.rows.cache.get(("", True))
        room = max(base.profile.peak or 0, base.profile.first_peak or 0) if base and base.profile else None
        within = self.within(beside)
        turn = _Turn(self.metric, None if self.max_t is None else self.max_slowdown, self.tolerance, self.target,
                     None if within is None else tuple(within))
        # Not where the plans run CUDA graphs: the first iterations' graphs keep their pool in the
        # process, and a row measured there after them would read it.
        graphed = step.mode == "reduce-overhead"
        compiling: list[float] = []
        first: list[float] = []

        def compiled(seconds: list[float]) -> None:
            compiling.append(time.perf_counter() - started)
            first.extend(s for s in seconds if not math.isnan(s))
            if progress:
                progress(0, len(plans), f"the last of {len(plans)} plans compiled after {compiling[0]:.1f} s; "
                                        "measuring where they compiled, one at a time")

        at_once, out = compile_ahead(self.rows.make, plans, self.rows.batch, self.rows.options_for(plans[0]), room,
                                     then=None if graphed else turn.row, compiled=compiled,
                                     after=None if graphed else turn.timed)
        if not at_once:
            return {}
        there = {p: r for p, r in zip(plans, out) if isinstance(r, tuple)}
        # What failed there: a process's error, or a row's (a plan that failed to compile fails
        # again in its turn, its row alone on the GPU).
        errors = [e for e in out if isinstance(e, str)] + [r[0][1] for r in there.values() if isinstance(r[0], tuple)]
        self.ahead = _Ahead(len(plans), at_once, time.perf_counter() - started, errors,
                            compiling=compiling[0] if compiling else None, first=first,
                            turns=[r[-1] for r in there.values()])
        return there

    def final(self, tried: list[Row]) -> Row:
        """The fastest plan that fits a budget, the smallest that fits a time limit. Where none fits
        both, the same of those that meet the limit that comes first (:meth:`holds`): the fastest
        within the budget; else the smallest. :func:`_answer` answers a time limit that no plan
        met, without a budget, with the model as it is."""
        ok = [r for r in tried if self.fits(r)] or [r for r in tried if self.holds(r)]
        if ok and not self.least_memory:
            return min(ok, key=lambda r: (r.profile.step_ms, self.metric(r)))
        if ok:  # the smallest, and of plans within 2% of it (memory alike), the fastest
            least = min(self.metric(r) for r in ok)
            return min((r for r in ok if self.metric(r) <= least * (1 + SAME_MEMORY)), key=lambda r: r.profile.step_ms)
        measured = [r for r in tried if r.profile is not None] or tried
        return min(measured, key=lambda r: self.metric(r) if r.profile else math.inf)
