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
- containers: a region that writes into a dict or list it was given (``state["h"] = h``) would
  recompute from the written container; the recompute gets a copy of the containers as they were
  before the forward, so it starts where the forward started;
- Hugging Face models: the KV cache would be written again by the recompute; a model holding
  checkpoint regions is called with ``use_cache=False`` in training, as HF's own
  ``gradient_checkpointing_enable()`` does (the record's notes say so; ``revert`` undoes it);
- eval mode, ``no_grad`` and ``inference_mode`` run the module directly, with no checkpoint.

Dropout masks match between forward and recompute (the RNG state is preserved), and inputs that
do not require grad still give gradients to the region's parameters (non-reentrant checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.hooks import RemovableHandle

from .. import _rewrite
from .._wrapper import TransparentWrapper, unwrap
from ..plan import Step
from ..select import Pattern, SelectionError


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


def _containers(obj: Any) -> Any:
    """``obj`` with every list and dict in it (nested in tuples too) copied; tensors and other
    objects are the same objects."""
    if isinstance(obj, (list, dict)):
        new = copy.copy(obj)  # keeps a subclass's type (OrderedDict, ModelOutput)
        for key, value in (enumerate(obj) if isinstance(obj, list) else obj.items()):
            new[key] = _containers(value)
        return new
    if type(obj) is tuple:
        return tuple(_containers(o) for o in obj)
    return obj


def _has_containers(obj: Any) -> bool:
    if isinstance(obj, (list, dict)):
        return True
    return type(obj) is tuple and any(_has_containers(o) for o in obj)


class _Run:
    """What torch's checkpoint runs: the module on the caller's inputs in the forward, and in the
    recompute on a copy of the containers among them as they were before the forward, so that a
    region writing into a dict it was given recomputes from what it was given."""

    def __init__(self, module: nn.Module, clone: bool, args: tuple, kwargs: dict) -> None:
        self.module, self.clone = module, clone
        self.before = _containers((args, kwargs)) if _has_containers((args, kwargs)) else None
        self.calls = 0

    def __call__(self, kwargs: dict, *args: Any) -> Any:
        # kwargs travel as one positional dict so that a module kwarg named like one of
        # torch.utils.checkpoint's own options (debug, preserve_rng_state, ...) cannot collide.
        if self.calls and self.before is not None:
            args, kwargs = _containers(self.before)
        self.calls += 1
        if self.clone:
            args, kwargs = _clone_tensors(args, kwargs)
        return self.module(*args, **kwargs)


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
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        out = _torch_checkpoint(
            _Run(inner, self._sw_clone_inputs, args, kwargs), kwargs, *args,
            use_reentrant=False, context_fn=self._contexts,
        )
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise RuntimeError(
                f"shrinkwrap: checkpointed module {self._sw_name!r} modified its input in place; "
                "its recompute in backward would start from the modified value. Checkpoint a region "
                "that starts after the in-place operation, or pass clone_inputs=True."
            )
        return out


class _NoCacheInTraining:
    """Forward pre-hook of a Hugging Face model that holds checkpoint regions: in training, call
    it with ``use_cache=False``. Its blocks would otherwise write their KV cache in the forward and
    again in the recompute, and backward fails (or, worse, reads the doubled cache)."""

    def __init__(self, position: int) -> None:
        self.position = position  # use_cache's index among the positional parameters after self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if len(args) > self.position:
            return (*args[: self.position], False, *args[self.position + 1 :]), kwargs
        return args, {**kwargs, "use_cache": False}


@dataclasses.dataclass
class Hooked:
    """Undo entry: a hook shrinkwrap put on a module."""

    handle: RemovableHandle

    def undo(self, model: nn.Module) -> None:
        self.handle.remove()


def _cache_hooks(model: nn.Module, regions: list[str]) -> tuple[list[Hooked], list[str]]:
    """Hook the outermost modules taking ``use_cache`` (Hugging Face models) that hold or are one
    of ``regions``; return the undo entries and a note per module."""
    undo, notes, owners = [], [], []
    for name, module in model.named_modules():
        if any(not o or name.startswith(o + ".") for o in owners):
            continue
        params = list(inspect.signature(type(unwrap(module)).forward).parameters)
        if "use_cache" not in params or not any(r == name or not name or r.startswith(name + ".") for r in regions):
            continue
        owners.append(name)
        if any(isinstance(h, _NoCacheInTraining) for h in module._forward_pre_hooks.values()):
            continue  # an earlier checkpoint step hooked it
        hook = _NoCacheInTraining(params.index("use_cache") - 1)
        undo.append(Hooked(module.register_forward_pre_hook(hook, with_kwargs=True)))
        notes.append(f"{name or type(model).__name__} runs with use_cache=False in training: "
                     "the recompute would write its KV cache a second time")
    return undo, notes


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
        hooks, notes = _cache_hooks(model, wrap)
        _rewrite.record(model, _rewrite.Record(str(self), tuple(wrap), tuple(skipped), undo + hooks, tuple(notes)))
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
    return Checkpoint(pattern, clone_inputs=clone_inputs).apply(model)
