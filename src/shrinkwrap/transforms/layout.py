"""Memory-layout transforms for convolutional models: ``channels_last`` and ``space_to_depth``.

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

:class:`SpaceToDepth` (``space_to_depth()``) computes an image model's stem convolution (stride 2,
a few input channels: resnet's 7x7 over RGB) as the same sums over the input's 2x2 space-to-depth
rearrangement: a stride-1 convolution over 4x the channels with a kernel half the size
(:class:`SpaceToDepthConv`). cuDNN runs a 3-channel convolution far from the tensor cores' speed;
the rearranged one, its channels zero-padded to a multiple of 8, runs faster in channels_last
(benchmarks/RESULTS.md, Per model: resnet18's s2d rows). It pays most where the convolution runs
twice, under a ``checkpoint('conv1')`` region. Exact, not bit for bit (the sums are added in another order);
it saves no memory. The rearranged input takes the layout torch's convolution would give its
output: contiguous (NCHW) for a contiguous input and weight, where the form is slower than the
plain convolution, so use it with ``channels_last()``.
"""

from __future__ import annotations

__all__ = ['ChannelsLast', 'SpaceToDepth', 'SpaceToDepthConv', 'apply_channels_last', 'apply_space_to_depth']

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _compat
from .. import _rewrite
from .._tree import tree_map
from .._wrapper import TransparentWrapper, has_hooks
from ..select import Pattern, SelectionError, require_module, select
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


class SpaceToDepthConv(TransparentWrapper):
    """A 2-D convolution of stride s computed as a stride-1 convolution over the input's s x s
    space-to-depth rearrangement (channels ``C*s*s``, zero-padded to a multiple of 8), with the
    kernel zero-padded to a multiple of s and rearranged alike. The same sums in another order.

    Wraps the convolution (names, ``state_dict`` and the weight object unchanged). The rearranged
    input is channels_last where the input or the weight is (cuDNN's tensor-core kernels read
    NHWC), as torch's convolution lays out its output; contiguous otherwise. An unbatched (3-D) input, or one with other than the convolution's input channels,
    runs the convolution itself.

    Example::

        >>> model.conv1 = SpaceToDepthConv(model.conv1)   # or apply_space_to_depth(model)
    """

    label = "SpaceToDepthConv"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.wrapped
        if x.dim() != 4 or x.shape[1] != conv.in_channels or has_hooks(conv):
            # Unbatched, or a wrong input: the convolution's own result or error. Hooked (after the
            # plan): the convolution itself, whose call runs them.
            return conv(x)
        s = conv.stride[0]
        (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
        kh2, kw2 = -(-kh // s) * s, -(-kw // s) * s
        oh, ow = (x.shape[2] + 2 * ph - kh) // s + 1, (x.shape[3] + 2 * pw - kw) // s + 1
        lh, lw = s * (oh - 1) + kh2, s * (ow - 1) + kw2  # the padded input's extent the kernels read
        # The layout torch's convolution gives its output: channels_last where the input's or the
        # weight's strides are (a 1-channel tensor is contiguous both ways: its strides decide).
        channels_last = CHANNELS_LAST in (_compat.suggest_memory_format(x), _compat.suggest_memory_format(conv.weight))
        # A negative pad crops: rows past the last window that the convolution never reads.
        x = F.pad(x, (pw, lw - x.shape[3] - pw, ph, lh - x.shape[2] - ph))
        w = F.pad(conv.weight, (0, kw2 - kw, 0, kh2 - kh))
        return F.conv2d(_space_to_depth(x, s, channels_last), _space_to_depth(w, s, channels_last), conv.bias)


def _space_to_depth(t: torch.Tensor, s: int, channels_last: bool) -> torch.Tensor:
    """``t`` (N, C, H, W; H and W multiples of ``s``) as (N, C*s*s, H/s, W/s), the s x s blocks'
    pixels as channels, zero channels added up to a multiple of 8 (tensor-core kernels take
    channels by eights). The input and the weight alike: the same channel order in both."""
    n, c, h, w = t.shape
    t = t.reshape(n, c, h // s, s, w // s, s).permute(0, 1, 3, 5, 2, 4).reshape(n, c * s * s, h // s, w // s)
    extra = -(c * s * s) % 8
    t = F.pad(t, (0, 0, 0, 0, 0, extra)) if extra else t
    return t.contiguous(memory_format=CHANNELS_LAST) if channels_last else t


def _stem_conv(module: nn.Module, name: str) -> bool:
    """The default selection: a stride-2 ``nn.Conv2d`` over at most 4 input channels (an image stem)."""
    return isinstance(module, nn.Conv2d) and tuple(module.stride) == (2, 2) and module.in_channels <= 4


def _space_to_depth_form(module: nn.Module) -> str:
    """Why ``module`` cannot be computed in the space-to-depth form ("" if it can)."""
    kind = type(module)
    if not isinstance(module, nn.Conv2d) or kind.forward is not nn.Conv2d.forward \
            or kind._conv_forward is not nn.Conv2d._conv_forward:
        # A subclass that changes the weight in its forward (weight standardisation, fake
        # quantisation) would compute something else from the raw weight.
        return f"is {kind.__module__}.{kind.__qualname__}, not an nn.Conv2d computing as torch's does"
    if has_hooks(module):
        return "has hooks, which the wrapper would not run"
    s = tuple(module.stride)
    if s[0] != s[1] or s[0] < 2:
        return f"has stride {s}: the form is for a square stride of 2 or more"
    if module.groups != 1 or tuple(module.dilation) != (1, 1):
        return f"has groups={module.groups}, dilation={tuple(module.dilation)}: the form is for groups=1, dilation=1"
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return f"has padding={module.padding!r}, padding_mode={module.padding_mode!r}: the form is for numeric zero padding"
    return ""


@dataclasses.dataclass(frozen=True)
class SpaceToDepth(Step):
    """Step: compute stem convolutions as stride-1 convolutions over the input's space-to-depth
    rearrangement (:class:`SpaceToDepthConv`): the same sums, faster on tensor cores.

    Args:
        pattern: which modules (see :func:`shrinkwrap.select`); default: every ``nn.Conv2d`` of
            stride 2 over at most 4 input channels (resnet's ``conv1``, efficientnet's first
            convolution). A selected module that is no plain ``nn.Conv2d`` with a square stride
            of 2 or more, ``groups=1``, ``dilation=1`` and numeric zero padding is passed over,
            with the reason, in ``shrinkwrap.records(model)``; where none is left to rewrite, the
            step raises ``SelectionError`` naming them.

    Exact, not bit for bit (float64 to ``rtol=1e-12`` in the tests); saves no memory. Put it
    before ``checkpoint(...)`` in a plan: a region over the convolution then recomputes the fast
    form (a convolution already wrapped by a region is passed over, as above). Pays with ``channels_last()``
    (see the module docstring). Not an autoplan candidate of its own (its first stage measures
    each whole-model step alone, where this one runs contiguous and slower); autoplan's compile
    stage puts it in its budgeted form where that recomputes a stem convolution in channels_last.

    Example::

        >>> sw.apply(resnet, "space_to_depth(), checkpoint('conv1'), channels_last(), "
        ...                  "autocast(torch.bfloat16), compile(mode='reduce-overhead', memory_budget=0.6)")
    """

    name = "space_to_depth"
    order = 5  # before checkpoint: a region over the stem wraps the fast form

    pattern: Pattern | None = None

    def targets(self, model: nn.Module) -> Targets:
        explicit = self.pattern is not None
        names = select(model, self.pattern if explicit else _stem_conv, outermost=True, allow_empty=not explicit)
        wrap, done, skipped = [], [], []
        for name in names:
            module = model.get_submodule(name)
            if isinstance(module, SpaceToDepthConv):
                done.append(name)
            elif isinstance(module, TransparentWrapper):
                skipped.append((name, f"is wrapped already ({module._get_name()}): put space_to_depth() "
                                      "before the step that wrapped it in the plan"))
            else:
                why = _space_to_depth_form(module)
                (skipped.append((name, why)) if why else wrap.append(name))
        if not (wrap or done):
            detail = "; ".join(f"{n} {w}" for n, w in skipped[:3]) or \
                "no nn.Conv2d of stride 2 over at most 4 input channels"
            raise SelectionError(
                f"shrinkwrap: space_to_depth() found no convolution to rewrite in {type(model).__name__} "
                f"({detail}). Leave space_to_depth() out of the plan, or name the convolutions with pattern=...")
        return Targets([*done, *wrap], skipped, wrap)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        return _rewrite.replace(model, targets.payload, lambda n, m: SpaceToDepthConv(m))


def apply_space_to_depth(model: nn.Module, pattern: Pattern | None = None) -> nn.Module:
    """Compute ``model``'s stem convolutions in the space-to-depth form, in place; return it. See
    :class:`SpaceToDepth`; ``shrinkwrap.revert(model)`` puts the convolutions back.

    Example::

        >>> apply_space_to_depth(torchvision.models.resnet18())   # model.conv1 is a SpaceToDepthConv
    """
    return SpaceToDepth(pattern).apply(require_module(model, "apply_space_to_depth()"))
