"""What fits: the smallest memory cap under which a configuration trains, found by training it.

A reading (``max_memory_allocated``) is what one steady-state iteration's tensors need. A card
must hold more: the caching allocator reserves whole segments and keeps freed blocks for reuse,
CUDA graphs keep private pools that no other allocation can use, and compilation, CUDA graph
recording and the warm-up iterations allocate what the steady step does not. The figure a user
needs is found by asking the GPU.

A probe (:func:`trains_under`) is a fresh process that caps its allocator at ``cap`` bytes
(``torch.cuda.set_per_process_memory_fraction``, before anything is allocated) and trains the
configuration's first ``iterations`` iterations, compilation, recording and warm-up included:
it passes if none runs out of memory. :func:`fit` first trains once with no cap (the bytes the
allocator then reserved are a cap that passes), then bisects between the largest cap that failed
and the smallest that passed, several probes at once where the GPU's free memory holds them,
until the two are within the resolution. The CUDA context and what is allocated outside
PyTorch's allocator (NCCL's buffers) are not under the cap: a card needs them besides.

Example::

    >>> f = sw.fit(torchvision.models.resnet18, torch.randn(128, 3, 224, 224), "autocast(torch.bfloat16)")
    >>> print(f)   # fits in N MiB: 8 iterations trained under an N MiB cap, not under the next cap below (...)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ._tree import tree_map
from .processes import PROCESS_MARGIN, compile_settings, model_maker, take_settings
from .processes.copies import build_model
from .processes.fresh import end_pool, first_error_line, stop_pool
from .processes.sendable import why_unsendable
from .measuring.graphs import graph_pool_bytes
from .measuring.profile import Options, require_options
from .measuring.step import require_batch, setup_iteration, device_name, resolve_device
from .plan import Plan, PlanLike, as_plan
from .select import count, function, positive

MiB = 2**20
ITERATIONS = 8  # a warm-up, compilation and CUDA graph recording happen in the first three or four


@dataclasses.dataclass(frozen=True)
class Probe:
    """One training under a cap (``cap`` None: no cap): whether its iterations ran (``ok``), the
    error where they did not (``oom``: the allocator's), and what the allocator held at most
    (``reserved``, ``allocated``: ``max_memory_reserved``/``max_memory_allocated``), at the end in
    CUDA graphs' private pools (``pools``), and after the model was built, before its first
    iteration (``model``)."""

    cap: int | None
    ok: bool
    oom: bool = False
    error: str | None = None
    reserved: int | None = None
    allocated: int | None = None
    pools: int | None = None
    model: int | None = None
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Fit:
    """The smallest cap under which a configuration trained its first ``iterations`` iterations
    (``cap``), the largest under which it did not (``below``; ``cap - below <= resolution``), and
    every probe, the first one without a cap.

    Example::

        >>> fit.cap / 2**20, fit.below / 2**20
        (1843.0, 1827.0)
    """

    cap: int
    below: int | None
    resolution: int
    iterations: int
    probes: tuple[Probe, ...]
    seconds: float
    device_name: str
    torch_version: str

    @property
    def uncapped(self) -> Probe:
        """The probe without a cap: what the allocator reserved and allocated at most, freely."""
        return self.probes[0]

    def __str__(self) -> str:
        below = f", not under {self.below / MiB:.0f} MiB" if self.below is not None else ""
        return (f"fits in {self.cap / MiB:.0f} MiB: {self.iterations} iterations trained under a "
                f"{self.cap / MiB:.0f} MiB cap{below} (resolution {self.resolution / MiB:.0f} MiB; "
                f"{len(self.probes)} probes, {self.seconds:.0f} s; {self.device_name}, torch {self.torch_version})")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or one it came from: a compiler's wrapper) is the allocator's."""
    while exc is not None:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _probe(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options, settings: dict,
           cap: int | None, iterations: int) -> Probe:
    """In a fresh process: the allocator capped at ``cap`` bytes, the configuration trained for
    ``iterations`` iterations."""
    start = time.perf_counter()
    take_settings(settings)
    device = torch.device(options.device)
    if cap is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    model = step = None
    built = None
    try:
        model = build_model(make, device, plan)
        built = torch.cuda.memory_allocated(device)
        step, _ = setup_iteration(model, batch, options, device)
        for _ in range(iterations):
            step()
        torch.cuda.synchronize(device)
        ok, oom, error = True, False, None
    except Exception as exc:  # noqa: BLE001 - out of memory is the answer; anything else is reported
        ok, oom, error = False, _out_of_memory(exc), first_error_line(exc)
    pools = graph_pool_bytes(device, [])[0] if ok else None
    return Probe(cap, ok, oom, error, torch.cuda.max_memory_reserved(device), torch.cuda.max_memory_allocated(device),
                 pools, built, time.perf_counter() - start)


def _run(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options, caps: list[int | None],
         iterations: int) -> list[Probe]:
    """Each cap's probe in a fresh process of its own, all at once."""
    settings = compile_settings()
    context = multiprocessing.get_context("spawn")
    pools = [concurrent.futures.ProcessPoolExecutor(1, mp_context=context) for _ in caps]
    try:
        futures = [pool.submit(_probe, make, plan, batch, options, settings, cap, iterations)
                   for pool, cap in zip(pools, caps)]
        out = []
        for cap, future in zip(caps, futures):
            try:
                out.append(future.result())
            except Exception as exc:  # noqa: BLE001 - a process that died (killed for memory, say)
                out.append(Probe(cap, False, _out_of_memory(exc), first_error_line(exc)))
        return out
    finally:
        for pool in pools:
            end_pool(stop_pool(pool), grace=10)


def _prepare(model_or_factory: nn.Module | Callable[[], nn.Module], batch: Any, plan: PlanLike, options: Options,
             where: str) -> tuple[Callable[[], nn.Module], Plan, Any, Options]:
    make = model_maker(model_or_factory, where)
    plan = as_plan(plan, where)
    require_batch(batch, where)
    device = resolve_device(require_options(options, where).device)
    if device.type != "cuda":
        raise ValueError(f"shrinkwrap: {where} caps the CUDA allocator; it needs a CUDA device, not {device}")
    options = dataclasses.replace(options, device=str(device))
    batch = tree_map(lambda t: t.to("cpu"), batch)  # CUDA tensors would be shared with the processes, not copied
    why = why_unsendable((make, plan, batch, options))
    if why:
        raise RuntimeError(f"shrinkwrap: {where} trains in fresh processes, and cannot start them: {why}")
    return make, plan, batch, options


def trains_under(model_or_factory: nn.Module | Callable[[], nn.Module], batch: Any, cap: int,
                 plan: PlanLike = (), options: Options = Options(), *, iterations: int = ITERATIONS) -> Probe:
    """Train ``plan`` on a fresh model for ``iterations`` iterations in a fresh process whose
    allocator may reserve at most ``cap`` bytes: the probe (``ok`` if it trained).

    Example::

        >>> sw.trains_under(make, batch, 8 * 2**30, "checkpoint(r'layers\\\\.\\\\d+')").ok
        True
    """
    positive(cap, "trains_under()", "cap", what=", bytes (8 * 2**30 for 8 GiB)")
    count(iterations, "trains_under()", "iterations")
    make, plan, batch, options = _prepare(model_or_factory, batch, plan, options, "trains_under()")
    return _run(make, plan, batch, options, [int(cap)], iterations)[0]


def fit(model_or_factory: nn.Module | Callable[[], nn.Module], batch: Any, plan: PlanLike = (),
        options: Options = Options(), *, iterations: int = ITERATIONS, resolution: int | None = None,
        at_once: int = 8, progress: Callable[[str], None] | None = None) -> Fit:
    """The smallest memory cap under which ``plan`` trains on a fresh model (see the module
    docstring): one probe without a cap, then rounds of up to ``at_once`` probes side by side
    (fewer where the GPU's free memory does not hold them), bisecting until the smallest cap that
    trained and the largest that did not are within ``resolution`` bytes (by default 1% of the
    uncapped reservation, at least 16 MiB). ``progress`` gets a line once the probe without a cap
    has trained, and a line as each round starts.

    Raises ``RuntimeError`` if the configuration does not train even without a cap, or fails
    otherwise than by running out of memory.

    Example::

        >>> f = sw.fit(make, batch, "checkpoint(r'layer[1-4]'), autocast(torch.bfloat16)")
        >>> f.cap / 2**20, f.uncapped.allocated / 2**20
    """
    count(iterations, "fit()", "iterations")
    count(resolution, "fit()", "resolution", none=True)
    count(at_once, "fit()", "at_once")
    function(progress, "fit()", "progress", "a function called with a line per round")
    make, plan, batch, options = _prepare(model_or_factory, batch, plan, options, "fit()")
    device = torch.device(options.device)
    start = time.perf_counter()
    (free,) = _run(make, plan, batch, options, [None], iterations)
    if not free.ok:
        raise RuntimeError(f"shrinkwrap: {plan or 'the baseline'} does not train on {device_name(device)} even "
                           f"without a cap: {free.error}")

    def at_once_now(passed: int) -> int:
        return max(1, min(at_once, int(torch.cuda.mem_get_info(device)[0] // (passed + PROCESS_MARGIN))))

    if progress:
        progress(f"fit: trained without a cap, reserving {free.reserved / MiB:.0f} MiB")
    resolution = resolution or max(16 * MiB, free.reserved // 100)
    probes = bisect(free, lambda caps: _run(make, plan, batch, options, caps, iterations), at_once_now,
                    resolution, progress)
    cap, below = bracket(probes)
    for p in probes:
        if not p.ok and not p.oom:
            raise RuntimeError(f"shrinkwrap: {plan or 'the baseline'} failed under a {p.cap / MiB:.0f} MiB cap "
                               f"otherwise than by running out of memory: {p.error}")
    return Fit(cap, below, resolution, iterations, tuple(probes), time.perf_counter() - start, device_name(device),
               torch.__version__)


def bracket(probes: list[Probe]) -> tuple[int, int | None]:
    """The smallest cap that trained (the uncapped probe's reservation counting as one), and the
    largest below it that did not (None if none did). Probes need not agree (a cap that trained
    below one that did not): the smallest that trained is the answer, and the failure under it."""
    passed = min(p.cap if p.cap is not None else p.reserved for p in probes if p.ok)
    below = [p.cap for p in probes if not p.ok and p.cap is not None and p.cap < passed]
    return passed, max(below) if below else None


def bisect(free: Probe, run: Callable[[list[int]], list[Probe]], at_once: Callable[[int], int], resolution: int,
           progress: Callable[[str], None] | None = None) -> list[Probe]:
    """The probes that bracket the smallest cap that trains to ``resolution``: ``free`` (the
    uncapped probe) first, then rounds of ``run(caps)``, each of ``at_once(smallest passing cap)``
    caps spaced evenly between the largest failing cap (at first 90% of what ``free`` allocated:
    tensors alone need that) and the smallest passing one. A probe that failed otherwise than by
    running out of memory ends the search."""
    probes = [free]
    floor = int(free.allocated * 0.9)
    while True:
        passed, failed = bracket(probes)
        if failed is not None and passed - failed <= resolution:
            return probes
        lo = failed if failed is not None else floor
        n = at_once(passed)
        caps = sorted({int(lo + (passed - lo) * (i + 1) / (n + 1)) for i in range(n)} - {passed})
        if failed is None:
            caps = sorted({lo, *caps[: max(0, n - 1)]})  # the floor itself, so that the round brackets
        if progress:
            progress(f"fit: {len(caps)} probes between {caps[0] / MiB:.0f} and {caps[-1] / MiB:.0f} MiB")
        new = run(caps)
        probes += new
        if any(not p.ok and not p.oom for p in new):
            return probes
        if failed is None and all(p.ok for p in new):
            if lo <= resolution:
                return probes  # it trained under every cap worth a probe
            floor = lo // 2
