"""The measuring stages: the search that runs the stages (base, candidates on top, the verified
answer, the compiled plans) against the limits, over rows it asks of :class:`~.rows.Rows` and
never makes itself."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch.nn as nn

from .._compat import aot_autograd_cache_counts
from ..compare import Progress, as_row
from ..measuring.progress import Stage
from ..measuring.ratios import ratio_interval, timed_against, within_slowdown
from ..plan import Plan
from ..report import Row
from ..select import blocks_by_depth, innermost_blocks
from ..step import Candidate, Step
from ..transforms.checkpoint import Checkpoint
from .choose import (BEATEN, SAME_MEMORY, Effect, _plan, _effects, _search, _raised, _covered, _outdone,
                     _timing_decides, _without)
from .compiled import _budgeted, _every_block, _Ahead, _Turn
from .rows import Rows


def _finer(chosen: list[Effect], model: nn.Module) -> list[Effect] | None:
    """``chosen`` with each region over a module that holds a stack of blocks (a stage, a
    transformer's layers; alone or among a candidate's other regions) replaced by a region per
    block inside it (the innermost blocks: a
    stage of stages gives its stages' blocks); None where there is none. A stage's region
    recomputes the whole stage at once in backward and holds its activations then, a region per
    block one block's; alone, their rows can read alike, and summed savings cannot tell them
    apart where other regions move the peak (ConvNeXt's stages: unrefined, an answer keeps more
    activation than every block checkpointed, at a slower step). The replacement's figures stand
    in as the region's until its plan is measured."""
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


@dataclasses.dataclass
class _Search:
    """What the stages share: how to measure, the limits, and the baseline they are read against."""

    rows: Rows
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
    progress: Progress | None = None  # told as each stage's rows end (measuring.progress.Stage)
    stage: Stage | None = None  # the stage measuring now: told of each round of a timing in turns
    skipped: list = dataclasses.field(default_factory=list)  # what could not be made, for the notes (made)

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
        say = None if self.stage is None else lambda text: self.stage.say(f"{text}: {plan}")  # the plan last: it is long
        self.ratios[str(plan)] = timed_against(self.rows.model(Plan()), self.rows.model(plan), self.rows.batch,
                                               self.rows.options_for(plan), self.max_slowdown, self.tolerance, say)

    def counted(self, plans: list[Plan], isolate: bool, stage: Stage, names: list[str] | None = None) -> list[Row]:
        """Rows for ``plans`` as :class:`~.rows.Rows` gives them, asked one plan at a time so that
        ``stage`` is told as each row ends (a row is seconds to a minute; a stage, dozens), by its
        name in ``names`` (by default its plan's text)."""
        out = []
        for i, plan in enumerate(plans):
            out += self.rows([plan], isolate)
            stage.done(names[i] if names else str(plan) or "baseline")
        return out

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
        them (a plan reading :data:`BEATEN` more or over is outdone); None where it is the
        fastest plan within the budget."""
        return [self.metric(r) for r in rows if self.fits(r)] if self.least_memory else None

    def outdone(self, row: Row, beside: list[Row]) -> bool:
        """Whether :meth:`final` answers with a row of ``beside`` before ``row`` whatever ``row``'s
        time: where the least memory within the time limit is the answer, one within the limits
        that reads :data:`BEATEN` less or under. Its timing in turns then decides nothing
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
        warm = self.rows.cuda and not self.isolate_candidates
        stage = Stage(self.progress, "whole-model steps, each alone", (len(whole) if warm else 0) + 1 + len(whole))
        if warm:
            for c in whole:
                self.rows.warm_up(Plan(c.steps))
                stage.done(f"{Plan(c.steps)} warmed up")
        rows = self.counted([Plan()] + [Plan(c.steps) for c in whole], self.isolate_candidates, stage)
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
        regions measured. Most of a convolutional model's candidates are regions, and at a tight
        limit none of them is the answer."""
        warm = bool(base_steps) and self.rows.cuda and not self.isolate_candidates
        timing = any(c.covers for c in rest)
        stage = Stage(self.progress, f"candidates on top of {Plan(base_steps) or 'the model as it is'}",
                      warm + 1 + len(rest) + timing)
        if warm:
            self.rows.warm_up(Plan(base_steps))  # every candidate is read against the base's row
            stage.done(f"{Plan(base_steps)} warmed up")
        cached = getattr(self.rows, "cache", {})
        regions = [c for c in rest if c.covers and all(s.recomputes for s in c.steps)
                   and (str(Plan(base_steps + c.steps)), self.isolate_candidates and self.rows.cuda) not in cached]
        pruning = prune and self.max_t is not None and bool(regions)
        first = [c for c in rest if c not in regions] if pruning else rest
        rows = self.counted([Plan(base_steps)] + [Plan(base_steps + c.steps) for c in first], self.isolate_candidates,
                            stage, ["the base"] + [str(c) for c in first])
        base = rows[0]
        if base.profile is None or baseline.profile is None:
            mem, t = self.base_mem, self.base_t
        else:
            mem = self.base_mem + self.metric(base) - self.metric(baseline)
            t = self.base_t + base.profile.step_ms - baseline.profile.step_ms
        forward = self.rows.forward_ms(Plan(base_steps)) if timing else {}
        if timing:
            stage.done("each module's forward timed")
        measured = dict(zip(map(id, first), rows[1:]))
        if pruning:
            won = sum(min(0.0, e.cost) for e in _effects(first, rows[1:], base, self.metric) if not e.error)
            room = self.max_t * (1 + self.tolerance + BEATEN) - t - won
            timed = {id(c): sum(forward[n] for n in c.covers) for c in regions if all(n in forward for n in c.covers)}
            # A region whose forward was not timed is measured: there is no price to leave it on,
            # and where the base is over the limit already the room is below any price, 0 too.
            dear = [c for c in regions if id(c) in timed and timed[id(c)] > room]
            self.unmeasured += [(c, timed[id(c)], room) for c in dear]
            left = [c for c in regions if c not in dear]
            stage.recount(stage.n - len(dear))
            measured.update(zip(map(id, left), self.counted([Plan(base_steps + c.steps) for c in left],
                                                            self.isolate_candidates, stage, [str(c) for c in left])))
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
               start: tuple[float, float] | None = None) -> list[Row]:
        """Stage 4: measure the chosen plan, in this process and, where it fits there, in a fresh
        one; refine where it misses.

        - Over the time limit: the candidates' costs were read from one row each, and the chosen
          ones partly because their rows read cheap. What the plan took beyond its prediction
          (from ``start``, the base's predicted memory and time) raises the costs
          (:func:`_raised`: every region priced by its forward time scaled alike, or else a
          share for each candidate chosen on top of the base), and the search runs again: dropping
          the costliest candidate one round at a time can leave a plan far over the limit after
          every round (a first plan can time near twice its limit). Where that finds
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
        stage = self.stage = Stage(self.progress, f"verifying, {rounds} rounds at most", rounds)
        for r in range(rounds):
            plan = _plan([e.candidate for e in chosen], self.model)
            self.sets.setdefault(str(plan), list(chosen))
            # Refined in this process (seconds: a copy of the model), answered from a fresh one (a
            # row there is mostly the process's start and first kernels).
            row = self.measure_chosen(plan, isolate=False)
            # Grown into the room the plan surely leaves: its row's own time, or even its median in
            # turns, can leave room the plan does not have, and grown plans then go over the limit.
            nxt = self.search(self._rest(effects, chosen, dropped), self.metric(row), self.measured_t(row, upper=True)) \
                if grow and self.fits(row) and r + 1 < rounds else []
            if nxt and sum(e.saving for e in nxt) < SAME_MEMORY / (1 + SAME_MEMORY) * self.metric(row):
                nxt = []  # memory alike (final()'s band): it would answer with the faster plan, this one
            if any(slow <= _covered(chosen + nxt) for slow in over):
                nxt = []  # back into a set already over the time limit (more recompute only adds time)
            if not nxt and (self.fits(row) or self.by_memory):
                row = self.measure_chosen(plan)
            stage.done(str(plan))
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
            tried += self._pruned(chosen, in_base, tried[-1], rounds, stage)
        finer, plan = self.refined(self.sets.get(str(self.final(tried).plan), chosen) if tried else chosen)
        if plan is not None and plan not in {t.plan for t in tried}:
            self.sets.setdefault(str(plan), finer)
            row = self.measure_chosen(plan, isolate=False)
            stage.done(f"{plan} (each region refined to blocks)")
            row.role, row.round = "chosen", 1 + max([r.round or 0 for r in tried])
            tried.append(row)
        tried = self._fresh_answer(tried, stage)
        stage.end()
        self.stage = None
        return tried

    def _pruned(self, chosen: list[Effect], in_base: list[Effect], row: Row, rounds: int,
                stage: Stage | None = None) -> list[Row]:
        """A plan that fits the budget, measured with its costliest candidate dropped, while what
        is left fits measured and the one dropped would leave it within the budget even if its
        own saving counted in full. Savings were added to choose the set; a peak moves when a
        region is added, so two regions can save more together than apart, and the sum then
        asks for a candidate the budget does not need (and its recompute time). The rows
        measured here say; a set whose measured memory is what its sum said is not touched.
        ``stage`` is told as each plan's row ends."""
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
            if stage:
                stage.done(f"{plan} (its costliest candidate dropped)")
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

    def _fresh_answer(self, tried: list[Row], stage: Stage | None = None) -> list[Row]:
        """``tried`` with the answer's figures from a fresh process: a grown plan that fitted,
        followed by a larger one that did not, was measured in this process only (measured fresh
        now); one measured again after a drop has both rows (the fresh one kept). A fresh row
        that no longer fits (its process read more than this one) hands the answer on to the
        next best plan, which is measured fresh in turn: each plan once, so this ends. An answer over
        the time limit but within the budget (:meth:`holds`) is measured fresh too. ``stage`` is
        told as each fresh row ends."""
        done: set[str] = set()
        while self.rows.cuda:
            best = self.final(tried)
            if not self.holds(best) or str(best.plan) in done:
                break
            done.add(str(best.plan))
            fresh = self.measure_chosen(best.plan)  # from the cache where it was measured fresh already
            if stage:
                stage.done(f"{best.plan} (in a fresh process)")
            fresh.role, fresh.round = ("compiled" if best.role == "compiled" else "chosen"), best.round
            last = max(i for i, r in enumerate(tried) if r.plan == best.plan)
            tried = [fresh if i == last else r for i, r in enumerate(tried) if r.plan != best.plan or i == last]
        return tried

    def undominated(self, tried: list[Row], measured: list[Row], tries: int = 2) -> list[Row]:
        """``tried`` with the rows that would beat the answer verified: a row autoplan measured but
        did not verify (a candidate on top of the base, a plan an earlier call with the same cache
        verified) that reads as little memory (within :data:`SAME_MEMORY`, and within the budget;
        within :data:`BEATEN` where the least memory is the answer, as :meth:`unbeaten` reads it)
        in :data:`BEATEN` less time is measured as a chosen plan is (:meth:`measure_chosen`), and
        the answer is chosen again. No row of its own search then beats the answer on both axes
        beyond one row's noise, and a looser limit cannot answer with a plan that a tighter
        limit's answer beats (a looser limit's answer that keeps the tighter one's memory at more
        time). Where the least memory within a time limit is the
        answer (no budget, or ``maximize="batch"``), a row that reads at least
        :data:`SAME_MEMORY` less than the answer within the limit by its own time is verified
        too, the least memory first, once no faster row of alike memory is left to verify: the
        plans verified grow from the search's choice and shrink from it by dropping, and a
        candidate's own row may fit where none of them did (a whole-model step's row that reads
        less memory in less time than the model as it is). Where no plan verified meets the time
        limit, the answer
        is the model as it is (:func:`_answer`), and the rows are read against it, fresh too.
        Other answers outside the limits are not guarded. At most ``tries`` plans in all: each is
        a fresh process and a timing in turns."""
        least_within = self.max_t is not None and self.least_memory
        asked: set[str] = set()
        stage = None  # said once a row is to be verified: most calls verify none
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
            alike = (1 + (BEATEN if least_within else SAME_MEMORY)) * mem  # the window unbeaten() answers from
            better = [r for r in known if faster is not None and self.metric(r) <= alike
                      and (self.target is None or self.metric(r) <= self.target)
                      and r.profile.step_ms < (1 - BEATEN) * faster]
            better = better or [r for r in known if least_within and self.metric(r) <= (1 - SAME_MEMORY) * mem
                                and self.fits_time(r)]
            if not better:
                break
            stage = self.stage = stage or Stage(self.progress, "verifying rows that could beat the answer", tries)
            row = self.measure_chosen(min(better, key=self.metric).plan)
            stage.done(str(row.plan))
            asked.add(str(row.plan))
            if faster is None and not self.holds(best) and \
                    (row.profile is None or self.metric(row) > (1 - SAME_MEMORY) * mem):
                continue  # read fresh, no less than the model as it is: the answer there, not among the rows
            row.role, row.round = "chosen", 1 + max([r.round or 0 for r in tried])
            tried = tried + [row]
        if stage:
            stage.end()
        self.stage = None
        return tried

    def compiled(self, tried: list[Row], effects: list[Effect], mem: float, t: float, step: Plan) -> list[Row]:
        """Stage 5: the verified plan and the smallest set of candidates (whatever its eager time),
        each with ``step`` (a plan of one compile step) last, the verified plan's budgeted form
        (:func:`_budgeted`), and the smallest set's where it keeps a region, and the verified
        plan with every block checkpointed instead of its regions (:func:`_every_block`). With
        inductor on CUDA they compile side by side in fresh processes, and where two or more run
        at once and the plans run no CUDA graphs, each is measured in its own, and timed in turns
        there where its time can decide (:meth:`compile_ahead`). Otherwise each is measured as the
        verified plans are (:meth:`measure_chosen`) but in this process: the timing in turns
        compiles the plan here anyway, and a fresh process would compile it a second time (most of
        a compile=True call's time); without a budget (or
        with ``maximize="batch"``) one that reads more memory than a plan already within the
        limits is then not timed in turns (:meth:`outdone`). A plan that fails to compile is a
        row with its error."""
        final = self.final(tried).plan
        smallest = self.made("the smallest set of candidates", lambda: _plan(
            [e.candidate for e in _search(effects, mem, t, None, None, self.speedups)], self.model))
        refined = self.refined(self.sets[str(final)])[1] if str(final) in self.sets else None
        # The smallest set's budgeted form only where it keeps a region (a ResNet stem's
        # convolution): otherwise it differs from the verified plan's by whole-model steps at
        # most, and each plan here is a compilation (minutes on a large model).
        budgeted = [self.made("the answer's form under the partitioner's budget", lambda: _budgeted(final, step, self.model))]
        kept = None if smallest is None else self.made("the smallest set's form under the partitioner's budget",
                                                       lambda: _budgeted(smallest, step, self.model))
        if kept is not None and any(s.recomputes for s in kept.steps):
            budgeted.append(kept)
        grains = self.made("the stacks' blocks", lambda: blocks_by_depth(self.model)) or []
        every = [self.made(f"every block checkpointed, {len(blocks)} blocks",
                           lambda: _every_block(final, step, self.model, blocks)) for blocks in grains]
        plans = [p + step for p in (final, smallest, refined) if p is not None] + [p for p in [*budgeted, *every] if p is not None]
        plans = list(dict.fromkeys(plans))  # the same plan once
        there = self.compile_ahead(plans, step.steps[0], self.progress, tried)
        before = aot_autograd_cache_counts() if self.ahead else None
        rows = []
        stage = self.stage = Stage(self.progress, "compiled plans" + (", each compiling here" if len(there) < len(plans)
                                                                     else ""), len(plans))
        for plan in plans:
            if plan in there:
                result, matched, skipped, timings, _ = there[plan]
                row = self.rows.cache[str(plan), True] = as_row(plan, result, matched, skipped, "compiled")
                if timings is not None:
                    self.ratios[str(plan)] = timings
                row = dataclasses.replace(row)
            else:
                row = self.measure_chosen(plan, isolate=False, beside=tried + rows)
            row.role = "compiled"
            rows.append(row)
            stage.done(str(plan))
        if before is not None:
            self.ahead.hits, self.ahead.misses = (a - b for a, b in zip(aot_autograd_cache_counts(), before))
        self.stage = None
        return rows

    def refined(self, chosen: list[Effect]) -> tuple[list[Effect] | None, Plan | None]:
        """``chosen`` with its stage regions refined to blocks (:func:`_finer`), and its plan;
        (None, None) where nothing is refined or it cannot be made (:meth:`made`)."""
        def make() -> tuple[list[Effect] | None, Plan | None]:
            finer = _finer(chosen, self.model)
            return (finer, _plan([e.candidate for e in finer], self.model)) if finer else (None, None)

        return self.made("the answer with its regions refined to blocks", make) or (None, None)

    def made(self, what: str, make: Callable[[], Any]) -> Any:
        """What ``make`` returns, or None where it raises, said in :attr:`skipped`: a plan autoplan
        could not make on this model is left out, and the call goes on with the others."""
        try:
            return make()
        except Exception as exc:  # noqa: BLE001 - any failure inside a candidate is a note, never the call's end
            self.skipped.append(f"{what}: left out, its making raised {type(exc).__name__}: {exc}")
            return None

    def compile_ahead(self, plans: list[Plan], step: Step, progress: Progress | None,
                      beside: list[Row] = ()) -> dict[Plan, tuple]:
        """``plans`` compiled (and where they can be, measured and timed) elsewhere before this
        process measures the rest (:meth:`~.rows.Rows.compiled_ahead`): each measured there is
        timed in turns, least memory first, unless a row ``beside`` them or timed before it
        answers first (:class:`_Turn`). Returns those plans' rows and timings in turns, by plan.
        Only with inductor (the backend whose work is kept on disk), and not where ``step``'s mode
        tunes kernels as it compiles (``max-autotune``: chosen beside other processes, the choice
        would be kept in the cached graph)."""
        if step.backend != "inductor" or "max-autotune" in (step.mode or ""):
            return {}
        within = self.within(beside)
        turn = _Turn(self.metric, None if self.max_t is None else self.max_slowdown, self.tolerance, self.target,
                     None if within is None else tuple(within))
        there, ahead = self.rows.compiled_ahead(plans, step, turn, progress)
        if ahead is not None:
            self.ahead = ahead
        return there

    def unbeaten(self, answer: Row, ok: list[Row], least: float) -> Row:
        """The least-memory ``answer`` or a row of ``ok`` that beats it: one within :data:`BEATEN`
        of its memory and at least :data:`BEATEN` faster answers instead, again from there (the
        user asked for speed within the memory, and 6% of memory is noise next to 2x the speed).
        Never a row :data:`BEATEN` or more over ``least``, the least memory within the limits: that
        row would beat it in turn, and the memory asked for comes first. Each move is 10% faster,
        so the walk ends."""
        while True:
            mem, t = self.metric(answer), answer.profile.step_ms
            faster = [r for r in ok if self.metric(r) <= (1 + BEATEN) * mem and not _outdone(self.metric(r), [least])
                      and r.profile.step_ms <= (1 - BEATEN) * t]
            if not faster:
                return answer
            answer = min(faster, key=lambda r: (r.profile.step_ms, self.metric(r)))

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
            answer = min((r for r in ok if self.metric(r) <= least * (1 + SAME_MEMORY)), key=lambda r: r.profile.step_ms)
            return self.unbeaten(answer, ok, least)
        measured = [r for r in tried if r.profile is not None] or tried
        return min(measured, key=lambda r: self.metric(r) if r.profile else math.inf)
