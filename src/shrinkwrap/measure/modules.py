"""Memory at each module's forward start, forward end and backward end over one training iteration.

:class:`ModuleLog` hooks every named module and calls a probe at each event: on CUDA the probe is
``torch.cuda.memory_allocated``, without CUDA it is the bytes saved for backward still held by the
graph (:class:`~shrinkwrap.measure.saved.SavedTensors`). The harness adds the step's phase
boundaries (``zero_grad``, ``forward``, ...) to the same timeline, so one list describes the step.
"""

from __future__ import annotations

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


class ModuleLog:
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
        self.in_backward = False
        self._handles: list[Any] = []

    def mark(self, phase: str) -> None:
        """Record the end of a phase of the step (the harness calls this after each phase)."""
        self.events.append(Event("", phase, self.probe()))
        # Backward comes right after the loss phase ends; forward hooks firing then are a recompute.
        self.in_backward = phase == "loss"

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

    def __enter__(self) -> "ModuleLog":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.in_backward = False

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
