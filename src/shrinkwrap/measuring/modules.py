"""Memory at each module's forward start, forward end and backward end over one training iteration.

:class:`ModuleLog` hooks every named module and calls a probe at each event: on CUDA the probe is
``torch.cuda.memory_allocated``, without CUDA it is the bytes saved for backward still held by the
graph (:class:`~shrinkwrap.measuring.saved.SavedTensors`). The harness adds the step's phase
boundaries (``zero_grad``, ``forward``, ...) to the same timeline, so one list describes the step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from .._wrapper import TransparentWrapper


@dataclass(frozen=True)
class Event:
    """One point of the timeline: ``module`` (dotted name, ``""`` for the root or a phase mark),
    ``event`` (``forward_start``, ``forward_end``, ``backward_end``, ``recompute`` or a phase name)
    and ``bytes`` (what the probe read)."""

    module: str
    event: str
    bytes: int


class _Hooked:
    """A context manager that hooks every named module's forward (``_pre`` and ``_post`` give
    each module's hooks) and knows, from the harness's phase marks, when forwards are a recompute
    in backward."""

    model: nn.Module
    in_backward: bool = False

    def _pre(self, name: str) -> Callable:
        raise NotImplementedError

    def _post(self, name: str) -> Callable:
        raise NotImplementedError

    def mark(self, phase: str) -> None:
        # Backward comes right after the loss phase ends; forward hooks firing then are a recompute.
        self.in_backward = phase == "loss"

    def __enter__(self) -> "_Hooked":
        self._handles = []
        try:
            for name, module in self.model.named_modules():
                if isinstance(module, torch.jit.ScriptModule):  # takes no Python hooks
                    continue
                for register, hook in ((module.register_forward_pre_hook, self._pre(name)),
                                       (module.register_forward_hook, self._post(name))):
                    hook._sw_observes = True  # only reads: the steps that fuse modules still fuse them
                    self._handles.append(register(hook))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.in_backward = False


class ModuleLog(_Hooked):
    """Context manager: log ``probe()`` at each module's forward start/end and backward end.

    A module's backward end is when the gradient of its first input that requires grad is
    computed, so modules whose inputs need no gradient (the stem) log no backward end. Forward
    hooks that fire during backward are a checkpointed region's recompute and are logged as
    ``recompute``.

    Example::

        >>> with ModuleLog(model, torch.cuda.memory_allocated) as log:
        ...     model(x).mean().backward()
        >>> log.contributors()[:3]   # [('layer1', 205520896), ...]
    """

    def __init__(self, model: nn.Module, probe: Callable[[], int]) -> None:
        self.model = model
        self.probe = probe
        self.events: list[Event] = []

    def mark(self, phase: str) -> None:
        """Record the end of a phase of the step (the harness calls this after each phase)."""
        self.events.append(Event("", phase, self.probe()))
        super().mark(phase)

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self.in_backward:
                return
            self.events.append(Event(name, "forward_start", self.probe()))
            # Hooked before the module runs, so an in-place op inside it cannot move the hook.
            first = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if first is not None and torch.is_grad_enabled():
                first.register_hook(self._backward_end(name))

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            event = "recompute" if self.in_backward else "forward_end"
            self.events.append(Event(name, event, self.probe()))

        return hook

    def _backward_end(self, name: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.events.append(Event(name, "backward_end", self.probe()))

        return hook

    def contributors(self) -> list[tuple[str, int]]:
        """(module, bytes its forward added and kept), largest first; see :func:`contributors`."""
        return contributors(self.events, _units(self.model))


def _units(model: nn.Module) -> set[str]:
    """Names that count as one contributor: leaves, and checkpointed regions as a whole (what is
    inside them is recomputed, not kept)."""
    units, regions = set(), []
    for name, module in model.named_modules():
        if not name or any(name.startswith(r + ".") for r in regions):
            continue
        if isinstance(module, TransparentWrapper) and module.recomputes:
            regions.append(name)
            units.add(name)
        elif not any(True for _ in module.children()):
            units.add(name)
    return units


def contributors(events: list[Event], units: set[str] | None = None) -> list[tuple[str, int]]:
    """Per module, the probe at forward end minus at forward start (what its forward added and
    still held when it returned), largest first. ``units`` limits the list to those names."""
    start: dict[str, int] = {}
    added: dict[str, int] = {}
    for e in events:
        if units is not None and e.module not in units:
            continue
        if e.event == "forward_start":
            start[e.module] = e.bytes
        elif e.event == "forward_end" and e.module in start:
            added[e.module] = added.get(e.module, 0) + e.bytes - start.pop(e.module)
    return sorted(added.items(), key=lambda kv: -kv[1])


class ForwardTimes(_Hooked):
    """Context manager: how long each named module's forward takes, per iteration run inside it.

    On a CUDA ``device`` a forward is timed by events recorded on its stream before and after it
    (GPU time, read once at the end, so nothing waits in between); else by the clock. Every module is
    timed in the same iterations, so a slow stretch of a shared GPU falls on all of them alike.
    Forwards during backward (a checkpointed region's recompute) are not counted. The harness
    calls :meth:`mark` at each phase end, as for :class:`ModuleLog`, and :meth:`next_iteration`
    after each iteration.

    Example::

        >>> with ForwardTimes(model, torch.device("cuda")) as times:
        ...     for _ in range(3):
        ...         step(times.mark); times.next_iteration()
        >>> times.ms()["layer1"]   # median over the iterations
    """

    def __init__(self, model: nn.Module, device: torch.device | None) -> None:
        self.model, self.device = model, device  # a CUDA device, or None: the clock
        self.iterations: list[dict[str, list[tuple[Any, Any]]]] = [{}]
        self._started: dict[str, list[Any]] = {}

    def _stamp(self) -> Any:
        if self.device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def next_iteration(self) -> None:
        self.iterations.append({})

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if not self.in_backward:
                self._started.setdefault(name, []).append(self._stamp())

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if not self.in_backward and self._started.get(name):
                self.iterations[-1].setdefault(name, []).append((self._started[name].pop(), self._stamp()))

        return hook

    def ms(self) -> dict[str, float]:
        """Per module, the median over the iterations of its forwards' milliseconds in each (a
        module called twice in an iteration counts both calls)."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        elapsed = (lambda a, b: a.elapsed_time(b)) if self.device is not None else (lambda a, b: (b - a) * 1e3)
        per_iteration = [{name: sum(elapsed(a, b) for a, b in spans) for name, spans in it.items()}
                         for it in self.iterations if it]
        names = {name for it in per_iteration for name in it}
        return {name: statistics.median(it.get(name, 0.0) for it in per_iteration) for name in names}
