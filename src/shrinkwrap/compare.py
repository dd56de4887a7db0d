"""Plans, measured side by side, each configuration in isolation.

:func:`measure_plans` measures a list of plans, one row each: every row is a fresh model (from
the factory, or a copy of the given instance) with its plan applied, measured by the one harness
(:func:`shrinkwrap.measuring.step.measure`). :func:`plan_report` is the baseline and then the plan's
steps applied one after another; autoplan measures its candidates. This module sits above
``report`` (it builds reports) and below ``autoplan``. On
CUDA each row runs in a fresh subprocess (``spawn``), so allocator caches and cuDNN workspaces of
one row cannot leak into the next; where the row cannot be sent to a subprocess (a lambda in the
plan, an unpicklable factory) it runs in this process after ``empty_cache`` and a reset of the peak
statistics, and the report says so.

Under a ``torch.distributed`` process group (``torchrun``) every rank builds and measures each row,
in this process (a subprocess is not in the group), and each row's profile carries every rank's;
``parallelize`` shards or replicates each row's model after its plan is applied (the order that
keeps the plan's guarantees: plan, then ``fully_shard`` or DDP).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import sys
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from . import _rewrite
from ._tree import tensors, tree_map
from .measuring.profile import LossFn, OptimizerFactory, Options, Profile, check_options
from .measuring.progress import Progress, Stage
from .measuring.ranks import rank_and_world
from .measuring.step import (clean_device, setup_iteration, device_name, measure_with, numbered, require_batch,
                             resolve_device)
from .plan import Plan, PlanLike, as_plan
from .fit import fit as fit_test
from .processes import FreshProcesses, model_maker
from .processes.copies import build_model, ModelCopies
from .processes.fresh import first_error_line
from .processes.sendable import why_unsendable
from .report import Report, Row
from .select import flag, function, text

Parallelize = Callable[[nn.Module], nn.Module]


class ProgressBar:
    """Progress on stderr, as a ``progress`` argument (``progress=True`` makes one): a bar redrawn
    in place on a terminal (a line kept as each stage ends), a line per call in a log (stderr not a
    terminal: a line as each item of a stage ends), nothing where ``quiet``. The calls come from
    :class:`~shrinkwrap.measuring.progress.Stage`: each text names the stage, the time left and
    the item that ended.

    Example::

        >>> plan, report = sw.autoplan(make_model, batch, max_slowdown=1.2, progress=sw.ProgressBar())
    """

    def __init__(self, quiet: bool = False) -> None:
        self.quiet, self.tty = flag(quiet, "ProgressBar()", "quiet"), sys.stderr is not None and sys.stderr.isatty()

    def __call__(self, i: int, n: int, label: str) -> None:
        if self.quiet or sys.stderr is None:  # pythonw, some services: no stderr to draw on
            return
        if not self.tty:
            sys.stderr.write(f"shrinkwrap: {i}/{n} {label[:200]}\n")
        else:
            filled = int(20 * i / max(n, 1))
            width = _columns() - 1  # a line longer than the terminal wraps, and \r redraws only its end
            text = f"measuring [{'#' * filled}{'.' * (20 - filled)}] {i}/{n} {label}"[:width]
            sys.stderr.write("\r" + text.ljust(width) + ("\n" if i == n else ""))
        sys.stderr.flush()


def _columns() -> int:
    """The width of the terminal stderr draws on (80 where it cannot be read, or reads 0: a
    pseudo-terminal whose size no one set, as ``script`` makes without a terminal of its own)."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture), or closed
        columns = 0
    return max(40, columns) if columns else 80


def progress_of(progress: Progress | bool | None) -> Progress | None:
    """A ``progress`` argument as the function that is called: ``True`` a :class:`ProgressBar`
    (on rank 0 alone under a process group: every rank measures), ``False`` or ``None`` nothing, a
    function itself."""
    if progress is True:
        ranks = rank_and_world()
        return ProgressBar() if ranks is None or ranks[0] == 0 else None
    if progress is None or progress is False:
        return None
    if not callable(progress):
        raise TypeError(f"shrinkwrap: progress is True (a bar on stderr) or a function called as "
                        f"progress(i, n, text); got {progress!r}")
    return progress


def _last_record(model: nn.Module, plan: Plan) -> tuple[tuple, tuple]:
    """What the plan's last step matched and skipped on ``model``."""
    last = plan.steps[-1] if plan.steps else None
    rec = next((r for r in reversed(_rewrite.records(model)) if r.step == last), None)
    return (rec.matched, rec.skipped) if rec else ((), ())


def measure_row(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options, snapshot: str | None,
         keep_going: bool = False, parallelize: Parallelize | None = None) -> tuple[Profile | tuple[str, str], tuple, tuple]:
    """Measure one row: (profile, matched, skipped). Out of memory comes back as ``("oom",
    message)`` in place of the profile, so the report goes on; with ``keep_going`` any other error
    too, as ``("failed", message)``. ``parallelize`` wraps the model after its plan is applied."""
    device = torch.device(options.device)
    matched: tuple = ()
    skipped: tuple = ()
    try:
        model = build_model(make, device, plan)
        matched, skipped = _last_record(model, plan)
        if parallelize is not None:
            model = parallelize(model)
            if not isinstance(model, nn.Module):
                raise TypeError(f"shrinkwrap: parallelize returned {type(model).__name__}, not an nn.Module")
        return measure_with(model, batch, options, snapshot, restore=False), matched, skipped
    except torch.cuda.OutOfMemoryError as exc:
        # "CUDA out of memory. Tried to allocate 2.00 GiB"; the allocator's advice that follows is long.
        return ("oom", ". ".join(str(exc).split(". ")[:2]).strip() or "out of memory"), matched, skipped
    except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is a row, not the end
        if not keep_going:
            raise
        return ("failed", first_error_line(exc)), matched, skipped
    finally:
        model = None  # this frame's reference must go before the cache is emptied for the next row
        clean_device(device)


def as_row(plan: Plan, result: Profile | tuple[str, str], matched: tuple, skipped: tuple, role: str) -> Row:
    """What :func:`measure_row` returned, as a report's row."""
    if isinstance(result, tuple):
        return Row(plan, None, matched, skipped, status=result[0], error=result[1], role=role)
    return Row(plan, result, matched, skipped, role=role)


def warm_process(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options) -> bool:
    """Run ``plan``'s first iterations once, untimed, in this process: the first row measured in a
    process otherwise pays what the process does once (thread pools, allocations, lazy imports):
    on a CPU a plan that recomputes read faster than the baseline measured before it. Returns
    whether they ran."""
    try:
        model = build_model(make, torch.device(options.device), plan)
        step, _ = setup_iteration(model, batch, options, torch.device(options.device))
        for _ in range(options.warmup):
            step()
        return True
    except Exception:  # noqa: BLE001 - only a warm-up: the row itself says what fails
        return False


def describe_batch(batch: Any) -> str:
    """``16x3x64x64 float32``, or ``input_ids 8x512 int64, labels 8 int64`` for a dict."""
    def one(t: torch.Tensor) -> str:
        return "x".join(map(str, t.shape)) + " " + str(t.dtype).removeprefix("torch.")

    if isinstance(batch, dict):
        return ", ".join(f"{k} {one(v)}" for k, v in batch.items() if isinstance(v, torch.Tensor))
    return ", ".join(one(t) for t in tensors(batch))


def measure_plans(
    make: Callable[[], nn.Module],
    plans: Sequence[Plan],
    batch: Any,
    options: Options = Options(),
    *,
    isolate: bool | None = None,
    snapshot: str | None = None,
    progress: Progress | bool | None = None,
    name: str | None = None,
    keep_going: bool = False,
    parallelize: Parallelize | None = None,
    processes: FreshProcesses | None = None,
    fit: bool | None = None,
) -> Report:
    """Measure each plan on a fresh model from ``make`` (see :func:`model_maker`), each in isolation;
    one row per plan, in order (role ``baseline`` for the empty plan, else ``candidate``). A row's
    ``matched``/``skipped`` are its plan's last step's. Keywords as :func:`plan_report`;
    ``keep_going``: a plan that fails to apply or to run is a row with status ``failed`` and the
    error, and the rows after it are measured (autoplan's candidates), instead of the error;
    ``processes``: where isolated rows run (a new process each by default); ``fit``: find each
    row's smallest memory cap by training it (:func:`shrinkwrap.fit`) on CUDA, ``None`` (default)
    for the rows that ran CUDA graphs only, whose reading it then replaces (see ``Report.value``).

    Example::

        >>> report = measure_plans(model_maker(model, "measure_plans()"), [Plan(), Plan([sw.swish()])], batch)
    """
    progress = progress_of(progress)
    device = resolve_device(options.device)
    options = dataclasses.replace(options, device=str(device))
    if snapshot and device.type != "cuda":
        raise ValueError("shrinkwrap: a memory snapshot records the CUDA allocator; it needs device='cuda'")
    notes: list[str] = []
    isolate = device.type == "cuda" if isolate is None else isolate
    if isolate and rank_and_world():
        isolate = False
        notes.append("rows measured in this process, not in subprocesses: a subprocess would not be in "
                      "this process group")
    # CUDA tensors would be shared with a subprocess, not copied.
    batch = tree_map(lambda t: t.to("cpu"), batch) if isolate else batch
    unsendable = why_unsendable((make, plans, batch, options)) if isolate else None
    if unsendable:
        isolate = False
        notes.append(f"rows measured in this process, not in subprocesses: {unsendable}")
    if device.type == "cuda" and not isolate:
        notes.append("in-process CUDA rows: caches emptied and peak statistics reset between rows, but "
                     "cuDNN workspaces and earlier rows' context may still count")
        if isinstance(make, ModelCopies) and any(p.is_cuda for p in make.model.parameters()):
            notes.append("your model's own weights stay on the GPU and are counted in every row")

    if not isolate and device.type == "cpu" and plans:
        warm_process(make, plans[0], batch, options)
    rows = []
    stage = Stage(progress, "rows", len(plans))
    # Rows' processes are joined as it closes, after the last row (see FreshProcesses.run).
    with contextlib.nullcontext(processes) if processes else FreshProcesses() as fresh:
        for i, plan in enumerate(plans):
            role = "candidate" if plan.steps else "baseline"
            args = (make, plan, batch, options, numbered(snapshot, i) if snapshot else None, keep_going, parallelize)
            if isolate:
                try:
                    result, matched, skipped = fresh.run(measure_row, *args)
                except concurrent.futures.process.BrokenProcessPool as exc:
                    isolate = False
                    notes.append(f"a subprocess failed ({exc}); rows from {str(plan) or 'baseline'!r} on "
                                 "measured in this process")
                    result, matched, skipped = measure_row(*args)
            else:
                result, matched, skipped = measure_row(*args)
            rows.append(as_row(plan, result, matched, skipped, role))
            stage.done(str(plan) or "baseline")
    fitted = [r for r in rows if device.type == "cuda" and r.profile is not None
              and (fit or (fit is None and r.profile.cuda_graphs))]
    stage = Stage(progress if fitted else None, "fit tests (rows trained under caps)", len(fitted))
    for row in fitted:
        if parallelize is not None or rank_and_world():
            notes.append(f"{row.label}: not fit-tested (a fit probe trains one process, not a process group)")
        elif why := why_unsendable((make, row.plan, batch, options)):
            notes.append(f"{row.label}: not fit-tested (it trains in fresh processes): {why}")
        else:
            row.fit = fit_test(make, batch, row.plan, options,
                               progress=lambda text, label=row.label: stage.say(f"{label}: {text}"))
        stage.done(row.label)
    return Report(
        rows=rows,
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        model=name or getattr(make, "__name__", type(make).__name__),
        batch=describe_batch(batch),
        isolation="in subprocesses" if isolate else "in this process",
        notes=notes,
    )


def plan_report(
    plan: PlanLike,
    model_or_factory: nn.Module | Callable[[], nn.Module],
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    *,
    iterations: int = 5,
    warmup: int = 2,
    device: str | torch.device | None = None,
    isolate: bool | None = None,
    snapshot: str | None = None,
    progress: Progress | bool | None = None,
    name: str | None = None,
    parallelize: Parallelize | None = None,
    fit: bool | None = None,
) -> Report:
    """Measure the baseline and the plan's steps applied one after another; one row each.

    Args:
        plan: a :class:`~shrinkwrap.Plan`, a list of steps, or the plan's text.
        model_or_factory: a function returning a fresh model (best: each row gets its own), or a
            model instance, which is copied per row and never changed.
        batch, loss_fn, optimizer, iterations, warmup, device: as :func:`shrinkwrap.measure`.
        isolate: run each row in a fresh subprocess; by default on CUDA. Needs the factory, plan,
            batch and loss_fn picklable (module-level functions), and a script that starts under
            ``if __name__ == "__main__":``; otherwise rows run in this process, with a note.
        snapshot: on CUDA, write one memory snapshot per row, named ``<stem>.<row><suffix>``.
        progress: ``True`` for a bar on stderr (:class:`ProgressBar`), or a function, called as
            ``progress(rows_done, row_count, text)`` as the rows start and as each one ends (and
            as each fit test's rounds go), the text with the time left.
        name: what the report calls the model (the factory's or class's name by default).
        parallelize: ``model -> model``, called on each row's model after its plan is applied:
            ``fully_shard`` each block and the root, or wrap in DDP (see
            :mod:`shrinkwrap.parallel`). Under ``torchrun`` every rank calls ``plan_report``;
            each row then shows every rank's figures (rank 0 prints the report).
        fit: on CUDA, also find each row's smallest memory cap by training it under caps in fresh
            processes (:func:`shrinkwrap.fit`: minutes per row): the figure a card must hold.
            ``None`` (default): only for rows that ran CUDA graphs, whose allocations read low.

    The whole plan is applied once to a fresh model before any row is measured, so a step that
    cannot apply raises at once. A row that runs out of CUDA memory says so; the rows after it
    are still measured.

    Example::

        >>> plan = sw.Plan([sw.checkpoint(r"layer[1-4]"), sw.autocast(torch.bfloat16)])
        >>> report = sw.plan_report(plan, torchvision.models.resnet18, torch.randn(128, 3, 224, 224))
        >>> print(report); report.save("report.json")
    """
    plan = as_plan(plan, "plan_report()")
    progress = progress_of(progress)
    make = model_maker(model_or_factory, "plan_report()")
    require_batch(batch, "plan_report()")
    check_options("plan_report()", loss_fn, optimizer, iterations, warmup, device)
    for key, value in (("isolate", isolate), ("fit", fit)):
        flag(value, "plan_report()", key, none=True)
    text(snapshot, "plan_report()", "snapshot", "a path (a str)")
    text(name, "plan_report()", "name")
    function(parallelize, "plan_report()", "parallelize", "a function model -> model")
    options = Options(loss_fn, optimizer, iterations, warmup, device)
    if plan.steps:
        dev = resolve_device(device)
        build_model(make, dev, plan)  # raises here, before minutes of measuring, if a step cannot apply
        clean_device(dev)
    prefixes = [Plan(plan.steps[:i]) for i in range(len(plan) + 1)]
    report = measure_plans(make, prefixes, batch, options, isolate=isolate, snapshot=snapshot,
                           progress=progress, name=name, parallelize=parallelize, fit=fit)
    for row in report.rows[1:]:
        row.role = "step"
    return report
