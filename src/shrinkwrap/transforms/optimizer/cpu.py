"""A parameter's optimizer stepped on the CPU (``step_in_backward(state='cpu')``): its copy,
gradient buffer and state in pinned memory, the fingerprint that tells whether the weight changed
on the GPU since its step wrote it, and the step itself: the gradient down on a side stream, the
update on a worker thread, the weight back up, at once or, with ``delayed=True``, at the next
backward's hook of the parameter (the step of iteration i runs during iteration i+1)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
import weakref

import torch

from ... import _compat
from .backward import _Backward, _unstepped
from .rounding import round_into
from .standin import local, norms, stand_in


def _one_optimizer(cls: type, p: torch.Tensor, options: dict, fused: bool) -> torch.optim.Optimizer:
    """``cls`` over the one tensor ``p``: fused where asked and the class has a fused form for
    ``p``'s device and dtype (a GPU parameter or its CPU copy), else with ``options`` as given."""
    if fused:
        try:
            return cls([p], **{**options, "foreach": None, "fused": True})
        except (TypeError, ValueError, RuntimeError):  # no fused form of this class here
            pass
    return cls([p], **options)


_PRINT = 4096  # values a block of a weight's fingerprint
_PROBES: dict = {}


def fingerprint(t: torch.Tensor) -> tuple | None:
    """What tells, on the GPU and without a copy of ``t``, whether it changed: each block's sum of
    bit patterns (exact, so any one value changed shows) and its product with a fixed vector (so
    values moved within a block show). None where ``t`` is not contiguous: it is taken as changed."""
    if not t.is_contiguous():
        return None
    flat = t.detach().reshape(-1)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    n = flat.numel()
    m = n - n % _PRINT
    probe = _PROBES.get((t.dtype, t.device))
    if probe is None:
        probe = _PROBES[(t.dtype, t.device)] = torch.linspace(1.0, 2.0, _PRINT, dtype=t.dtype, device=t.device)
    sums = [bits[:m].view(-1, _PRINT).sum(1, dtype=torch.int64), bits[m:].sum(dtype=torch.int64).reshape(1)]
    mixed = [flat[:m].view(-1, _PRINT) @ probe, (flat[m:] * probe[: n - m]).sum().reshape(1)]
    return torch.cat(sums), torch.cat(mixed)


def _differs(now: tuple | None, then: tuple | None, device: torch.device) -> torch.Tensor:
    """Whether the fingerprints differ (or either is missing), a bool on ``device``."""
    if now is None or then is None:
        return torch.ones((), dtype=torch.bool, device=device)
    return (now[0] != then[0]).any() | (now[1] != then[1]).any()


def worker_threads() -> int:
    """The CPU step's threads: the process's own (torch's, within the cores it may run on) less
    two, left to the threads that launch the forward and backward on the GPU: a worker on every
    core slows those, and with them the GPU, more than its own step gains."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores) - 2)


class _OnCpu:
    """One parameter's optimizer stepped on the CPU: its copy (float32 where the parameter is
    half: the master copy), gradient buffer and norms in pinned memory (plain memory where there
    is no CUDA), the optimizer over the copy, and for a half weight the values its last step
    wrote (``sent``: the master rounded to nearest, or stochastically).

    The step starts from what the model holds (a ``load_state_dict``, a clamp through ``.data``,
    a resume since): a GPU weight comes down where its :func:`fingerprint` differs from the one
    its last step wrote; a float32 weight replaces the master, and a half weight's values that
    differ from what its step wrote replace the master's. For a GPU's parameter the CPU optimizer
    is torch's fused one where its class has one (AdamW, Adam, SGD, Adagrad): one pass over the
    values instead of one an operation. A CPU model's parameters keep the single-tensor path, and
    with it the plain loop's bits."""

    def __init__(self, p: torch.Tensor, cls: type, options: dict) -> None:
        pinned = p.is_cuda
        dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        self.master = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        self.master.copy_(p.detach())
        self.master.requires_grad_(True)
        half = dtype != p.dtype
        self.sent = torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned) if half else None
        if half:
            self.sent.copy_(p.detach())
        # Where a changed weight comes down: beside the master for a half weight, into it else.
        self.seen = torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned) if half and pinned else None
        self.grad = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        # The gradient's 2-norm and largest magnitude, and whether the weight changed since its step.
        self.norms = torch.empty(3, dtype=torch.promote_types(p.dtype, torch.float32), pin_memory=pinned)
        # The fingerprint of the weight as the last step wrote it (as bound, before a first step).
        self.written: tuple | None = fingerprint(p) if pinned else None
        self.optimizer = _one_optimizer(cls, self.master, options, fused=pinned)
        self.future: concurrent.futures.Future | None = None  # delayed: a step whose weight is not written
        self.read: torch.cuda.Event | None = None  # the last copy up, done reading the host copy

    @property
    def source(self) -> torch.Tensor:
        """What the model's weight is written from: the master, or its rounding for a half weight."""
        return self.master.detach() if self.sent is None else self.sent

    def take(self, weight: torch.Tensor) -> None:
        """The master copy from the weight the model holds (``weight``: what came down, or a CPU
        model's parameter): a half weight's values that differ from what the last step wrote."""
        if self.sent is None:
            if weight.data_ptr() != self.master.data_ptr():
                self.master.detach().copy_(weight)
            return
        changed = weight != self.sent
        if bool(changed.any()):
            self.master.detach()[changed] = weight[changed].to(self.master.dtype)
            self.sent[changed] = weight[changed]


def _count_change(p: torch.Tensor) -> None:
    """Count the CPU step's coming write in ``p``'s version now, before the worker makes it: a node
    later in this backward that needs the weight as it was raises torch's error, as it does where
    the step runs on the device (whose in-place update counts)."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(p)
        return
    _compat.set_version(p, p._version + 1)


class CpuSteps:
    """The step with the state on the CPU (``state='cpu'``), mixed into :class:`~.handle.InBackward`:
    the gradient down as backward makes it, the step on a worker thread, the weight back up."""

    def _to_cpu(self, name: str, p: torch.Tensor, record: _Backward) -> None:
        """The gradient, its norms and whether the weight changed down (a side stream), the step on
        the worker thread, the weight back up (another stream); a non-finite gradient stops the
        steps as on the device, raised at the next ``wait()`` where some were stepped. Delayed,
        the last step's weight goes up first, and the step waits for ``step()`` (see
        :meth:`_submit_delayed`)."""
        on = self.cpu[name]
        grad = p.grad
        two, peak = norms([local(grad)])
        pending = on.future is not None
        copied = up = None
        if p.is_cuda:
            down, up, _ = self._streams(p.device)
            # Whether the weight changed since its step wrote it, taken on the compute stream now,
            # after whatever the forward did to it (and before a delayed step's weight goes up).
            compute = torch.cuda.current_stream(p.device)
            for t in on.written or ():
                t.record_stream(compute)  # made on the copy-up stream, read here
            changed = _differs(fingerprint(p), on.written, p.device).to(two[0].dtype)
            told = torch.stack([two[0], peak[0], changed])
        if pending:
            # After the fingerprint of the weight it replaces, and before this gradient comes down
            # over the buffer its step read.
            self._write_pending(p, on)
        if p.is_cuda:
            down.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(down):
                on.grad.copy_(grad, non_blocking=True)
                on.norms.copy_(told, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(down)
            grad.record_stream(down)  # their memory is reused only once the copies are done
            told.record_stream(down)
        else:
            on.grad.copy_(grad)
            on.norms.copy_(torch.stack([two[0], peak[0], two[0]]))
        p.grad = stand_in(p, name, two[0], peak[0])
        _count_change(p)
        # The step holds the parameter, its state and the handle weakly: a finished step's closure
        # can outlive wait() for a moment in the worker, and must not keep a dropped model alive.
        refs = weakref.ref(p), weakref.ref(on), weakref.ref(self)
        options, lock, delayed = self._options(name, record), self.lock, self.delayed

        def step() -> None:
            p, on, handle = (r() for r in refs)
            if p is None or on is None or handle is None:
                return
            began = time.perf_counter()
            if copied is not None:
                copied.synchronize()
            finite = math.isfinite(float(on.norms[1]))
            with lock:
                skip = record.skipping
            if skip or not finite:
                _unstepped(p.grad)
                if not skip:
                    handle._stop(record, name, worker=True)
                return
            if up is None:
                on.take(p.detach())  # a CPU model's own weight
            if on.read is not None:
                on.read.synchronize()  # the last copy up has read the host copy this step writes
            if up is not None and bool(on.norms[2]):  # the weight changed on the GPU since its step wrote it
                if pending:
                    raise RuntimeError(
                        f"shrinkwrap: the weight of {name!r} changed on the GPU while its last update was still "
                        "on the CPU (step_in_backward(delayed=True)): the change is lost. Call "
                        "sw.optimizer(model).wait() before changing weights (a load, a clamp); it writes them up.")
                fetch = on.master.detach() if on.sent is None else on.seen
                with torch.cuda.stream(handle._streams(p.device)[2]):  # waits for no copy up
                    fetch.copy_(p.detach(), non_blocking=True)
                    torch.cuda.current_stream().synchronize()
                handle.fetched += 1
                on.take(fetch)
            on.master.grad = on.grad
            on.optimizer.param_groups[0].update(options)
            on.optimizer.step()
            on.master.grad = None
            if on.sent is not None:
                round_into(on.sent, on.master, handle.rounding_generator)
            with lock:
                record.stepped.append(name)
            if not delayed:
                handle._write(p, on)
            with lock:
                handle.worker_s += time.perf_counter() - began

        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shrinkwrap-step",
                                                                initializer=torch.set_num_threads,
                                                                initargs=(worker_threads(),))
        if delayed:
            with self.lock:
                self.deferred.append((name, on, copied, step))
            return
        with self.lock:
            self.futures.append(self.worker.submit(step))

    def _write(self, p: torch.Tensor, on: _OnCpu) -> None:
        """``p`` from its host copy: on the copy-up stream once the compute stream is past its
        uses (a GPU's), and its fingerprint taken there; a CPU model's at once."""
        if not p.is_cuda:
            with torch.no_grad():
                p.data.copy_(on.source)
            return
        up = self._streams(p.device)[1]
        with torch.no_grad(), torch.cuda.stream(up):
            p.data.copy_(on.source, non_blocking=True)
            on.written = fingerprint(p)
            on.read = torch.cuda.Event()
            on.read.record(up)

    def _write_pending(self, p: torch.Tensor, on: _OnCpu) -> None:
        """Delayed: the weight of ``p``'s last step up (waiting for the step where the CPU is
        behind), after the compute stream's uses of the weight it replaces."""
        future, on.future = on.future, None
        began = time.perf_counter()
        future.result()
        self.waited_s += time.perf_counter() - began
        if p.is_cuda:
            self._streams(p.device)[1].wait_stream(torch.cuda.current_stream(p.device))
        self._write(p, on)

    def _submit_delayed(self) -> None:
        """Delayed, at ``step()``: the last backward's steps to the worker, once every gradient
        of it came down finite (else none is stepped, and ``step()`` raises as on the device);
        their weights go up at the parameters' hooks in the next backward, or at ``wait()``."""
        bad = self._verdict()
        if bad is not None:
            self._drop_delayed()
            self.skipped = bad
            return
        with self.lock:
            deferred, self.deferred = self.deferred, []
        for _, on, _, step in deferred:
            on.future = self.worker.submit(step)
            with self.lock:
                self.futures.append(on.future)

    def _verdict(self) -> str | None:
        """Delayed: the first of the last backward's gradients that came down not finite, or None."""
        for _, _, copied, _ in self.deferred:
            if copied is not None:
                copied.synchronize()
        return next((n for n, on, _, _ in self.deferred if not math.isfinite(float(on.norms[1]))), None)

    def _drop_delayed(self) -> None:
        """Delayed: a backward no ``step()`` followed (a skipped batch): its steps are dropped."""
        with self.lock:
            deferred, self.deferred = self.deferred, []
        for n, _, _, _ in deferred:
            if n in self.params:
                _unstepped(self.params[n].grad)

    def _flush(self) -> None:
        """Delayed: every step done and its weight written, so that the model holds the latest."""
        for n, on in self.cpu.items():
            if on.future is not None and n in self.params:
                self._write_pending(self.params[n], on)

    def _streams(self, device: torch.device) -> tuple:
        """A device's streams for the CPU steps: the copies down, the copies up, the fetches."""
        if device not in self.streams:
            self.streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return self.streams[device]
