"""Running a model forward and backward beside its checkpointed copy, bit for bit: what the checkpoint test files
share."""

import torch


def run(model, x, seed=1, **kw):
    """Forward + backward with a fixed dropout seed; returns output and named gradients."""
    plain = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes the names
    plain.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x, **kw)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
