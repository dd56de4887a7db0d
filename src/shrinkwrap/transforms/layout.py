"""Memory-layout transforms: ``channels_last`` for convolutional models.

:class:`ChannelsLast` (``channels_last()``) stores the model's 4-D floating parameters and buffers
(2-D convolution weights) in ``torch.channels_last`` memory format (NHWC in memory, the same
NCHW shape and values), and gives the model's forward its 4-D floating inputs in that format. The
convolutions, BatchNorms and elementwise ops then keep their outputs in it. On NVIDIA GPUs this
is what lets cuDNN run bf16/fp16 convolutions on tensor cores without a transpose around each
one; it saves no memory. Whether it pays on a given model and device is for measuring: it is an
autoplan candidate on every convolutional model.

It is exact, not lossy: no value changes. It is not bit for bit: kernels for channels_last
tensors add in another order than those for contiguous ones (they do on CPU), so outputs,
gradients and BatchNorm running statistics differ from the untransformed model's by rounding;
the tests hold float64 to ``rtol=1e-12``. Element-wise dropout draws its random numbers in memory
order, so on a channels_last activation the same numbers fall on other elements: the masks have
the same distribution, not the same elements, as the untransformed model's.

torch.compile: the inputs are converted by a forward of the root's own (see
``_rewrite.RootForward``), which dynamo traces into the model's one graph.
"""

from __future__ import annotations

__all__ = ['ChannelsLast', 'apply_channels_last']

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import _rewrite
from .._tree import tree_map
from ..select import SelectionError, require_module
from ..step import Candidate, Context, Step, Targets, applied_steps

CHANNELS_LAST = torch.channels_last


def _image_like(t: torch.Tensor) -> bool:
    """A tensor channels_last applies to: 4-D, floating (and, for parameters, initialised)."""
    return not isinstance(t, nn.parameter.UninitializedTensorMixin) and t.dim() == 4 and t.is_floating_point()


def _to_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=CHANNELS_LAST) if _image_like(t) else t


class _ChannelsLastInputs(_rewrite.RootForward):
    """The root's forward: 4-D floating inputs (images, anywhere in the arguments) to
    channels_last; others untouched."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_to_channels_last, (args, kwargs))
        return self.inner(*args, **kwargs)


def _strided(stride: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function copying a tensor into one of the same shape with ``stride``."""
    return lambda t: torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


@dataclasses.dataclass
class Relaid:
    """Undo entry: the shape and strides of each converted parameter and buffer, by name."""

    layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def undo(self, model: nn.Module) -> str | None:
        """Lay each tensor out as before; a name that no longer leads to one of the same shape (the
        user replaced its module) is returned, and revert warns that it stays as it is."""
        gone = []
        for name, (shape, stride) in self.layouts.items():
            owner, _, attr = name.rpartition(".")
            try:
                module = model.get_submodule(owner)
            except AttributeError:
                gone.append(name)
                continue
            t = module._parameters.get(attr, module._buffers.get(attr))
            if t is None or tuple(t.shape) != shape:
                gone.append(name)
            else:
                _rewrite.set_data(t, _strided(stride))
        return ", ".join(gone) or None


@dataclasses.dataclass(frozen=True)
class ChannelsLast(Step):
    """Step: store 4-D floating parameters and buffers (conv weights) in ``torch.channels_last``
    memory format, in place, and convert the model's 4-D floating inputs to it.

    The Parameter objects stay the same (their ``.data``, and ``.grad`` if any, are converted),
    so an optimizer built before still holds them; names, ``state_dict`` keys and values do not
    change (``load_state_dict`` copies values into the channels_last tensors, whatever the
    layout saved). Inputs are converted by a forward of the root's own, which ``torch.compile``
    traces without a graph break. Outputs and gradients equal the untransformed model's up to
    rounding: see the module docstring. ``revert`` restores each tensor's previous strides and
    the root's forward. Applying it again changes nothing. A model without a 4-D floating
    parameter (no 2-D convolution) is an error. Tensors that share storage with another
    parameter or buffer are left alone (converting one would break the sharing); the record lists
    them in ``skipped``.

    Example::

        >>> sw.apply(model, sw.Plan([sw.channels_last(), sw.autocast(torch.bfloat16)]))
        >>> model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> print(model)   # Autocast[ChannelsLast[ResNet]](...)
    """

    name = "channels_last"
    order = 35  # after the activation steps (module swaps), before autocast

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the root (its input conversion) and the modules whose tensors are converted;
        payload: the tensor names to convert and whether to set the root's forward."""
        named = [*model.named_parameters(), *model.named_buffers()]
        ready = [(n, t) for n, t in named if not isinstance(t, nn.parameter.UninitializedTensorMixin)]
        lazy = [n for n, t in named if isinstance(t, nn.parameter.UninitializedTensorMixin)]
        if not any(_image_like(t) and isinstance(t, nn.Parameter) for _, t in ready):
            fix = ("Run one forward to initialise its lazy parameters first, or leave channels_last() out of the plan."
                   if lazy else "Leave channels_last() out of the plan.")
            raise SelectionError(
                f"shrinkwrap: channels_last() found no 4-D floating parameter (a convolution's weight) in "
                f"{type(model).__name__}: channels_last only changes the layout of convolutional models. {fix}"
            )
        hooked = any(isinstance(s, ChannelsLast) for s in applied_steps(model))
        storages = Counter(t.untyped_storage().data_ptr() for _, t in ready if t.numel())
        convert: list[str] = []
        skipped = [(n, "a lazy parameter not initialised yet: run one forward before channels_last()") for n in lazy]
        for name, t in ready:
            if not _image_like(t) or t.is_contiguous(memory_format=CHANNELS_LAST):
                continue  # not an image-like tensor, or already channels_last (1x1 kernels are both)
            if storages[t.untyped_storage().data_ptr()] > 1:
                skipped.append((name, "shares its storage with another parameter or buffer; converting it "
                                      "alone would break the sharing"))
            else:
                convert.append(name)
        if hooked and not convert:
            return Targets(payload=([], False))  # applied already, and nothing new since
        owners = list(dict.fromkeys(n.rpartition(".")[0] for n in convert))
        matched = ([] if hooked or "" in owners else [""]) + owners
        return Targets(matched, [] if hooked else skipped, (convert, not hooked))

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        convert, hook = targets.payload
        tensors = dict((*model.named_parameters(), *model.named_buffers()))
        before = Relaid({name: (tuple(tensors[name].shape), tuple(tensors[name].stride())) for name in convert})
        for name in convert:
            _rewrite.set_data(tensors[name], _to_channels_last)
        undo: list[Any] = [before] if convert else []
        if hook:
            undo.append(_rewrite.change_root(model, "ChannelsLast", _ChannelsLastInputs(model)))
        return undo

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """The step on any model with a convolution's weight. autoplan measures it with the other
        whole-model steps; it chooses by memory saved, so it leaves this one out where it saves none."""
        return cls.itself(model)


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Store ``model``'s conv weights in channels_last and convert its 4-D inputs, in place;
    return it. See :class:`ChannelsLast`; ``shrinkwrap.revert(model)`` restores the layouts.

    Example::

        >>> apply_channels_last(model)
        >>> model(torch.randn(8, 3, 32, 32)).shape   # same values, up to rounding
    """
    return ChannelsLast().apply(require_module(model, "apply_channels_last()"))
