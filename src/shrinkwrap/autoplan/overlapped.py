"""Rows for plans with the work around them overlapped: the mechanisms kept beside the sequential
path of ``rows.py``, each where a figure shows what it buys (docs/architecture.md, "autoplan's
processes"): the rows' fresh processes started ahead and primed with cuDNN's first-use calls, and
the compile stage's plans compiled ahead, side by side, and measured where they compiled. The
stages ask the same methods of :class:`OverlappedRows` as of :class:`~.rows.Rows`."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..compare import Progress, warm_process
from ..measuring import first_use
from ..measuring.progress import Stage
from ..measuring.step import resolve_device
from ..plan import Plan
from ..processes import PROCESS_MARGIN, FreshProcesses, compile_ahead
from ..processes.fresh import AHEAD
from ..step import Step
from .compiled import _Ahead
from .rows import Rows


class OverlappedRows(Rows):
    """:class:`~.rows.Rows` whose isolated rows run in processes started ahead: two (:data:`AHEAD`)
    while this process measures the candidates, each next one as a row starts, each making the
    calls of cuDNN's first use before its row (:class:`~shrinkwrap.processes.FreshProcesses`,
    :meth:`start_ahead`, :meth:`prime`); and whose compile stage compiles its plans ahead
    (:meth:`compiled_ahead`). autoplan takes it on CUDA where a fresh process can start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.primed: set[str] = set()  # the plans whose calls the fresh processes make (see prime)
        self.primed_none = False  # the first plan recorded made no call to prime

    @staticmethod
    def _processes(make: Callable[[], nn.Module], model: nn.Module) -> FreshProcesses:
        return FreshProcesses(make, sorted({type(m).__module__ for m in model.modules()}), ahead=True)

    def _replay_reserve(self) -> int | None:
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
        :data:`AHEAD` where the GPU has the room :meth:`_replay_reserve` asks for, else one (each
        holds a CUDA context)."""
        self.fresh.depth = AHEAD if self._replay_reserve() is not None else 1
        self.fresh.start_next()

    def prime(self, plan: Plan) -> None:
        """Record the library calls one iteration of ``plan`` makes here (cuDNN's, whose first use
        at each shape, layout and type costs a process seconds: see
        :mod:`~shrinkwrap.measuring.first_use`), and have the fresh processes started ahead make
        those they were not given yet before their rows (:meth:`FreshProcesses.prime`). The base
        is recorded as the candidates' rows end, and each plan verified as its row here is read,
        while the plan is timed in turns and before its row in a fresh process: a plan adds calls
        the base never made (a checkpoint's recompute runs its convolutions on autograd's thread,
        whose plans are its own; ``channels_last`` measured on top of a base without it), and a
        process primed with the base's calls alone still pays those. A replay makes a call only
        where its device has room for it beyond :meth:`_replay_reserve`. On CUDA only, where rows
        run in fresh processes; not for a compiled plan (its iteration here would compile it), and
        not once the first plan recorded made no such call."""
        keep = self._replay_reserve()  # None off CUDA
        if keep is None or self.unsendable or not first_use.SUPPORTED or str(plan) in self.primed or self.primed_none \
                or any(s.name == "compile" for s in plan.steps):
            return
        self.measured_here = True
        self.primed.add(str(plan))
        with first_use.recorded() as calls:
            ran = warm_process(self.local, plan, self.batch, dataclasses.replace(self.options_for(plan), warmup=1))
        # A model without convolutions or cuDNN attention makes none under any plan: one iteration
        # a verified plan would be spent recording nothing.
        self.primed_none = ran and not calls and len(self.primed) == 1
        if calls:
            self.fresh.prime(calls, keep)

    def compiled_ahead(self, plans: list[Plan], step: Step, turn: Any, progress: Progress | None
                       ) -> tuple[dict[Plan, tuple], _Ahead | None]:
        """Compile ``plans`` (those not measured yet) in processes side by side first
        (:func:`~shrinkwrap.processes.compile_ahead`), as many at once as the GPU's free memory
        holds at the baseline's peak each, on CUDA (``step``: the compile step, whose mode says
        whether the plans run CUDA graphs).

        Unless the plans run CUDA graphs, each is then measured there, one process at a time once
        all have compiled (in waves of as many as run at once, where fewer do), and timed in
        turns there, least memory first (within its wave), as ``turn`` (``compiled._Turn``) says.
        Returns those plans' rows and timings in turns, by plan, and the stage's record; the
        others this process compiles from the on-disk caches. A plan compiled cold takes minutes
        and from the caches seconds (benchmarks/RESULTS.md, "What compile=True pays per plan")."""
        if not self.cuda:
            return {}, None
        plans = [p for p in plans if (str(p), False) not in self.cache]  # measured here already: compiled
        if len(plans) < 2:
            return {}, None
        stage = Stage(progress, f"{len(plans)} plans compiled side by side in fresh processes"
                      + ("" if step.mode == "reduce-overhead" else ", then each measured there"), len(plans))
        started = time.perf_counter()
        self.fresh.stop_next()  # their CUDA contexts are no room for a plan
        base = self.cache.get(("", True))
        room = max(base.profile.peak or 0, base.profile.first_peak or 0) if base and base.profile else None
        # Not where the plans run CUDA graphs: the first iterations' graphs keep their pool in the
        # process, and a row measured there after them would read it.
        graphed = step.mode == "reduce-overhead"
        compiling: list[float] = []
        first: list[float] = []
        cached: list[int] = []

        def compiled(seconds: list[float], graphs: tuple[int, int]) -> None:
            compiling.append(time.perf_counter() - started)
            first.extend(s for s in seconds if not math.isnan(s))
            cached.extend(graphs)
            if not stage.i:  # one wave: the time left is the turns', not the compiling's
                stage.restart()
            stage.say(f"the last compiled after {compiling[0]:.1f} s; measuring each where it compiled, one at a time")

        at_once, out = compile_ahead(self.make, plans, self.batch, self.options_for(plans[0]), room,
                                     then=None if graphed else turn.row, compiled=compiled,
                                     after=None if graphed else turn.timed,
                                     finished=lambda i: stage.done(str(plans[i])))
        if not at_once:
            stage.end("fewer than two fit on the GPU at once: each compiles here instead")
            return {}, None
        there = {p: r for p, r in zip(plans, out) if isinstance(r, tuple)}
        # What failed there: a process's error, or a row's (a plan that failed to compile fails
        # again in its turn, its row alone on the GPU).
        errors = [e for e in out if isinstance(e, str)] + [r[0][1] for r in there.values() if isinstance(r[0], tuple)]
        return there, _Ahead(len(plans), at_once, time.perf_counter() - started, errors,
                             compiling=compiling[0] if compiling else None, first=first, cached=tuple(cached),
                             turns=[r[-1] for r in there.values()])
