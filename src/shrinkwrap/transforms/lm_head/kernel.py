"""The chunked cross-entropy: a head's loss and gradients ``chunk_size`` rows at a time, no tensor of
``rows x vocabulary`` outliving its chunk."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on, else the tensor's."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


_OUT_DTYPE = [True]  # whether addmm takes out_dtype on CUDA here (older torch: not, or not in place)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in ``acc``'s dtype, in place where it can be: a bfloat16 product goes into a
    float32 sum without a bfloat16 copy of it (``addmm``'s ``out_dtype``, CUDA, recent torch)."""
    if torch.compiler.is_compiling():
        return acc + (a @ b).to(acc.dtype)  # the compiler fuses the sum
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if acc.is_cuda and _OUT_DTYPE[0]:
        try:
            with torch.autocast("cuda", enabled=False):  # autocast would round the sum to bfloat16
                return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (TypeError, RuntimeError):  # no out_dtype, or not into a wider sum (torch < 2.10)
            _OUT_DTYPE[0] = False
    return acc.add_(a @ b)


class _HeadLoss(torch.autograd.Function):
    """Summed cross-entropy of ``linear(hidden, weight, bias)`` against ``labels``, scaled by
    ``scale``, one chunk of rows at a time. Where ``grads`` (grad mode was on) the forward
    computes each chunk's gradients with its loss (softmax minus one-hot, through the soft-cap)
    and keeps only the gradients of ``hidden`` (rows x hidden) and of ``weight`` and ``bias``
    (the weight's gradient, which backward makes in any case): the head costs the three matmuls
    of the plain model, with no recompute, and no tensor of ``rows x vocabulary`` outlives its
    chunk. Backward multiplies by the incoming gradient, in float32.

    Matmuls run in the compute dtype (autocast's), the softmax and the sums in at least float32.
    The gradient matmuls take softmax minus one-hot unscaled (entries within [-1, 1]), and the
    scale (1 / counted tokens) comes after them in float32: scaled first, a float16 gradient would
    underflow before the GradScaler's factor arrives in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, scale: torch.Tensor, chunk_size: int, softcap: float | None,
                ignore_index: int, dtype: torch.dtype, grads: bool) -> torch.Tensor:
        want_h, want_w, want_b = (grads and need for need in ctx.needs_input_grad[:3])
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        acc = torch.promote_types(dtype, torch.float32)
        rows = hidden.shape[0]
        total = hidden.new_zeros((), dtype=acc)
        # Kept until backward in the narrower of their own dtype and bfloat16 where the matmuls run in
        # bfloat16 (see the end of forward).
        kept = (lambda d: dtype if dtype == torch.bfloat16 and d.itemsize > 2 else d)
        grad_h = torch.empty_like(hidden, dtype=kept(hidden.dtype)) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, acc)) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.promote_types(bias.dtype, acc)) if want_b else None
        # Eager, the narrow chunk gradients of two chunks go into one buffer and into the weight's
        # float32 gradient with one matmul: each such sum reads and writes the whole of it (1 GiB at
        # a 128k vocabulary), and the buffer is no larger than one chunk's float32 log-softmax.
        compiling = torch.compiler.is_compiling()
        group = 2 * chunk_size if want_w and not want_b and dtype != acc and not compiling else chunk_size
        buffer = hidden.new_empty((min(group, rows), weight.shape[0]), dtype=dtype) if group > chunk_size else None
        # The matmuls run in `dtype` explicitly; autocast would add float32 copies of the chunk.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_size):
                h = hidden[start:start + chunk_size].to(dtype)
                y = labels[start:start + chunk_size]
                z = F.linear(h, w, b)
                if softcap is not None:
                    t = torch.tanh(z.to(acc) / softcap)
                    z = t * softcap
                counted = y != ignore_index
                target = torch.where(counted, y, 0).unsqueeze(1)
                g = torch.log_softmax(z, dim=-1, dtype=acc)  # one pass from the narrow logits
                del z
                total = total - (g.gather(1, target).squeeze(1) * counted).sum()
                if not (want_h or want_w or want_b):
                    continue
                g = g.exp_()  # d(sum of losses)/dz: softmax - one-hot, on counted rows
                g.scatter_add_(1, target, torch.full_like(target, -1, dtype=g.dtype))
                if softcap is not None:
                    g.mul_(1 - t * t)
                mask = counted.unsqueeze(1)
                at = start % group
                if want_b or dtype == acc or compiling:
                    gd = g.mul_(mask).to(dtype)
                    if want_b:
                        grad_b += g.sum(0)
                else:  # masked and narrowed in one pass
                    gd = torch.mul(g, mask, out=(buffer[at:at + len(g)] if buffer is not None else
                                                 torch.empty(g.shape, dtype=dtype, device=g.device)))
                del g
                if want_h:
                    grad_h[start:start + chunk_size] = (gd @ w).to(acc) * scale
                if not want_w:
                    continue
                if buffer is None:
                    grad_w = _add_product(grad_w, gd.t(), h)
                elif at + len(gd) == group or start + len(gd) == rows:
                    first = start - at
                    grad_w = _add_product(grad_w, buffer[:at + len(gd)].t(),
                                          hidden[first:start + len(gd)].to(dtype))
        # The sums scaled in float32, then kept until backward in the narrower of the parameter's
        # dtype and bfloat16 where the matmuls ran in bfloat16 (rounded once): the plain model under
        # bfloat16 autocast rounds its head's gradients to bfloat16 too (its matmuls' outputs), and
        # a float32 copy of a 128k-vocabulary head's weight gradient would hold 1 GiB from forward
        # to backward. float16 keeps float32: without the GradScaler's factor, which arrives in
        # backward, small gradients would underflow.
        grad_w = grad_w.mul_(scale).to(kept(weight.dtype)) if want_w else None
        grad_b = grad_b.mul_(scale).to(kept(bias.dtype)) if want_b else None
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():
            # Second derivatives would come out zero, not wrong by rounding: refused.
            raise RuntimeError(
                "shrinkwrap: chunked_loss() computes the head's gradients in the forward, as numbers with no "
                "graph, so backward with create_graph=True (a gradient penalty) cannot differentiate them again. "
                "Compute this loss from the logits: call the model without labels and apply the loss yourself, "
                "or revert the plan (shrinkwrap.revert(model)).")
        wide = grad_out.to(torch.promote_types(grad_out.dtype, torch.float32))
        scaled = [(g * wide).to(d) if g is not None else None for g, d in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*scaled, None, None, None, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          shift_labels: torch.Tensor, *, chunk_size: int = 1024, softcap: float | None = None,
                          num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of ``linear(hidden, weight, bias)`` against ``shift_labels`` (already shifted,
    one per row of ``hidden``), ``chunk_size`` rows at a time (see :class:`_HeadLoss`): the sum
    over counted rows divided by their number, or by ``num_items_in_batch`` when given.

    Example::

        >>> loss = chunked_cross_entropy(hidden, model.lm_head.weight, None, labels[:, 1:], chunk_size=512)
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    dtype = _compute_dtype(hidden)
    acc = torch.promote_types(dtype, torch.float32)
    if num_items_in_batch is None:
        scale = 1 / (shift_labels != ignore_index).sum().to(acc)
    else:
        scale = 1 / torch.as_tensor(num_items_in_batch, device=hidden.device).to(acc)
    return _HeadLoss.apply(hidden, weight, bias, shift_labels, scale, chunk_size, softcap, ignore_index, dtype,
                           torch.is_grad_enabled())
