"""What a measurement takes and gives: :class:`Options` (how a configuration is measured), and
:class:`Profile` (one configuration's figures, with its :class:`Phase` list) and :class:`Timing`
(an iteration's time measured in turns with others).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ..select import count, flag, function, wrong
from .modules import Event

MiB = 2**20

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Phase:
    """One phase of a CUDA step: ``allocated`` bytes at its end, ``peak`` bytes during it."""

    name: str
    allocated: int
    peak: int


@dataclass
class Profile:
    """What one configuration measured. Bytes throughout; ``None`` where the device cannot say.

    CUDA only (``None`` on CPU): ``peak`` (steady-state step, ``max_memory_allocated``),
    ``first_peak`` (the first step), ``static`` (allocated before the steady step), and the
    per-phase ``first_step``/``steady_step`` lists. Any device: ``saved`` (bytes saved for
    backward, unique storages), ``parameters`` (parameters and buffers), ``gradients``,
    ``optimizer_state``, ``batch``, ``step_ms`` (median, warm-up excluded), ``first_ms`` (the
    first iteration, compilation included), ``transfers`` (bytes per timed iteration that
    shrinkwrap's regions moved between the device and the CPU, by direction: offload's PCIe traffic),
    ``cpu_step`` (with ``step_in_backward(state='cpu')``: per timed iteration, the CPU worker's
    milliseconds stepping, ``worker_ms``, the loop's waiting for it, ``waited_ms``, and the
    worker's ``threads``; see :attr:`cpu_bound`). ``timeline`` is the per-module log of one iteration,
    read with ``timeline_probe`` (``"allocated"`` or ``"saved_for_backward"``).

    A model compiled with ``torch.compile`` (``compiled``): ``graph_breaks`` and ``recompiles``
    (graphs compiled after warm-up: a timed iteration that recompiles is not a steady state)
    come from dynamo's counters. On CUDA its per-module log and saved-bytes count are skipped
    (``saved`` is None, the timeline empty): their hooks would make dynamo compile the model
    again, and that program is not the one measured. ``cuda_graphs`` (``graph_pool`` set, the
    private pools' reserved bytes): the model runs CUDA graphs (``mode='reduce-overhead'``). A
    replayed graph writes into its pool without the allocator's counters seeing it, so a steady
    step that replays them would read almost nothing. Where a warm-up iteration after the first
    recorded, whole, every graph the steady step replays (``graph_recorded``: a model compiled
    fresh, as :func:`~.step.measure` and autoplan's rows get it), its allocations were all in the open and
    each replay reuses exactly those addresses: the steady figures are that iteration's, aligned
    with the steady step's where both have freed their gradients. Otherwise (graphs recorded
    before :func:`~.step.measure` was called, or in its first iteration; an iteration that re-recorded one
    function and replayed the rest would read low) the steady figures count every private pool's
    reserved bytes as in use throughout the step: an upper bound, other graphed models of the
    process included. Gradients a replay wrote into a pool count as static either way.

    Measured under a ``torch.distributed`` process group: ``rank`` is this process's rank and
    ``ranks`` every rank's profile, in rank order (theirs with ``ranks`` empty); the byte counts
    are what this rank holds (an FSDP2 shard, not the whole parameter). Without one, ``rank`` is
    None and ``ranks`` empty.
    """

    device: str
    device_name: str
    torch_version: str
    saved: int | None
    parameters: int
    gradients: int
    optimizer_state: int
    batch: int
    step_ms: float
    step_times_ms: list[float]
    peak: int | None = None
    first_peak: int | None = None
    static: int | None = None
    first_step: list[Phase] = field(default_factory=list)
    steady_step: list[Phase] = field(default_factory=list)
    timeline: list[Event] = field(default_factory=list)
    timeline_probe: str = "saved_for_backward"
    top_modules: list[tuple[str, int]] = field(default_factory=list)
    snapshot: str | None = None
    transfers: dict[str, float] = field(default_factory=dict)
    cpu_step: dict | None = None
    compiled: bool = False
    first_ms: float | None = None
    recompiles: int | None = None
    graph_breaks: int | None = None
    graph_pool: int | None = None
    graph_recorded: bool = False
    rank: int | None = None
    ranks: list["Profile"] = field(default_factory=list)

    @property
    def cuda_graphs(self) -> bool:
        return self.graph_pool is not None

    @property
    def cpu_bound(self) -> bool:
        """Whether the CPU's optimizer step, not the device, set the step time: the loop waited
        for it a tenth of the step or more (``step_in_backward(state='cpu')``)."""
        return self.cpu_step is not None and self.cpu_step["waited_ms"] >= 0.1 * self.step_ms

    def cpu_note(self) -> str | None:
        """What the CPU's optimizer step cost the step, in a sentence; None without one."""
        c = self.cpu_step
        if c is None:
            return None
        said = (f"the CPU's optimizer step stepped {c['worker_ms']:.0f} ms a step on {c['threads']} threads, and the "
                f"loop waited {c['waited_ms']:.0f} ms of the {self.step_ms:.0f} ms step for it")
        if self.cpu_bound:
            said += (": the CPU, not the device, sets this step's time (delayed=True hides the wait behind the "
                     "next step)")
        return said

    @property
    def peak_phase(self) -> str | None:
        """The phase of the steady step in which the peak was reached."""
        if not self.steady_step:
            return None
        return max(self.steady_step, key=lambda p: p.peak).name

    def breakdown(self) -> dict[str, int]:
        """The steady-state peak split into parameters, gradients, optimizer state, batch and
        activations/other (the rest). Gradients count only if the peak came in backward or the
        optimizer step: zero_grad(set_to_none) frees them before forward. Empty on CPU."""
        if self.peak is None:
            return {}
        grads = self.gradients if self.peak_phase in ("backward", "step") else 0
        parts = {
            "parameters": self.parameters,
            "gradients": grads,
            "optimizer_state": self.optimizer_state,
            "batch": self.batch,
        }
        parts["activations_other"] = self.peak - sum(parts.values())
        return parts

    def __str__(self) -> str:
        mib = lambda b: f"{b / MiB:.1f} MiB"  # noqa: E731
        head = f"shrinkwrap profile on {self.device} ({self.device_name}), torch {self.torch_version}"
        lines = [head]
        if self.peak is not None:
            lines.append(f"  peak (steady step, max_memory_allocated): {mib(self.peak)}; "
                         f"first step {mib(self.first_peak or 0)}; static {mib(self.static or 0)}")
            lines.append("  at the peak: " + ", ".join(f"{k} {mib(v)}" for k, v in self.breakdown().items()))
        else:
            lines.append("  no CUDA: no GPU peak measured")
        lines.append(f"  saved for backward: {mib(self.saved or 0)}; parameters+buffers {mib(self.parameters)}, "
                     f"gradients {mib(self.gradients)}, optimizer state {mib(self.optimizer_state)}, "
                     f"batch {mib(self.batch)}")
        lines.append(f"  step time: {self.step_ms:.1f} ms (median of {len(self.step_times_ms)})")
        if self.transfers:
            lines.append("  moved per iteration: " + ", ".join(f"{k} {mib(v)}" for k, v in self.transfers.items()))
        if self.cpu_step is not None:
            lines.append(f"  {self.cpu_note()}")
        if self.compiled:
            lines.append(f"  compiled: first iteration {self.first_ms:.0f} ms (compilation included); "
                         f"graph breaks {self.graph_breaks}, recompiles after warm-up {self.recompiles}")
        if self.graph_recorded:
            lines.append("  CUDA graphs: peak read at the iteration that recorded them (replays reuse its allocations); "
                         f"their private pools reserve {mib(self.graph_pool)}")
        elif self.cuda_graphs:
            lines.append(f"  CUDA graphs: their private pools' {mib(self.graph_pool)} reserved counted as in use "
                         "throughout the step (an upper bound: they were recorded before this measure)")
        for p in self.ranks:
            memory = f"peak {mib(p.peak)}" if p.peak is not None else f"saved for backward {mib(p.saved or 0)}"
            lines.append(f"  rank {p.rank}: {memory}, parameters+buffers {mib(p.parameters)}, step {p.step_ms:.1f} ms")
        return "\n".join(lines)

@dataclass(frozen=True)
class Options:
    """How a configuration is measured: the loss (``output -> scalar``; by default
    :func:`~.step.default_loss`), the optimizer factory (``params -> Optimizer``; AdamW by default),
    ``iterations`` timed after ``warmup``, the device (CUDA when present by default), whether
    to use a GradScaler (by default when a float16 autocast step was applied), and whether to run
    the extra iteration that logs memory per module (``module_log``; without CUDA it runs anyway,
    since it also counts the bytes saved for backward, the figure there)."""

    loss_fn: LossFn | None = None
    optimizer: OptimizerFactory | None = None
    iterations: int = 5
    warmup: int = 2
    device: str | torch.device | None = None
    grad_scaler: bool | None = None
    module_log: bool = True

    def __post_init__(self) -> None:
        check_options("Options()", self.loss_fn, self.optimizer, self.iterations, self.warmup, self.device,
                      self.grad_scaler)
        flag(self.module_log, "Options()", "module_log")


def require_options(options: Any, where: str) -> "Options":
    """``options`` if it is an :class:`Options`; else a ``TypeError`` saying what ``where`` got."""
    if not isinstance(options, Options):
        raise TypeError(wrong(where, "options= an Options, e.g. sw.Options(iterations=3, device='cuda')", options))
    return options


def check_options(where: str, loss_fn: Any, optimizer: Any, iterations: Any, warmup: Any, device: Any,
                  grad_scaler: Any = None) -> None:
    """Raise, naming ``where`` (the public function they were given to), if the arguments that
    make an :class:`Options` are not what it takes; before anything is measured."""
    function(loss_fn, where, "loss_fn", "a function output -> scalar tensor")
    function(optimizer, where, "optimizer", "a function params -> Optimizer (torch.optim.AdamW, not AdamW(params))")
    count(iterations, where, "iterations")
    count(warmup, where, "warmup")
    flag(grad_scaler, where, "grad_scaler", none=True)
    parse_device(device, where)


class DeviceError(ValueError, RuntimeError):
    """A device torch cannot read; a RuntimeError too, as torch's own error is, for callers that
    catch that."""


def parse_device(device: Any, where: str) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``), or a shrinkwrap error naming
    ``where``: torch's own says neither the argument nor the fix."""
    takes = "device= 'cuda', 'cuda:1', 'cpu', a torch.device or None"
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(wrong(where, takes, device))
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(wrong(where, takes, device)) from None



@dataclass(frozen=True)
class Timing:
    """One configuration's iteration time, measured in turns with others: the mean of each round,
    their median, and the spread between the fastest and the slowest round."""

    rounds_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds_ms)

    @property
    def spread(self) -> float:
        """(slowest - fastest round) / median: how far two figures must differ to mean something."""
        return (max(self.rounds_ms) - min(self.rounds_ms)) / self.median

    def __str__(self) -> str:
        return f"{self.median:.1f} ms ({min(self.rounds_ms):.1f}-{max(self.rounds_ms):.1f}, {len(self.rounds_ms)} rounds)"
