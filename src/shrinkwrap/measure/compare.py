"""Plans, measured side by side, each configuration in isolation.

:func:`measure_plans` measures a list of plans, one row each: every row is a fresh model (from
the factory, or a copy of the given instance) with its plan applied, measured by the one harness
(:func:`shrinkwrap.measure.step.measure`). :func:`plan_report` (``Plan.measure``) is the baseline
and then the plan's steps applied one after another; autoplan measures its candidates. On
CUDA each row runs in a fresh subprocess (``spawn``), so allocator caches and cuDNN workspaces of
one row cannot leak into the next; where the row cannot be sent to a subprocess (a lambda in the
plan, an unpicklable factory) it runs in this process after ``empty_cache`` and a reset of the peak
statistics, and the report says so.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import multiprocessing
import pickle
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .. import _rewrite
from ..plan import Plan, PlanLike, as_plan
from ..report import Report, Row
from ..select import wrong
from .step import LossFn, OptimizerFactory, Profile, _clean, _tensors, _to, device_name, measure, resolve_device

Progress = Callable[[int, int, str], None]


class _Copies:
    """Fresh copies of one model instance, so the user's own model is never touched.

    In this process a copy is a ``deepcopy``; sent to a subprocess, the model travels as
    ``torch.save`` bytes loaded onto the CPU (no CUDA memory shared between processes).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__name__ = type(model).__name__

    def __call__(self) -> nn.Module:
        return copy.deepcopy(self.model)

    def __getstate__(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.model, buf)
        return {"blob": buf.getvalue(), "name": self.__name__}

    def __setstate__(self, state: dict) -> None:
        self.model = torch.load(io.BytesIO(state["blob"]), map_location="cpu", weights_only=False)
        self.__name__ = state["name"]


def model_maker(model_or_factory: nn.Module | Callable[[], nn.Module], where: str) -> Callable[[], nn.Module]:
    """A function returning a fresh model each call: the factory itself, or copies of an instance;
    ``where`` names the public function for the message if it is neither."""
    if isinstance(model_or_factory, nn.Module):
        return _Copies(model_or_factory)
    if callable(model_or_factory):
        return model_or_factory
    raise TypeError(wrong(where, "a model or a function returning one", model_or_factory))


def _build(make: Callable[[], nn.Module], device: torch.device, plan: Plan) -> nn.Module:
    model = make()
    if not isinstance(model, nn.Module):
        raise TypeError(f"shrinkwrap: the model factory returned {type(model).__name__}, not an nn.Module")
    return plan.apply(model.to(device))


def _last_record(model: nn.Module, plan: Plan) -> tuple[tuple, tuple]:
    """What the plan's last step matched and skipped on ``model``."""
    last = str(plan.steps[-1]) if plan.steps else None
    rec = next((r for r in reversed(_rewrite.records(model)) if r.step == last), None)
    return (rec.matched, rec.skipped) if rec else ((), ())


def _row(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: dict) -> tuple[Profile | str, tuple, tuple]:
    """Measure one row: (profile, matched, skipped). Out of memory comes back as the message, in
    place of the profile, so the report goes on."""
    device = torch.device(options["device"])
    matched: tuple = ()
    skipped: tuple = ()
    try:
        model = _build(make, device, plan)
        matched, skipped = _last_record(model, plan)
        return measure(model, batch, **options), matched, skipped
    except torch.cuda.OutOfMemoryError as exc:
        # "CUDA out of memory. Tried to allocate 2.00 GiB"; the allocator's advice that follows is long.
        return ". ".join(str(exc).split(". ")[:2]).strip() or "out of memory", matched, skipped
    finally:
        model = None  # this frame's reference must go before the cache is emptied for the next row
        _clean(device)


def _in_subprocess(args: tuple) -> tuple[Profile | str, tuple, tuple]:
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_row, *args).result()


def describe_batch(batch: Any) -> str:
    """``16x3x64x64 float32``, or ``input_ids 8x512 int64, labels 8 int64`` for a dict."""
    def one(t: torch.Tensor) -> str:
        return "x".join(map(str, t.shape)) + " " + str(t.dtype).removeprefix("torch.")

    if isinstance(batch, dict):
        return ", ".join(f"{k} {one(v)}" for k, v in batch.items() if isinstance(v, torch.Tensor))
    return ", ".join(one(t) for t in _tensors(batch))


def measure_plans(
    make: Callable[[], nn.Module],
    plans: Sequence[Plan],
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    *,
    steps: int = 5,
    warmup: int = 2,
    device: str | torch.device | None = None,
    isolate: bool | None = None,
    snapshot: str | None = None,
    progress: Progress | None = None,
    labels: Sequence[str] | None = None,
    name: str | None = None,
) -> Report:
    """Measure each plan on a fresh model from ``make`` (see :func:`model_maker`), each in isolation;
    one row per plan, in order. A row's ``matched``/``skipped`` are its plan's last step's.

    Options as :func:`plan_report`; ``labels`` names the rows (default: the plan's text, or
    ``baseline`` for the empty plan).

    Example::

        >>> report = measure_plans(model_maker(model, "measure_plans()"), [Plan(), Plan([sw.swish()])], batch)
    """
    device = resolve_device(device)
    if snapshot and device.type != "cuda":
        raise ValueError("shrinkwrap: a memory snapshot records the CUDA allocator; it needs device='cuda'")
    labels = list(labels) if labels is not None else [str(p) or "baseline" for p in plans]
    notes: list[str] = []
    isolate = device.type == "cuda" if isolate is None else isolate
    batch = _to(batch, torch.device("cpu")) if isolate else batch  # CUDA tensors would be shared, not copied
    options = dict(loss_fn=loss_fn, optimizer=optimizer, steps=steps, warmup=warmup, device=str(device))
    if isolate:
        try:
            pickle.dumps((make, plans, batch, options))
        except Exception as exc:  # pickle raises many types (PicklingError, AttributeError, TypeError)
            isolate = False
            notes.append(f"rows measured in this process, not in subprocesses: cannot pickle the row ({exc})")
    if device.type == "cuda" and not isolate:
        notes.append("in-process CUDA rows: caches emptied and peak statistics reset between rows, but "
                     "cuDNN workspaces and earlier rows' context may still count")
        if isinstance(make, _Copies) and any(p.is_cuda for p in make.model.parameters()):
            notes.append("your model's own weights stay on the GPU and are counted in every row")

    rows = []
    for i, (label, plan) in enumerate(zip(labels, plans)):
        if progress:
            progress(i, len(plans), label)
        args = (make, plan, batch, {**options, "snapshot": _numbered(snapshot, i) if snapshot else None})
        if isolate:
            try:
                result, matched, skipped = _in_subprocess(args)
            except concurrent.futures.process.BrokenProcessPool as exc:
                isolate = False
                notes.append(f"a subprocess failed ({exc}); rows from {label!r} on measured in this process")
                result, matched, skipped = _row(*args)
        else:
            result, matched, skipped = _row(*args)
        if isinstance(result, str):
            rows.append(Row(label, str(plan), None, matched, skipped, status="oom", error=result))
        else:
            rows.append(Row(label, str(plan), result, matched, skipped))
    if progress:
        progress(len(plans), len(plans), "done")
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
    **options: Any,
) -> Report:
    """Measure the baseline and the plan's steps applied one after another; one row each.

    Args:
        plan: a :class:`~shrinkwrap.Plan`, a list of steps, or the plan's text.
        model_or_factory: a function returning a fresh model (best: each row gets its own), or a
            model instance, which is copied per row and never changed.
        batch, loss_fn, optimizer: as :func:`shrinkwrap.measure`.
        steps, warmup, device: keywords, as :func:`shrinkwrap.measure`.
        isolate: run each row in a fresh subprocess; by default on CUDA. Needs the factory, plan,
            batch and loss_fn picklable (module-level functions), and a script that starts under
            ``if __name__ == "__main__":``; otherwise rows run in this process, with a note.
        snapshot: on CUDA, write one memory snapshot per row, named ``<stem>.<row><suffix>``.
        progress: called as ``progress(row_index, row_count, step_text)`` before each row.
        name: what the report calls the model (the factory's or class's name by default).

    The whole plan is applied once to a fresh model before any row is measured, so a step that
    cannot apply raises at once. A row that runs out of CUDA memory says so; the rows after it
    are still measured.

    Example::

        >>> plan = sw.Plan([sw.checkpoint(r"layer[1-4]"), sw.autocast(torch.bfloat16)])
        >>> report = plan.measure(torchvision.models.resnet18, torch.randn(128, 3, 224, 224))
        >>> print(report); report.save("report.json")
    """
    plan = as_plan(plan, "plan_report()")
    make = model_maker(model_or_factory, "plan_report()")
    if plan.steps:
        device = resolve_device(options.get("device"))
        _build(make, device, plan)  # raises here, before minutes of measuring, if a step cannot apply
        _clean(device)
    prefixes = [Plan(plan.steps[:i]) for i in range(len(plan) + 1)]
    labels = ["baseline"] + [str(s) for s in plan.steps]
    return measure_plans(make, prefixes, batch, loss_fn, optimizer, labels=labels, **options)


def _numbered(path: str, i: int) -> str:
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.{i}.{suffix}" if dot and "/" not in suffix else f"{path}.{i}"
