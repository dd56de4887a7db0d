"""Reports: a plan's baseline and steps, as an aligned table, markdown, JSON and a PNG plot.

Units are MiB (2**20 bytes); every report names its device and torch version. The headline
number is ``metric``: on CUDA ``peak_allocated`` (``max_memory_allocated`` over the first training
iteration and a steady-state one, the larger), without CUDA ``saved_for_backward`` (bytes the forward saves for backward, unique storages),
which is activation memory, not a GPU peak.

Measured under a ``torch.distributed`` process group (``torchrun``, FSDP2 or DDP), each row holds
every rank's profile: the headline is the largest rank's figure (the rank that runs out of memory
first), and the table has one column per rank.

JSON schema ``shrinkwrap.report/1`` (field names are stable; new fields may be added)::

    schema, device, device_name, torch_version, model, batch, isolation, notes[],
    world_size (ranks measured; 1 without a process group),
    metric ("peak_allocated" | "saved_for_backward"), metric_label,
    rows[]:
      step (the row's label: "baseline", the step's text, "chosen (round 1)", ...),
      plan (the row's whole plan as text),
      role ("baseline" | "step" | "candidate" | "chosen" | "compiled" | "batch"), round (autoplan's
        verification round, or null), batch_size and fits (maximize="batch" rows: whether the
        batch fits the budget; autoplan's chosen rows: false where the plan read within the
        budget but did not train under its cap; else null),
      status ("ok" | "oom" | "failed"), error (null or the message),
      value_mib (the metric; of the largest rank under a process group), delta_prev_mib,
      delta_base_mib, ratio_base,
      step_ms, step_ratio (against the baseline; timed in turns with it where autoplan did so),
      matched[] (module names the step acted on), skipped[] ({module, reason}),
      peak_mib, first_peak_mib, static_mib (CUDA; null without),
      saved_mib, parameters_mib (parameters and buffers), gradients_mib, optimizer_state_mib, batch_mib,
      breakdown {parameters_mib, gradients_mib, optimizer_state_mib, batch_mib, activations_other_mib}
        (the steady-state peak; {} without CUDA),
      phases {first[], steady[]} of {phase, allocated_mib, peak_mib} (CUDA; [] without),
      fit_mib (the smallest allocator cap under which the row's plan trained its first fit_iterations
        iterations, found by training it: shrinkwrap.fit; null where not tested), fit_below_mib (the
        largest cap under which it did not), fit_resolution_mib, fit_iterations,
        trained_under_mib (a cap the row's plan was trained under to check a budget, or null),
      top_modules[] ({module, mib}: what each module's forward added and kept, largest first),
      timeline_probe ("allocated" | "saved_for_backward"), timeline[] ({module, event, mib}),
      snapshot (path of the CUDA memory snapshot, or null),
      transfers_mib {offloaded, reloaded} (per timed iteration, moved between the device and the
        CPU by offload regions; {} when nothing moved),
      cpu_step {worker_ms, waited_ms, threads, cpu_bound} (step_in_backward(state='cpu'): per timed
        iteration, the CPU worker's time stepping and the loop's waiting for it; cpu_bound where the
        wait is a tenth of the step or more; null without that step),
      compiled (the model ran under torch.compile), first_ms (the first iteration, compilation
        included; step_ms excludes it), recompiles (graphs compiled after warm-up) and
        graph_breaks (dynamo's count; both null for a model not compiled),
      rank (the rank that wrote the report, or null), ranks[] ({rank, value_mib, peak_mib,
        saved_mib, parameters_mib, gradients_mib, optimizer_state_mib, step_ms}: every rank's
        figures, in rank order; [] without a process group)

A field that a row cannot have (an OOM row has no peak) is null, never missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .plan import Plan

if TYPE_CHECKING:
    from .measuring.profile import Profile

MiB = 2**20
SCHEMA = "shrinkwrap.report/1"

_METRIC_LABELS = {
    "peak_allocated": "peak MiB: torch.cuda.max_memory_allocated over one steady-state step",
    "saved_for_backward": "saved MiB: bytes saved for backward (unique storages); no GPU here, so no GPU peak",
}


def _mib(b: int | float | None) -> float | None:
    return None if b is None else round(b / MiB, 3)


@dataclass
class Row:
    """One configuration measured: its plan, its profile (``None`` when it failed), what the plan's
    last step matched and skipped, and its place in the report.

    ``role`` is ``"baseline"``, ``"step"`` (a plan report's row: the plan up to that step),
    ``"candidate"`` (autoplan), ``"chosen"`` (autoplan's verification ``round``), ``"compiled"``
    (autoplan's ``compile`` stage) or ``"batch"``
    (``maximize="batch"``: ``batch_size`` and whether it ``fits``; a chosen plan that read within
    autoplan's budget but did not train under its cap: ``fits`` false). :attr:`label` is its text.
    ``fit``: the smallest memory cap under which it trained (:func:`shrinkwrap.fit`), where tested;
    ``trained_under``: a cap it trained under (autoplan's check of its budget); ``time_ratio``: its
    step time over the baseline's, timed in turns with it in one process, where it was (the
    figure the report shows then: rows timed apart drift on a shared GPU; benchmarks/RESULTS.md,
    Timing in turns).
    """

    plan: Plan
    profile: "Profile | None"
    matched: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    status: str = "ok"
    error: str | None = None
    role: str = "candidate"
    round: int | None = None
    batch_size: int | None = None
    fits: bool | None = None
    fit: Any = None  # a shrinkwrap.fit.Fit (a layer above this one)
    trained_under: int | None = None
    time_ratio: float | None = None  # step time over the baseline's, timed in turns with it (autoplan)

    @property
    def label(self) -> str:
        """The row's name in tables: ``baseline``, the step's text, ``chosen (round 2)``, ..."""
        if self.role == "baseline":
            return "baseline"
        if self.role == "step" and self.plan.steps:
            return str(self.plan.steps[-1])
        if self.role == "chosen":
            return f"chosen (round {self.round})"
        if self.role == "compiled":
            return f"compiled: {self.plan}"
        if self.role == "batch":
            return f"batch {self.batch_size}: {'fits' if self.fits else 'too large'}"
        return str(self.plan) or "baseline"


@dataclass
class Report:
    """Measured rows side by side: :func:`shrinkwrap.plan_report`'s baseline and one row per step,
    or autoplan's baseline, candidates and chosen plans.

    ``str(report)`` is an aligned table; :meth:`to_markdown`, :meth:`to_json` and :meth:`plot`
    give the other forms.

    Example::

        >>> report = sw.plan_report(plan, make_model, torch.randn(32, 3, 224, 224))
        >>> print(report)
        >>> report.save("report.json"); report.plot("memory.png")
    """

    rows: list[Row]
    device: str
    device_name: str
    torch_version: str
    model: str = ""
    batch: str = ""
    isolation: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def metric(self) -> str:
        return "peak_allocated" if self.device.startswith("cuda") else "saved_for_backward"

    @property
    def world_size(self) -> int:
        """How many ranks measured each row (1 without a process group)."""
        return max([len(r.profile.ranks) for r in self.rows if r.profile is not None] + [1])

    def _metric(self, p: "Profile") -> int | None:
        if self.metric != "peak_allocated":
            return p.saved
        # What training needs gets through its first step too: a chain checkpoint's first forward
        # runs its members plainly (it watches how the parent calls them), so its activations are
        # all kept once: such a plan's first step can peak well above its steady one and not train
        # under the steady figure (docs/measuring.md).
        return p.peak if p.peak is None or p.first_peak is None else max(p.peak, p.first_peak)

    def value(self, row: Row) -> int | None:
        """The row's headline number in bytes (``None`` if the row has none, e.g. out of memory):
        on CUDA the larger of the steady step's peak and the first step's; measured on several
        ranks, the largest rank's. A row that ran CUDA graphs and was fit-tested has the fit
        figure: a graphed iteration's allocations are no measure of what it needs (see
        :mod:`shrinkwrap.fit`)."""
        if row.profile is None:
            return None
        if row.fit is not None and row.profile.cuda_graphs and self.metric == "peak_allocated":
            return row.fit.cap
        values = [self._metric(p) for p in row.profile.ranks or [row.profile]]
        return None if None in values else max(values)

    def frontier(self) -> list[Row]:
        """The plans' rows no other row beats on both memory and step time (the plans worth
        choosing between: less memory costs time along them), by memory, least first; rows of
        other batch sizes (``maximize="batch"``) are left out.

        Example::

            >>> [(r.plan, r.profile.step_ms) for r in report.frontier()]
        """
        rows = [r for r in self.rows if self.value(r) is not None and r.role != "batch"]  # plans, at one batch

        def beats(a: Row, b: Row) -> bool:
            va, vb, ta, tb = self.value(a), self.value(b), a.profile.step_ms, b.profile.step_ms
            return va <= vb and ta <= tb and (va < vb or ta < tb)

        return sorted((r for r in rows if not any(beats(o, r) for o in rows)), key=self.value)

    def _deltas(self) -> list[dict[str, Any]]:
        base = self.rows[0] if self.rows else None
        base_v = self.value(base) if base else None
        base_t = base.profile.step_ms if base and base.profile else None
        out, prev_v = [], None
        for i, row in enumerate(self.rows):
            v = self.value(row)
            t = row.profile.step_ms if row.profile else None
            out.append({
                "value_mib": _mib(v),
                "delta_prev_mib": _mib(v - prev_v) if i and v is not None and prev_v is not None else None,
                "delta_base_mib": _mib(v - base_v) if v is not None and base_v is not None else None,
                "ratio_base": round(v / base_v, 4) if v is not None and base_v else None,
                "step_ms": None if t is None else round(t, 3),
                "step_ratio": round(row.time_ratio, 4) if row.time_ratio is not None else
                round(t / base_t, 4) if t is not None and base_t else None,
            })
            prev_v = v
        return out

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data, in the documented ``shrinkwrap.report/1`` schema."""
        rows = []
        frontier = {id(r) for r in self.frontier()}
        for row, d in zip(self.rows, self._deltas()):
            rows.append({
                "step": row.label,
                "plan": str(row.plan),
                "role": row.role,
                "round": row.round,
                "batch_size": row.batch_size,
                "fits": row.fits,
                "status": row.status,
                "error": row.error,
                **d,
                "matched": list(row.matched),
                "skipped": [{"module": m, "reason": r} for m, r in row.skipped],
                **_profile_dict(row.profile),
                "fit_mib": _mib(row.fit.cap) if row.fit else None,
                "fit_below_mib": _mib(row.fit.below) if row.fit else None,
                "fit_resolution_mib": _mib(row.fit.resolution) if row.fit else None,
                "fit_iterations": row.fit.iterations if row.fit else None,
                "trained_under_mib": _mib(row.trained_under),
                "frontier": id(row) in frontier,
                "rank": row.profile.rank if row.profile else None,
                "ranks": [{"rank": p.rank, "value_mib": _mib(self._metric(p)), "peak_mib": _mib(p.peak),
                           "saved_mib": _mib(p.saved), "parameters_mib": _mib(p.parameters),
                           "gradients_mib": _mib(p.gradients), "optimizer_state_mib": _mib(p.optimizer_state),
                           "step_ms": round(p.step_ms, 3)} for p in (row.profile.ranks if row.profile else [])],
            })
        return {
            "schema": SCHEMA,
            "device": self.device,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "model": self.model,
            "batch": self.batch,
            "isolation": self.isolation,
            "notes": list(self.notes),
            "world_size": self.world_size,
            "metric": self.metric,
            "metric_label": _METRIC_LABELS[self.metric],
            "rows": rows,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str) -> None:
        """Write the report by the path's suffix: ``.json``, ``.md``, ``.png``, or a text table."""
        if path.endswith(".png"):
            return self.plot(path)
        text = {".json": self.to_json, ".md": self.to_markdown}.get(path[path.rfind("."):], self.to_text)()
        with open(path, "w") as f:
            f.write(text + "\n")

    # -- tables ------------------------------------------------------------------------------

    def _table(self, width: int | None = None) -> tuple[list[str], list[list[str]], list[str]]:
        """Headers, rows, and the legend of the labels cut to fit ``width`` columns (None: none cut)."""
        cuda = self.metric == "peak_allocated"
        world = self.world_size
        headers = ["step", ("peak MiB" if cuda else "saved MiB") + (f", max of {world} ranks" if world > 1 else "")]
        headers += [f"rank {r}" for r in range(world)] if world > 1 else []
        headers += ["x base"]
        # The bill's terms apart, so that a row shows which one its step took away: on CUDA at the
        # peak (gradients only where it came in backward or the step), without CUDA what is held.
        headers += ["params", "grads", "opt state"] + (["activations"] if cuda else [])
        fits = any(r.fit is not None for r in self.rows)
        headers += ["fits in MiB"] if fits else []
        headers += ["step ms" if cuda else "CPU step ms", "time x base", "matched"]
        body = []
        for row, d in zip(self.rows, self._deltas()):
            p = row.profile
            cells = [row.label, _num(d["value_mib"]) if p else row.status.upper()]
            if world > 1:
                ranks = {q.rank: q for q in p.ranks} if p else {}
                cells += [_num(_mib(self._metric(ranks[r]))) if r in ranks else "-" for r in range(world)]
            cells += [_num(d["ratio_base"], ratio=True)]
            if p is None:
                cells += ["-"] * (4 if cuda else 3)
            elif cuda:
                at = p.breakdown()
                cells += [_num(_mib(at["parameters"])), _num(_mib(at["gradients"])), _num(_mib(at["optimizer_state"])),
                          _num(_mib(at["activations_other"]))]
            else:
                cells += [_num(_mib(p.parameters)), _num(_mib(p.gradients)), _num(_mib(p.optimizer_state))]
            cells += [_num(_mib(row.fit.cap)) if row.fit else "-"] if fits else []
            cells += [_num(d["step_ms"]), _num(d["step_ratio"], ratio=True), _matched(row)]
            body.append(cells)
        legend: list[str] = []
        if width is not None:
            # The first and last columns (labels and matched names) give way, numbers never.
            fixed = sum(max(len(r[i]) for r in [headers, *body]) + 2 for i in range(1, len(headers) - 1))
            room = max(24, (width - fixed) * 2 // 3)
            for cells in body:
                if len(cells[0]) > room:
                    legend.append(f"[{len(legend) + 1}] {cells[0]}")
                    cells[0] = cells[0][: room - 6 - len(str(len(legend)))] + f"… [{len(legend)}]"
            label = max(len(r[0]) for r in [headers, *body]) + 2
            for cells in body:
                if len(cells[-1]) > width - fixed - label:
                    cells[-1] = cells[-1][: max(8, width - fixed - label - 1)] + "…"
        return headers, body, legend

    def _header_lines(self) -> list[str]:
        lines = [f"shrinkwrap report: {self.model or 'model'}, batch {self.batch or '?'}",
                 f"device {self.device} ({self.device_name}), torch {self.torch_version}"
                 + (f", rows measured {self.isolation}" if self.isolation else ""),
                 _METRIC_LABELS[self.metric]]
        if self.world_size > 1:
            lines.append(f"measured on each of {self.world_size} ranks of a torch.distributed process group "
                         "(batch, shards and figures per rank); the headline is the largest rank's")
        return lines

    def _footer_lines(self, notes: int | None = None) -> list[str]:
        lines = []
        for row in self.rows:
            if row.error:
                lines.append(f"{row.label}: {row.status}: {row.error}")
            if row.fit is not None:
                lines.append(f"{row.label}: {row.fit}")
        ok = [r for r in self.rows if r.profile is not None]
        for row in ok[:1] + ok[-1:] if len(ok) > 1 else ok:
            top = ", ".join(f"{m or '(root)'} {b / MiB:.2f}" for m, b in row.profile.top_modules[:5])
            if top:
                lines.append(f"largest contributors, {row.label} (MiB kept by each forward): {top}")
        for row in ok:
            p = row.profile
            if p.transfers:
                moved = ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in p.transfers.items())
                lines.append(f"moved between device and CPU per iteration, {row.label}: {moved}")
            if p.cpu_step is not None:
                lines.append(f"{row.label}: {p.cpu_note()}")
            if p.compiled:
                lines.append(f"compiled, {row.label}: first iteration {p.first_ms:.0f} ms with compilation, "
                             f"graph breaks {p.graph_breaks}, recompiles after warm-up {p.recompiles}")
        shown = self.notes if notes is None else self.notes[:notes]
        lines += [f"note: {n}" for n in shown]
        if len(shown) < len(self.notes):
            lines.append(f"({len(self.notes) - len(shown)} more notes: --verbose, or the report's JSON)")
        return lines

    def to_text(self, width: int = 120, notes: int | None = None) -> str:
        """An aligned table for a terminal, ``width`` columns at most: a label too long for it is
        cut and given in full in a legend below, as are the names a row matched. ``notes``: how many
        of the report's notes to show (None: all; the rest are counted, and are in the JSON)."""
        headers, body, legend = self._table(width)
        widths = [max(len(r[i]) for r in [headers, *body]) for i in range(len(headers))]
        # Text columns read left-aligned, numbers right-aligned.
        fmt = lambda cells: "  ".join(  # noqa: E731
            c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()
        lines = [_wrap(h, width) for h in self._header_lines()] + ["", fmt(headers), fmt(["-" * w for w in widths])]
        lines += [fmt(r) for r in body]
        footer = [_wrap(f, width) for f in legend + self._footer_lines(notes)]
        return "\n".join(lines + ([""] + footer if footer else []))

    def to_markdown(self) -> str:
        """A markdown table to paste in an issue."""
        headers, body, _ = self._table()
        esc = lambda c: c.replace("|", "\\|")  # noqa: E731
        lines = [" · ".join(self._header_lines()), "",
                 "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        # The step's text goes in a code span, where a regex's backslashes are not markdown escapes.
        lines += ["| " + " | ".join([f"`{esc(r[0])}`", *(esc(c) for c in r[1:])]) + " |" for r in body]
        footer = self._footer_lines()
        return "\n".join(lines + ([""] + [f"- {f}" for f in footer] if footer else []))

    def __str__(self) -> str:
        return self.to_text()

    # -- plot --------------------------------------------------------------------------------

    def plot(self, path: str) -> None:
        """Write a PNG of memory over one step, one line per row (baseline against the plan).

        Needs matplotlib (``pip install matplotlib``).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(
                "shrinkwrap: plotting needs matplotlib; install it with: pip install matplotlib"
            ) from None
        fig = Figure(figsize=(9, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        probe = "allocated"
        for row in self.rows:
            p = row.profile
            if p is None or not p.timeline:
                continue
            probe = p.timeline_probe
            n = max(len(p.timeline) - 1, 1)
            xs = [i / n for i in range(len(p.timeline))]
            ax.plot(xs, [e.bytes / MiB for e in p.timeline], label=row.label, lw=2 if row is self.rows[0] else 1.2)
            if row is self.rows[0]:
                # The baseline's phase ends, so the eye can tell forward from backward.
                for x, e in zip(xs, p.timeline):
                    if not e.module and e.event in ("forward", "backward"):
                        ax.axvline(x, color="grey", ls=":", lw=0.8)
                        ax.text(x, ax.get_ylim()[1], f" end of {e.event} ", va="top", fontsize=8, color="grey",
                                ha="right" if x > 0.9 else "left")
        ax.set_xlabel("progress through one training step (module events)")
        ax.set_ylabel("allocated MiB" if probe == "allocated" else "saved for backward, held MiB (no GPU)")
        ax.set_title(f"{self.model or 'model'} · {self.device} ({self.device_name}) · torch {self.torch_version}",
                     fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)


def _profile_dict(p: "Profile | None") -> dict[str, Any]:
    """The per-configuration fields of a row; the same keys, null-valued, for a row with no profile."""
    return {
        "peak_mib": _mib(p.peak) if p else None,
        "first_peak_mib": _mib(p.first_peak) if p else None,
        "static_mib": _mib(p.static) if p else None,
        "saved_mib": _mib(p.saved) if p else None,
        "parameters_mib": _mib(p.parameters) if p else None,
        "gradients_mib": _mib(p.gradients) if p else None,
        "optimizer_state_mib": _mib(p.optimizer_state) if p else None,
        "batch_mib": _mib(p.batch) if p else None,
        "breakdown": {f"{k}_mib": _mib(v) for k, v in p.breakdown().items()} if p else {},
        "phases": {
            when: [{"phase": ph.name, "allocated_mib": _mib(ph.allocated), "peak_mib": _mib(ph.peak)} for ph in phases]
            for when, phases in (("first", p.first_step if p else []), ("steady", p.steady_step if p else []))
        },
        "top_modules": [{"module": m, "mib": _mib(b)} for m, b in (p.top_modules if p else [])],
        "timeline_probe": p.timeline_probe if p else None,
        "timeline": [{"module": e.module, "event": e.event, "mib": _mib(e.bytes)} for e in (p.timeline if p else [])],
        "snapshot": p.snapshot if p else None,
        "transfers_mib": {k: _mib(v) for k, v in p.transfers.items()} if p else {},
        "cpu_step": ({**{k: round(v, 3) for k, v in p.cpu_step.items()}, "cpu_bound": p.cpu_bound}
                     if p and p.cpu_step is not None else None),
        "compiled": p.compiled if p else None,
        "first_ms": round(p.first_ms, 3) if p and p.first_ms is not None else None,
        "recompiles": p.recompiles if p else None,
        "graph_breaks": p.graph_breaks if p else None,
    }


def _wrap(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` columns, continuations indented."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=True,
                                    break_on_hyphens=False)) or text


def _num(x: float | None, sign: bool = False, ratio: bool = False) -> str:
    if x is None:
        return "-"
    if ratio:
        return f"{x:.2f}"
    digits = 1 if abs(x) >= 100 else 2
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _matched(row: Row) -> str:
    if row.role == "baseline":
        return ""
    names = [n or "(root)" for n in row.matched]
    text = ", ".join(names[:3]) + (f", … ({len(names)} modules)" if len(names) > 3 else "")
    if not names:
        text = "(nothing new)"
    if row.skipped:
        text += f"; {len(row.skipped)} skipped"
    return text
