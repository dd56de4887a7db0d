"""What autoplan may try and which set of it to take: candidates from the steps, and the set
chosen exactly (branch and bound) over measured savings and costs, with recomputes priced by
their forward time. No measuring here."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable

import torch
import torch.nn as nn

from ..measuring.step import resolve_device
from ..plan import Plan
from ..report import Row
from ..step import Candidate, Context, registered

SAME_MEMORY = 0.02  # plans whose memory differs by less are alike in it: the faster is the answer
BEATEN = 0.10  # a plan within this of the answer's memory and this much faster answers instead (stages.unbeaten);
# a row this much faster is verified (one row's time is noisy); and this much of the time limit is added
# to the room regions are left unmeasured against (on_top)


def _outdone(mem: float, within: list[float]) -> bool:
    """Whether a plan that reads ``mem`` gives way, whatever its time, to a plan within the limits
    that reads one of ``within``, where the answer is the least memory within them: one that reads
    :data:`BEATEN` or more less (within that, a faster plan may answer: ``_Search.unbeaten``)."""
    return any(m <= (1 - BEATEN) * mem for m in within)


def _timing_decides(mem: float | None, target: float | None, within: list[float] | None) -> bool:
    """Whether timing a plan that reads ``mem`` (None: its row has no figure) in turns with the
    baseline can decide anything: within the budget ``target``, and where the answer is the least
    memory within the limits (``within``: what the rows within them read; None where the answer is
    the fastest plan within the budget), not :func:`_outdone` by one of them."""
    return mem is not None and (target is None or mem <= target) and not (within is not None and _outdone(mem, within))


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


def candidates(model: nn.Module, *, allow_lossy: bool = False, device: str | torch.device | None = None,
               max_groups: int = 4, budget: bool = False, optimizer: Any = None,
               skipped: list[str] | None = None) -> list[Candidate]:
    """What autoplan may try on ``model``: every registered step's candidates, in plan order
    (``budget``: a memory budget was given; ``optimizer``: the caller's optimizer factory). A step
    whose search raises on this model offers none, and says why in ``skipped`` (where given; else
    the error is raised): a model no step was written for costs that step, not the call."""
    context = Context(allow_lossy, resolve_device(device), max_groups, budget, optimizer)
    out = []
    for cls in registered():
        try:
            out += cls.candidates(model, context)
        except Exception as exc:  # noqa: BLE001 - a step's own failure on an unseen model is a note
            if skipped is None:
                raise
            skipped.append(f"{cls.name}(): no candidates, its search on this model raised {type(exc).__name__}: {exc}")
    return out


def _plan(chosen: list[Candidate], model: nn.Module) -> Plan:
    """The candidates' steps, merged by their class (regions by name become one regex), in the
    order each step class says (checkpoints first, precision last)."""
    steps = [s for c in chosen for s in c.steps]
    classes = registered()
    merged = [m for cls in classes for m in cls.merge([s for s in steps if type(s) is cls], model)]
    return Plan(sorted(merged + [s for s in steps if type(s) not in classes], key=lambda s: s.order))


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


def _priced(effects: list[Effect], forward: dict[str, float]) -> list[Effect]:
    """``effects`` as the search weighs them. A region that recomputes costs its forward time on
    the base (``forward``: every module timed in the same iterations; the recompute runs that
    forward again) times what the regions' rows read over their forwards, taken as the median
    of those ratios and no less than 1: checkpointing has its own overhead (on a CPU its rows read
    about 3 times their forward). Where the forward was not timed, a region costs what its row
    read, but no less than nothing.

    A row is three iterations, and one row differs from the next by more than a region's
    recompute (two blocks alike in every way can read a cost and a saving of time): taken as
    free, the search would choose every region, and its first plans time far over the limit."""
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
