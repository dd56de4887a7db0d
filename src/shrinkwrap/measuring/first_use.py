"""What a process does the first time it runs a configuration, recorded in one process and done
again in another ahead of time: cuDNN's set-up of each convolution, batch norm and attention
shape, layout and type it meets.

cuDNN plans each call the first time a thread of a process meets its shape, strides and type, and
keeps the plan for the thread's life. Under a new layout or type that first step can take seconds
where the next takes milliseconds, and every fresh process that measures such a plan pays it again
(autoplan verifies its answers in fresh processes; figures: docs/architecture.md, "autoplan's
processes", from ``benchmarks/first_use.py``). :func:`recorded` lists the calls one iteration
made, and on which thread: the caller's, or autograd's (on CUDA backward runs on a thread of the
device's own); :func:`replay` makes the same calls on new tensors of the same metadata, each on its
thread, in a process started ahead while it waits for its row.

The replay's tensors go and the allocator's cache is emptied; what it leaves allocated (kept by
cuDNN) a row's first iteration allocates and keeps too: the steps' peaks read the same to the byte
(a CUDA test checks it). cuDNN passes over a plan whose workspace it cannot allocate, and keeps the
one it takes for the row too: a caller replays only with memory to spare (``keep``).

Example::

    >>> with recorded() as calls:
    ...     model(x).sum().backward()
    >>> replay(calls)          # in another process: its cuDNN plans for these calls are made
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Any, Iterator

import torch

from .._compat import dispatch_mode, overload_name

# The aten operators whose first call at a shape plans a library call (cuDNN), by overload packet.
# Batch norm comes by several names: ``native_batch_norm`` from nn.BatchNorm2d in training (on
# CUDA), ``_batch_norm_with_update`` from bn_act's own call. Their floating tensors are made
# uninitialised, the others (a batch norm's reserve, attention's sequence offsets) zero: a value
# out of range there could fault the device, and a faulted process measures nothing.
PLANNED = frozenset({
    "convolution", "convolution_backward",
    "native_batch_norm", "native_batch_norm_backward", "_batch_norm_with_update", "batch_norm_backward",
    "cudnn_batch_norm", "cudnn_batch_norm_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
})
# Whether this torch lets a dispatch mode leave torch.compile alone (see _Recorder): without it
# dynamo skips, then and after, the code it first meets under the mode.
SUPPORTED = hasattr(dispatch_mode(), "ignore_compile_internals")


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor argument as a replay makes it: metadata only (the offset too, as cuDNN keeps a
    plan by its pointers' alignment)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: str


def _spec(x: Any) -> Any:
    """``x`` as a hashable record: tensors as their metadata, lists as tuples (an ``int[]``
    argument takes either)."""
    if isinstance(x, torch.Tensor):
        return _Tensor(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, str(x.device))
    return tuple(_spec(v) for v in x) if isinstance(x, (list, tuple)) else x


def _extent(t: _Tensor) -> int:
    """The elements of storage ``t`` reaches."""
    return t.offset + (1 + sum((n - 1) * s for n, s in zip(t.size, t.stride)) if all(t.size) else 0)


def _made(x: Any) -> Any:
    if isinstance(x, _Tensor):
        new = torch.empty if x.dtype.is_floating_point else torch.zeros
        return new(_extent(x), dtype=x.dtype, device=x.device).as_strided(x.size, x.stride, x.offset)
    return tuple(_made(v) for v in x) if isinstance(x, tuple) else x


def _bytes(spec: Any) -> int:
    return sum(t.dtype.itemsize * _extent(t) for t in _tensors(spec))


class _Recorder(dispatch_mode()):
    """Records the :data:`PLANNED` calls, and whether each came from another thread than the one
    that started recording: autograd's on CUDA, which runs backward (and a checkpoint's
    recomputation), and whose cuDNN plans are its own."""

    def __init__(self, calls: dict) -> None:
        super().__init__()
        self.calls = calls
        self.thread = threading.get_ident()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile then compiles what it meets here as it would outside (with the mode off),
        # and the compiled code's calls come here as they run.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in PLANNED:
            key = (threading.get_ident() != self.thread, func.overloadpacket.__name__, overload_name(func),
                   _spec(args), _spec(tuple(kwargs.items())))
            self.calls.setdefault(key, None)
        return func(*args, **kwargs)


@dataclasses.dataclass
class Calls:
    """The calls :func:`recorded` saw, each once, in the order first seen."""

    calls: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.calls)


@contextlib.contextmanager
def recorded() -> Iterator[Calls]:
    """Record the :data:`PLANNED` calls made inside, with their tensors' metadata (a
    ``TorchDispatchMode``: below autograd and autocast, so the dtypes are those that ran). Needs a
    torch whose dispatch modes can leave torch.compile alone (:data:`SUPPORTED`)."""
    if not SUPPORTED:
        raise RuntimeError("shrinkwrap: recording library calls needs a torch whose dispatch modes can "
                           "leave torch.compile alone (TorchDispatchMode.ignore_compile_internals)")
    out = Calls()
    with _Recorder(out.calls):
        yield out


class _InBackward(torch.autograd.Function):
    """Makes calls in autograd's backward, where the calls recorded there were made (on CUDA a
    thread of the device's own)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, make: Any) -> torch.Tensor:
        ctx.make = make
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.make(True)
        return grad, None


def replay(calls: Calls, keep: int = 0) -> int:
    """Make each of ``calls`` once, on new tensors, in the thread it was recorded in (this one, or
    autograd's for its device); returns how many ran. A call runs only where its arguments take
    at most a third of what its device has free beyond ``keep`` bytes (its results and cuDNN's
    workspace take about as much again each): a replay beside other processes' work leaves them
    what they may still take. A call that fails is skipped, and nothing raises: a replay only
    warms, and the row it warms for makes its own calls. The process's own cuDNN settings apply,
    as they do to its row."""
    ran = 0

    def make(backward: bool, device: str) -> None:
        nonlocal ran
        for in_backward, name, overload, args, kwargs in calls.calls:
            if in_backward != backward or _where(args) != device or 3 * _bytes((args, kwargs)) > _free(device) - keep:
                continue
            try:
                getattr(getattr(torch.ops.aten, name), overload)(*_made(args), **dict(_made(kwargs)))
                ran += 1
            except Exception:  # noqa: BLE001 - an operator this torch lacks or takes differently, or no memory
                pass

    try:
        for device in dict.fromkeys(_where(key[3]) for key in calls.calls if not key[0]):
            with torch.no_grad():
                make(False, device)
        for device in dict.fromkeys(_where(key[3]) for key in calls.calls if key[0]):
            start = torch.zeros((), device=device, requires_grad=True)
            _InBackward.apply(start, functools.partial(make, device=device)).backward()
    except Exception:  # noqa: BLE001 - a device this process lacks: those calls are not made
        pass
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return ran


def _where(spec: Any) -> str:
    """The device of the first tensor in ``spec``."""
    return next((t.device for t in _tensors(spec)), "cpu")


def _free(device: str) -> float:
    """The bytes free on ``device`` now: on CUDA, in the device as a whole, beside other processes."""
    return torch.cuda.mem_get_info(torch.device(device))[0] if torch.device(device).type == "cuda" else math.inf


def _tensors(spec: Any) -> Iterator[_Tensor]:
    """The tensors' records in ``spec``, in order."""
    if isinstance(spec, _Tensor):
        yield spec
    elif isinstance(spec, (tuple, list)):
        for v in spec:
            yield from _tensors(v)
