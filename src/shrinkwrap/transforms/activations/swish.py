"""The ``swish`` step: hand-written Swish becomes :class:`MemoryEfficientSwish`; hand-written Mish,
Hard-Swish and tanh-GELU become ``nn.Mish`` / ``nn.Hardswish`` / ``nn.GELU(approximate="tanh")``,
which already keep only their input."""

from __future__ import annotations

import dataclasses

import regex
import torch.nn as nn

from ... import _rewrite
from ...select import CONTAINERS, Pattern, SelectionError, require_module, select
from ...step import Targets
from .base import _WholeModelStep
from .efficient_swish import MemoryEfficientSwish
from .recognise import _KINDS, _ONE_OP, _activation_kind, _native_kind, _probe_dtype_device

# Only used to *report* stateful modules we will not run; replacement never depends on names.
_LOOKS_LIKE = regex.compile(r"swish|silu|mish", regex.IGNORECASE)
_REPLACED = "_sw_replacement"  # set on modules this transform put in place, so reapplying sees them


@dataclasses.dataclass(frozen=True)
class Swish(_WholeModelStep):
    """Step: replace hand-written Swish, Mish, Hard-Swish and tanh-GELU modules by memory-efficient ones.

    Args:
        pattern: which modules to look at (see :func:`shrinkwrap.select`); default: all of them.
        include_silu: also swap ``nn.SiLU`` (not in place) for :class:`MemoryEfficientSwish`. It
            saves no memory (``nn.SiLU`` keeps only its input already); it makes every Swish the
            same module.

    What is replaced, and what looks like Swish but is left alone (with why), is in
    ``shrinkwrap.records(model)``.

    Example::

        >>> sw.apply(model, sw.Plan([sw.swish()]))
    """

    name = "swish"
    order = 20
    recomputes = True

    include_silu: bool = False

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the modules to replace and those already replaced; payload: name -> kind."""
        explicit = self.pattern is not None
        names = select(model, self.pattern if explicit else (lambda m, n: True), allow_empty=not explicit)
        dtype, device = _probe_dtype_device(model)
        replace: dict[str, str] = {}
        done: list[str] = []
        skipped: list[tuple[str, str]] = []
        for name in names:
            if any(name.startswith(p + ".") for p in (*replace, *done)):
                continue  # inside a module already chosen
            module = model.get_submodule(name)
            if isinstance(module, MemoryEfficientSwish) or module.__dict__.get(_REPLACED):
                done.append(name)
                continue
            native = _native_kind(module)
            if native == "swish" and self.include_silu and not module.inplace:
                replace[name] = "swish"
            elif native == "swish" and self.include_silu:
                # Same memory either way (in-place SiLU saves a copy of its input), but the code
                # around an in-place module may read its input after the call.
                skipped.append((name, "in-place nn.SiLU: the code around it may rely on its input being overwritten"))
            elif native is not None:
                hint = " (pass include_silu=True to swap it anyway)" if native == "swish" else ""
                skipped.append((name, f"native {type(module).__name__} already saves only its input{hint}"))
            else:
                kind, why = _activation_kind(module, dtype, device)
                if why == _ONE_OP:
                    continue
                if kind is not None and not why:
                    replace[name] = kind
                elif kind is not None or explicit or (
                    _LOOKS_LIKE.search(type(module).__name__) and not isinstance(module, CONTAINERS)
                ):
                    skipped.append((name, why))
        if not (replace or done or skipped):
            raise SelectionError(
                f"shrinkwrap: swish() found no Swish, Mish, Hard-Swish or tanh-GELU in {type(model).__name__}: "
                "no stateless module computes x * sigmoid(x), x * tanh(softplus(x)), x * relu6(x + 3) / 6 or "
                "0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))). Leave swish() out of the plan, "
                "or name the modules with pattern=..."
            )
        return Targets([*done, *replace], skipped, replace)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        kinds = targets.payload

        def make(name: str, old: nn.Module) -> nn.Module:
            new = _KINDS[kinds[name]][1]()
            new.train(old.training)
            object.__setattr__(new, _REPLACED, True)
            return new

        return _rewrite.replace(model, list(kinds), make)


def apply_swish(model: nn.Module, pattern: Pattern | None = None, *, include_silu: bool = False) -> nn.Module:
    """Replace hand-written Swish, Mish, Hard-Swish and tanh-GELU modules of ``model`` in place;
    return it.

    A module is replaced when it has no parameters, buffers or hooks, and on probe inputs of the
    model's dtype (float32 for a half-precision model) and device returns what ``F.silu`` (``F.mish``, ``F.hardswish``, ``F.gelu(x,
    approximate="tanh")``) returns, with the same gradient, without modifying its input or itself.
    Swish becomes :class:`MemoryEfficientSwish`; Mish, Hard-Swish and tanh-GELU (Hugging Face's
    ``NewGELUActivation``, GPT-2's ``gelu_new``) become ``nn.Mish`` / ``nn.Hardswish`` /
    ``nn.GELU(approximate="tanh")``, which keep only their input. Applying it again changes nothing; ``shrinkwrap.revert(model)``
    puts the original modules back. Raises ``SelectionError`` if ``model`` has no Swish-like
    module at all (unless ``pattern`` names the modules to look at).

    Example::

        >>> apply_swish(efficientnet)               # every x * sigmoid(x) module
        >>> sw.records(efficientnet)[-1].skipped    # what looked like Swish but was left alone
    """
    return Swish(pattern, include_silu=include_silu).apply(require_module(model, "apply_swish()"))
