"""Activation checkpointing: recompute a region's activations in backward instead of storing them.

``CheckpointModule`` runs the wrapped module under non-reentrant ``torch.utils.checkpoint`` and
fixes what the plain recipe gets wrong:

- names: the wrapper adds no level to parameter or buffer names (see ``_wrapper``);
- BatchNorm: the recompute would update running statistics a second time; they are restored
  after the recompute, so ``running_mean``, ``running_var`` and ``num_batches_tracked`` match the
  unwrapped model's;
- in-place input: a region that modifies its own input in place would recompute from the
  modified value; that is refused at apply time where it can be seen (the region is, or starts
  with, a module with ``inplace=True``) and raised with the module's name at the first forward
  otherwise. ``clone_inputs=True`` gives such a region a private copy of its inputs instead;
- eval mode, ``no_grad`` and ``inference_mode`` run the module directly, with no checkpoint.

Dropout masks match between forward and recompute (the RNG state is preserved), and inputs that
do not require grad still give gradients to the region's parameters (non-reentrant checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import _rewrite
from .._wrapper import TransparentWrapper, unwrap
from ..plan import Step
from ..select import Pattern, SelectionError, require_module


class _RestoreNormStats:
    """Recompute context: put BatchNorm running statistics back as they were before it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = [
            (buf, buf.clone())
            for m in self.module.modules()
            if isinstance(unwrap(m), nn.modules.batchnorm._NormBase)  # also a BatchNorm inside bn_act
            for buf in m.buffers(recurse=False)
        ]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buf, value in self.saved:
                buf.copy_(value)


def _clone_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def c(x: Any) -> Any:
        return x.clone() if isinstance(x, torch.Tensor) else x

    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def _run(module: nn.Module, clone: bool, kwargs: dict, *args: Any) -> Any:
    # kwargs travel as one positional dict so that a module kwarg named like one of
    # torch.utils.checkpoint's own options (debug, preserve_rng_state, ...) cannot collide.
    if clone:
        args, kwargs = _clone_tensors(args, kwargs)
    return module(*args, **kwargs)


class CheckpointModule(TransparentWrapper):
    """Run ``module`` under activation checkpointing, changing no parameter or buffer name.

    Args:
        module: the region to recompute in backward.
        name: its dotted name in the model, used in messages.
        clone_inputs: give the region a private copy of its tensor inputs, for regions that
            modify their input in place. The caller's tensor is then left unmodified.

    Example::

        >>> model.layer1 = CheckpointModule(model.layer1)   # or apply_checkpoint(model, "layer1")
        >>> model.state_dict().keys()                        # unchanged: 'layer1.0.conv1.weight', ...
    """

    label = "Checkpoint"

    def __init__(self, module: nn.Module, *, name: str = "", clone_inputs: bool = False) -> None:
        if isinstance(module, CheckpointModule):
            raise ValueError(f"shrinkwrap: {name or 'module'} is already checkpointed")
        super().__init__(module)
        self._sw_name = name or type(module).__name__
        self._sw_clone_inputs = clone_inputs

    def _contexts(self) -> tuple[Any, Any]:
        return contextlib.nullcontext(), _RestoreNormStats(self.wrapped)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped
        if not (self.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        out = _torch_checkpoint(
            _run, inner, self._sw_clone_inputs, kwargs, *args,
            use_reentrant=False, context_fn=self._contexts,
        )
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise RuntimeError(
                f"shrinkwrap: checkpointed module {self._sw_name!r} modified its input in place; "
                "its recompute in backward would start from the modified value. Checkpoint a region "
                "that starts after the in-place operation, or pass clone_inputs=True."
            )
        return out


def _first_leaf(module: nn.Module) -> nn.Module:
    while True:
        children = list(module.children())
        if not children:
            return module
        module = children[0]


@dataclasses.dataclass(frozen=True)
class Checkpoint(Step):
    """Step: checkpoint the submodules that ``pattern`` selects (outermost matches only).

    Example::

        >>> sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]")]))
    """

    name = "checkpoint"

    pattern: Pattern
    clone_inputs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pattern, list):
            object.__setattr__(self, "pattern", tuple(self.pattern))

    def _targets(self, model: nn.Module) -> tuple[list[str], list[tuple[str, str]]]:
        wrap, skipped = _rewrite.wrap_targets(model, self.pattern, CheckpointModule, "checkpoint", "checkpointed")
        for name in wrap:
            first = _first_leaf(model.get_submodule(name))
            if not self.clone_inputs and getattr(first, "inplace", False):
                raise SelectionError(
                    f"shrinkwrap: cannot checkpoint {name!r}: it starts with an in-place "
                    f"{type(first).__name__}, which modifies the region's input that the "
                    "recompute needs. Checkpoint a region that starts after it, or pass clone_inputs=True."
                )
        return wrap, skipped

    def check(self, model: nn.Module) -> None:
        self._targets(model)

    def apply(self, model: nn.Module) -> nn.Module:
        wrap, skipped = self._targets(model)
        undo = _rewrite.unwrap_inside(model, wrap, CheckpointModule)
        undo += _rewrite.replace(
            model, wrap, lambda n, m: CheckpointModule(m, name=n, clone_inputs=self.clone_inputs)
        )
        _rewrite.record(model, _rewrite.Record(str(self), tuple(wrap), tuple(skipped), undo))
        return model


def apply_checkpoint(model: nn.Module, pattern: Pattern, *, clone_inputs: bool = False) -> nn.Module:
    """Checkpoint the submodules of ``model`` that ``pattern`` selects, in place; return ``model``.

    See :class:`CheckpointModule` for what is preserved. Raises ``SelectionError`` for a pattern
    that matches nothing, a module with no forward (``ModuleList``), or a region that starts with
    an in-place operation (unless ``clone_inputs=True``).

    Example::

        >>> apply_checkpoint(resnet, r"layer[12]")
        >>> print(resnet.layer1)   # Checkpoint[Sequential](...)
    """
    return Checkpoint(pattern, clone_inputs=clone_inputs).apply(require_module(model, "apply_checkpoint()"))
