"""Rows for plans: the one interface the measuring stages ask (:class:`Rows`), and its plain
sequential path.

The stages ask ``rows(plans, isolate)`` for one row per plan and read nothing of how a row is made.
Here every row is measured when it is asked for, one after another: in this process on a copy of
the model, or (``isolate``, on CUDA) in a new spawned process started as the row is asked.
``overlapped.py`` adds, behind the same methods, only what a figure shows it buys (processes
started ahead and primed, plans compiled ahead side by side: docs/architecture.md, "autoplan's
processes").
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from typing import Any, Callable

import torch
import torch.nn as nn

from .._compat import clear_cublas_workspaces
from ..compare import Progress, measure_plans
from ..measuring.profile import Options
from ..measuring.step import resolve_device
from ..measuring.turns import forward_times, time_interleaved
from ..plan import Plan
from ..processes import FreshProcesses
from ..processes.copies import build_model, ModelCopies
from ..processes.sendable import why_unsendable
from ..report import Row
from ..step import Step


class Rows:
    """Rows for plans, each plan measured once (keyed by its text and whether it ran isolated), one
    after another.

    Rows in this process are built from copies of one model the factory made (building a model
    can take a large part of a candidate's row) and skip the per-module log; isolated rows run in
    a fresh process each, started when the row is asked for. :meth:`start_ahead`, :meth:`prime`
    and :meth:`compiled_ahead` are the points where ``overlapped.OverlappedRows`` overlaps that
    work; here they do nothing.

    Example::

        >>> with contextlib.closing(Rows(make, make(), batch, Options(), cuda=False, cache={})) as rows:
        ...     baseline, swished = rows([Plan(), Plan.parse("swish()")], isolate=False)
    """

    def __init__(self, make: Callable[[], nn.Module], model: nn.Module, batch: Any, options: Options, cuda: bool,
                 cache: dict, warmup: int | None = None) -> None:
        self.make, self.batch, self.options, self.cuda, self.cache = make, batch, options, cuda, cache
        self.warmup = warmup
        self.local = _copies_of(make, model)
        # The model to read names from: the copy kept on the CPU, where there is one, so that the
        # factory's model, which may be on the GPU, can go (it is never moved: a factory may hand
        # out one shared model).
        self.probe = self.local.model if isinstance(self.local, ModelCopies) and self.local is not make else model
        self.fresh = self._processes(make, model)
        # Why no fresh process can start (see why_unsendable), or None: every row is then measured here.
        self.unsendable = why_unsendable((make, batch, options)) if cuda else None
        self.measured_here = False  # whether a row has run in this process
        self.foreign: int | None = None  # what the process held on the GPU before the first row (see held)

    def options_for(self, plan: Plan) -> Options:
        """The options ``plan``'s rows are measured and timed with. Unless the caller set ``warmup``:
        one warm-up iteration for an eager plan, whose first iteration makes what the optimizer
        keeps, so that the second, the one measured, is steady (a CUDA test checks that its peak is
        two warm-ups' to the byte); two for a compiled plan, which dynamo may compile again on its
        second call. One iteration less per candidate, across every candidate of a call."""
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
        """One row per plan, in order, each measured once: with ``isolate`` on CUDA in a fresh
        process (unless none can start), else in this process.

        Args:
            plans: the plans to measure.
            isolate: whether the rows are a fresh process's (the figures autoplan answers with).

        Returns:
            A copy of each plan's row, so that a caller may set its role and round.
        """
        if self.foreign is None:
            self.foreign = self.held()
        isolate = isolate and self.cuda and not self.unsendable  # a subprocess buys nothing without CUDA
        todo = [p for p in plans if (str(p), isolate) not in self.cache]
        empty = next((p for p in todo if not p.steps), None)
        if isolate and empty is not None and not self.measured_here and self.untouched():
            # The baseline, before any row in this process and with nothing of it on the GPU: it
            # sees what a fresh process would (every byte of its peak its own), without a process's
            # start (seconds). The row serves both keys.
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
        return build_model(self.local, resolve_device(self.options.device), plan)

    def warm_up(self, plan: Plan) -> None:
        """Run ``plan`` for a few iterations in this process, unless its row ran here already:
        what its layout and types use first (cuDNN's choice of kernels) is then not in its row.
        Measured cold, a base under a new layout or type reads slow, every candidate on top of it
        reads faster than it, and the search takes them all."""
        if (str(plan), False) not in self.cache:
            self.measured_here = True
            try:
                time_interleaved({"warm-up": self.model(plan)}, self.batch, self.options_for(plan), rounds=1,
                                 per_round=2)
            except Exception:  # noqa: BLE001 - the plan's row records what failed, as a row and a note
                pass

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
        measured here would read them as its own, and a budget set from fresh figures could find no
        plan. Nothing without CUDA, or before CUDA has started."""
        if not self.cuda or not torch.cuda.is_initialized():
            return 0
        gc.collect()  # a model in a reference cycle waits for the collector
        # cuBLAS's workspaces from the caller's matmuls would be the rows' own in a fresh process:
        # let go, they are made again by the first row that needs them, and count there.
        clear_cublas_workspaces()
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

    # What overlapped.OverlappedRows overlaps; nothing on this sequential path.

    @staticmethod
    def _processes(make: Callable[[], nn.Module], model: nn.Module) -> FreshProcesses:
        """Where isolated rows run: a new process each, started as the row is asked for."""
        return FreshProcesses(make)

    def start_ahead(self) -> None:
        """Start the processes of the rows to come, before they are asked for."""

    def prime(self, plan: Plan) -> None:
        """Have the processes of the rows to come make ``plan``'s first-use library calls early."""

    def compiled_ahead(self, plans: list[Plan], step: Step, turn: Any, progress: Progress | None
                       ) -> tuple[dict[Plan, tuple], Any]:
        """``plans`` compiled (and where they can be, measured) elsewhere first: here none are.
        Returns what each plan measured there gave, by plan, and a record of the stage
        (``compiled._Ahead``), or None."""
        return {}, None

    def close(self) -> None:
        self.fresh.close()



def _isolation(rows: Rows, isolate_candidates: bool) -> str:
    """Where the report's rows were measured, for its header."""
    if not rows.cuda or rows.unsendable:
        return "in this process"
    where = "in subprocesses" if isolate_candidates else "candidates in this process, chosen plans in subprocesses"
    return where + ("; the baseline first in this process, with nothing else on the GPU" if rows.baseline_here
                    else "; the baseline in a subprocess")



def _copies_of(make: Callable[[], nn.Module], model: nn.Module) -> Callable[[], nn.Module]:
    """Fresh models for rows in this process: copies of ``model``, new from ``make`` and untouched,
    kept on the CPU; ``make`` itself where the model cannot be copied."""
    if isinstance(make, ModelCopies):
        return make
    try:
        return ModelCopies(copy.deepcopy(model).to("cpu"))
    except Exception:  # noqa: BLE001 - deepcopy fails in many ways (locks, open files, C handles)
        return make

