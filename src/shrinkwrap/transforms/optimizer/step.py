"""The step: ``step_in_backward(optimizer, options, state)``, the optimizer stepped inside backward.

See :mod:`.handle` for the handle the loop drives, and docs/steps/step_in_backward.md for the
loops it serves and those it refuses.
"""

from __future__ import annotations

__all__ = ["StepInBackward", "apply_step_in_backward", "optimizer"]

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn as nn

from ... import _rewrite
from ...select import require_module
from ...step import Candidate, Context, Step, Targets
from .handle import InBackward
from .interface import HANDLE
from .refusals import check_class
from .lowbit import LowBitAdamW


class _Bind:
    """Forward pre-hook of the root (see :meth:`InBackward.before_forward`)."""

    def __init__(self, handle: InBackward) -> None:
        self.handle = handle

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.handle.before_forward(module)


class _Latest:
    """State-dict pre-hook of the root with ``delayed=True``: the latest weights written into the
    model before ``model.state_dict()`` reads them (a checkpoint, ``save_pretrained``)."""

    def __init__(self, handle: InBackward) -> None:
        self.handle = weakref.ref(handle)

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        handle = self.handle()
        if handle is not None:
            handle.wait()


@dataclasses.dataclass
class _Detach:
    """Undo entry: the handle's hooks removed, its worker stopped, the gradients' stand-ins dropped."""

    handle: InBackward

    def undo(self, model: nn.Module) -> None:
        self.handle.close()
        for p in self.handle.params.values():
            p.grad = None
        model.__dict__.pop(HANDLE, None)


@dataclasses.dataclass(frozen=True)
class StepInBackward(Step):
    """Step: the optimizer steps each parameter inside backward, as its gradient is accumulated,
    and drops the gradient; with ``state="cpu"`` its state lives in CPU memory and the step runs
    there, overlapped with backward. See the module docstring for what is exact and what is refused.

    Args:
        optimizer: the optimizer class (any ``torch.optim.Optimizer``), built once a parameter.
        options: its keyword arguments, as a dict or pairs: ``{'lr': 1e-4, 'weight_decay': 0.01}``.
        state: ``"device"`` (the state beside the parameter) or ``"cpu"``.
        delayed: with ``state="cpu"``, the CPU's step of iteration i runs during iteration i+1,
            whose gradient is taken at the weights before it (ZeRO-Offload's one-step-delayed
            update): lossy, off by default. ``sw.optimizer(model).wait()`` writes the latest
            weights into the model (``state_dict()`` and an evaluation forward do too).
        rounding: with ``state="cpu"`` and bf16 weights, how the float32 master copy becomes the
            weight: ``"nearest"`` or ``"stochastic"`` (unbiased: updates below bf16's spacing
            still reach the forward on average).
        delay_after: with ``delayed=True``, how many steps are taken exact before the update is
            delayed (ZeRO-Offload's warm-up; 0, the default: from the first). Counted by the
            handle's ``step()``; a state_dict loaded into the handle sets the count from its
            ``step`` entries, where the optimizer keeps them.

    Example::

        >>> sw.apply(model, sw.step_in_backward(torch.optim.AdamW, {"lr": 1e-4}, state="cpu"))
        >>> sw.optimizer(model)   # the handle for the loop
    """

    name = "step_in_backward"
    order = 70

    @property
    def lossy(self) -> bool:  # type: ignore[override]
        """Lossy where its optimizer says so (:class:`LowBitAdamW`), or the update is delayed."""
        return bool(getattr(self.optimizer, "lossy", False)) or self.delayed

    optimizer: type = torch.optim.AdamW
    options: Any = ()
    state: str = "device"
    delayed: bool = False
    rounding: str = "nearest"
    delay_after: int = 0

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
        if not isinstance(self.delayed, bool):
            raise TypeError(f"shrinkwrap: step_in_backward(delayed={self.delayed!r}): delayed is True or False")
        if self.delay_after < 0:  # its type is checked with the other fields'
            raise ValueError(f"shrinkwrap: step_in_backward(delay_after={self.delay_after!r}): delay_after is a count "
                             "of steps, 0 or more")
        if self.delay_after and not self.delayed:
            raise ValueError(f"shrinkwrap: step_in_backward(delay_after={self.delay_after}) is the delayed update's "
                             "warm-up; add delayed=True")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"shrinkwrap: step_in_backward(rounding={self.rounding!r}): rounding is 'nearest' or "
                             "'stochastic'")
        for what, off in (("delayed=True", not self.delayed), (f"rounding={self.rounding!r}",
                                                                self.rounding == "nearest")):
            if not off and self.state != "cpu":
                raise ValueError(f"shrinkwrap: step_in_backward({what}) is a form of the step on the CPU; add "
                                 "state='cpu'")
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
        if self.delayed:
            parts.append("delayed=True")
        if self.rounding != "nearest":
            parts.append(f"rounding={self.rounding!r}")
        if self.delay_after:
            parts.append(f"delay_after={self.delay_after}")
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
        if getattr(other, "needs_grad_scaler", False):
            return (f"{other} trains with a GradScaler, whose scaled gradients the step in backward would apply "
                    "before the scaler could unscale them; use autocast(torch.bfloat16), which needs none")
        return None

    def targets(self, model: nn.Module) -> Targets:
        handle = model.__dict__.get(HANDLE)
        if handle is not None:
            if handle.spec != self._spec:
                raise ValueError(f"shrinkwrap: {type(model).__name__}'s optimizer steps in backward already as "
                                 f"{handle.spec[0]}; to step it as {self}, revert it first (shrinkwrap.revert(model))")
            return Targets()  # applied already
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"shrinkwrap: step_in_backward() found no parameter that requires grad in "
                             f"{type(model).__name__}")
        try:
            self.optimizer([torch.zeros(1, requires_grad=True)], **dict(self.options))
        except Exception as exc:  # noqa: BLE001 - the optimizer's own message, before any change
            raise ValueError(f"shrinkwrap: {self}: the optimizer refuses its options: {exc}") from None
        check_class(self.optimizer, dict(self.options), trainable[0].device)
        return Targets([""])

    @property
    def _spec(self) -> tuple:
        return (str(self), self.optimizer, self.options, self.state, self.delayed, self.rounding, self.delay_after)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        if not targets.matched:
            return []
        handle = InBackward(self.optimizer, dict(self.options), self.state == "cpu", self._spec, self.delayed,
                            self.rounding, self.delay_after)
        handle.model = weakref.ref(model)
        handle.bind(model)
        model.__dict__[HANDLE] = handle
        hooks = [_rewrite.Hooked(model.register_forward_pre_hook(_Bind(handle)))]
        if self.delayed:
            hooks.append(_rewrite.Hooked(model.register_state_dict_pre_hook(_Latest(handle))))
        return [_Detach(handle), *hooks]


def optimizer(model: nn.Module) -> InBackward:
    """The optimizer-shaped handle of a model with ``step_in_backward()``: give it to the loop, an
    LR scheduler, the Hugging Face Trainer (``optimizers=(handle, scheduler)``), a checkpoint.

    Example::

        >>> opt = sw.optimizer(model); sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    """
    root = require_module(model, "optimizer()")
    # The model the step was applied to, or one that wraps it (PEFT's PeftModel, a parallel wrapper).
    owner = next((m for m in root.modules() if HANDLE in m.__dict__), None)
    if owner is None:
        raise ValueError(f"shrinkwrap: {type(model).__name__} has no step_in_backward(); apply it first, or make "
                         "an optimizer of your own")
    handle = owner.__dict__[HANDLE]
    if handle.model() is None:  # a copy's (deepcopy, pickle): it binds the copied model
        handle.model = weakref.ref(owner)
        handle.bind(owner)
    return handle


def apply_step_in_backward(model: nn.Module, optimizer: type = torch.optim.AdamW, options: Any = (),
                           state: str = "device", delayed: bool = False, rounding: str = "nearest",
                           delay_after: int = 0) -> nn.Module:
    """Step ``model``'s optimizer inside backward, in place; return ``model`` (see :class:`StepInBackward`).

    Example::

        >>> apply_step_in_backward(model, torch.optim.AdamW, {"lr": 1e-4}); opt = sw.optimizer(model)
    """
    step = StepInBackward(optimizer, options, state, delayed, rounding, delay_after)
    return step.apply(require_module(model, "apply_step_in_backward()"))
