"""The template every transform's plan step follows, and the registry that names the steps.

A step is a small frozen dataclass. It says which modules it targets (:meth:`Step.targets`,
which raises before anything changes) and how to rewrite them (:meth:`Step.rewrite`, which
returns the undo entries); :meth:`Step.apply` — written once, here — checks, rewrites and
records. A step also says how autoplan may use it: :meth:`Step.candidates` (what to try on a
model), ``lossy`` (changes the numbers) and ``order`` (where it sits in a plan autoplan builds).

Defining a subclass with a ``name`` registers it: ``Plan.parse`` reads it, autoplan asks it for
candidates. A new transform is one file under ``transforms/`` plus its export line.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

import torch
import torch.nn as nn

from . import _rewrite
from .select import check_pattern, lies_inside, require_module, wrong

_STEPS: dict[str, type["Step"]] = {}


@dataclasses.dataclass
class Targets:
    """What a step will do to a model, found before anything changes.

    ``matched``: the names it acts on (and those it already acted on); ``skipped``: names passed
    over, with the reason; ``payload``: whatever else its :meth:`Step.rewrite` needs (a kind per
    name, say); ``notes``: anything else a user should read in the record.
    """

    matched: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    payload: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One thing autoplan may add: ``steps``, the modules they cover (two candidates that share a
    module exclude each other), and ``lossy`` (changes the numbers)."""

    steps: tuple["Step", ...]
    covers: tuple[str, ...] = ()

    @property
    def lossy(self) -> bool:
        return any(s.lossy for s in self.steps)

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.steps)

    def overlaps(self, other: "Candidate") -> bool:
        """Whether the two cannot both be taken: they cover a module in common, or their steps
        cannot share a plan (:meth:`Step.conflict`)."""
        return any(lies_inside(a, b) or lies_inside(b, a) for a in self.covers for b in other.covers) or any(
            a.conflict(b) or b.conflict(a) for a in self.steps for b in other.steps)


@dataclasses.dataclass(frozen=True)
class Context:
    """What autoplan tells a step when it asks for candidates."""

    allow_lossy: bool = False
    device: torch.device = torch.device("cpu")
    max_groups: int = 4
    budget: bool = False  # a memory budget was given: steps that cut the whole bill are worth their time
    optimizer: Any = None  # the caller's optimizer factory, or None for AdamW


@dataclasses.dataclass(frozen=True)
class Step:
    """Base class of plan steps. Subclasses are frozen dataclasses that set ``name`` and
    implement :meth:`targets` and :meth:`rewrite`.

    Class attributes: ``lossy`` marks steps that change the numbers (precision); ``order`` is
    where autoplan puts the step in a plan (lower first); ``last`` marks a step that goes last
    (compile): a plan with a step after it is refused, and so is any other step on a model that
    already has it; ``recomputes`` marks steps that save memory by recomputing in backward what
    autograd would keep (checkpoint, swish, bn_act, swiglu): under ``compile(memory_budget=...)``
    the compiler's partitioner chooses that recompute itself, so autoplan tries the plan without
    them there.

    Example (a complete step)::

        @dataclasses.dataclass(frozen=True)
        class Tanhify(Step):
            name = "tanhify"
            def targets(self, model):
                return Targets(select(model, nn.Sigmoid))
            def rewrite(self, model, targets):
                return _rewrite.replace(model, targets.matched, lambda n, m: nn.Tanh())
    """

    name: ClassVar[str] = ""
    lossy: ClassVar[bool] = False
    order: ClassVar[int] = 50
    last: ClassVar[bool] = False
    recomputes: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name"):
            _STEPS[cls.name] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> "Step":
        # The call is checked against the fields before the dataclass's __init__ sees it, so that a
        # misspelt or missing argument is a shrinkwrap error in Python as in a plan's text.
        try:
            inspect.signature(cls).bind(*args, **kwargs)
        except TypeError as exc:
            call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            takes = ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name}={literal(f.default)}"
                              for f in dataclasses.fields(cls))
            raise TypeError(f"shrinkwrap: {cls.name}({call}): {exc}; {cls.name}() takes ({takes})") from None
        return super().__new__(cls)

    def __reduce__(self) -> tuple:
        # Copies and pickles are made through the constructor, as the user made the step.
        return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __post_init__(self) -> None:
        # A list pattern becomes a tuple: steps are frozen and hashable.
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        for f in dataclasses.fields(self):
            what = _KINDS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            value = getattr(self, f.name)
            if what is not None and not what[1](value):
                raise TypeError(wrong(f"{self.name}()", f"{f.name}= {what[0]}", value))
            if f.type in ("Pattern", "Pattern | None") and (value is not None or f.default is dataclasses.MISSING):
                check_pattern(value)  # an invalid regex or a pattern of the wrong type, where the step is written

    # -- what a step implements ----------------------------------------------------------------
    def targets(self, model: nn.Module) -> Targets:  # pragma: no cover - abstract
        """What this step would do to ``model``; raise, naming the module and the fix, if it cannot."""
        raise NotImplementedError

    def rewrite(self, model: nn.Module, targets: Targets) -> list:  # pragma: no cover - abstract
        """Change ``model`` as ``targets`` says; return the undo entries."""
        raise NotImplementedError

    def conflict(self, other: "Step") -> str | None:
        """Why this step cannot share a plan with ``other`` (None if it can)."""
        return None

    def under_budget(self, model: nn.Module) -> "Step | None":
        """What of this step a plan keeps where ``compile(memory_budget=...)`` lets the compiler's
        partitioner choose the recompute (autoplan's budgeted form): this step, unless it
        ``recomputes``; then nothing, the partitioner's choice standing for it."""
        return None if self.recomputes else self

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """What autoplan may try of this step on ``model`` (nothing by default)."""
        return []

    @classmethod
    def itself(cls, model: nn.Module) -> list[Candidate]:
        """The step with its defaults as autoplan's one candidate, where it has something to do on
        ``model``: what a step over the whole model returns from :meth:`candidates`."""
        step = cls()
        return [Candidate((step,))] if step.applies(model) else []

    @classmethod
    def merge(cls, steps: list["Step"], model: nn.Module) -> list["Step"]:
        """Steps of this class that autoplan chose together, written as few as read well (as they
        are by default)."""
        return steps

    # -- the template ----------------------------------------------------------------------------
    def check(self, model: nn.Module) -> None:
        """Raise, naming the module and the fix, if this step cannot be applied to ``model``."""
        self.targets(self._applicable(require_module(model, f"{self.name}().check()")))

    def applies(self, model: nn.Module) -> bool:
        """Whether the step has something to do on ``model`` (its check passes)."""
        try:
            self.check(model)
        except (ValueError, TypeError):  # SelectionError is a ValueError: nothing to do, or unsafe
            return False
        return True

    def apply(self, model: nn.Module) -> nn.Module:
        """Check, rewrite and record; return ``model``. A step that finds nothing at all (nothing
        to act on, nothing passed over) and changes nothing leaves no record."""
        targets = self.targets(self._applicable(require_module(model, f"{self.name}().apply()")))
        undo = self.rewrite(model, targets)
        if undo or targets.matched or targets.skipped or targets.notes:
            _rewrite.record(model, _rewrite.Record(
                self, tuple(targets.matched), tuple(targets.skipped), undo, tuple(targets.notes)))
        return model

    def _applicable(self, model: nn.Module) -> nn.Module:
        """``model``, unless it already has another step that goes last (``last``), or FSDP2's
        ``fully_shard`` already manages a module of it: then raise."""
        # A wrapper around a sharded module hides it from FSDP2, whose root finds the modules it
        # manages by walking the tree: each hidden one becomes a root of its own and keeps its
        # parameters unsharded after forward. Right numbers, no error, and sharding's saving gone.
        _rewrite.refuse_sharded(
            model, f"apply {self} to",
            "A wrapper put around a sharded module hides it from FSDP, which then keeps that module's "
            "parameters unsharded after forward: the losses stay right and sharding's memory saving is "
            "gone. Apply the plan first, then shard: shrinkwrap.apply(model, plan), then fully_shard "
            "each block and the root.")
        for done in applied_steps(model):
            if done.last and done != self:
                raise ValueError(
                    f"shrinkwrap: cannot apply {self} to {type(model).__name__}, which already has {done}: "
                    f"{done.name} goes last. Call shrinkwrap.revert(model) first, then apply one plan "
                    f"that ends with {done}."
                )
        return model

    def __str__(self) -> str:
        fields = dataclasses.fields(self)
        parts = []
        for i, f in enumerate(fields):
            value = getattr(self, f.name)
            if i == 0 and f.default is dataclasses.MISSING:
                parts.append(literal(value))
            elif value != f.default:
                parts.append(f"{f.name}={literal(value)}")
        return f"{self.name}({', '.join(parts)})"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The field annotations a step's arguments are checked against (the text of the annotation, as
# `from __future__ import annotations` keeps it): what the message says it takes, and the check.
# Patterns are checked by the selection (select.py: check_pattern); other fields by the step itself.
_KINDS: dict[str, tuple[str, Any]] = {
    "bool": ("True or False", lambda v: isinstance(v, bool)),
    "bool | None": ("True, False or None", lambda v: v is None or isinstance(v, bool)),
    "int": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float | None": ("a number or None", lambda v: v is None or _number(v)),
    "str": ("a str", lambda v: isinstance(v, str)),
    "str | None": ("a str or None", lambda v: v is None or isinstance(v, str)),
    "torch.dtype": ("a torch dtype (torch.bfloat16, torch.float16)", lambda v: isinstance(v, torch.dtype)),
    "tuple[str, ...]": ("a tuple of str", lambda v: isinstance(v, tuple) and all(isinstance(s, str) for s in v)),
}


def registered() -> list[type[Step]]:
    """The registered step classes, in the order autoplan puts them in a plan."""
    return sorted(_STEPS.values(), key=lambda cls: cls.order)


def step_class(name: str) -> type[Step] | None:
    return _STEPS.get(name)


def applied_steps(model: nn.Module) -> list[Step]:
    """The steps applied to ``model``, oldest first (those whose object survived pickling)."""
    return [r.step for r in _rewrite.records(model) if isinstance(r.step, Step)]


def literal(value: Any) -> str:
    """A value as plan text writes it: regexes raw, dtypes and types dotted, predicates as <name>."""
    if isinstance(value, str) and "\\" in value and not value.endswith("\\") and not set("'\n\r") & set(value):
        return f"r'{value}'"  # regexes read as users write them: r'layer\d\.\d+'
    if isinstance(value, torch.dtype):
        return str(value)  # 'torch.bfloat16'
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if callable(value):
        return f"<{getattr(value, '__qualname__', type(value).__name__)}>"
    return repr(value)
