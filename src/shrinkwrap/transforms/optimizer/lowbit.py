"""LowBitAdamW: AdamW with 8-bit moments and, for bf16 weights, stochastic rounding in place of a
float32 master copy. An optimizer of its own (usable without shrinkwrap's steps), meant for
``step_in_backward()``: it keeps everything of a parameter in its group and ``state[p]``, so a
bucket of parameters steps as each would alone.
"""

from __future__ import annotations

__all__ = ["LowBitAdamW"]

from typing import Any

import torch

from ... import _compat

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
        not a parameter's, which for a large vocabulary's embedding would each be the size of the
        weight in float32. A parameter not contiguous in memory (channels_last convolutions:
        small) goes in one slice."""
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
    its values takes: in backward the hooks' calls are the step's cost, so the fewer the better
    (packed by kind, not only runs of one dtype: a model's bf16 weights alternate with float32
    norms). The step time it reaches: benchmarks/RESULTS.md, "The whole memory bill". Packing
    copies the small pieces in and out, which leaves the peak where it is."""
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
    _compat.foreach_copy_(list(grad_in.view(-1).split(spans)[::2]), grads)
    _compat.foreach_copy_(weights_in, weights)
    joined = [torch.cat(s) for s in states]
    update(grad_in, weight_in, *joined, hyper)
    _compat.foreach_copy_(weights, weights_in)
    for parts, whole in zip(states, joined):
        _compat.foreach_copy_(parts, list(whole.split(sizes)))


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
    slice is some 25 kernels, each a pass over the slice, which leaves the step in backward
    several times slower than the plain loop's (benchmarks/RESULTS.md, "The whole memory bill",
    has the compiled one). Compiled, the pass over the moments and weight
    is fused and writes them in place (:func:`_step_packed`). Shapes are dynamic (slices differ
    in length) and the hyperparameters a tensor, so a scheduler's new learning rate and the next
    step's bias corrections do not compile again; a graph is compiled for each pair of parameter
    and gradient dtypes, for views of a parameter and for packed buffers, and for a call of one
    block (a length of one is specialized): bf16 weights with float32 norms take up to six. Past
    dynamo's recompile limit (8 a function) a call runs eagerly: the same update, slower.
    The random bits of the stochastic rounding are the compiler's own, so the compiled update
    does not match the eager one bit for bit where parameters are bf16."""
    if not p.is_cuda or _is_fake(p):
        return None
    if not _COMPILED:
        _COMPILED.append(torch.compile(_adamw_slice, dynamic=True))
    return _COMPILED[0]


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``shrinkwrap.estimate``), where nothing is compiled."""
    return isinstance(t, _compat.fake_tensor()[0])

