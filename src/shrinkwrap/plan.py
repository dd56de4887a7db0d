"""Plans: an ordered, serialisable list of steps, applied to a model in place.

A step is a small frozen dataclass (see :mod:`shrinkwrap.step`) with ``check(model)`` (raise
before anything changes) and ``apply(model)``. ``str(plan)`` writes the steps as calls,
comma-separated::

    checkpoint('layer[12]'), swish(), autocast(torch.bfloat16)

and :meth:`Plan.parse` reads that text back (string, number, bool, None, list and tuple
literals; dtypes as ``bfloat16`` or ``torch.bfloat16``; module types as dotted import paths).
"""

from __future__ import annotations

import ast
import importlib
from typing import Any, Iterable, Sequence, Union

import torch
import torch.nn as nn

from . import _rewrite
from .select import SelectionError, require_module, wrong
from .step import Step, registered, step_class


class PlanError(ValueError):
    """A plan is invalid: unknown step, bad text, or steps that contradict each other."""


class NotAStepError(PlanError, TypeError):
    """A plan given something that is not a step: a bad plan, and an argument of the wrong type."""


class Plan:
    """An ordered list of steps.

    Example::

        >>> plan = Plan([checkpoint(r"layer[12]"), swish()])
        >>> str(plan)
        "checkpoint('layer[12]'), swish()"
        >>> Plan.parse(str(plan)) == plan
        True
        >>> model = plan.apply(model)   # or shrinkwrap.apply(model, plan)
    """

    def __init__(self, steps: Iterable[Step] = ()) -> None:
        if isinstance(steps, (str, Step, nn.Module)) or not isinstance(steps, Iterable):
            hint = (" — read a plan's text with Plan.parse(...)" if isinstance(steps, str)
                    else f" — put it in a list: Plan([{steps}])" if isinstance(steps, Step) else "")
            raise TypeError(wrong("Plan()", "a list of steps", steps, hint))
        self.steps: tuple[Step, ...] = tuple(steps)
        for s in self.steps:
            if not isinstance(s, Step):
                raise NotAStepError(wrong("Plan()", "a list of steps (a plan holds steps such as checkpoint(...))", s))
        for i, a in enumerate(self.steps):
            for b in self.steps[i + 1 :]:
                why = a.conflict(b) or b.conflict(a)
                if why:
                    raise PlanError(f"shrinkwrap: {a} and {b} cannot share a plan: {why}")
        for a, b in zip(self.steps, self.steps[1:]):
            if a.last:
                raise PlanError(f"shrinkwrap: {a.name} goes last in a plan, but {b} comes after {a}; put {a} at the end")

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.steps)

    def __repr__(self) -> str:
        return f"Plan({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.steps == other.steps

    def __hash__(self) -> int:
        return hash(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __add__(self, other: "Plan | Step | Sequence[Step] | str") -> "Plan":
        return Plan(self.steps + as_plan(other, "plan + other").steps)

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """Read the text that ``str(plan)`` writes. Raises :class:`PlanError` on bad text.

        Example::

            >>> Plan.parse("checkpoint('layer[12]'), autocast(torch.bfloat16)")
            Plan("checkpoint('layer[12]'), autocast(torch.bfloat16)")
        """
        if not isinstance(text, str):
            raise TypeError(wrong("Plan.parse()", "the plan's text (a str)", text))
        if not text.strip():
            return cls()
        try:  # the text as the user wrote it, so that a message names what they typed
            body = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise PlanError(f"shrinkwrap: cannot read plan {text!r}: {exc.msg}") from None
        steps = []
        for node in body.elts if isinstance(body, ast.Tuple) else [body]:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                raise PlanError(f"shrinkwrap: expected a step like swish() in plan, got {ast.unparse(node)!r}")
            step_cls = step_class(node.func.id)
            if step_cls is None:
                known = ", ".join(sorted(cls.name for cls in registered()))
                raise PlanError(f"shrinkwrap: unknown step {node.func.id!r}; known steps: {known}")
            args = [_value(a) for a in node.args]
            kwargs = {k.arg: _value(k.value) for k in node.keywords if k.arg}
            try:
                steps.append(step_cls(*args, **kwargs))
            except TypeError as exc:  # the step's own message, as a Python call gets it
                raise PlanError(str(exc)) from None
        return cls(steps)

    def apply(self, model: nn.Module) -> nn.Module:
        """Apply every step to ``model`` in place and return it.

        Every step to apply is checked against the model first, so a pattern that matches nothing
        or a module a step cannot handle raises before any module changes. A step whose modules an
        earlier step of the plan took (``swish()`` after ``bn_act()`` fused every Swish) does
        nothing, and its record says so in its notes. A step that fails midway otherwise reverts
        the steps already applied. A step already applied to this model is skipped, so applying a
        plan twice is a no-op.
        """
        require_module(model, "Plan.apply()")
        done = [r.step for r in _rewrite.records(model)]
        todo = [s for s in self.steps if s not in done]
        for step in todo:
            step.check(model)
        keep = len(_rewrite.records(model))
        try:
            for i, step in enumerate(todo):
                try:
                    step.apply(model)
                except SelectionError as exc:
                    if not i:  # checked on this very model just now: not an earlier step's doing
                        raise
                    why = " ".join(str(exc).split()).removeprefix("shrinkwrap: ")
                    _rewrite.record(model, _rewrite.Record(step, (), (), [], (
                        f"nothing left to do after the steps before it in the plan: {why}",)))
        except BaseException:
            _rewrite.revert(model, keep=keep)
            raise
        return model


def _value(node: ast.AST) -> Any:
    if isinstance(node, (ast.Name, ast.Attribute)):
        dotted = ast.unparse(node)
        short = dotted.removeprefix("torch.")
        if isinstance(getattr(torch, short, None), torch.dtype):
            return getattr(torch, short)
        module, _, attr = dotted.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr) if module else None
        except (ImportError, AttributeError):
            obj = None
        if isinstance(obj, type):
            return obj
        raise PlanError(f"shrinkwrap: {dotted!r} in a plan is neither a dtype nor an importable module type")
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise PlanError(f"shrinkwrap: cannot read {ast.unparse(node)!r} in a plan") from None


PlanLike = Union[Plan, Step, Sequence[Step], str]


def as_plan(plan: PlanLike, where: str) -> Plan:
    """A :class:`Plan` from a plan, a step, a list of steps or the plan's text; ``where`` names
    the public function for the message if ``plan`` is none of these."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Step):
        return Plan([plan])
    if isinstance(plan, str):
        return Plan.parse(plan)
    if isinstance(plan, (list, tuple)):
        return Plan(plan)
    raise TypeError(wrong(where, "a Plan, a step, a list of steps or the plan's text", plan))


def apply(model: nn.Module, plan: PlanLike) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return the same model.

    ``plan`` is a :class:`Plan`, a list of steps, one step, or the plan's text.

    Example::

        >>> import shrinkwrap as sw
        >>> model = sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]")]))
        >>> model = sw.apply(model, "checkpoint('layer[12]')")   # the same, from text
    """
    require_module(model, "apply()")
    return as_plan(plan, "apply()").apply(model)
