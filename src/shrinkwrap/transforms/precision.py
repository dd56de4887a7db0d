"""Precision transforms: run the forward under autocast, or store the model in a half dtype.

Both are lossy (``Step.lossy``): outputs move away from the float32 model's by the rounding of the
half dtype. As a rule of thumb for a well-scaled network, bfloat16 (8 significant bits) gives a
relative error around 1e-2 on the output, float16 (11 bits) around 1e-3; the tests hold bfloat16
autocast to 2e-2 (``torch.linalg.norm(out - ref) / torch.linalg.norm(ref)``).

- :class:`Autocast` (``autocast(dtype, pattern=None)``) runs the whole model's forward, or that of
  the modules ``pattern`` selects, under ``torch.autocast`` for the device of its inputs: matmuls
  and convolutions compute in ``dtype`` and save their inputs for backward in ``dtype``, which
  roughly halves activation memory. Parameters stay float32. Floating outputs in ``dtype`` are cast
  back to float32 unless ``keep_output_dtype=True``, or unless the output carries its loss
  (Hugging Face with ``labels``): then only the loss is, and the logits stay in ``dtype``.
- :class:`Half` (``half(dtype, keep=...)``) casts parameters and buffers to ``dtype`` in place
  (the "brute force" ``model.half()``), except the modules ``keep`` selects (normalisation
  layers by default), which compute in float32 behind a ``KeepFloat`` wrapper (cast up to it
  where the model was loaded in a half dtype).

``autocast(d)`` and ``half(d)`` of the same dtype compose: parameters are stored in ``d``, and
autocast still runs the ops it keeps in float32 (softmax, losses, norms) in float32 and returns
float32 outputs. Steps naming different dtypes contradict each other and cannot share a plan.

float16 needs loss scaling: an ``Autocast`` step with float16 has ``needs_grad_scaler == True``;
the measuring harness uses ``torch.amp.GradScaler`` when a step of the plan says so.
"""

from __future__ import annotations

__all__ = ['Autocast', 'Half', 'AutocastModule', 'KeepFloatModule', 'apply_autocast', 'apply_half']

import dataclasses
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .. import _rewrite
from .._tree import tensors, tree_map
from .._wrapper import TransparentWrapper
from ..select import Pattern, require_module, select
from ..step import Candidate, Context, Step, Targets, applied_steps

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _map_floats(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every floating tensor in it."""
    return tree_map(lambda t: fn(t) if t.is_floating_point() else t, obj)


def _device(module: nn.Module) -> torch.device:
    t = next(itertools.chain(module.parameters(), module.buffers()), None)
    return t.device if t is not None else torch.device("cpu")


def _cast_to(dtype: torch.dtype, only: torch.dtype | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function casting a tensor to ``dtype`` (only tensors of dtype ``only``, if given)."""
    return lambda t: t if only is not None and t.dtype != only else t.to(dtype)


# -- autocast -----------------------------------------------------------------------------------
def _region(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> torch.autocast | None:
    """The autocast context for one call, on the device of the first floating input (of the
    module's parameters when there is none: token ids); None where an enclosing region, the
    user's or shrinkwrap's, already runs ``dtype`` there: no second region, no output cast."""
    first = next((t for t in tensors((args, kwargs)) if t.is_floating_point()), None)
    device = first.device.type if first is not None else _device(module).type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == dtype:
        return None
    return torch.autocast(device, dtype=dtype)


def _loss(out: Any) -> Any:
    """The loss an output carries (Hugging Face's ``.loss``, or a dict's ``"loss"``), or None."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _outputs(out: Any, dtype: torch.dtype, keep_output_dtype: bool) -> Any:
    """Floating outputs in ``dtype`` cast back to float32, unless ``keep_output_dtype``, and
    unless the output carries its loss: then training reads the loss, and a float32 copy of the
    logits beside it (batch x sequence x vocabulary floats) would be waste; only the loss is cast."""
    if keep_output_dtype:
        return out
    loss = _loss(out)
    if loss is not None:
        if loss.dtype != dtype:  # the usual case (losses run in float32 under autocast): nothing to cast
            return out
        return _map_floats(out, lambda t: t.to(torch.float32) if t is loss else t)
    return _map_floats(out, _cast_to(torch.float32, only=dtype))


def _autocast_call(fn: Callable, module: nn.Module, dtype: torch.dtype, keep_output_dtype: bool,
                   args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` in ``module``'s autocast region (see :func:`_region`)."""
    region = _region(dtype, module, args, kwargs)
    if region is None:
        return fn(*args, **kwargs)
    with region:
        out = fn(*args, **kwargs)
    return _outputs(out, dtype, keep_output_dtype)


class AutocastModule(TransparentWrapper):
    """Run ``module``'s forward under ``torch.autocast(dtype)``, changing no parameter name.

    Example::

        >>> model.encoder = AutocastModule(model.encoder, torch.bfloat16)   # or apply_autocast
        >>> print(model.encoder)   # Autocast[Encoder](...)
    """

    label = "Autocast"

    def __init__(self, module: nn.Module, dtype: torch.dtype, *, keep_output_dtype: bool = False) -> None:
        super().__init__(module)
        self._sw_dtype = dtype
        self._sw_keep_output_dtype = keep_output_dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _autocast_call(self.wrapped, self.wrapped, self._sw_dtype, self._sw_keep_output_dtype, args, kwargs)


class _AutocastForward(_rewrite.RootForward):
    """The root's forward under autocast: one ``with`` block around what ran before."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep_output_dtype: bool) -> None:
        super().__init__(module)
        self.dtype, self.keep_output_dtype = dtype, keep_output_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _autocast_call(self.inner, self.module, self.dtype, self.keep_output_dtype, args, kwargs)


def _undo_entries(model: nn.Module) -> Iterator[Any]:
    for rec in _rewrite.records(model):
        yield from rec.undo


def _refuse_conflicts(step: Step, model: nn.Module) -> None:
    for done in applied_steps(model):
        why = step.conflict(done) or done.conflict(step)
        if why:
            raise ValueError(
                f"shrinkwrap: cannot apply {step} to {type(model).__name__}, which already has {done}: "
                f"{why}. Call shrinkwrap.revert(model) first."
            )


def _check_model(step: Step, model: nn.Module, dtype: torch.dtype, *, autocast: bool) -> None:
    """Raise if ``step`` contradicts a step the model already has, or unless ``dtype`` (under
    autocast, or as a plain dtype) runs a matmul where the model is."""
    _refuse_conflicts(step, model)
    device = _device(model)
    if autocast and not torch.amp.is_autocast_available(device.type):
        raise ValueError(
            f"shrinkwrap: {step}: torch {torch.__version__} has no autocast for device {device.type!r}, "
            f"where {type(model).__name__}'s parameters are. Move the model to cuda or cpu, or use half()."
        )
    x = torch.ones(2, 2, device=device)
    try:
        if autocast:
            with torch.autocast(device.type, dtype=dtype):
                y = x @ x
        else:
            y = x.to(dtype) @ x.to(dtype)
        why = None if y.dtype == dtype else f"the test matmul ran in {y.dtype}"
    except RuntimeError as exc:
        why = str(exc).splitlines()[0]
    if why:
        other = HALF_DTYPES[1 - HALF_DTYPES.index(dtype)]
        raise ValueError(
            f"shrinkwrap: {step} cannot run on {device} with torch {torch.__version__} ({why}). "
            f"Use {other} there, or move the model to a device that runs {dtype}."
        )


def _check_dtype(step: Step, dtype: Any) -> None:
    if dtype not in HALF_DTYPES:
        raise ValueError(f"shrinkwrap: {step.name}() takes torch.float16 or torch.bfloat16, got {dtype!r}")


def _other_dtype(dtype: torch.dtype, other: Step) -> str | None:
    if isinstance(other, (Autocast, Half)) and other.dtype != dtype:
        return f"one computes in {dtype} and the other in {other.dtype}; use one dtype"
    return None


@dataclasses.dataclass(frozen=True)
class Autocast(Step):
    """Step: run the forward of the model (``pattern=None``) or of the modules ``pattern`` selects
    under ``torch.autocast(device, dtype)``, the device being that of the inputs.

    Parameters stay float32; floating outputs in ``dtype`` come back as float32 unless
    ``keep_output_dtype=True`` (then a module outside the region receives ``dtype`` tensors).
    float16 needs a ``torch.amp.GradScaler`` in training: ``needs_grad_scaler`` says so. Applying
    it again, or to modules inside a region it already covers, changes nothing; ``revert`` removes
    it. The root module gets forward hooks (it cannot be replaced); selected submodules an
    ``AutocastModule`` wrapper. Lossy: see the module docstring for the tolerance.

    Example::

        >>> sw.apply(model, sw.Plan([sw.autocast(torch.bfloat16)]))
        >>> print(model)   # Autocast[ResNet](...)
    """

    name = "autocast"
    lossy = True
    order = 40

    dtype: torch.dtype
    pattern: Pattern | None = None
    keep_output_dtype: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dtype(self, self.dtype)

    @property
    def needs_grad_scaler(self) -> bool:
        """True for float16, whose small gradients underflow without loss scaling."""
        return self.dtype == torch.float16

    def conflict(self, other: Step) -> str | None:
        return _other_dtype(self.dtype, other)

    def targets(self, model: nn.Module) -> Targets:
        """The names to wrap ("" for the root) and the names passed over, with why."""
        _check_model(self, model, self.dtype, autocast=True)
        at_root = any(isinstance(e, _rewrite.RootChange) and e.kind == "Autocast" for e in _undo_entries(model))
        if self.pattern is None:
            return Targets([], [("", "already autocast")]) if at_root else Targets([""])
        if at_root:
            return Targets([], [(name, "inside the autocast root") for name in select(model, self.pattern, outermost=True)])
        return Targets(*_rewrite.wrap_targets(model, self.pattern, AutocastModule, "autocast", "autocast"))

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        wrap = targets.matched
        # Never a region inside a region: a new one absorbs those inside it (the root: all).
        undo: list[Any] = _rewrite.unwrap_inside(model, wrap, AutocastModule)
        if wrap == [""]:
            undo.append(_rewrite.change_root(model, "Autocast", _AutocastForward(model, self.dtype, self.keep_output_dtype)))
        else:
            undo += _rewrite.replace(
                model, wrap,
                lambda n, m: AutocastModule(m, self.dtype, keep_output_dtype=self.keep_output_dtype),
            )
        return undo

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """bfloat16 autocast of the whole model, when lossy steps are allowed and the device runs it."""
        cuda = context.device.type == "cuda"
        if not context.allow_lossy or (cuda and not torch.cuda.is_bf16_supported()):
            return []
        return [Candidate((cls(torch.bfloat16),))]


def apply_autocast(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    pattern: Pattern | None = None,
    *,
    keep_output_dtype: bool = False,
) -> nn.Module:
    """Run ``model``'s forward (or that of the modules ``pattern`` selects) under autocast, in
    place; return ``model``. See :class:`Autocast`.

    Raises ``ValueError`` for a dtype other than float16/bfloat16 or one the model's device cannot
    run under autocast, ``SelectionError`` for a pattern that matches nothing.

    Example::

        >>> apply_autocast(model, torch.bfloat16)
        >>> model(x).dtype
        torch.float32
    """
    return Autocast(dtype, pattern, keep_output_dtype).apply(require_module(model, "apply_autocast()"))


# -- half ---------------------------------------------------------------------------------------
def is_norm(module: nn.Module, name: str = "") -> bool:
    """The default ``keep`` of :class:`Half`: BatchNorm, InstanceNorm, LayerNorm, GroupNorm,
    ``nn.RMSNorm`` and classes named ``*RMSNorm`` or ``*LayerNorm`` (Llama's, T5's)."""
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    return isinstance(module, norms) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _float_dtype(module: nn.Module) -> torch.dtype:
    t = next((t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()), None)
    return t.dtype if t is not None else torch.float32


class KeepFloatModule(TransparentWrapper):
    """Keep ``module`` in its own (float32) dtype inside a half model: floating inputs are cast up
    to its parameters' dtype, floating outputs back to ``dtype``.

    Example::

        >>> model.bn1 = KeepFloatModule(model.bn1, torch.float16)   # or apply_half(model)
        >>> print(model.bn1)   # KeepFloat[BatchNorm2d](64, eps=1e-05, ...)
    """

    label = "KeepFloat"

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self._sw_dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _map_floats((args, kwargs), _cast_to(_float_dtype(self.wrapped)))
        return _map_floats(self.wrapped(*args, **kwargs), _cast_to(self._sw_dtype))


class _CastInputs(_rewrite.RootForward):
    """The root's forward in a half model: floating inputs to ``dtype``; token ids untouched."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _map_floats((args, kwargs), _cast_to(self.dtype))
        return self.inner(*args, **kwargs)


def _set_dtype(t: torch.Tensor, dtype: torch.dtype) -> None:
    _rewrite.set_data(t, lambda x: x.to(dtype))


@dataclasses.dataclass
class Recast:
    """Undo entry: the dtypes parameters and buffers had before ``half``, by name."""

    parameters: dict[str, torch.dtype]
    buffers: dict[str, torch.dtype]

    def undo(self, model: nn.Module) -> None:
        for name, dtype in self.parameters.items():
            _set_dtype(model.get_parameter(name), dtype)
        for name, dtype in self.buffers.items():
            _set_dtype(model.get_buffer(name), dtype)


@dataclasses.dataclass(frozen=True)
class Half(Step):
    """Step: cast floating parameters and buffers to ``dtype`` in place, except inside the modules
    ``keep`` selects (None: :func:`is_norm`; ``()``: none), which stay in float32 (or the wider
    dtype they have) behind a :class:`KeepFloatModule`; in a model loaded in a half dtype they
    are cast up to float32. Floating inputs to the model are cast to ``dtype``; integer inputs
    (token ids) are left alone; outputs come out in ``dtype``.

    The Parameter objects stay the same (their ``.data`` is cast), so an optimizer built before
    still holds them; build it after, though, if it already has state. ``revert`` restores the
    original dtypes, but not the bits lost: values come back rounded through ``dtype``.
    Do not use ``torch.amp.GradScaler`` with float16 here: it refuses float16 gradients
    (``needs_grad_scaler`` is False). Applying it twice changes nothing the second time.

    Example::

        >>> sw.apply(model, sw.Plan([sw.half(torch.bfloat16)]))
        >>> model.conv1.weight.dtype, model.bn1.weight.dtype
        (torch.bfloat16, torch.float32)
    """

    name = "half"
    lossy = True
    needs_grad_scaler = False

    dtype: torch.dtype
    keep: Pattern | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dtype(self, self.dtype)

    def conflict(self, other: Step) -> str | None:
        if isinstance(other, Half) and other != self:
            return "a model is cast to a half dtype once; keep one half step"
        return _other_dtype(self.dtype, other)

    def targets(self, model: nn.Module) -> Targets:
        """The modules kept in their dtype; nothing if the model is already cast."""
        _check_model(self, model, self.dtype, autocast=False)
        pattern = is_norm if self.keep is None else self.keep
        kept = select(model, pattern, outermost=True, allow_empty=not self.keep)
        if any(isinstance(e, Recast) for e in _undo_entries(model)):
            return Targets()  # already cast (to this dtype: any other is a conflict)
        return Targets(kept, payload=kept)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        kept = targets.payload
        if kept is None:
            return []  # already cast
        stay = {
            id(t) for name in kept
            for t in itertools.chain(model.get_submodule(name).parameters(), model.get_submodule(name).buffers())
        }
        before = Recast({}, {})
        for named, dtypes in ((model.named_parameters(), before.parameters), (model.named_buffers(), before.buffers)):
            for name, t in named:
                # The kept modules compute in float32, also in a model that was loaded in a half dtype.
                want = (torch.float32 if t.dtype in HALF_DTYPES else t.dtype) if id(t) in stay else self.dtype
                if t.is_floating_point() and t.dtype != want:
                    dtypes[name] = t.dtype
                    _set_dtype(t, want)
        undo: list[Any] = [before]
        undo += _rewrite.replace(model, kept, lambda n, m: KeepFloatModule(m, self.dtype))
        undo.append(_rewrite.change_root(model, "Half", _CastInputs(model, self.dtype)))
        return undo


def apply_half(model: nn.Module, dtype: torch.dtype = torch.float16, *, keep: Pattern | None = None) -> nn.Module:
    """Cast ``model`` to ``dtype`` in place, normalisation layers (or ``keep``) excepted; return it.
    See :class:`Half`; ``shrinkwrap.revert(model)`` restores the dtypes (values stay rounded).

    Example::

        >>> apply_half(model, torch.bfloat16)
        >>> model(torch.randn(8, 3, 32, 32)).dtype   # float32 input cast on the way in
        torch.bfloat16
    """
    return Half(dtype, keep).apply(require_module(model, "apply_half()"))
