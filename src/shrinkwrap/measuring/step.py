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
import platform
import statistics
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .. import _compat
from .. import _rewrite
from .._tree import tensors, tree_map
from .._wrapper import TransparentWrapper
from ..select import compiled_how, require_module, text, wrong
from ..transforms.optimizer.cpu import worker_threads
from ..transforms.optimizer.interface import trained_by
from .graphs import _as_recorded, _dynamo_counts, graph_pool_bytes, _graph_trees, _recompile_limit, _recorded_whole, _replays
from .modules import ModuleLog
from .profile import LossFn, OptimizerFactory, Options, Phase, Profile, check_options, parse_device
from .ranks import gather, rank_and_world
from .restore import restored
from .saved import SavedTensors
from .sizes import _bytes, _state_tensors

# -- batch, loss, optimizer ----------------------------------------------------------------


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a tensor, a tuple/list of positional inputs, or a dict of kwargs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def require_batch(batch: Any, where: str) -> Any:
    """``batch`` if it holds a tensor (see :func:`call_model`); else a ``TypeError`` saying what
    ``where`` got, before the model's own forward fails on it."""
    if next(tensors(batch), None) is None:
        raise TypeError(wrong(where, "a batch: a tensor, a tuple or list of positional inputs, or a dict of keyword "
                                     "inputs, with a tensor in it", batch))
    return batch


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


def resolve_device(device: str | torch.device | None, where: str = "a measurement") -> torch.device:
    """``None`` -> CUDA if present, else CPU. Asking for CUDA without it is an error, and so is a
    device torch cannot read (the message names ``where``, the function it was given to)."""
    device = parse_device(device, where) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


def clean_device(device: torch.device) -> None:
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
    _compat.record_memory_history(True)
    try:
        yield
        _compat.dump_memory_snapshot(path)
    finally:
        _compat.record_memory_history(False)


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
    require_module(model, "measure()")
    check_options("measure()", loss_fn, optimizer, iterations, warmup, device, grad_scaler)
    text(snapshot, "measure()", "snapshot", "a path (a str)")
    options = Options(loss_fn, optimizer, iterations, warmup, device, grad_scaler)
    return measure_with(model, require_batch(batch, "measure()"), options, snapshot)


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


def numbered(path: str, tag: object) -> str:
    """``path`` with ``tag`` before its suffix: ``memory.pickle`` -> ``memory.<tag>.pickle``."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.{tag}.{suffix}" if dot and "/" not in suffix else f"{path}.{tag}"


def setup_iteration(model: nn.Module, batch: Any, options: Options, device: torch.device) -> tuple[_Iteration, Any]:
    """The model on ``device`` in training mode, and an iteration with a fresh optimizer."""
    model.to(device).train()
    batch = tree_map(lambda t: t.to(device), batch)
    opt = trained_by(model) or (options.optimizer or torch.optim.AdamW)([p for p in model.parameters() if p.requires_grad])
    grad_scaler = needs_grad_scaler(model) if options.grad_scaler is None else options.grad_scaler
    scaler = torch.amp.GradScaler(device.type) if grad_scaler else None
    return _Iteration(model, batch, options.loss_fn or default_loss, opt, scaler), batch


def _measure(model: nn.Module, batch: Any, options: Options, snapshot: str | None) -> Profile:
    device = resolve_device(options.device)
    if snapshot and device.type != "cuda":
        raise ValueError("shrinkwrap: a memory snapshot records the CUDA allocator; it needs device='cuda'")
    cuda = device.type == "cuda"
    step, batch = setup_iteration(model, batch, options, device)
    opt = step.opt

    compiled = is_compiled(model)
    counts = _dynamo_counts if compiled else (lambda: (0, 0))
    graphs_start, breaks_start = counts()
    clean_device(device)
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
    clean_device(device)
    static = torch.cuda.memory_allocated(device) if cuda else None
    # Read before the steady step's zero_grad: a recording's gradients, which the counters hold in
    # static already, are replaced then by ones a replay writes, unseen.
    _, unseen_grads = graph_pool_bytes(device, [p.grad for p in model.parameters()]) if compiled and cuda else (0, 0)
    steady: list[Phase] = []
    replayed, steady_recorded = read(steady) if cuda else ([], False)
    pool = graph_pool_bytes(device, [])[0] if replayed else 0  # after it: a steady step may record (warmup=1)
    recorded = None
    if replayed and not steady_recorded:  # the steady step replayed graphs, whose memory the counters miss
        static += unseen_grads  # gradients a replay wrote: in use, and not counted
        recorded = _as_recorded(steady, replayed, warm, unseen_grads)
        steady = recorded or [Phase(p.name, p.allocated + pool, p.peak + pool) for p in steady]
    _transfers(model, reset=True)
    handle = trained_by(model)
    on_cpu = handle is not None and getattr(handle, "on_cpu", False)
    before = (handle.worker_s, handle.waited_s) if on_cpu else None
    times = _timed(step, device, options.iterations)
    transfers = {k: v / options.iterations for k, v in _transfers(model, reset=True).items() if v}
    cpu_step = None
    if on_cpu:
        # The timed iterations' CPU steps: the worker's seconds, and the loop's waiting for it.
        cpu_step = {"worker_ms": (handle.worker_s - before[0]) * 1e3 / options.iterations,
                    "waited_ms": (handle.waited_s - before[1]) * 1e3 / options.iterations,
                    "threads": worker_threads()}
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
        cpu_step=cpu_step,
        compiled=compiled,
        first_ms=first_ms,
        recompiles=graphs - graphs_warm if compiled else None,
        graph_breaks=breaks - breaks_start if compiled else None,
        graph_pool=pool if replayed else None,
        graph_recorded=steady_recorded or recorded is not None,
    )


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
