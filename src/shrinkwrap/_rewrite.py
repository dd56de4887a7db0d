"""How one module is changed, recorded, and changed back: the one tree rewriter of shrinkwrap.

Every transform goes through :func:`replace` (swap the modules at some dotted names) and
:func:`record` (write what it did on the model). The records live on the root module as a plain
list attribute, so they travel with ``copy.deepcopy``, pickling and ``torch.save(model)``, and they
hold what :func:`revert` needs to restore the original objects.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .select import Pattern, SelectionError, count, require_module, select

_RECORDS = "_shrinkwrap_records"


@dataclass
class Replaced:
    """The module at ``name`` was replaced by ``new``; ``original`` is what stood there before."""

    name: str
    original: nn.Module
    new: nn.Module

    def undo(self, model: nn.Module) -> str | None:
        """Put ``original`` back, unless the slot no longer holds ``new``: then the user replaced
        it after the transform, and their module stays. Returns the name in that case."""
        try:
            current = get_module(model, self.name)
        except AttributeError:  # the user removed the module, or its parent
            return self.name
        if current is not self.new:
            return self.name
        set_module(model, self.name, self.original)
        return None


@dataclass
class Record:
    """What one step did to a model: the step, the names it acted on, the names it passed over
    (with the reason), how to undo it, and notes on anything else it changed.

    ``step`` is the step object; a model pickled with a step that cannot be pickled (a lambda
    pattern) keeps the step's text there instead.
    """

    step: Any
    matched: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    undo: list = field(default_factory=list)
    notes: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        try:
            pickle.dumps(self.step)
        except Exception:  # noqa: BLE001 - pickle raises many types (PicklingError, AttributeError)
            state["step"] = str(self.step)
        return state

    def __deepcopy__(self, memo: dict) -> "Record":
        # A deep copy keeps the step object, lambda patterns and all (only pickling drops them).
        new = Record.__new__(Record)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) if k != "step" else v for k, v in self.__dict__.items()})
        return new


@dataclass
class Hooked:
    """Undo entry: a hook shrinkwrap put on a module."""

    handle: RemovableHandle

    def undo(self, model: nn.Module) -> None:
        self.handle.remove()


class Label:
    """Stands in for the root's ``_get_name`` so ``print(model)`` shows ``Autocast[ResNet]``; a
    plain object so the model still pickles."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self) -> str:
        return self.text


class RootForward:
    """Base of the ``forward`` a step sets on the root instance (the root cannot be replaced in
    place): :meth:`inner` runs what ran before it. A forward wrapper, not hooks, because
    torch.compile traces through it into one graph, and hooks on the compiled root break it.
    A plain object (not a closure), so the model still deep-copies and pickles."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.previous = module.__dict__.get("forward")  # another step's, or accelerate's, or None

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # The forward's own parameters: libraries read them (the Hugging Face Trainer keeps only
        # the batch columns that model.forward names).
        previous = self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)
        return inspect.signature(previous)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class RootChange:
    """Undo entry: the ``forward`` a step set on the root, and the label ``print(model)`` shows;
    ``label`` and ``forward`` hold what the instance had before (None: the class's own)."""

    kind: str
    label: Any = None
    forward: Any = None

    def undo(self, model: nn.Module) -> None:
        for attr, before in (("_get_name", self.label), ("forward", self.forward)):
            if before is None:
                model.__dict__.pop(attr, None)
            else:
                model.__dict__[attr] = before


def change_root(model: nn.Module, kind: str, forward: RootForward) -> RootChange:
    """Set ``forward`` on the root and relabel it ``kind[Name]``; return the undo entry."""
    entry = RootChange(kind, model.__dict__.get("_get_name"), model.__dict__.get("forward"))
    model.__dict__["forward"] = forward
    model.__dict__["_get_name"] = Label(f"{kind}[{model._get_name()}]")
    return entry


def set_data(t: torch.Tensor, to: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace a parameter's or buffer's values by ``to(values)``, and its gradient's, in place.

    Through ``.data``, so the Parameter or buffer stays the same object: an optimizer built
    before still holds it, and undoing is the same call with the inverse ``to``.
    """
    t.data = to(t.data)
    if t.grad is not None:
        t.grad = to(t.grad)


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def set_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at dotted ``name`` and return what stood there."""
    if not name:
        raise ValueError("shrinkwrap: the root module cannot be replaced in place")
    parent_name, _, attr = name.rpartition(".")
    parent = get_module(model, parent_name)
    old = parent._modules[attr]
    parent._modules[attr] = new  # same slot, same order; bypasses attribute forwarding
    return old


def replace(
    model: nn.Module, names: Iterable[str], make: Callable[[str, nn.Module], nn.Module]
) -> list[Replaced]:
    """Replace the module at each name by ``make(name, module)``; return the undo entries."""
    done = []
    for name in names:
        old = get_module(model, name)
        new = make(name, old)
        if new is not old:
            set_module(model, name, new)
            done.append(Replaced(name, old, new))
    return done


def wrap_targets(
    model: nn.Module, pattern: Pattern, wrapper: type, verb: str, done: str
) -> tuple[list[str], list[tuple[str, str]]]:
    """The outermost modules ``pattern`` selects that a ``wrapper`` region should wrap, and those
    passed over with the reason: already wrapped, or inside a region (never a region in a region).

    ``verb``/``done`` word the messages ("checkpoint"/"checkpointed"). A module with no forward
    of its own (``ModuleList``) is an error naming it and the fix.
    """
    regions = [n for n, m in model.named_modules() if isinstance(m, wrapper)]
    wrap, skipped = [], []
    for name in select(model, pattern, outermost=True):
        module = model.get_submodule(name)
        enclosing = next((r for r in regions if name.startswith(r + ".")), None)
        if isinstance(module, wrapper):
            skipped.append((name, f"already {done}"))
        elif enclosing is not None:
            skipped.append((name, f"inside {done} {enclosing!r}"))
        elif type(module).forward is nn.Module.forward:
            raise SelectionError(
                f"shrinkwrap: cannot {verb} {name!r} ({type(module).__name__}): it has no "
                f"forward of its own. Select the modules inside it, e.g. r'{name}\\.\\d+'."
            )
        else:
            wrap.append(name)
    return wrap, skipped


def unwrap_inside(model: nn.Module, names: list[str], wrapper: type) -> list[Replaced]:
    """Unwrap the ``wrapper`` regions inside (or, for the root ``""``, anywhere in) the modules
    at ``names``, before those are wrapped: a new region absorbs the ones inside it."""
    inner = [n for n, m in model.named_modules()
             if isinstance(m, wrapper) and any(w == "" or n.startswith(w + ".") for w in names)]
    return replace(model, inner, lambda n, m: m.wrapped)


def sharded(model: nn.Module) -> list[str]:
    """The names of the modules in ``model`` that FSDP2's ``fully_shard`` manages (``""``: the root).

    Reads ``sys.modules`` only: where ``torch.distributed.fsdp`` was never imported, nothing was
    sharded, and nothing is imported here.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    owner = getattr(fsdp, "FSDPModule", None)
    if owner is None:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, owner)]


def refuse_sharded(model: nn.Module, doing: str, why_and_fix: str) -> None:
    """Raise if ``fully_shard`` manages a module of ``model`` (shrinkwrap's rewrites go before it),
    with a message saying what ``doing`` would break and what to do instead."""
    names = sharded(model)
    if names:
        shown = ", ".join(repr(n) if n else "the root" for n in names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(f"shrinkwrap: cannot {doing} {type(model).__name__}: FSDP2's fully_shard already "
                         f"manages {shown}. {why_and_fix}")


def records(model: nn.Module) -> list[Record]:
    """What shrinkwrap has applied to ``model``, oldest first (an empty list if nothing).

    Example::

        >>> sw.records(sw.apply(model, "checkpoint('layer1')"))[0].matched
        ('layer1',)
    """
    return require_module(model, "records()").__dict__.get(_RECORDS, [])


def record(model: nn.Module, rec: Record) -> Record:
    if _RECORDS not in model.__dict__:
        object.__setattr__(model, _RECORDS, [])
    model.__dict__[_RECORDS].append(rec)
    return rec


def revert(model: nn.Module, keep: int = 0) -> nn.Module:
    """Undo what shrinkwrap applied to ``model``, newest first, down to the first ``keep`` records.

    The original module objects are put back where they stood, so references taken before the
    transform (an optimizer's parameters, hooks) stay valid. A module that was replaced again after
    shrinkwrap replaced it (``model.set_swish(False)``, say) is the user's: it stays, and a warning
    names it. Returns ``model``.

    Example::

        >>> sw.apply(model, sw.Plan([sw.checkpoint("layer1")]))
        >>> sw.revert(model)   # model.layer1 is the original Sequential again
    """
    recs = records(require_module(model, "revert()"))
    count(keep, "revert()", "keep", least=0)
    if len(recs) > keep:
        # fully_shard hooked the wrappers it was given: without them, those modules would run
        # their forward on sharded parameters (an error in the first forward).
        refuse_sharded(model, "revert", "shrinkwrap's wrappers hold FSDP's hooks for the modules they wrap; "
                       "without them those modules would run on sharded parameters. Revert before sharding, "
                       "or build the model again.")
    kept: list[str] = []
    while len(recs) > keep:
        rec = recs.pop()
        for entry in reversed(rec.undo):
            name = entry.undo(model)
            if name is not None:
                kept.append(name)
    if kept:
        warnings.warn(
            f"shrinkwrap: revert kept {len(kept)} module(s) replaced after shrinkwrap changed them, "
            f"as they are: {', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''}. "
            "shrinkwrap's originals for them were dropped.",
            stacklevel=2,
        )
    return model
