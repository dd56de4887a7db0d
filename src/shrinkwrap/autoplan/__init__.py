"""Auto-plan: the plan that fits a memory budget at the highest speed, found by measuring.

The usual advice — "measure the effect at various levels and locations, then choose a set of
checkpointed modules so that you fit within your memory budget but incur the smallest throughput
impact" — done for the user, in stages. This package: :func:`autoplan` and the answer it
gives (here); candidates and the exact choice of a set (``choose.py``); the measuring stages
(``stages.py``), which ask for rows for plans and never make them (``rows.py``: one after
another; ``overlapped.py``: the work around them overlapped, on CUDA); the compile stage's
pieces (``compiled.py``). Step-time ratios in turns are
the measuring harness's (``shrinkwrap.measuring.ratios``).

1. Candidates come from the steps themselves (:meth:`shrinkwrap.step.Step.candidates`), found in
   the module tree, not in a list of model names: checkpoint regions over stages and groups of
   blocks, ``swish()`` and ``bn_act()`` where they apply, ``autocast(bfloat16)`` when lossy
   steps are allowed and the device runs bfloat16.
2. Each whole-model step (swish, bn_act, autocast) is measured alone against the baseline; the
   best of them within the limits (chosen as in 3.) form a base, and every other candidate is
   measured on top of it (on CUDA the peak and step time; without CUDA the bytes saved for
   backward and step time), but for regions whose forward alone takes longer than a time
   limit leaves, where no budget or compiling decides (the notes list them). A region's
   recompute is priced by its forward time on the base, every module timed in the same
   iterations (one row per region is noisier than the recompute), times the median of what the
   regions' rows read over their forwards.
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
   ``compile()`` as their last step, and the verified plan without its recompute
   steps with ``compile(memory_budget=0.6)``, where the compiler's partitioner chooses what to
   recompute, and the one-line recipe (every block a region, compiled); the best of every plan
   measured wins, and where an eager plan does, a note says why. Four compilations or so, not
   one per candidate: compiled, every plan runs faster than eager, so the smallest set usually
   fits a step-time limit that it missed eager. With inductor on CUDA (not ``max-autotune``) the
   plans compile side by side in fresh processes; where at least two run at once and none runs
   CUDA graphs (``reduce-overhead``), each is then measured in its own, one at a time once all
   (of its wave, where the GPU holds fewer at once) have compiled, and timed in turns there where
   its time can decide. Otherwise they are measured in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import re
import time
from typing import Any, Callable, Union

import torch
import torch.nn as nn

from .._tree import tensors, tree_map
from ..compare import Progress, describe_batch, measure_plans, progress_of
from ..fit import ITERATIONS, Probe, trains_under
from ..measuring.profile import LossFn, OptimizerFactory, Options, check_options
from ..measuring.progress import Stage
from ..measuring.ratios import CONFIDENCE, ratio_interval, slowdown_decided
from ..measuring.step import device_name, require_batch, resolve_device
from ..plan import Plan
from ..processes import model_maker
from ..report import Report, Row
from ..select import byte_count, count, flag, got, positive, wrong
from .choose import Effect, candidates, _priced, _effect_notes
from .compiled import _Ahead, _compile_step
from .overlapped import OverlappedRows
from .rows import Rows, _isolation
from .stages import SAME_MEMORY, _Search

Budget = Union[int, float, str, None]
CAP_TRIES = 3  # plans trained under the budget's cap before the search aims lower
CAP_ROUNDS = 3  # times the search aims lower before autoplan answers with no plan that trained
# How far under the least plan that did not train under the budget's cap the search aims next: an
# eager plan trains under a cap a few percent over its reading, and an answer read a few percent
# under its budget may not train under it (benchmarks/RESULTS.md, "What fits").
HEADROOM = 0.08
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_budget(budget: Budget, baseline: float) -> float | None:
    """Bytes from an int of at least 1 MiB (``8_000_000_000``) or a size with its unit (``"8GiB"``,
    ``"500MB"``, ``"100B"``, ``"1TiB"``), or a fraction of ``baseline`` from a number in (0, 1]
    (``0.5``, ``"0.5"``). Refused, each with what to write: an int under 1 MiB (``budget=2`` is
    surely not 2 bytes), a number above 1 without a unit (``1.5``, ``"1.5"``: as bytes it would be
    nothing, as a fraction more than the baseline), a bool, nan, inf, 0 and below, and text it
    cannot read (``"8G"``); text that reads as a number (``"1e9"``) is that number."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
        raise TypeError(f"shrinkwrap: a budget is bytes (an int, or text such as '8GiB') or a fraction of the "
                        f"baseline (0.5); got {got(budget)}")
    text = isinstance(budget, str)
    if text:
        m = re.fullmatch(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([kmgt]i?b|b)?\s*", budget.lower())
        if m and m.group(2):
            size = float(m.group(1)) * _UNITS[m.group(2)]
            if size <= 0:
                raise ValueError(f"shrinkwrap: a budget must be positive, got {budget!r}")
            return size
        try:  # text Python reads as a number ('0.5', '1e9', 'inf') is read as that number
            budget = float(m.group(1) if m else budget)
        except ValueError:
            raise ValueError(f"shrinkwrap: cannot read budget {budget!r}; write e.g. '4GiB', '500MB' or 0.5") from None
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"shrinkwrap: a budget is a positive finite size, got {budget!r}; write e.g. '4GiB', or "
                         "0.5 for half the baseline" + (", or leave it out (None) for none" if budget > 0 else ""))
    if isinstance(budget, numbers.Integral):
        return float(byte_count(budget, "autoplan()", "budget", as_text=True,
                                other=", or a fraction of the baseline such as 0.5"))
    if budget > 1:
        exact = f"'{int(budget)}B'" if text else str(int(budget))  # text (the CLI's) has no int form
        bytes_as = f"'{budget / 2**30:.3g}GiB' or {exact}" if budget >= 2**20 else f"'{budget:g}GiB'"
        raise ValueError(f"shrinkwrap: budget {budget!r} has no unit: a fraction of the baseline's memory is at "
                         f"most 1, and bytes need a unit: write e.g. {bytes_as}, or 0.5 for half the baseline")
    return budget * baseline


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
    progress: Progress | bool | None = None,
    compile: bool | str = False,
) -> tuple[Plan, Report]:
    """Find, by measuring, the plan that fits ``budget`` with the least slowdown.

    Args:
        model_or_factory: a function returning a fresh model, or a model (copied, never changed).
        batch: as :func:`shrinkwrap.measure`.
        budget: bytes (an int of at least 1 MiB), a string such as ``"4GiB"``, or a fraction of
            the baseline (``0.5``): see :func:`parse_budget`. The memory is the CUDA peak, or
            without CUDA the bytes saved for backward.
        max_slowdown: the most step time allowed, as a multiple of the baseline's (``1.0``: no
            slower; below 1, faster). Without a budget: the least memory within this limit.
        allow_lossy: also try lossy steps (``autocast(bfloat16)``).
        maximize: ``"speed"`` (default), or ``"batch"``: the largest batch (scaling ``batch`` along
            its first dimension) that fits ``budget`` with the least-memory plan within
            ``max_slowdown``.
        loss_fn, optimizer, device: as :func:`shrinkwrap.measure`.
        iterations: each row's timed iterations, as :func:`shrinkwrap.measure`; timing in turns
            runs rounds of its own size (:data:`~shrinkwrap.measuring.ratios.PER_ROUND`).
        warmup: iterations before a row is measured, as :func:`shrinkwrap.measure`; by default one
            for an eager plan (its second iteration is steady) and two for a compiled one.
        tolerance: how far over ``max_slowdown`` a plan may time and still count as within it.
            A chosen plan is timed in turns with the baseline in one process, five rounds of three
            iterations and more until an 80% interval of the ratio lies within or over the limit
            (at most 15), and the limit is decided on the median ratio (:func:`slowdown_decided`).
        isolate_candidates: measure each candidate in its own process too. By default candidates
            are measured in this process (a fresh model each, caches emptied: seconds instead of
            a process start each), and every chosen plan that fits in this process again in a
            fresh process on CUDA, so the figures autoplan answers with are isolated ones.
        cache: a dict to keep measurements in, keyed by plan text; pass the same dict to calls
            with the same model and batch (say ``max_slowdown=1.0`` then ``1.5``) to measure each
            candidate once.
        progress: ``True`` for a bar on stderr (:class:`~shrinkwrap.ProgressBar`; a call takes
            seconds to minutes, more with ``compile``), or a function called as
            ``progress(i, n, text)`` as each stage starts and as each of its items ends (a row
            measured, a plan verified or compiled, a probe): ``i`` of the stage's ``n`` done, the
            text the stage, the time left, and the item.
        compile: also try the plans compiled (stage 5 above): ``True`` for ``compile()``, or the
            compile step's text (``"compile(mode='max-autotune')"``). The answer may then end in
            ``compile()`` (or ``compile(memory_budget=0.6)``, the plan's recompute steps left to
            the compiler, where the step sets no budget, compiles the whole model and its backend
            partitions: see ``_budgeted``); candidates are still measured eager.

    Returns ``(plan, report)``: the report lists the baseline, every candidate measured, the
    chosen plan's measurements and, in its notes, why each candidate was taken or left. A budget
    that cannot be reached is an answer, not an error: the notes say so and name the smallest
    memory found, which is the returned plan's. Where plans fit the budget but none the time
    limit, the answer is the fastest of them; a time limit without a budget that no plan meets
    is answered with the empty plan (the model as it is). The notes say which.

    Example::

        >>> plan, report = sw.autoplan(make_model, batch, budget=0.6, max_slowdown=1.3, progress=True)
        >>> print(report); sw.apply(model, plan)
    """
    # Every argument is checked before anything is measured: a misread one costs minutes.
    if budget is None and max_slowdown is None:
        raise ValueError("shrinkwrap: autoplan needs a budget, a max_slowdown, or both")
    parse_budget(budget, 1.0)
    positive(max_slowdown, "autoplan()", "max_slowdown", none=True,
             what=", the baseline's step time times this (1.2: at most 20% slower; below 1: faster)")
    positive(tolerance, "autoplan()", "tolerance", zero=True, below=1,
             what=", a fraction of max_slowdown (0.03: 3% over it still counts as within)")
    count(rounds, "autoplan()", "rounds")
    count(warmup, "autoplan()", "warmup", none=True)
    for key, value in (("allow_lossy", allow_lossy), ("isolate_candidates", isolate_candidates)):
        flag(value, "autoplan()", key)
    if cache is not None and not isinstance(cache, dict):
        raise TypeError(wrong("autoplan()", "cache= a dict (to keep measurements in) or None", cache))
    if maximize not in ("speed", "batch"):
        raise ValueError(f"shrinkwrap: maximize is 'speed' or 'batch', got {maximize!r}")
    if maximize == "batch" and budget is None:
        raise ValueError("shrinkwrap: maximize='batch' needs a budget")
    check_options("autoplan()", loss_fn, optimizer, iterations, 2 if warmup is None else warmup, device)
    require_batch(batch, "autoplan()")
    compile_step = _compile_step(compile)
    progress = progress_of(progress)
    make = model_maker(model_or_factory, "autoplan()")
    probe = make()
    if not isinstance(probe, nn.Module):
        raise TypeError(wrong("autoplan()", "a model or a function returning one", make, f", which returned {got(probe)}"))
    options = Options(loss_fn, optimizer, iterations, 2 if warmup is None else warmup, device)
    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    rows = _rows_for(make, probe, batch, options, cuda, {} if cache is None else cache, warmup)
    # The rows keep copies on the CPU and let a model built on the GPU go: so must this frame, for
    # the baseline to be measured first with nothing on the GPU (rows.Rows).
    del probe
    with contextlib.closing(rows):
        answer = _autoplan(rows, rows.probe, dev, budget, max_slowdown, allow_lossy, maximize, rounds, tolerance,
                           isolate_candidates, progress, compile_step)
    if progress:
        progress(1, 1, "done")  # a bar ends its line
    return answer


def _rows_for(make: Callable[[], nn.Module], model: nn.Module, batch: Any, options: Options, cuda: bool,
              cache: dict, warmup: int | None) -> Rows:
    """Where autoplan's rows come from: the plain sequential path (:class:`~.rows.Rows`), and on
    CUDA, where rows run in fresh processes, that path with the work around them overlapped
    (:class:`~.overlapped.OverlappedRows`; what each mechanism buys: docs/architecture.md,
    "autoplan's processes"). Where no fresh process can start, the overlapped rows do what the
    sequential ones do."""
    return (OverlappedRows if cuda else Rows)(make, model, batch, options, cuda, cache, warmup)


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
    if not search.holds(final) and search.least_memory:
        return base, ["no plan found within the step-time limit; the answer is the empty plan (the model as it "
                      "is)" + (f"; the smallest memory verified is {found}" if len(final.plan) else "")]
    if search.holds(final) and not search.by_memory:
        return final, [f"no plan found within both limits; the fastest within the budget is {found}"]
    return final, [f"no plan found within the limits; the smallest memory found is {found}"]


def _autoplan(rows: Rows, probe: nn.Module, dev: torch.device, budget: Budget, max_slowdown: float | None,
              allow_lossy: bool, maximize: str, rounds: int, tolerance: float, isolate_candidates: bool,
              progress: Progress | None, compile_step: Plan | None) -> tuple[Plan, Report]:
    make, batch, options, cuda = rows.make, rows.batch, rows.options, rows.cuda
    skipped: list[str] = []
    cands = candidates(probe, allow_lossy=allow_lossy, device=dev, budget=budget is not None, optimizer=options.optimizer,
                       skipped=skipped)
    stage = Stage(progress, "baseline", 1)
    # Candidates are compared with a baseline measured the same way (in this process unless asked
    # otherwise); the budget and the chosen plans with a baseline measured as the chosen plans are,
    # each in a fresh process on CUDA, or as fresh: first in this process, where nothing of it is
    # on the GPU yet (see rows.Rows).
    base = rows([Plan()], True)[0]
    stage.done()
    if base.profile is None and base.status == "oom":
        raise RuntimeError(f"shrinkwrap: the model as it is runs out of memory at this batch ({base.error}), and "
                           "autoplan measures every plan against it: pass a batch it fits at (with a budget, "
                           "maximize='batch' then finds the largest batch the answer fits at), or predict this "
                           "batch's peak under a plan on the CPU with sw.estimate")
    if base.profile is None:
        raise RuntimeError(f"shrinkwrap: the baseline itself could not be measured: {base.error}")
    if cuda:  # the chosen plans' processes, started while the candidates are measured (none without CUDA)
        rows.start_ahead()
    report = Report([base], str(dev), device_name(dev), torch.__version__,
                    model=getattr(make, "__name__", type(make).__name__), batch=describe_batch(batch),
                    isolation=_isolation(rows, isolate_candidates))
    base_mem, base_t = float(report.value(base)), base.profile.step_ms
    target = parse_budget(budget, base_mem)
    if target is not None and base_mem <= target and maximize == "speed":
        report.notes = [f"baseline: {base_mem / 2**20:.1f} MiB within the budget of {target / 2**20:.1f} MiB: "
                        "the empty plan"]
        checked, said = _under_cap([base], rows, target, progress) if dev.type == "cuda" else (base, [])
        report.notes += said
        if checked is not None:
            return Plan(), report
        report.notes.append("the model as it is did not train under the budget's cap: autoplan searches on")
    # A copy of the report without its rows reads rows: it travels to the processes ahead light.
    search = _Search(rows, probe, dataclasses.replace(report, rows=[], notes=[]).value, base_mem, base_t, target,
                     None if max_slowdown is None else max_slowdown * base_t, isolate_candidates, maximize == "batch",
                     max_slowdown, tolerance, progress=progress, skipped=skipped)

    started = time.perf_counter()
    in_base, whole_rows, baseline = search.base([c for c in cands if not c.covers])
    base_steps = tuple(s for e in in_base for s in e.candidate.steps)
    # What the base took, and what cannot share a plan with it (another step_in_backward), is not
    # measured on top of it.
    rest = [c for c in cands if all(c is not e.candidate and not c.overlaps(e.candidate) for e in in_base)]
    # Without a budget the time limit decides, and a region that cannot fit it is not worth a row;
    # compiled plans run faster than eager ones, and a budget comes before time: all measured.
    prune = target is None and not search.by_memory and compile_step is None
    effects, top_rows, start_mem, start_t, forward = search.on_top(base_steps, rest, baseline, prune)
    report.rows += [*whole_rows, *top_rows]
    # Stage 3: the search, exact over what was measured.
    priced = _priced(effects, forward)  # the measured figures stay in `effects`, for the notes
    chosen = in_base + search.search(priced, start_mem, start_t, None if search.by_memory else target)
    effects = in_base + effects
    measured = time.perf_counter()
    tried = search.verify(list(chosen), in_base, in_base + priced, rounds, (start_mem, start_t))
    chosen = search.sets.get(str(search.final(tried).plan), chosen)  # what the verified answer is made of
    compiling = None
    if compile_step is not None:
        compiling = time.perf_counter()
        tried += search.compiled(tried, effects, start_mem, start_t, compile_step)
        compiling = time.perf_counter() - compiling
    # Rows measured but not verified, this call's and the plans an earlier call with the same cache
    # verified, where one would beat the answer: measured as a chosen plan is (see undominated).
    earlier = _answerable(rows.cache, cands, compile_step, allow_lossy)
    tried = search.undominated(tried, [*report.rows[1:], *earlier])
    verified = time.perf_counter()
    final, unmet = _answer(search, tried, base)
    capped: list[str] = []
    if cuda and target is not None and maximize == "speed" and search.fits(final):
        # Read within the budget is not trained within it: the answer is trained under a cap of the
        # budget first. Where the plans tried do not train, the search aims below them by the
        # margin a fit takes over a reading (HEADROOM), and its plan is verified and tried in turn.
        aim, cap_tried = target, 0
        while True:
            left = [r for r in tried if search.fits(r) and r.fits is not False and search.metric(r) <= aim]
            order = []
            while left and len(order) < CAP_TRIES:
                order.append(search.final(left))
                left = [r for r in left if r is not order[-1]]
            checked, notes = _under_cap(order, rows, target, progress)
            capped += notes
            cap_tried += len(order)
            if checked is not None or cap_tried >= CAP_ROUNDS * CAP_TRIES or not order:
                break
            aim = min(search.metric(r) for r in order) * (1 - HEADROOM)
            capped.append(f"aiming at {aim / 2**20:.1f} MiB, {HEADROOM:.0%} under the least plan that did not train "
                          f"under the cap")
            search.target = aim
            try:
                again = in_base + search.search(priced, start_mem, start_t, aim)
                tried += search.verify(again, in_base, in_base + priced, rounds, (start_mem, start_t))
            finally:
                search.target = target
        if checked is None:
            least = min((r for r in tried if r.profile is not None), key=search.metric)
            unmet = [f"no plan measured within the budget trained under a cap of it ({cap_tried} tried); "
                     f"the answer is the one that reads the least memory, {search.metric(least) / 2**20:.1f} MiB"]
            final = least
        else:
            final = checked
    chosen = [] if final is base else _made_of(search, final.plan, effects, chosen)  # for the notes

    # What answers the question first (the limits, whether they were met, the plan); then why.
    notes = [f"baseline: {base_mem / 2**20:.1f} MiB ({report.metric}), {base_t:.1f} ms per step", *report.notes]
    if target is not None:
        notes.append(f"budget: {target / 2**20:.1f} MiB")
    if search.max_t is not None:
        notes.append(f"step-time limit: {search.max_t:.1f} ms ({max_slowdown}x the baseline)")
    notes += [*unmet, *capped, f"plan: {final.plan or '(none: the model as it is)'}"]
    if rows.unsendable:
        notes.append(f"every row measured in this process, none in a fresh one: {rows.unsendable}")
    if compile_step is not None and final.role != "compiled":
        notes.append(_eager_won(search, tried, final))
    notes += _bill_cut(base, final)
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
    notes += search.skipped
    notes += [f"left unmeasured: {c}: its forward takes {cost:.1f} ms, more than the {max(room, 0.0):.1f} ms the "
              f"step-time limit leaves on top of {Plan(base_steps) or 'the model as it is'}"
              for c, cost, room in search.unmeasured]
    notes.append(f"autoplan's own time: {measured - started:.1f} s measuring {len(cands) - len(search.unmeasured)} "
                 f"candidates (in {'subprocesses' if isolate_candidates and cuda else 'this process'}"
                 f"{f'; {len(search.unmeasured)} more left unmeasured' if search.unmeasured else ''}), "
                 f"{verified - measured:.1f} s verifying {len(tried)} plan(s) (in this process, and one that "
                 "fits there again in a fresh process on CUDA, compiled ones where they compiled; each timed in "
                 "turns with the baseline)")
    if compiling is not None:
        notes.append(f"of which {compiling:.1f} s in the compile stage ({sum(r.role == 'compiled' for r in tried)} "
                     "compiled plans)")
    if search.ahead:
        notes.append(_ahead_note(search.ahead))
    report.rows = _last_of_each(report.rows + tried)
    notes.append("frontier (no other row measured reads less memory in less time): " + "; ".join(
        f"{r.plan or 'the model as it is'}: {report.value(r) / 2**20:.1f} MiB, {r.profile.step_ms:.1f} ms"
        for r in report.frontier()))
    report.notes = notes
    if maximize == "batch":
        return final.plan, _largest_batch(make, final.plan, batch, target, report, options, progress)
    return final.plan, report


def _ahead_note(ahead: _Ahead) -> str:
    """Where the compile stage's seconds went, for the notes (after autoplan's own time)."""
    rest = ahead.plans - ahead.measured
    rows, timed = [r for r, _ in ahead.turns], [t for _, t in ahead.turns if t is not None]
    return (f"of which {ahead.seconds:.1f} s compiling {ahead.plans} plan(s) ahead, {ahead.at_once} processes at once"
            + (f" (the last compiled after {ahead.compiling:.1f} s; each plan's first iterations took "
               f"{_span(ahead.first)} s" + (f", {ahead.cached[0]} graph(s) from the compiler's on-disk caches and "
                                            f"{ahead.cached[1]} anew" if ahead.cached else "") + ")"
               if ahead.compiling is not None else "")
            + (f", and measuring {ahead.measured} of them there, one at a time (a row {_span(rows)} s"
               + (f", and timing {len(timed)} in turns {_span(timed)} s" if timed else "") + ")" if ahead.measured else "")
            + (f"; {rest} measured in this process, which compiled {ahead.hits} graph(s) from the compiler's "
               f"on-disk caches and {ahead.misses} anew" if rest else "")
            + (f"; {len(ahead.errors)} failed there, the first with {ahead.errors[0]}" if ahead.errors else ""))


def _span(seconds: list[float]) -> str:
    """``seconds`` as their least and most (one figure where they are one)."""
    low, high = f"{min(seconds):.1f}", f"{max(seconds):.1f}"
    return low if low == high else f"{low}-{high}"


def _answerable(cache: dict, cands: list, compile_step: Plan | None, allow_lossy: bool) -> list[Row]:
    """The rows an earlier call with the same cache measured in fresh processes whose plans this
    call could answer with: made of the steps of its candidates (and its compile step), lossy
    ones only where it allows them. A cache shared by a call with lossy steps, a budget or
    ``compile`` would otherwise hand a call without them a plan it ruled out."""
    kinds = {type(s) for c in cands for s in c.steps} | {type(s) for s in (compile_step.steps if compile_step else ())}
    return [r for (text, fresh), r in cache.items() if fresh and text and all(
        type(s) in kinds and (allow_lossy or not s.lossy) for s in r.plan.steps)]


_TERMS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"))


def _made_of(search: _Search, plan: Plan, effects: list[Effect], verified: list[Effect]) -> list[Effect]:
    """The candidates the answer ``plan`` is made of: the set it was verified as; or, for a row
    verified as it was measured (a candidate on top of the base, a whole-model step alone: see
    :meth:`_Search.undominated`), the candidates whose steps make it up; or else (a compiled
    form of the verified plan) the ``verified`` plan's."""
    made = search.sets.get(str(plan))
    if made is not None:
        return made
    made = [e for e in effects if e.candidate.steps and all(s in plan.steps for s in e.candidate.steps)]
    if sorted(str(s) for e in made for s in e.candidate.steps) == sorted(str(s) for s in plan.steps):
        return made
    return verified


def _bill_cut(base: Row, final: Row) -> list[str]:
    """A note where the answer cuts the bill beyond activations (a step in backward, the state on
    the CPU, half-precision weights): which terms, from what to what; and, where it steps the
    optimizer in backward, that the step's options are the optimizer's defaults until set."""
    if final is base or base.profile is None or final.profile is None:
        return []
    cut = [f"{label} {getattr(base.profile, key) / 2**20:.1f} -> {getattr(final.profile, key) / 2**20:.1f} MiB"
           for key, label in _TERMS if getattr(final.profile, key) < 0.99 * getattr(base.profile, key)]
    notes = [f"the answer cuts more than activations: {', '.join(cut)}"] if cut else []
    if any(s.name == "step_in_backward" for s in final.plan.steps):
        notes.append("the optimizer steps inside backward at its defaults: give the step your options "
                     "(options={'lr': ...}) and train with sw.optimizer(model) as the optimizer")
    return notes


def _eager_won(search: _Search, tried: list[Row], final: Row) -> str:
    """Why an eager plan answers where the compile stage measured compiled ones: each compiled
    plan's failure, the limit it missed, or what the answer does better."""
    def why(r: Row) -> str:
        if r.profile is None:
            return f"failed ({r.error})"
        mem = search.metric(r)
        if search.target is not None and mem > search.target:
            return f"over the budget ({mem / 2**20:.1f} MiB)"
        if r.fits is False:
            return "did not train under the budget's cap"
        if str(r.plan) not in search.ratios and search.outdone(r, tried):
            return f"more memory ({mem / 2**20:.1f} MiB; not timed in turns)"
        if not search.fits_time(r):
            return f"over the step-time limit ({r.profile.step_ms:.1f} ms)"
        if final.profile is None or not search.least_memory or \
                mem <= (1 + SAME_MEMORY) * search.metric(final):
            return f"slower ({r.profile.step_ms:.1f} ms)"
        return f"more memory ({mem / 2**20:.1f} MiB)"

    return "the answer is eager; the compiled plans measured: " + "; ".join(
        f"{r.plan}: {why(r)}" for r in tried if r.role == "compiled")


def _last_of_each(rows: list[Row]) -> list[Row]:
    """``rows`` with one row per plan, its last (a plan verified in a fresh process, not its
    candidate row), the baseline first."""
    last = {str(r.plan): r for r in rows[1:]}
    return rows[:1] + [r for r in rows[1:] if last[str(r.plan)] is r and str(r.plan) != str(rows[0].plan)]


def _under_cap(rows_in_order: list[Row], rows: Rows, cap: float, progress: Progress | None = None
               ) -> tuple[Row | None, list[str]]:
    """The first of ``rows_in_order`` whose plan trains its first iterations on a fresh model in a
    fresh process whose allocator may reserve at most ``cap`` bytes (:func:`shrinkwrap.trains_under`),
    marked on the row, and a note per plan tried. (None, notes) where none does, or where the rows
    cannot be sent to a fresh process (a note says so). ``progress`` is told as each probe ends."""
    notes = []
    if rows.unsendable:  # read on CUDA, where this is called
        return rows_in_order[0] if rows_in_order else None, [
            f"not trained under the budget's cap (it trains in fresh processes): {rows.unsendable}"]
    stage = Stage(progress if rows_in_order else None, f"training under the budget's cap of {cap / 2**20:.0f} MiB",
                  len(rows_in_order))
    for row in rows_in_order:
        probe: Probe = trains_under(rows.make, rows.batch, int(cap), row.plan, rows.options_for(row.plan))
        stage.done(f"{row.plan or 'the model as it is'} {'trained' if probe.ok else 'did not train'}")
        if probe.ok:
            row.trained_under = int(cap)
            notes.append(f"fits in {cap / 2**20:.0f} MiB: {row.plan or 'the model as it is'} trained {ITERATIONS} iterations "
                         f"under a {cap / 2**20:.0f} MiB cap (the allocator reserved at most {probe.reserved / 2**20:.0f} MiB)")
            stage.end()
            return row, notes
        row.fits = False  # read within the budget, but not trained under its cap
        notes.append(f"{row.plan or 'the model as it is'} reads within the budget but did not train under a "
                     f"{cap / 2**20:.0f} MiB cap: {probe.error}")
    return None, notes


def scale_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples: tensors are cut or repeated along their first dimension."""
    return tree_map(lambda t: t.repeat(math.ceil(n / t.shape[0]), *([1] * (t.dim() - 1)))[:n], batch)


def _largest_batch(make: Callable[[], nn.Module], plan: Plan, batch: Any, target: float | None, report: Report,
                   options: Options, progress: Progress | None = None, tries: int = 8) -> Report:
    first = next(tensors(batch))
    lo, hi = 0, None
    n = first.shape[0]
    stage = Stage(progress, "the largest batch that fits", tries)
    for _ in range(tries):
        row = measure_plans(make, [plan], scale_batch(batch, n), options).rows[0]
        stage.done(f"batch {n}")
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
    stage.end()
    report.notes.append(f"largest batch that fits the budget: {lo} (plan: {plan})" if lo else
                        "no batch size fits the budget with this plan")
    return report
