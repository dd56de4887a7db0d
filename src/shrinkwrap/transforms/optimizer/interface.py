"""What the rest of shrinkwrap asks of a model's optimizer step in backward, and nothing more: the
measuring harness and :func:`~shrinkwrap.estimate` import this module, never the handle's insides,
so that they change only where it does.

- :func:`trained_by`: the optimizer-shaped handle that steps a model inside backward, or None. A
  harness drives its iterations through it (``zero_grad()``, ``step()``, ``state_dict()``), not
  through an optimizer of its own, which would step every parameter a second time.
- :func:`holds_no_gradient`: whether a ``.grad`` is the stand-in a gradient leaves once the step
  used it: a tensor of no bytes, which a count of gradient memory skips.

Example::

    >>> handle = trained_by(model)            # None without step_in_backward()
    >>> opt = handle or torch.optim.AdamW(model.parameters())
    >>> sum(p.grad.nbytes for p in model.parameters() if p.grad is not None and not holds_no_gradient(p.grad))
"""

from __future__ import annotations

__all__ = ["HANDLE", "holds_no_gradient", "trained_by"]

from typing import Any

import torch.nn as nn

from .standin import is_stand_in

HANDLE = "_sw_optimizer"  # the attribute of the module step_in_backward() was applied to that holds its handle


def trained_by(model: nn.Module) -> Any:
    """The optimizer-shaped handle (:class:`~.handle.InBackward`) of a model whose optimizer steps
    inside backward: the model's own, or that of the module a parallel wrapper holds (DDP's
    ``module``); None where neither has ``step_in_backward()``.

    Args:
        model: the model as the harness runs it.

    Returns:
        The handle, a ``torch.optim.Optimizer``, or None.
    """
    for m in (model, *model.children()):
        handle = m.__dict__.get(HANDLE)
        if handle is not None:
            return handle
    return None


def holds_no_gradient(t: Any) -> bool:
    """Whether ``t`` (a gradient, or a DTensor over one) is the stand-in the step in backward left
    once it used the gradient: it holds no memory.

    Args:
        t: what a parameter's ``.grad`` holds.

    Returns:
        True for a stand-in, False for a gradient or anything else.
    """
    return is_stand_in(t)
