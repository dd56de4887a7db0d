"""Activation offloading: what a region saves for backward waits in CPU memory, not on the GPU.

:class:`OffloadModule` runs the wrapped module, in training with grad enabled, under
``torch.autograd.graph.saved_tensors_hooks``. A tensor the region saves for backward that is on
an offloaded device (CUDA by default), is not a parameter or buffer (nor a view of one), is laid
out densely, and holds at least ``min_bytes``, is copied to pinned CPU memory on a side stream;
backward copies it back. Everything else (small tensors, parameters, buffers) stays where it is.

- Exact: the backward reads a bit-for-bit copy of what the forward saved, with the same shape,
  strides and dtype, so outputs, gradients and BatchNorm statistics equal the plain model's bit
  for bit (the tests' toy models, and real models with their blocks checkpointed too; with offload
  alone, GPT-2's and T5's float64 CPU gradients differed from the plain model's by up to 1e-16, for
  a reason not found). Autograd's in-place checks still run (the version counter is kept by autograd).
- Streams (CUDA): the side stream waits for the compute stream before each copy, and the GPU
  tensor is marked as in use on the side stream (``record_stream``), so the allocator reuses its
  memory only once the copy is done, while the forward goes on without waiting for it (waiting at
  the region's end would cost the forward the whole transfer). Host copies go to pinned memory, so
  the copies run asynchronously. Memory the allocator cannot reuse yet is not counted as
  allocated, and while it waits the allocator asks the driver for more: the reserved bytes can
  exceed the plain model's while the allocated ones are far lower (docs/steps/offload.md). Under a cap the allocator
  waits for the copies before it gives up, so what fits is what ``max_memory_allocated`` says;
  the forward then waits for the copies.
- Prefetch: in backward, the first tensor a region asks for starts the copies back of all its own
  tensors and of the region that ran before it in the forward (one region ahead), on the side
  stream; the compute stream waits for a tensor's copy only when it needs it.
- The last region: the region the forward reaches last is the first one backward needs, so
  offloading it gains no memory; ``keep_last=True`` (the default) leaves the last selected region,
  in module order, unwrapped (the record says so).
- Checkpoint: torch's non-reentrant checkpoint saves a region's inputs outside its own hooks, so
  ``Offload[Checkpoint[Block]]`` offloads exactly the inputs that checkpointing keeps. The offload
  step wraps a checkpoint region from outside, whichever order they are applied in: a plan runs
  ``offload`` after ``checkpoint`` (``order``), and an offload region that ends up *inside* a
  checkpoint region (checkpoint applied later) runs plainly, since its own hooks would hide the
  tensors from the checkpoint's. A selected module inside a checkpoint region is passed over.
- Traffic: each region counts the bytes it moved (:class:`Traffic`, on ``OffloadModule.traffic``);
  :func:`offload_traffic` sums a model's regions, and ``reset=True`` starts a new count, so a
  harness reads it after each step as the PCIe traffic of that step.
- eval, ``no_grad``, ``inference_mode`` and ``torch.compile`` run the module plainly (no hooks).
- On a machine without the offloaded device the regions change nothing. ``devices=('cpu',)``
  makes CPU tensors "offload" too (into a separate CPU copy): for tests of the logic on a CPU.

Example::

    >>> plan = sw.Plan([sw.checkpoint(r"model\\.layers\\.\\d+"), sw.offload(r"model\\.layers\\.\\d+")])
    >>> sw.apply(model, plan)
    >>> print(model.model.layers[0])          # Offload[Checkpoint[LlamaDecoderLayer]](...)
    >>> loss = model(**batch).loss; loss.backward()
    >>> sw.offload_traffic(model, reset=True) # Traffic(offloaded=..., reloaded=..., ...)
"""

from __future__ import annotations

__all__ = ['Offload', 'OffloadModule', 'Traffic', 'apply_offload', 'offload_traffic']

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn as nn

from .. import _compat
from .. import _rewrite
from .._wrapper import TransparentWrapper, refuse_functorch
from ..select import Pattern, block_groups, flag, require_module
from ..step import Step, Targets

MiB = 1 << 20


def _device_type(text: str) -> bool:
    """Whether ``text`` is a device type torch knows, without an index (``'cuda'``, not ``'cuda:0'``)."""
    try:
        return torch.device(text).type == text
    except (RuntimeError, ValueError):
        return False
_STREAMS: dict[torch.device, Any] = {}  # one side stream per device, made on first use (not on modules: they pickle)


@dataclasses.dataclass
class Traffic:
    """Bytes a region moved since the last reset: ``offloaded`` (device to CPU), ``reloaded``
    (CPU to device; more than ``offloaded`` when a graph is kept and run twice) and ``kept``
    (saved tensors on an offloaded device left there: small, parameters, buffers), with counts."""

    offloaded: int = 0
    reloaded: int = 0
    kept: int = 0
    tensors_offloaded: int = 0
    tensors_kept: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


def _stream(device: torch.device) -> Any:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _dense(t: torch.Tensor) -> bool:
    """Laid out so that a copy with the same strides holds the same bytes (no gaps, no overlap):
    an expanded or sliced tensor stays, where a copy would be larger or lose its layout."""
    if t.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()])


class _OffloadedTensor:
    """A saved tensor's stand-in while it waits on the CPU: the copy, and where it goes back."""

    __slots__ = ("stored", "device", "ready", "event", "region", "__weakref__")

    def __init__(self, stored: torch.Tensor, device: torch.device, region: "OffloadModule") -> None:
        self.stored, self.device, self.region = stored, device, region
        self.ready: torch.Tensor | None = None  # brought back ahead of use (prefetch)
        self.event: Any = None

    def fetch(self) -> None:
        """Start the copy back (on the side stream on CUDA); :meth:`take` waits for it."""
        if self.ready is not None:
            return
        if self.device.type == "cuda":
            side = _stream(self.device)
            with torch.cuda.stream(side):
                self.ready = self.stored.to(self.device, non_blocking=True)
                self.event = side.record_event()
        else:
            self.ready = self.stored.to(self.device, copy=True)
        self.region.traffic.reloaded += self.stored.nbytes

    def take(self) -> torch.Tensor:
        self.fetch()
        out, self.ready = self.ready, None
        if self.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            out.record_stream(current)  # allocated on the side stream, used on this one
            self.event = None
        return out


class _Schedule:
    """The offload regions of one step, in the order the last forward ran them: backward reaching
    one region prefetches the one before it."""

    def __init__(self) -> None:
        # Weak references: a graph that is dropped frees its CPU copies.
        self.order: list[tuple["OffloadModule", list[weakref.ref]]] = []

    def ran(self, region: "OffloadModule", held: list[_OffloadedTensor]) -> None:
        if any(r is region for r, _ in self.order):  # a new iteration (or the region runs twice)
            self.order = []
        self.order.append((region, [weakref.ref(h) for h in held]))

    def reached(self, region: "OffloadModule") -> None:
        """Backward asked ``region`` for a tensor: bring the previous region's tensors back."""
        for i, (r, _) in enumerate(self.order):
            if r is region:
                if i > 0:
                    for ref in self.order[i - 1][1]:
                        h = ref()
                        if h is not None:
                            h.fetch()
                del self.order[i:]  # this region and later ones are done prefetching
                return


def _in_checkpoint() -> bool:
    """Whether torch's checkpoint hooks are the innermost saved-tensor hooks (a checkpoint region
    around this one, in its forward or its recompute)."""
    top = _compat.innermost_saved_tensors_hooks()
    return top is not None and getattr(top[0], "__module__", "") == "torch.utils.checkpoint"


class OffloadModule(TransparentWrapper):
    """Run ``module`` with what it saves for backward offloaded to CPU memory; no name changes.

    Args:
        module: the region.
        name: its dotted name in the model, used in messages.
        min_bytes: smaller saved tensors stay where they are.
        devices: device types whose tensors are offloaded (``("cuda",)``); ``("cpu",)`` copies CPU
            tensors too, to test the logic on a CPU.

    Example::

        >>> model.layer1 = OffloadModule(model.layer1)        # or apply_offload(model, "layer1")
        >>> model.layer1.traffic                             # Traffic(offloaded=..., ...)
    """

    label = "Offload"

    def __init__(self, module: nn.Module, *, name: str = "", min_bytes: int = MiB,
                 devices: tuple[str, ...] = ("cuda",), schedule: _Schedule | None = None) -> None:
        if isinstance(module, OffloadModule):
            raise ValueError(f"shrinkwrap: {name or 'module'} is already offloaded")
        super().__init__(module)
        self._sw_name = name or type(module).__name__
        self._sw_min_bytes = min_bytes
        self._sw_devices = tuple(devices)
        self._sw_schedule = schedule if schedule is not None else _Schedule()
        self._sw_traffic = Traffic()

    @property
    def traffic(self) -> Traffic:
        """The bytes this region moved since its last reset (the wrapper's own: not the module's)."""
        return self.__dict__["_sw_traffic"]

    def transfers(self, reset: bool = False) -> dict[str, int]:
        """Bytes moved between the device and the CPU since the last reset (what the measuring
        harness reports as a step's PCIe traffic)."""
        moved = {"offloaded": self.traffic.offloaded, "reloaded": self.traffic.reloaded}
        if reset:
            self.traffic.reset()
        return moved

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped
        if not (self.training and torch.is_grad_enabled()) or torch.compiler.is_compiling() or _in_checkpoint():
            return inner(*args, **kwargs)
        refuse_functorch(f"offloaded module {self._sw_name!r}", "offload moves what the module saves for backward")
        own = {t.untyped_storage().data_ptr() for t in (*inner.parameters(), *inner.buffers())}
        held: list[_OffloadedTensor] = []
        reached = [False]

        def pack(t: torch.Tensor) -> Any:
            if t.device.type not in self._sw_devices:
                return t
            if (isinstance(t, nn.Parameter) or t.nbytes < self._sw_min_bytes or not _dense(t)
                    or type(t) is not torch.Tensor or t.untyped_storage().data_ptr() in own):
                self.traffic.kept += t.nbytes
                self.traffic.tensors_kept += 1
                return t
            if t.device.type == "cuda":
                side = _stream(t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(side):
                    stored = torch.empty_like(t, device="cpu", pin_memory=True)
                    stored.copy_(t, non_blocking=True)
                t.record_stream(side)  # its memory is reused only after the copy
            else:
                stored = torch.empty_like(t, device="cpu").copy_(t)
            h = _OffloadedTensor(stored, t.device, self)
            held.append(h)
            self.traffic.offloaded += t.nbytes
            self.traffic.tensors_offloaded += 1
            return h

        def unpack(h: Any) -> torch.Tensor:
            if not isinstance(h, _OffloadedTensor):
                return h
            if not reached[0]:
                reached[0] = True
                for own_held in held:  # all at once: later ones arrive while the first is used
                    own_held.fetch()
                self._sw_schedule.reached(self)
            return h.take()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = inner(*args, **kwargs)
        self._sw_schedule.ran(self, held)
        return out


def offload_traffic(model: nn.Module, reset: bool = False) -> Traffic:
    """The bytes all offload regions of ``model`` moved since their last reset (summed); with
    ``reset=True`` their counts start again from zero (read it once per training step).

    Example::

        >>> loss.backward(); print(sw.offload_traffic(model, reset=True).offloaded)
    """
    total = Traffic()
    flag(reset, "offload_traffic()", "reset")
    for m in require_module(model, "offload_traffic()").modules():
        if isinstance(m, OffloadModule):
            total = total + m.traffic
            if reset:
                m.traffic.reset()
    return total


@dataclasses.dataclass(frozen=True)
class Offload(Step):
    """Step: offload what the submodules ``pattern`` selects save for backward (outermost
    matches; ``None``: the blocks of the model's largest stack of same-type blocks) to CPU memory.

    ``candidates``: none. Offloading trades PCIe bandwidth and host memory for GPU memory; whether
    a region pays depends on the transfer time against its compute, which autoplan would have to
    measure on the GPU.

    Example::

        >>> sw.apply(model, sw.Plan([sw.checkpoint(r"layers\\.\\d+"), sw.offload(r"layers\\.\\d+")]))
    """

    name = "offload"
    order = 15  # after checkpoint: an offload region wraps a checkpoint region

    pattern: Pattern = None
    min_bytes: int = MiB
    keep_last: bool = True
    devices: tuple[str, ...] = ("cuda",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_bytes < 0:
            raise ValueError(f"shrinkwrap: offload(min_bytes={self.min_bytes!r}): min_bytes is the size in bytes "
                             f"under which a saved tensor stays on the device, 0 or more (default {MiB}, 1 MiB)")
        # A region compares each saved tensor's device type with these: 'cuda:0' or 'gpu' would
        # never match, and the step would offload nothing without a word.
        wrong_types = [d for d in self.devices if not _device_type(d)]
        if wrong_types or not self.devices:
            raise ValueError(f"shrinkwrap: offload(devices={self.devices!r}): devices are one or more device types "
                             f"whose saved tensors go to the CPU, such as ('cuda',) or ('cpu',); "
                             + (f"{', '.join(map(repr, wrong_types))} is no device type" if wrong_types
                                else "none offloads nothing"))

    def targets(self, model: nn.Module) -> Targets:
        pattern = self.pattern if self.pattern is not None else _blocks(model)
        wrap, skipped = _rewrite.wrap_targets(model, pattern, OffloadModule, "offload", "offloaded")
        regions = [n for n, m in model.named_modules() if getattr(type(m), "recomputes", False)]
        keep = []
        for name in wrap:
            enclosing = next((r for r in regions if name.startswith(r + ".")), None)
            if enclosing is not None:
                skipped.append((name, f"inside checkpointed {enclosing!r}: recomputed, not saved"))
            else:
                keep.append(name)
        if self.keep_last and keep:
            skipped.append((keep[-1], "the last region: backward needs it first, it stays on the device"))
            keep = keep[:-1]
        return Targets(keep, skipped)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        schedule = _Schedule()
        return _rewrite.replace(model, targets.matched, lambda n, m: OffloadModule(
            m, name=n, min_bytes=self.min_bytes, devices=self.devices, schedule=schedule))


def _blocks(model: nn.Module) -> list[str]:
    """The blocks of the model's largest stack of same-type blocks (a transformer's layers; see
    :func:`shrinkwrap.select.block_groups`); an error if it has none."""
    groups = block_groups(model)
    if not groups:
        raise ValueError(f"shrinkwrap: offload() found no stack of same-type blocks in "
                         f"{type(model).__name__}; name the regions, e.g. offload(r'layers\\.\\d+')")
    return max((blocks for _, blocks, _ in groups), key=len)


def apply_offload(model: nn.Module, pattern: Pattern = None, **options: Any) -> nn.Module:
    """Offload the regions ``pattern`` selects in ``model``, in place; return ``model``. See
    :class:`Offload` for ``options`` and :class:`OffloadModule` for what is preserved.

    Example::

        >>> apply_offload(model, r"layers\\.\\d+", min_bytes=1 << 16)
    """
    return Offload(pattern, **options).apply(require_module(model, "apply_offload()"))
