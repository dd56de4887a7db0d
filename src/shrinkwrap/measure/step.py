"""The one measuring harness: an instrumented training iteration, on CUDA or without it.

An iteration (a training step; "step" in shrinkwrap means a plan step) is
``zero_grad(set_to_none=True)``, forward, loss, backward, optimizer step. :func:`measure` runs, on
the model in place (restored afterwards):

1. the first iteration, recording allocated memory after each phase and the peak during it (CUDA);
2. warm-up iterations (a compiled model's read like the first: the one that records its CUDA
   graphs is where their memory can be seen, see :class:`Profile`);
3. gc, ``empty_cache``, ``reset_peak_memory_stats``, then one steady-state iteration recorded the
   same way: its peak is the number a report shows, broken down into parameters, gradients,
   optimizer state, the batch and activations/other;
4. ``iterations`` timed iterations (synchronised on CUDA); the median is the step time;
5. one iteration with the per-module log and the saved-for-backward count (and, on request, a
   CUDA memory-history snapshot): these hooks cost time, so no timed iteration carries them.

Without CUDA there is no allocator to read: the profile holds the bytes saved for backward,
parameter/gradient/optimizer-state bytes and step time, and its CUDA fields are ``None``.

Under a ``torch.distributed`` process group (``torchrun``; a model sharded with FSDP2 or
replicated with DDP), every rank runs the same iterations and measures its own: the bytes a rank
holds (its shards of parameters, gradients and optimizer state), its peak. The ranks' profiles
are then gathered (:mod:`.ranks`), so each profile, rank 0's included, carries every rank's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from .. import _rewrite
from .._tree import tensors, tree_map
from .._wrapper import TransparentWrapper
from ..select import compiled_how, require_module
from .modules import Event, ForwardTimes, ModuleLog
from .ranks import gather, local, rank_and_world
from .saved import SavedTensors

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
    shrinkwrap's regions moved between the device and the CPU, by direction: offload's PCIe traffic). ``timeline`` is the per-module log of one iteration,
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
    fresh, as :func:`measure` and autoplan's rows get it), its allocations were all in the open and
    each replay reuses exactly those addresses: the steady figures are that iteration's, aligned
    with the steady step's where both have freed their gradients. Otherwise (graphs recorded
    before :func:`measure` was called, or in its first iteration; an iteration that re-recorded one
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


# -- batch, loss, optimizer ----------------------------------------------------------------


def _bytes(ts: Iterable[torch.Tensor | None], device: torch.device | None = None) -> int:
    """Total size of the unique storages behind ``tensors`` (tied weights counted once); of a
    DTensor, this rank's shard; on ``device`` only, where given. A gradient the optimizer step in
    backward used and dropped holds nothing."""
    seen: dict[int, int] = {}
    for t in ts:
        if isinstance(t, torch.Tensor) and not _dropped(t) and (device is None or _same_device(t.device, device)):
            storage = local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(opt: Any) -> Iterator[torch.Tensor]:
    """The tensors an optimizer keeps: its ``state``, or, for one that has none (torchao's
    ``CPUOffloadOptimizer`` keeps an optimizer per parameter), every tensor its ``state_dict``
    holds, however nested."""
    state = getattr(opt, "state", None)
    if state is not None:
        for s in state.values():
            yield from tensors(s)
    elif hasattr(opt, "state_dict"):
        yield from tensors(opt.state_dict())


def _dropped(t: torch.Tensor) -> bool:
    """Whether ``t`` is the stand-in a gradient leaves once the optimizer step in backward used it."""
    return getattr(type(getattr(t, "_local_tensor", t)), "_sw_consumed", False)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def in_backward(model: nn.Module) -> Any:
    """The optimizer-shaped handle of a model whose optimizer steps inside backward (the root, or
    the module a parallel wrapper holds), or None: the harness steps through it, not through an
    optimizer of its own, which would step every parameter a second time."""
    for m in (model, *model.children()):
        handle = m.__dict__.get("_sw_optimizer")
        if handle is not None:
            return handle
    return None


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a tensor, a tuple/list of positional inputs, or a dict of kwargs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def default_loss(out: Any) -> torch.Tensor:
    """A scalar from common outputs: a tensor's mean; ``.loss`` (Hugging Face with labels);
    ``.logits``' mean; the first element of a tuple or list."""
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.float().mean()
    if isinstance(out, (list, tuple)) and out:
        return default_loss(out[0])
    raise TypeError(
        f"shrinkwrap: cannot make a loss from a model output of type {type(out).__name__}; "
        "pass loss_fn=lambda out: ... returning a scalar tensor"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA if present, else CPU. Asking for CUDA without it is an error."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"shrinkwrap: device {str(device)!r} asked, but CUDA is not available to torch "
                f"{torch.__version__}; use device='cpu' or install a CUDA build of torch"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def needs_grad_scaler(model: nn.Module) -> bool:
    """Whether a step applied to ``model`` (or to the model inside it: DDP's ``module``) asks for a
    GradScaler (float16 autocast sets ``needs_grad_scaler``)."""
    return any(getattr(r.step, "needs_grad_scaler", False) for m in model.modules() for r in _rewrite.records(m))


@dataclass(frozen=True)
class Options:
    """How a configuration is measured: the loss (``output -> scalar``; by default
    :func:`default_loss`), the optimizer factory (``params -> Optimizer``; AdamW by default),
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
        if self.iterations < 1 or self.warmup < 1:
            raise ValueError(f"shrinkwrap: iterations and warmup must be at least 1, "
                             f"got iterations={self.iterations}, warmup={self.warmup}")


# -- the harness -----------------------------------------------------------------------------


class _Iteration:
    """One training iteration, with a callback at the end of each phase."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: LossFn, opt: torch.optim.Optimizer,
                 scaler: Any) -> None:
        self.model, self.batch, self.loss_fn, self.opt, self.scaler = model, batch, loss_fn, opt, scaler

    def __call__(self, mark: Callable[[str], None] = lambda phase: None) -> None:
        self.opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        out = call_model(self.model, self.batch)
        mark("forward")
        loss = self.loss_fn(out)
        mark("loss")
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        mark("backward")
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        mark("step")


def _clean(device: torch.device) -> None:
    """Free what earlier work left behind before reading the allocator. Without CUDA no reading
    depends on it, and a full gc in a large process costs more than the steps it precedes."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _phases(step: _Iteration, device: torch.device) -> list[Phase]:
    """Run ``step``, reading allocated and peak at each phase end (peak reset per phase)."""
    phases: list[Phase] = []

    def mark(name: str) -> None:
        phases.append(Phase(name, torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)))
        torch.cuda.reset_peak_memory_stats(device)

    step(mark)
    return phases


def _timed(step: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


@contextlib.contextmanager
def _memory_history(path: str | None) -> Iterator[None]:
    """Record the CUDA allocator's history and write a snapshot for pytorch.org/memory_viz."""
    if not path:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[nn.Module]:
    """Give ``model`` back afterwards as it was: the same parameter and buffer objects with their
    values, gradients, devices and train/eval flags. Copies go to CPU memory, so measuring in
    place adds nothing to the device's count (a deepcopy on the GPU would); of an FSDP2 shard,
    only this rank's part is copied."""
    flags = [(m, m.training) for m in _all_modules(model)]
    slots = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    # Of a gradient only the values: holding the tensor would keep it on the device,
                    # and in the measured peak, through the whole measurement.
                    grad = _copy(t.grad)[1:] if t.grad is not None and not _dropped(t.grad) else None
                    slots.append((table, key, _copy(t), grad))
    handle = in_backward(model)
    states = _cpu_copy(handle.state_dict()) if handle is not None else None
    try:
        yield model
    finally:
        if handle is not None:
            handle.load_state_dict(states)  # the iterations stepped the model's own optimizer
        with torch.no_grad():
            for table, key, (t, dev, value), grad in slots:
                table[key] = t  # a forward may have swapped a buffer for a new tensor
                _put_back(t, dev, value)
                if grad is None:
                    t.grad = None
                elif t.grad is not None and _fits(local(t.grad), *grad):
                    local(t.grad).copy_(grad[1])  # into the gradient the last iteration made
                else:
                    t.grad = grad[1].to(grad[0])
        for m, mode in flags:
            m.training = mode


def _cpu_copy(state: Any) -> Any:
    return tree_map(lambda t: t.detach().to("cpu", copy=True), state)


def _copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.device, torch.Tensor]:
    """``t``, its device, and a CPU copy of what this rank holds of it (a DTensor's local shard)."""
    return t, t.device, local(t).detach().to("cpu", copy=True)


def _fits(held: torch.Tensor, device: torch.device, value: torch.Tensor) -> bool:
    return held.device == device and held.dtype == value.dtype and held.shape == value.shape


def _put_back(t: torch.Tensor, device: torch.device, value: torch.Tensor) -> None:
    """``t``'s values from ``value``: in place where it is still where it was, so that storage it
    shares stays shared (FSDP2's sharded parameters are views of its own buffers, which its
    all-gathers read); moved back otherwise."""
    held = local(t)
    if _fits(held, device, value):
        held.copy_(value)
    else:
        held.data = value.to(device)


def _all_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Every module, and the originals inside shrinkwrap's wrappers (they keep their own flags)."""
    for m in model.modules():
        yield m
        while isinstance(m, TransparentWrapper):
            m = m.wrapped
            yield m


def measure(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    *,
    iterations: int = 5,
    warmup: int = 2,
    device: str | torch.device | None = None,
    grad_scaler: bool | None = None,
    snapshot: str | None = None,
) -> Profile:
    """Measure one training iteration of ``model`` on ``batch``; the model is left as it was.

    Args:
        model: the model as it is (transformed or not). It is measured in place and restored:
            same parameter and buffer objects, values, gradients, device and train/eval flags.
        batch: a tensor, a tuple/list of positional inputs, or a dict of keyword inputs
            (Hugging Face). Moved to ``device``.
        loss_fn: ``output -> scalar``; by default a tensor's mean, ``output.loss``, or
            ``output.logits``' mean.
        optimizer: ``params -> Optimizer``, e.g. ``functools.partial(torch.optim.SGD, lr=0.1)``;
            AdamW by default. A fresh one is made; its state is dropped afterwards.
        iterations: timed steady-state iterations (the median is reported); ``warmup`` come first.
        device: ``"cuda"``, ``"cpu"``...; CUDA when present by default.
        grad_scaler: use ``torch.amp.GradScaler``; by default when a float16 autocast step was
            applied to the model.
        snapshot: on CUDA, write a ``torch.cuda.memory`` snapshot of one iteration to this path
            (open it at https://pytorch.org/memory_viz).

    Under ``torchrun`` (a process group initialised; the model sharded with FSDP2 or wrapped in
    DDP), every rank calls it: each measures its own iteration, and each profile carries every
    rank's in ``Profile.ranks``.

    Example::

        >>> prof = shrinkwrap.measure(model, torch.randn(32, 3, 224, 224))
        >>> prof.peak / 2**20, prof.breakdown()      # CUDA
        >>> prof.saved / 2**20, prof.step_ms           # any device
    """
    options = Options(loss_fn, optimizer, iterations, warmup, device, grad_scaler)
    return measure_with(require_module(model, "measure()"), batch, options, snapshot)


def measure_with(model: nn.Module, batch: Any, options: Options, snapshot: str | None = None,
                 restore: bool = True) -> Profile:
    """:func:`measure` with the options in one object. Under a process group every rank must call
    it (the iterations run collectives); each gets every rank's profile in ``ranks``, and a
    snapshot path gets the rank in its name (``memory.rank1.pickle``). ``restore=False`` leaves
    the model as the iterations left it (a model built for the row and thrown away after it)."""
    where = rank_and_world()
    if snapshot and where:
        snapshot = numbered(snapshot, f"rank{where[0]}")
    with restored(model) if restore else contextlib.nullcontext(), _recompile_limit() as met:
        profile = _measure(model, batch, options, snapshot)
    if where:  # every rank gathers first: one that raised before it would leave the others waiting
        profile.rank = where[0]
        profile.ranks = gather(profile) or []
    if met and profile.compiled:
        raise RuntimeError(
            f"shrinkwrap: dynamo met its limit of recompiles while this compiled model ran ({met[0]}), and runs "
            "that code eagerly from then on: the figures would be partly an eager model's. Every model compiled "
            "whole in one process shares the limit through nn.Module._call_impl (8 models of other structures by "
            "default). Measure it in a fresh process (sw.plan_report and autoplan do on CUDA), call "
            "torch._dynamo.reset() before building it, or raise torch._dynamo.config.recompile_limit.")
    return profile


@contextlib.contextmanager
def _recompile_limit() -> Iterator[list[str]]:
    """The limits of recompiles dynamo meets in the block, as its log names them (``recompile_limit
    (8)``): a frame past its limit runs eagerly from then on, which dynamo says in a warning only."""
    met: list[str] = []

    class Met(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("torch._dynamo hit config."):
                met.append(record.getMessage().splitlines()[0].removeprefix("torch._dynamo hit config."))

    logger, handler = logging.getLogger("torch._dynamo.convert_frame"), Met(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield met
    finally:
        logger.removeHandler(handler)


def numbered(path: str, tag: object) -> str:
    """``path`` with ``tag`` before its suffix: ``memory.pickle`` -> ``memory.<tag>.pickle``."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.{tag}.{suffix}" if dot and "/" not in suffix else f"{path}.{tag}"


def _setup(model: nn.Module, batch: Any, options: Options, device: torch.device) -> tuple[_Iteration, Any]:
    """The model on ``device`` in training mode, and an iteration with a fresh optimizer."""
    model.to(device).train()
    batch = tree_map(lambda t: t.to(device), batch)
    opt = in_backward(model) or (options.optimizer or torch.optim.AdamW)([p for p in model.parameters() if p.requires_grad])
    grad_scaler = needs_grad_scaler(model) if options.grad_scaler is None else options.grad_scaler
    scaler = torch.amp.GradScaler(device.type) if grad_scaler else None
    return _Iteration(model, batch, options.loss_fn or default_loss, opt, scaler), batch


def _measure(model: nn.Module, batch: Any, options: Options, snapshot: str | None) -> Profile:
    device = resolve_device(options.device)
    if snapshot and device.type != "cuda":
        raise ValueError("shrinkwrap: a memory snapshot records the CUDA allocator; it needs device='cuda'")
    cuda = device.type == "cuda"
    step, batch = _setup(model, batch, options, device)
    opt = step.opt

    compiled = is_compiled(model)
    counts = _dynamo_counts if compiled else (lambda: (0, 0))
    graphs_start, breaks_start = counts()
    _clean(device)
    first: list[Phase] = []
    trees = (lambda: _graph_trees(device)) if compiled and cuda else (lambda: None)

    def read(phases: list[Phase]) -> tuple[list[Any], bool]:
        """One CUDA iteration, its phases added to ``phases``: the CUDA graphs it replayed, and
        whether it recorded every one of them (its allocations all in the open)."""
        before = trees()
        torch.cuda.reset_peak_memory_stats(device)
        with _replays() if compiled else contextlib.nullcontext([]) as replayed:
            phases.extend(_phases(step, device))
        return replayed, _recorded_whole(before, trees(), replayed)

    first_ms = _timed(lambda: read(first) if cuda else step(), device, 1)[0]
    warm: list[tuple[list[Phase], list[Any], bool]] = []  # not the first: it compiles and makes the optimizer's state
    for _ in range(options.warmup - 1):
        if compiled and cuda:
            phases: list[Phase] = []
            warm.append((phases, *read(phases)))
        else:
            step()
    graphs_warm, _ = counts()
    _clean(device)
    static = torch.cuda.memory_allocated(device) if cuda else None
    # Read before the steady step's zero_grad: a recording's gradients, which the counters hold in
    # static already, are replaced then by ones a replay writes, unseen.
    _, unseen_grads = _graph_pools(device, [p.grad for p in model.parameters()]) if compiled and cuda else (0, 0)
    steady: list[Phase] = []
    replayed, steady_recorded = read(steady) if cuda else ([], False)
    pool = _graph_pools(device, [])[0] if replayed else 0  # after it: a steady step may record (warmup=1)
    recorded = None
    if replayed and not steady_recorded:  # the steady step replayed graphs, whose memory the counters miss
        static += unseen_grads  # gradients a replay wrote: in use, and not counted
        recorded = _as_recorded(steady, replayed, warm, unseen_grads)
        steady = recorded or [Phase(p.name, p.allocated + pool, p.peak + pool) for p in steady]
    _transfers(model, reset=True)
    times = _timed(step, device, options.iterations)
    transfers = {k: v / options.iterations for k, v in _transfers(model, reset=True).items() if v}
    graphs, breaks = counts()

    saved: SavedTensors | None = None
    log = ModuleLog(model, lambda: 0)
    if not (compiled and cuda) and (options.module_log or not cuda or snapshot):
        saved = SavedTensors()
        log.probe = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: saved.live)
        with saved, log, _memory_history(snapshot):
            step(log.mark)

    return Profile(
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        saved=saved.bytes if saved is not None else None,
        parameters=_bytes([*model.parameters(), *model.buffers()]),
        gradients=_bytes(p.grad for p in model.parameters()),
        optimizer_state=_bytes(_state_tensors(opt), device),
        batch=_bytes(tensors(batch)),
        step_ms=statistics.median(times),
        step_times_ms=times,
        peak=max(p.peak for p in steady) if cuda else None,
        first_peak=max(p.peak for p in first) if cuda else None,
        static=static,
        first_step=first,
        steady_step=steady,
        timeline=log.events,
        timeline_probe="allocated" if cuda else "saved_for_backward",
        top_modules=log.contributors()[:10],
        snapshot=snapshot,
        transfers=transfers,
        compiled=compiled,
        first_ms=first_ms,
        recompiles=graphs - graphs_warm if compiled else None,
        graph_breaks=breaks - breaks_start if compiled else None,
        graph_pool=pool if replayed else None,
        graph_recorded=steady_recorded or recorded is not None,
    )


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


def time_interleaved(models: dict[str, nn.Module], batch: Any, options: Options = Options(), *,
                     rounds: int = 5, per_round: int = 3,
                     until: Callable[[dict[str, Timing]], bool] | None = None,
                     max_rounds: int | None = None) -> dict[str, Timing]:
    """Time the training iteration of several models in turns (A B C, B C A, ...) in this process.

    Step times on a shared GPU drift 10-20% between processes and over minutes; measured in
    turns, drift falls on every configuration alike, and each result carries its spread. Each
    model gets ``options.warmup`` iterations first (compilation happens there), then ``rounds``
    rounds of ``per_round`` iterations each; models are restored afterwards, as by :func:`measure`.
    With ``until``, rounds go on one at a time after the first ``rounds`` while ``until(timings so
    far)`` is false, up to ``max_rounds`` in all (which ``until`` needs): as many repeats as a
    decision needs.

    Example::

        >>> t = time_interleaved({"fp32": plain, "plan": transformed}, batch, Options(device="cuda"))
        >>> t["plan"].median / t["fp32"].median, t["plan"].spread
    """
    if rounds < 1 or (until is not None and max_rounds is None):
        raise ValueError("shrinkwrap: time_interleaved needs rounds >= 1, and max_rounds with until")
    device = resolve_device(options.device)
    with contextlib.ExitStack() as stack:
        steps = {}
        for name, model in models.items():
            stack.enter_context(restored(require_module(model, "time_interleaved()")))
            steps[name], _ = _setup(model, batch, options, device)
            for _ in range(options.warmup):
                steps[name]()
        names = list(steps)
        out: dict[str, list[float]] = {name: [] for name in names}

        def timings() -> dict[str, Timing]:
            return {name: Timing(tuple(times)) for name, times in out.items()}

        r = 0
        while r < rounds or (until is not None and r < max_rounds and not until(timings())):
            for name in names[r % len(names):] + names[: r % len(names)]:  # a new first each round
                out[name].append(statistics.mean(_timed(steps[name], device, per_round)))
            r += 1
    return timings()


def forward_times(model: nn.Module, batch: Any, options: Options = Options()) -> dict[str, float]:
    """Each named module's forward time in a training iteration, in milliseconds (GPU time on
    CUDA): the median over ``options.iterations`` iterations after ``options.warmup``; the model
    is restored afterwards, as by :func:`measure`. What recomputing a region in backward costs,
    read for every region from the same iterations: on a shared GPU one row per region differs
    from the next by more than a region's recompute takes.

    Example::

        >>> forward_times(model, batch, Options(device="cuda"))["layer1"]
        4.1
    """
    device = resolve_device(options.device)
    with restored(require_module(model, "forward_times()")):
        step, _ = _setup(model, batch, options, device)
        for _ in range(options.warmup):
            step()
        with ForwardTimes(model, device if device.type == "cuda" else None) as times:
            for _ in range(options.iterations):
                step(times.mark)
                times.next_iteration()
        return times.ms()


def _transfers(model: nn.Module, reset: bool = False) -> dict[str, int]:
    """What the model's wrappers moved between devices since their last reset, summed by direction."""
    total: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, TransparentWrapper):
            for k, v in m.transfers(reset).items():
                total[k] = total.get(k, 0) + v
    return total


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a module in it runs compiled: ``Module.compile``, or ``torch.compile``'s
    wrapper (``OptimizedModule``) as the model or in place of a child
    (``model.layer1 = torch.compile(model.layer1)``)."""
    return any(compiled_how(m) for m in model.modules())


def _graph_pools(device: torch.device, grads: list[torch.Tensor | None]) -> tuple[int, int]:
    """Bytes reserved on ``device`` in private memory pools (CUDA graphs'), and the bytes of
    ``grads`` whose storage (a DTensor's: this rank's shard) lies in them outside every block the
    allocator counts as allocated: written by a replayed graph, unseen by its counters (one a
    recording made is counted)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    segments = [s for s in torch.cuda.memory_snapshot()
                if s.get("device", index) == index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    counted = [(b["address"], b["address"] + b["size"]) for s in segments for b in s.get("blocks", ())
               if b.get("state") == "active_allocated" and "address" in b]

    def within(g: torch.Tensor, spans: Iterable[tuple[int, int]]) -> bool:
        at = local(g).untyped_storage().data_ptr()
        return any(a <= at < b for a, b in spans)

    pools = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    return sum(b - a for a, b in pools), _bytes(g for g in grads if g is not None and not _dropped(g)
                                                and within(g, pools) and not within(g, counted))


def _graph_trees(device: torch.device) -> int | None:
    """How many graphs ``torch.compile``'s CUDA graph trees have recorded for ``device`` in this
    thread (each node of a tree is one recording); None where this torch's trees cannot say."""
    try:
        from torch._inductor import cudagraph_trees

        index = torch.cuda.current_device() if device.index is None else device.index
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        nodes, count = [n for ns in manager.roots.values() for n in ns] if manager is not None else [], 0
        while nodes:
            count += 1
            nodes.extend(c for cs in nodes.pop().children.values() for c in cs)
        return count
    except Exception:  # noqa: BLE001 - private structures of torch: without them, the upper bound
        return None


@contextlib.contextmanager
def _replays() -> Iterator[list[Any]]:
    """List the CUDA graphs replayed (``torch.cuda.CUDAGraph.replay``, through which graph trees
    run each) while open, in the list it gives. The trees' own structures cannot
    tell which graphs an iteration ran: the path they keep can begin anew within one iteration."""
    cls = torch.cuda.CUDAGraph
    own = "replay" in vars(cls)
    original = cls.replay
    replayed: list[Any] = []  # the graphs themselves: an id could be reused by another

    def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
        replayed.append(graph)
        return original(graph, *args, **kwargs)

    cls.replay = replay
    try:
        yield replayed
    finally:
        if own:
            cls.replay = original
        else:
            del cls.replay


def _as_recorded(steady: list[Phase], replayed: list[Any], warm: list[tuple[list[Phase], list[Any], bool]],
                 unseen_grads: int) -> list[Phase] | None:
    """The steady step's phases as a warm-up iteration that recorded, whole, every CUDA graph the
    steady step replayed (``replayed``) made them in the open: that iteration's phases, aligned
    with the steady step's at zero_grad, where both have freed their gradients and hold the same
    state. No phase reads less than the steady step's own counters, with the ``unseen_grads`` a
    replay wrote from backward on (a phase that differs between iterations, such as a first
    optimizer step, or leftovers freed between them, would otherwise read low). ``warm`` holds
    each warm-up's phases, the graphs it replayed and whether it recorded them whole. None where
    no warm-up did."""
    for phases, graphs, whole in warm:
        if whole and set(replayed) <= set(graphs):
            shift = steady[0].allocated - phases[0].allocated
            grads = [unseen_grads if p.name in ("backward", "step") else 0 for p in steady]
            return [Phase(r.name, max(r.allocated + shift, s.allocated + g), max(r.peak + shift, s.peak + g))
                    for r, s, g in zip(phases, steady, grads)]
    return None


def _recorded_whole(before: int | None, after: int | None, replayed: list[Any]) -> bool:
    """Whether an iteration, between two readings of :func:`_graph_trees`, recorded every CUDA
    graph it ran: graph trees replay a graph once as they record it (capture computes nothing),
    so its replays are exactly its recordings, each once, one at least. One that re-recorded one
    function and replayed the others would read low: their memory unseen."""
    return (before is not None and after is not None and after > before
            and len(replayed) == len(set(replayed)) == after - before)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters  # imported already where a model is compiled

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
