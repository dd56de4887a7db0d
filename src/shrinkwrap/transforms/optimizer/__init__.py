"""The optimizer's share of the bill: its step inside backward, its state off the GPU, and smaller state.

A training iteration's peak holds, besides activations, the parameters, their gradients and the
optimizer's state: 16 bytes a parameter for float32 AdamW. ``step_in_backward(optimizer, options,
state)`` takes the gradient term away, and with ``state="cpu"`` the state too; ``LowBitAdamW``
keeps the state in 8 bits (lossy, opt-in). The files, one concern each:

- ``step.py``: the plan step and ``sw.optimizer(model)``, the handle the loop drives.
- ``handle.py``: the handle, ``InBackward``, as the loop sees it: param groups, ``state_dict``,
  ``add_param_group``, step hooks, ``step()`` and ``zero_grad()``.
- ``binding.py``: an optimizer and a hook for each parameter, bound again as the model changes.
- ``backward.py``: the steps inside backward, a parameter or a bucket at a time, and the check
  that a gradient is finite.
- ``cpu.py``: the step with the state on the CPU: a parameter's copy, its weight's fingerprint,
  the worker thread.
- ``checks.py``: the loop checks between backwards (a backward no ``step()`` followed, options
  changed after backward, a backward that raised halfway).
- ``refusals.py``: what is refused before any step (an optimizer class, a GradScaler).
- ``interface.py``: what the measuring harness asks of the step (the handle that trains a model,
  whether a gradient was used and dropped); nothing outside this package reads more.
- ``standin.py``: what ``.grad`` holds after the step used a gradient.
- ``lowbit.py``: ``LowBitAdamW``.

Example::

    >>> sw.apply(model, "step_in_backward(torch.optim.AdamW, options={'lr': 1e-4, 'weight_decay': 0.01})")
    >>> opt = sw.optimizer(model)                 # for the loop, a scheduler, checkpoints
    >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    >>> for batch in data:
    ...     model(**batch).loss.backward()        # each parameter is updated here
    ...     opt.step(); opt.zero_grad(); sched.step()
"""

from .handle import InBackward
from .lowbit import LowBitAdamW
from .step import StepInBackward, apply_step_in_backward, optimizer

__all__ = ["StepInBackward", "InBackward", "LowBitAdamW", "apply_step_in_backward", "optimizer"]
