"""The optimizer's share of the bill: its step inside backward, its state off the GPU, and smaller state.

A training iteration's peak holds, besides activations, the parameters, their gradients and the
optimizer's state: 16 bytes a parameter for float32 AdamW. :class:`StepInBackward`
(``step_in_backward(optimizer=torch.optim.AdamW, options=(), state="device")``) takes the gradient
term away, and with ``state="cpu"`` the state too:

- **In backward** (exact). Each parameter gets an optimizer of its own (the class and options
  given, ``torch.optim``'s or any other), and its gradient is stepped and dropped in backward, as
  soon as it is accumulated (``Tensor.register_post_accumulate_grad_hook``; FSDP2 runs these hooks
  on the sharded gradient it reduced). Gradients wait in buckets of at most 128 MiB (``_BUCKET``)
  and a bucket steps at once, or at the end of the backward, through one optimizer over its
  parameters that shares their state and options, their norms taken in one launch a dtype: a
  step costs the CPU some 0.2 ms besides its arithmetic, and a backward that keeps the GPU
  waiting on the CPU (a checkpointed 0.5B model's does) pays it for every step. A
  class other than torch's (and LBFGS) and :class:`LowBitAdamW` steps each parameter on its own.
  No more than a bucket of gradients (and one parameter's) waits, at most a sixteenth of the
  model's, and the optimizer's temporaries are a bucket's. The weights
  after N iterations are the plain loop's bit for bit: on the CPU the loop's with ``foreach``
  off (a step over a bucket computes what the single-tensor step computes); on CUDA, where the
  class has a fused kernel (AdamW, Adam, SGD), the loop's with ``fused=True``: one launch a
  bucket instead of one an operation a parameter.
- **State on the CPU** (``state="cpu"``, exact). Each parameter's optimizer state, and a copy of
  it (float32 where the parameter is half: the master copy), lives in pinned CPU memory; its
  gradient goes down on a side stream as backward produces it, a worker thread steps it on the
  CPU while backward goes on, and the updated weight comes back on another stream. The model's
  next forward, and the handle's ``step()``, wait for every update. Equal to the GPU optimizer's
  result to rounding (the CPU's kernels).
- **Smaller state and weights** (lossy, opt-in: ``optimizer=shrinkwrap.LowBitAdamW``).
  :class:`LowBitAdamW` keeps AdamW's two moments in 8 bits a value (blocks of 256 with a float32
  scale each, square-root companded, the second moment never coded zero: 2 bytes a parameter
  where float32 takes 8) and, for a bf16 parameter, writes the float32 update back with
  stochastic rounding instead of keeping a float32 master copy. With ``half(torch.bfloat16)`` a
  parameter costs 4.03 bytes on the GPU with its state (the block scales the 0.03). On CUDA
  each slice's update is compiled.

The user's loop keeps working through the model's optimizer-shaped handle, :func:`optimizer`
(a ``torch.optim.Optimizer``): its ``param_groups`` are the per-parameter optimizers' own (an LR
scheduler drives them), ``state_dict``/``load_state_dict`` round-trip, and ``step()`` and
``zero_grad()`` are safe to call (``step`` waits for CPU updates; ``zero_grad`` clears what
backward left). What cannot work is refused, never silently wrong: after backward each parameter's
``.grad`` is a stand-in with no data (:class:`Consumed`) that keeps the gradient's norm: a loop or
the Trainer logging the global norm gets it, ``clip_grad_norm_`` within its limit changes
nothing, and clipping that would scale the gradients, reading a gradient's values, and
accumulating gradients over several backwards (the next backward adds to the stand-in) raise,
naming the step. DDP (gradients averaged across ranks after the hook) is refused at the first
backward.

Example::

    >>> sw.apply(model, "step_in_backward(torch.optim.AdamW, options={'lr': 1e-4, 'weight_decay': 0.01})")
    >>> opt = sw.optimizer(model)                 # for the loop, a scheduler, checkpoints
    >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    >>> for batch in data:
    ...     model(**batch).loss.backward()        # each parameter is updated here
    ...     opt.step(); opt.zero_grad(); sched.step()
"""

from __future__ import annotations

__all__ = ["StepInBackward", "InBackward", "LowBitAdamW", "apply_step_in_backward", "optimizer"]

import concurrent.futures
import dataclasses
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from .. import _rewrite
from ..select import require_module
from ..step import Candidate, Context, Step, Targets

_HANDLE = "_sw_optimizer"  # where the root keeps its handle: the measuring harness reads it (no import)


def _message(what: str) -> str:
    return (f"shrinkwrap: {what}: this model's optimizer steps inside backward (step_in_backward()), and each "
            "parameter's gradient was used and dropped there. Global-norm clipping, reading gradients and "
            "accumulating them over several backwards cannot work with it: call the handle's zero_grad() "
            "(sw.optimizer(model).zero_grad()) after each backward, and for clipping or accumulation leave "
            "step_in_backward() out of the plan (shrinkwrap.revert(model)).")


class Consumed(torch.Tensor):
    """What ``.grad`` holds after the step in backward used it: a tensor of the gradient's shape,
    dtype and device with no data, and the gradient's 2-norm, kept before it was dropped. Its norm
    is answered (a loop or the Trainer logging it, ``clip_grad_norm_`` reading it), and clipping by
    a factor of exactly 1 (a norm within the limit) changes nothing; anything else raises, naming
    the step: clipping that would act, reading the values, accumulating into it."""

    _sw_consumed = True

    @staticmethod
    def __new__(cls, like: torch.Tensor, norm: torch.Tensor, device: torch.device | None = None) -> "Consumed":
        # A storage of no bytes: what counts storages (torch's MemTracker, shrinkwrap.estimate) sees none.
        out = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=device or like.device,
                                                  storage_size=0)
        out._sw_norm = norm
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name == "linalg_vector_norm" and _two(args, kwargs, 1) and isinstance(args[0], Consumed):
            return args[0]._sw_norm.to(kwargs.get("dtype") or args[0].dtype)
        if name == "_foreach_norm" and _two(args, kwargs, 1) and all(isinstance(t, Consumed) for t in args[0]):
            return [t._sw_norm.to(kwargs.get("dtype") or t.dtype) for t in args[0]]
        if name in _VIEWS:  # what a DTensor makes of its shard: another stand-in, the same norm
            meta = func(torch.empty(args[0].shape, dtype=args[0].dtype, device="meta"), *args[1:], **kwargs)
            return Consumed(meta, args[0]._sw_norm, args[0].device)
        if name in ("mul_", "_foreach_mul_") and _one(args[1]):
            # Clipping a gradient within the limit: scaled by 1, it is what the step used. (An
            # in-place op returns its tensor; the foreach one nothing.)
            return None if name == "_foreach_mul_" else args[0]
        what = "clipping that would scale the gradients" if name in ("mul_", "_foreach_mul_") else f"{func}"
        raise RuntimeError(_message(f"{what} on a parameter's gradient"))

    def __repr__(self) -> str:  # type: ignore[override]
        return "<shrinkwrap: a gradient used and dropped by the optimizer step in backward>"


_VIEWS = ("view", "alias", "detach", "_unsafe_view")


def _two(args: tuple, kwargs: dict, at: int) -> bool:
    """Whether a norm call asks for the 2-norm (its order, positional at ``at`` or ``ord``)."""
    order = args[at] if len(args) > at else kwargs.get("ord", 2)
    return float(order) == 2.0


def _one(factor: Any) -> bool:
    """Whether a scale factor (a number, a one-element tensor, or a list of them) is exactly 1."""
    factors = factor if isinstance(factor, (list, tuple)) else [factor]
    return all(float(f.item() if isinstance(f, torch.Tensor) else f) == 1.0 for f in factors)


def _consumed(p: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor | None:
    """The stand-in for ``p``'s gradient, with the gradient's 2-norm (``norm`` where it was taken
    already): of a DTensor (FSDP2's sharded parameter), a DTensor over a stand-in of this rank's shard."""
    local = getattr(p, "_local_tensor", None)
    grad = p.grad if local is None else p.grad._local_tensor
    if norm is None:
        norm = torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.promote_types(grad.dtype, torch.float32))
    if local is None:
        return Consumed(p, norm)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(Consumed(local, norm), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


# Gradients that wait in backward to be stepped together (see InBackward._later): at most 128 MiB,
# and a sixteenth of the model's gradient bytes, so that the gradient term stays out of the peak.
_BUCKET = 128 << 20
_SHARE = 16
_TOGETHER = 64  # bucket optimizers kept (buckets differ where a forward leaves parameters unused)
_HOW = ("foreach", "fused")  # the group options that say how an optimizer steps, not what it computes


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, as ``_consumed`` takes it (float32 at least), one launch a dtype:
    a launch a gradient costs the CPU more than a backward that keeps the GPU waiting can spare."""
    out: list[Any] = [None] * len(grads)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, at in by_dtype.items():
        norms = torch._foreach_norm([grads[i].detach() for i in at], 2, dtype=torch.promote_types(dtype, torch.float32))
        for i, norm in zip(at, norms):
            out[i] = norm
    return out


def _compiled_autograd() -> bool:
    """Whether backward runs under compiled autograd, whose engine takes no end-of-backward
    callback but from a full graph: there each parameter steps in its hook."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported: not running
    region = getattr(ca, "in_compiled_autograd_region", False)  # a flag in some versions, a function in others
    return bool(region() if callable(region) else region)


def _same_options(a: dict, b: dict) -> bool:
    """Whether two param groups step alike: every option but ``params`` equal (a tensor option,
    such as a tensor learning rate, the same object)."""
    return a.keys() == b.keys() and all(
        k == "params" or a[k] is b[k] or (not isinstance(a[k], torch.Tensor) and not isinstance(b[k], torch.Tensor)
                                          and a[k] == b[k]) for k in a)


_BLOCK = 256  # values that share one scale in LowBitAdamW's state
_SLICE = 1 << 20  # values LowBitAdamW updates at once (a multiple of _BLOCK): 4 MiB a float32 temporary
_COMPILED_SLICE = 1 << 24  # the same compiled, and the most one packed call gathers (96 MiB at bf16)


def _quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) as 8-bit codes of the square root of its magnitude over its block's largest,
    and the blocks' scales: small values keep more of their precision than a linear code gives.
    ``x`` shaped (blocks, ``_BLOCK``) is taken as it is: the compiled update has no length to pad
    (inductor cannot tile a length padded by a symbolic remainder)."""
    if _blocked(x):
        blocks = x
    else:
        flat = x.reshape(-1)
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % _BLOCK)).view(-1, _BLOCK)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-30)
    root = (blocks.abs() / scale).sqrt_()
    if signed:
        codes = (root * 127).round_().mul_(blocks.sign()).to(torch.int8)
    else:
        # Never code 0 (the zero-point problem): AdamW divides by the second moment's root, and a
        # small one decoded as zero made that value's update lr * m / eps, thousands of times lr.
        codes = (root * 255).round_().clamp_min_(1).to(torch.uint8)
    return codes, scale.squeeze(1)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor, signed: bool) -> torch.Tensor:
    root = codes.float().div_(127 if signed else 255)
    values = root.abs().square_().mul_(root.sign() if signed else 1).mul_(scale[:, None])
    return values if _blocked(like) else values.reshape(-1)[: like.numel()].view_as(like)


def _blocked(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[1] == _BLOCK


def _stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` in bf16, each value rounded up or down with the probability of its distance:
    unbiased, so that updates smaller than bf16's spacing still move the weight on average."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return (bits + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW with its two moments in 8 bits a value and, for bf16 parameters, stochastic rounding
    in place of a float32 master copy. Lossy: the moments carry about two significant digits, and
    a weight's updates are unbiased but noisy. Meant for ``step_in_backward()``, usable alone; it
    updates a parameter a slice at a time, so its float32 temporaries are a slice's.

    Example::

        >>> sw.apply(model, "half(torch.bfloat16), step_in_backward(shrinkwrap.LowBitAdamW, options={'lr': 1e-4})")
    """

    lossy = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, foreach: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            hypers: dict = {}
            compiled: list = []  # (parameter, state, hyper) of the parameters the compiled update takes
            update = None
            for p in group["params"]:
                if p.grad is None:
                    continue
                if getattr(p, "_local_tensor", None) is not None:
                    raise RuntimeError(
                        "shrinkwrap: LowBitAdamW quantizes whole tensors in blocks, not FSDP2's shards (DTensor); "
                        "under fully_shard step in backward with a torch optimizer, e.g. "
                        "step_in_backward(torch.optim.AdamW), or leave the model unsharded")
                state = self.state[p]
                if not state:  # zero moments: code 0 with a scale of 1e-30 decodes to 0
                    blocks = -(-p.numel() // _BLOCK)
                    state["step"] = 0
                    for key, dtype in (("m", torch.int8), ("v", torch.uint8)):
                        state[key] = torch.zeros((blocks, _BLOCK), dtype=dtype, device=p.device)
                        state[key + "_scale"] = torch.full((blocks,), 1e-30, dtype=torch.float32, device=p.device)
                state["step"] += 1
                hyper = self._hyper(p, state["step"], group, hypers)
                fn = _compiled_slice(p) if p.is_contiguous() else None
                if fn is None:
                    self._step_slices(p, state, hyper)
                else:
                    compiled.append((p, state, hyper))
                    update = fn  # one function a process
            if compiled:
                _step_packed(compiled, update)
        return loss

    @staticmethod
    def _hyper(p: torch.Tensor, t: int, group: dict, hypers: dict) -> torch.Tensor:
        """One tensor of the step's numbers (a compiled update would compile again for each new
        float), sent from pinned memory (a plain copy to the GPU waits for its queued work), once
        for the parameters of a step that are at the same step count."""
        hyper = hypers.get((t, p.device))
        if hyper is None:
            beta1, beta2 = group["betas"]
            hyper = torch.tensor([beta1, beta2, 1 - beta1 ** t, 1 - beta2 ** t, group["lr"], group["weight_decay"],
                                  group["eps"]], dtype=torch.float32)  # not torch's default dtype, which may be bf16
            hyper = hyper.pin_memory().to(p.device, non_blocking=True) if p.is_cuda else hyper.to(p.device)
            hypers[(t, p.device)] = hyper
        return hyper

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments stay 8-bit codes with float32 scales: ``Optimizer`` casts a
        floating parameter's state to the parameter's dtype, which for a bf16 parameter doubles
        the codes' bytes and rounds the scales."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        indices = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip(params, indices):
            saved = state_dict["state"].get(i, {})
            for key in ("m", "v", "m_scale", "v_scale"):
                if key in saved:
                    self.state[p][key] = saved[key].to(p.device, copy=True)

    @staticmethod
    def _step_slices(p: torch.Tensor, state: dict, hyper: torch.Tensor) -> None:
        """The eager update of ``p``, a slice of ``_SLICE`` values at a time: its float32
        temporaries (the moments decoded, the weight widened, the step's quotient) are a slice's,
        not a parameter's, which for a 150k-vocabulary embedding are 0.5 GiB each. A parameter not
        contiguous in memory (channels_last convolutions: small) goes in one slice."""
        whole = not p.is_contiguous()
        weights = p.detach()
        flat, grads = (weights, p.grad) if whole else (weights.view(-1), p.grad.reshape(-1))
        n = flat.numel()
        step = max(n, 1) if whole else _SLICE
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            blocks = slice(lo // _BLOCK, -(-hi // _BLOCK))
            values, weight = (grads, flat) if whole else (grads[lo:hi], flat[lo:hi])
            _adamw_slice(values, weight, state["m"][blocks], state["m_scale"][blocks], state["v"][blocks],
                         state["v_scale"][blocks], hyper)


def _step_packed(params: list[tuple[torch.Tensor, dict, torch.Tensor]], update: Any) -> None:
    """The compiled ``update`` of ``params`` (parameter, state, hyper), in calls of up to
    ``_COMPILED_SLICE`` values: a large parameter a slice at a time, and the small parameters of
    one kind (dtypes and hyper) packed into one call, wherever they sit in ``params``. Fused, the
    update keeps no temporaries of its own, and a call costs the CPU more than the GPU's pass over
    its values takes (on an H100 host, some 110 us against 10 for 800k values). Stepped in
    backward, qwen05b (290 parameters, bf16 weights alternating with float32 norms) spent 80 ms of
    CPU an iteration in its hooks in 306 calls, one a parameter or a slice (one run); in another,
    83 ms in 112 calls packing only runs of one dtype (1.27x the plain loop's step time) and 43 ms
    in 50 calls packing by kind (0.97x; H100, torch 2.11). Packing copies the small pieces in
    and out: the peak did not move."""
    kinds: dict = {}  # one packing a kind (dtypes, hyper), in the order the kinds first come
    for p, state, hyper in params:
        kinds.setdefault((p.dtype, p.grad.dtype, id(hyper)), []).append((p, state, hyper))
    for kind in kinds.values():
        chunk: list = []
        values = 0
        for p, state, hyper in kind:
            n = p.numel()
            for lo in range(0, n, _COMPILED_SLICE):
                hi = min(lo + _COMPILED_SLICE, n)
                size = -(-(hi - lo) // _BLOCK) * _BLOCK
                if chunk and values + size > _COMPILED_SLICE:
                    _step_chunk(chunk, update)
                    chunk, values = [], 0
                chunk.append((p, state, hyper, lo, hi))
                values += size
        if chunk:
            _step_chunk(chunk, update)


def _step_chunk(chunk: list, update: Any) -> None:
    """One compiled call over pieces ``(parameter, state, hyper, lo, hi)``, shaped (blocks,
    ``_BLOCK``): one piece of whole blocks as it lies; else the pieces gathered into one buffer,
    each from a block's start, its last block padded with zeros (which the update keeps at zero,
    or the second moment's first code, as the eager update's padding), and written back: a copy
    a tensor kind, not a call a parameter. The compiler cannot tile a slice padded to a block by
    a length it does not know."""
    hyper = chunk[0][2]
    keys = ("m", "m_scale", "v", "v_scale")
    if len(chunk) == 1 and (chunk[0][4] - chunk[0][3]) % _BLOCK == 0:
        p, state, _, lo, hi = chunk[0]
        blocks = slice(lo // _BLOCK, hi // _BLOCK)
        update(p.grad.reshape(-1)[lo:hi].view(-1, _BLOCK), p.detach().view(-1)[lo:hi].view(-1, _BLOCK),
               *(state[k][blocks] for k in keys), hyper)
        return
    weights = [p.detach().view(-1)[lo:hi] for p, _, _, lo, hi in chunk]
    grads = [p.grad.reshape(-1)[lo:hi] for p, _, _, lo, hi in chunk]
    states = [[state[k][lo // _BLOCK: -(-hi // _BLOCK)] for _, state, _, lo, hi in chunk] for k in keys]
    sizes = [s.shape[0] for s in states[1]]
    # Each piece's values, then its last block's padding: one split gives every piece's view.
    spans = [n for w, b in zip(weights, sizes) for n in (w.numel(), b * _BLOCK - w.numel())]
    grad_in = grads[0].new_zeros(sum(sizes), _BLOCK)
    weight_in = weights[0].new_zeros(sum(sizes), _BLOCK)
    weights_in = list(weight_in.view(-1).split(spans)[::2])
    torch._foreach_copy_(list(grad_in.view(-1).split(spans)[::2]), grads)
    torch._foreach_copy_(weights_in, weights)
    joined = [torch.cat(s) for s in states]
    update(grad_in, weight_in, *joined, hyper)
    torch._foreach_copy_(weights, weights_in)
    for parts, whole in zip(states, joined):
        torch._foreach_copy_(parts, list(whole.split(sizes)))


def _adamw_slice(grad: torch.Tensor, weight: torch.Tensor, m_codes: torch.Tensor, m_scale: torch.Tensor,
                 v_codes: torch.Tensor, v_scale: torch.Tensor, hyper: torch.Tensor) -> None:
    """One slice of :class:`LowBitAdamW`'s update, in place: the moments' codes and scales, and the
    weight (stochastically rounded where it is bf16). Compiled, the writes are the graph's own,
    not copies launched after it. ``hyper``: float32
    ``[beta1, beta2, 1 - beta1 ** step, 1 - beta2 ** step, lr, weight_decay, eps]``."""
    beta1, beta2, bias1, bias2, lr, weight_decay, eps = hyper.unbind()
    grad = grad.float()
    m = _dequantize(m_codes, m_scale, grad, True).lerp_(grad, 1 - beta1)
    v = _dequantize(v_codes, v_scale, grad, False)
    v.mul_(beta2).add_(grad.square().mul_(1 - beta2))
    for (codes, scale), (codes_out, scale_out) in ((_quantize(m, True), (m_codes, m_scale)),
                                                   (_quantize(v, False), (v_codes, v_scale))):
        codes_out.copy_(codes)
        scale_out.copy_(scale)
    denom = v.div_(bias2).sqrt_().add_(eps)
    new = weight.float().mul_(1 - lr * weight_decay)
    new.sub_(m.div_(denom).mul_(lr / bias1))
    weight.copy_(_stochastic_round(new, weight.dtype))


_COMPILED: list = []


def _compiled_slice(p: torch.Tensor) -> Any:
    """For a CUDA parameter, :func:`_adamw_slice` compiled (once a process); else None. Eager, one
    slice is some 25 kernels, each a pass over 4 MiB: a 0.5B model's step in backward ran at 4.1x
    the plain loop's step time (H100, torch 2.11). Compiled, the pass over the moments and weight
    is fused and writes them in place (:func:`_step_packed`). Shapes are dynamic (slices differ
    in length) and the hyperparameters a tensor, so a scheduler's new learning rate and the next
    step's bias corrections do not compile again; a graph is compiled for each pair of parameter
    and gradient dtypes, for views of a parameter and for packed buffers, and for a call of one
    block (a length of one is specialized): bf16 weights with float32 norms take up to six. Past
    dynamo's recompile limit (8 a function) a call runs eagerly: the same update, some 4x slower.
    The random bits of the stochastic rounding are the compiler's own, so the compiled update
    does not match the eager one bit for bit where parameters are bf16."""
    if not p.is_cuda or _is_fake(p):
        return None
    if not _COMPILED:
        _COMPILED.append(torch.compile(_adamw_slice, dynamic=True))
    return _COMPILED[0]


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``shrinkwrap.estimate``), where nothing is compiled."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _OnCpu:
    """One parameter's optimizer stepped on the CPU: its float32 copy and gradient buffer in pinned
    memory (plain memory where there is no CUDA), the optimizer over the copy.

    For a GPU's parameter the CPU optimizer is torch's fused one where its class has one (AdamW,
    Adam, SGD, Adagrad): one pass over the values instead of one an operation. On 2 CPU cores
    (torch 2.13) AdamW stepped 20M values in 11.7 ms fused against 93.6 ms one tensor at a time,
    the two 6e-8 apart after three steps: to rounding, as the GPU's own optimizer is. A CPU
    model's parameters keep the single-tensor path, and with it the plain loop's bits."""

    def __init__(self, p: torch.Tensor, cls: type, options: dict) -> None:
        pinned = p.is_cuda
        # A half parameter's master copy is float32; a float32 or float64 one keeps its dtype.
        dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        self.master = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        self.master.copy_(p.detach())
        self.master.requires_grad_(True)
        self.grad = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        self.optimizer = _one_optimizer(cls, self.master, options, fused=pinned)
        self.ready: torch.cuda.Event | None = None


def _one_optimizer(cls: type, p: torch.Tensor, options: dict, fused: bool) -> torch.optim.Optimizer:
    """``cls`` over the one tensor ``p``: fused where asked and the class has a fused form for
    ``p``'s device and dtype (a GPU parameter's CPU copy, see :class:`_OnCpu`; a GPU parameter, see
    the module docstring), else with ``options`` as given (``foreach`` off)."""
    if fused:
        try:
            return cls([p], **{**options, "foreach": None, "fused": True})
        except (TypeError, ValueError, RuntimeError):  # no fused form of this class here
            pass
    return cls([p], **options)


class InBackward(torch.optim.Optimizer):
    """The optimizer-shaped handle of a model whose optimizer steps inside backward (see the module
    docstring). A ``torch.optim.Optimizer``: LR schedulers take it, and its ``param_groups`` are
    the per-parameter optimizers' own groups, one a parameter."""

    def __init__(self, names: list[str], cls: type, options: dict, on_cpu: bool) -> None:
        # Not Optimizer.__init__: it builds groups of its own. What schedulers and state_dict read:
        self.defaults = dict(options)
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
        self.names, self.cls, self.options, self.on_cpu = list(names), cls, dict(options), on_cpu
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.hooks: dict[str, Any] = {}
        self.cpu: dict[str, _OnCpu] = {}
        self.pending: list[concurrent.futures.Future] = []
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.streams: tuple | None = None
        self.lock = threading.Lock()
        self.model: Any = lambda: None  # a weak reference to the model, set by the step
        # Gradients waiting to be stepped together (see _later), and the optimizers that step a
        # bucket of parameters at once, by the bucket's names.
        self.waiting: dict[str, torch.Tensor] = {}  # name: parameter
        self.waiting_bytes = 0
        self.grad_bytes = 0  # the gradients of every parameter bound
        self.flush_queued = False
        self.together: OrderedDict[tuple[str, ...], torch.optim.Optimizer] = OrderedDict()

    # -- what torch's Optimizer API reads ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [self.optimizers[n].param_groups[0] for n in self.names if n in self.optimizers]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        pass  # Optimizer's own code assigns it; the groups are the per-parameter optimizers'

    @property
    def state(self) -> dict:  # type: ignore[override]
        out: dict = {}
        for n in self.names:
            if n in self.optimizers:
                opt = self.optimizers[n]
                out.update({self.params[n]: s for s in opt.state.values()})
        return out

    @state.setter
    def state(self, value: Any) -> None:
        pass

    def __getstate__(self) -> dict:
        raise TypeError("shrinkwrap: the step-in-backward handle is saved through state_dict(), not pickled")

    def __repr__(self) -> str:
        return (f"InBackward({self.cls.__module__}.{self.cls.__qualname__}, {len(self.names)} parameters, "
                f"state on the {'CPU' if self.on_cpu else 'device'})")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Waits for updates on the CPU; steps, as a plain optimizer would, a parameter whose
        gradient no hook took in backward (one FSDP2 held unsharded when the hooks were placed:
        it has its hook from now on)."""
        self.wait()
        self._rebind()
        for n, p in self.params.items():
            if p.grad is not None and not getattr(type(getattr(p.grad, "_local_tensor", p.grad)), "_sw_consumed", False):
                if self.on_cpu:
                    self._to_cpu(n, p)
                else:
                    self.optimizers[n].step()
                p.grad = None
        self.wait()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the stand-ins backward left in ``.grad``, before the next backward."""
        self._drop_waiting()
        self._rebind()
        for p in self.params.values():
            p.grad = None

    def _rebind(self) -> None:
        model = self.model()
        if model is not None:
            self.bind(model)

    def state_dict(self) -> dict:  # type: ignore[override]
        """As a plain optimizer's, one group a parameter, in the model's parameter order."""
        self.wait()
        state, groups = {}, []
        for i, n in enumerate(self.names):
            sd = self.optimizers[n].state_dict()
            if 0 in sd["state"]:
                state[i] = sd["state"][0]
            groups.append({**sd["param_groups"][0], "params": [i]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        groups = state_dict["param_groups"]
        if len(groups) != len(self.names):
            raise ValueError(f"shrinkwrap: a state_dict of {len(groups)} parameter groups cannot load into the "
                             f"step-in-backward handle of {len(self.names)} parameters (one group a parameter)")
        self.wait()
        for i, (n, g) in enumerate(zip(self.names, groups)):
            # How each optimizer steps (fused, foreach) stays its own: a plain optimizer's
            # state_dict would otherwise turn a per-parameter step into its multi-tensor path.
            own = {k: v for k, v in self.optimizers[n].param_groups[0].items() if k in _HOW}
            one = {"state": {0: state_dict["state"][i]} if i in state_dict["state"] else {},
                   "param_groups": [{**g, **own, "params": [0]}]}
            self.optimizers[n].load_state_dict(one)
        self.together.clear()  # their state dicts are new ones

    # -- binding parameters ------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Give each named parameter an optimizer and the hook, where the model holds another object
        under that name than last time (first: at apply; again after FSDP2's fully_shard swapped
        them): its group (the dict a scheduler changes) and state carry over."""
        named = dict(model.named_parameters())
        # Under FSDP2 the model holds its sharded parameters between forwards and the unsharded ones
        # while a module runs: the step takes the sharded one, whose reduced gradient FSDP2 hands to
        # the hooks.
        sharded = bool(_rewrite.sharded(model))
        changed = False
        for n in self.names:
            p = named.get(n)
            if p is None or self.params.get(n) is p or (sharded and getattr(p, "_local_tensor", None) is None):
                continue
            if n in self.hooks:
                self.hooks.pop(n).remove()
            old = self.optimizers.get(n)
            on = _OnCpu(p, self.cls, self.options) if self.on_cpu else None
            # A DTensor (FSDP2's shard) keeps the single-tensor step: torch's fused kernels are
            # not among the operations DTensor shards in every version.
            new = on.optimizer if on else _one_optimizer(
                self.cls, p, self.options, fused=p.is_cuda and getattr(p, "_local_tensor", None) is None)
            if old is not None:
                if any(old.state.values()):
                    raise RuntimeError(f"shrinkwrap: parameter {n!r} was replaced after training began (by "
                                       f"sharding?); its optimizer state cannot follow it. Shard the model first.")
                group = old.param_groups[0]
                # The dict a scheduler holds, stepping as the new optimizer does: fused where the
                # old one took a GPU tensor, a shard's single-tensor step (whose bits a plain
                # sharded loop's match) would otherwise run torch's fused kernel over a DTensor.
                group.update({k: v for k, v in new.param_groups[0].items() if k in ("params", *_HOW)})
                new.param_groups[0] = group
            if on is not None:
                self.cpu[n] = on
            self.optimizers[n], self.params[n] = new, p
            self.hooks[n] = p.register_post_accumulate_grad_hook(self._hook(n))
            changed = True
        if changed:
            self.together.clear()
            self.grad_bytes = sum(q.numel() * q.element_size() for q in self.params.values())

    def _hook(self, name: str) -> Any:
        # The hook reaches the handle through a weak reference: a tensor's hooks are held from C++,
        # where the garbage collector cannot see them, so a handle -> parameter -> hook -> handle
        # cycle would never be collected, and a model dropped without revert() would keep its
        # parameters and optimizer state on the GPU.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            handle = ref()
            if handle is None:  # the model and its handle are gone
                return
            if (torch.distributed.is_available() and torch.distributed.is_initialized()
                    and torch.distributed.get_world_size() > 1 and getattr(p, "_local_tensor", None) is None):
                raise RuntimeError(
                    f"shrinkwrap: step_in_backward() steps {name!r} as its gradient is accumulated, before DDP "
                    "averages it across ranks: each rank would train on its own gradient. Use FSDP2 "
                    "(fully_shard), whose reduced gradient the step takes, or leave the step out.")
            if handle.batched and not handle.on_cpu and getattr(p, "_local_tensor", None) is None \
                    and not _compiled_autograd():
                handle._later(name, p)
                return
            dropped = _consumed(p)  # its norm, before the step uses it
            if handle.on_cpu:
                handle._to_cpu(name, p)
            else:
                handle.optimizers[name].step()
            p.grad = dropped
        return hook

    @property
    def batched(self) -> bool:
        """Whether gradients may wait to be stepped in buckets: for torch's optimizers and
        :class:`LowBitAdamW`, which keep everything of a parameter in its group and ``state[p]``
        (another class may keep more on the optimizer object, which a bucket's would not share)."""
        torch_own = self.cls.__module__.startswith("torch.optim") and self.cls is not torch.optim.LBFGS
        return torch_own or self.cls is LowBitAdamW

    def _later(self, name: str, p: torch.Tensor) -> None:
        """Step ``p`` with the gradients that came before it, once they hold ``_BUCKET`` bytes (or a
        ``_SHARE``-th of the model's gradients, the less), and at the end of this backward at the
        latest (a callback of the autograd engine). One optimizer step a bucket, not a parameter:
        each step costs the CPU time besides its arithmetic (torch's Optimizer.step, its groups'
        bookkeeping), which a backward that keeps the GPU waiting on the CPU pays in full. On an
        H100 (torch 2.11) qwen05b's plain iteration leaves its GPU idle a fifth of the time (170
        ms of kernels in 214), and its 290 parameters' hooks cost the CPU 66 ms an iteration
        stepped one at a time, 21.7 ms in buckets of 32 MiB (61 steps), 13.6 ms in buckets of 123
        MiB (its sixteenth: 16 steps) and 3.6 ms in one bucket at the end."""
        with self.lock:  # hooks run on one autograd thread a device
            if name in self.waiting:
                # A second gradient into one still waiting (a reentrant checkpoint around a parameter
                # used outside it too): stepped once, it would leave one of them unused.
                raise RuntimeError(_message(f"a second gradient accumulated into {name!r} in one backward"))
            if not self.flush_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
                self.flush_queued = True
            self.waiting[name] = p
            self.waiting_bytes += p.grad.numel() * p.grad.element_size()
            full = self.waiting_bytes >= min(_BUCKET, self.grad_bytes // _SHARE)
        if full:
            self._step_waiting()

    def _flush(self) -> None:
        self.flush_queued = False
        self._step_waiting()

    def _drop_waiting(self) -> None:
        """Forget gradients left waiting by a backward that raised before its end (its callback did
        not run): they stay in ``.grad`` as a plain optimizer's would, for ``step()`` or
        ``zero_grad()``, not stepped behind the caller's back."""
        with self.lock:
            self.waiting, self.waiting_bytes, self.flush_queued = {}, 0, False

    def _step_waiting(self) -> None:
        with self.lock:
            waiting, self.waiting, self.waiting_bytes = self.waiting, {}, 0
        if not waiting:
            return
        names, params = tuple(waiting), list(waiting.values())
        dropped = [_consumed(p, norm) for p, norm in zip(params, _norms([p.grad for p in params]))]
        together = self._together(names)
        if together is not None:
            together.step()
        else:
            for n in names:
                self.optimizers[n].step()
        for p, stand_in in zip(params, dropped):
            p.grad = stand_in

    def _together(self, names: tuple[str, ...]) -> torch.optim.Optimizer | None:
        """One optimizer over the parameters ``names``, sharing their optimizers' state (the same
        ``state[p]`` dicts) and options (copied from their groups, which a scheduler may have
        changed since), or None where there is one name or their options differ. It computes
        what their own steps compute: the same kernels, over a list (bit for bit: CPU tests)."""
        groups = [self.optimizers[n].param_groups[0] for n in names]
        first = groups[0]
        if len(names) < 2 or any(not _same_options(g, first) for g in groups[1:]):
            return None
        opt = self.together.pop(names, None)
        if opt is None:
            opt = self.cls([self.params[n] for n in names], **self.options)
        self.together[names] = opt  # the most recent last
        while len(self.together) > _TOGETHER:
            self.together.popitem(last=False)
        opt.param_groups[0].update({k: v for k, v in first.items() if k != "params"})
        for n in names:
            p = self.params[n]
            opt.state[p] = self.optimizers[n].state[p]
        return opt

    def _to_cpu(self, name: str, p: torch.Tensor) -> None:
        on = self.cpu[name]
        grad = p.grad
        if p.is_cuda:
            if self.streams is None:
                self.streams = (torch.cuda.Stream(p.device), torch.cuda.Stream(p.device))
            down, up = self.streams
            down.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(down):
                on.grad.copy_(grad, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(down)
            grad.record_stream(down)  # its memory is reused only once the copy is done
        else:
            on.grad.copy_(grad)
            copied = up = None
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shrinkwrap-step")

        def step() -> None:
            if copied is not None:
                copied.synchronize()
            on.master.grad = on.grad
            on.optimizer.step()
            on.master.grad = None
            with torch.no_grad():
                if up is not None:
                    with torch.cuda.stream(up):
                        p.data.copy_(on.master, non_blocking=True)
                        on.ready = torch.cuda.Event()
                        on.ready.record(up)
                else:
                    p.data.copy_(on.master)

        with self.lock:
            self.pending.append(self.worker.submit(step))

    def wait(self) -> None:
        """Every CPU step done and its weight back (the compute stream waits for the copies);
        gradients a backward that raised left waiting are left to ``.grad`` (:meth:`_drop_waiting`)."""
        self._drop_waiting()
        with self.lock:
            pending, self.pending = self.pending, []
        for future in pending:
            future.result()
        if self.streams is not None:
            torch.cuda.current_stream(self.streams[1].device).wait_stream(self.streams[1])

    def close(self) -> None:
        self.wait()
        for handle in self.hooks.values():
            handle.remove()
        self.hooks.clear()
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class _Bind:
    """Forward pre-hook of the root: the weights the CPU steps updated are back before they are
    used, and parameters replaced since (FSDP2) get their optimizers."""

    def __init__(self, handle: InBackward) -> None:
        self.handle = handle

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.handle.wait()
        if torch.is_grad_enabled() and module.training:
            self.handle.bind(module)


@dataclasses.dataclass
class _Detach:
    """Undo entry: the handle's hooks removed, its worker stopped, the gradients' stand-ins dropped."""

    handle: InBackward

    def undo(self, model: nn.Module) -> None:
        self.handle.close()
        self.handle.zero_grad()
        model.__dict__.pop(_HANDLE, None)


@dataclasses.dataclass(frozen=True)
class StepInBackward(Step):
    """Step: the optimizer steps each parameter inside backward, as its gradient is accumulated,
    and drops the gradient; with ``state="cpu"`` its state lives in CPU memory and the step runs
    there, overlapped with backward. See the module docstring for what is exact and what is refused.

    Args:
        optimizer: the optimizer class (any ``torch.optim.Optimizer``), built once a parameter.
        options: its keyword arguments, as a dict or pairs: ``{'lr': 1e-4, 'weight_decay': 0.01}``.
        state: ``"device"`` (the state beside the parameter) or ``"cpu"``.

    Example::

        >>> sw.apply(model, sw.step_in_backward(torch.optim.AdamW, {"lr": 1e-4}, state="cpu"))
        >>> sw.optimizer(model)   # the handle for the loop
    """

    name = "step_in_backward"
    order = 70

    @property
    def lossy(self) -> bool:  # type: ignore[override]
        """Lossy where its optimizer says so (:class:`LowBitAdamW`)."""
        return bool(getattr(self.optimizer, "lossy", False))

    optimizer: type = torch.optim.AdamW
    options: Any = ()
    state: str = "device"

    def __post_init__(self) -> None:
        options = self.options
        if isinstance(options, dict):
            options = tuple(sorted(options.items()))
        if not (isinstance(options, tuple) and all(isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)
                                                    for o in options)):
            raise TypeError(f"shrinkwrap: step_in_backward() takes options= a dict of the optimizer's keyword "
                            f"arguments, e.g. {{'lr': 1e-4}}; got {self.options!r}")
        object.__setattr__(self, "options", options)
        super().__post_init__()
        if not (isinstance(self.optimizer, type) and issubclass(self.optimizer, torch.optim.Optimizer)):
            raise TypeError(f"shrinkwrap: step_in_backward() takes optimizer= an optimizer class such as "
                            f"torch.optim.AdamW; got {self.optimizer!r}")
        if self.state not in ("device", "cpu"):
            raise ValueError(f"shrinkwrap: step_in_backward(state={self.state!r}): state is 'device' or 'cpu'")
        if "foreach" in dict(options) or "fused" in dict(options):
            raise ValueError("shrinkwrap: step_in_backward() steps one parameter at a time; leave foreach= and "
                             "fused= out of its options")

    def __str__(self) -> str:
        cls = self.optimizer
        short = getattr(torch.optim, cls.__name__, None) is cls
        parts = [f"torch.optim.{cls.__name__}" if short else f"{cls.__module__}.{cls.__qualname__}"]
        if self.options:
            parts.append("options={" + ", ".join(f"{k!r}: {v!r}" for k, v in self.options) + "}")
        if self.state != "device":
            parts.append(f"state={self.state!r}")
        return f"{self.name}({', '.join(parts)})"

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """With a memory budget, on CUDA, where the baseline steps torch's AdamW (autoplan's
        default optimizer, at its defaults): AdamW in backward, and with its state on the CPU;
        with lossy steps allowed, :class:`LowBitAdamW` in backward. Not without a budget (they
        cut gradients and optimizer state, which a time limit alone does not ask for), nor with
        the caller's own optimizer, which cannot be built again a parameter at a time."""
        if not context.budget or context.device.type != "cuda" or context.optimizer is not None:
            return []
        steps = [cls(torch.optim.AdamW), cls(torch.optim.AdamW, state="cpu")]
        steps += [cls(LowBitAdamW)] if context.allow_lossy else []
        return [Candidate((s,)) for s in steps]

    def conflict(self, other: Step) -> str | None:
        if isinstance(other, StepInBackward):
            return "one optimizer steps each parameter in backward; keep one step_in_backward()"
        return None

    def targets(self, model: nn.Module) -> Targets:
        if _HANDLE in model.__dict__:
            return Targets()  # applied already
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(f"shrinkwrap: step_in_backward() found no parameter that requires grad in "
                             f"{type(model).__name__}")
        try:
            self.optimizer([torch.zeros(1, requires_grad=True)], **dict(self.options))
        except Exception as exc:  # noqa: BLE001 - the optimizer's own message, before any change
            raise ValueError(f"shrinkwrap: {self}: the optimizer refuses its options: {exc}") from None
        return Targets([""], payload=names)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        if not targets.matched:
            return []
        # One parameter a step: foreach would group it with none (fused is chosen per parameter).
        options = {**dict(self.options), "foreach": False}
        handle = InBackward(targets.payload, self.optimizer, options, self.state == "cpu")
        handle.model = weakref.ref(model)
        handle.bind(model)
        model.__dict__[_HANDLE] = handle
        hook = _rewrite.Hooked(model.register_forward_pre_hook(_Bind(handle)))
        return [_Detach(handle), hook]


def optimizer(model: nn.Module) -> InBackward:
    """The optimizer-shaped handle of a model with ``step_in_backward()``: give it to the loop, an
    LR scheduler, the Hugging Face Trainer (``optimizers=(handle, scheduler)``), a checkpoint.

    Example::

        >>> opt = sw.optimizer(model); sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    """
    handle = require_module(model, "optimizer()").__dict__.get(_HANDLE)
    if handle is None:
        raise ValueError(f"shrinkwrap: {type(model).__name__} has no step_in_backward(); apply it first, or make "
                         "an optimizer of your own")
    return handle


def apply_step_in_backward(model: nn.Module, optimizer: type = torch.optim.AdamW, options: Any = (),
                           state: str = "device") -> nn.Module:
    """Step ``model``'s optimizer inside backward, in place; return ``model`` (see :class:`StepInBackward`).

    Example::

        >>> apply_step_in_backward(model, torch.optim.AdamW, {"lr": 1e-4}); opt = sw.optimizer(model)
    """
    return StepInBackward(optimizer, options, state).apply(require_module(model, "apply_step_in_backward()"))
