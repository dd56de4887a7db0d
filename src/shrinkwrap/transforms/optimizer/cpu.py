"""A parameter's optimizer stepped on the CPU (``step_in_backward(state='cpu')``): its copy,
gradient buffer and state in pinned memory, and the fingerprint that tells whether a half weight
changed on the GPU since its step wrote it."""

from __future__ import annotations

import torch

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


class _OnCpu:
    """One parameter's optimizer stepped on the CPU: its copy (float32 where the parameter is
    half: the master copy), gradient buffer and norms in pinned memory (plain memory where there
    is no CUDA), the optimizer over the copy.

    The step starts from what the model holds (a ``load_state_dict``, a clamp through ``.data``,
    a resume since): a float32 weight comes down with its gradient into the copy the step takes.
    A half weight comes down where its :func:`fingerprint` differs from the one its last step
    wrote (the master copy holds more than the weight), and its values that differ from the
    master's rounding replace the master's. For a GPU's parameter the CPU optimizer is torch's
    fused one where its class has one (AdamW, Adam, SGD, Adagrad): one pass over the values
    instead of one an operation. A CPU
    model's parameters keep the single-tensor path, and with it the plain loop's bits."""

    def __init__(self, p: torch.Tensor, cls: type, options: dict) -> None:
        pinned = p.is_cuda
        dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        self.master = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        self.master.copy_(p.detach())
        self.master.requires_grad_(True)
        self.seen = None if dtype == p.dtype else torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned)
        self.grad = torch.empty(p.shape, dtype=dtype, pin_memory=pinned)
        # The gradient's 2-norm and largest magnitude, and whether a half weight changed since its step.
        self.norms = torch.empty(3, dtype=torch.promote_types(p.dtype, torch.float32), pin_memory=pinned)
        self.written: tuple | None = None  # the fingerprint of the weight as the last step wrote it
        self.optimizer = _one_optimizer(cls, self.master, options, fused=pinned)

    def take(self, weight: torch.Tensor) -> None:
        """The master copy from the weight the model holds (``weight``: what came down into the
        master or ``seen``, or a CPU model's parameter)."""
        if self.seen is None:
            if weight.data_ptr() != self.master.data_ptr():
                self.master.detach().copy_(weight)
            return
        changed = weight != self.master.detach().to(weight.dtype)
        if bool(changed.any()):
            self.master.detach()[changed] = weight[changed].to(self.master.dtype)
