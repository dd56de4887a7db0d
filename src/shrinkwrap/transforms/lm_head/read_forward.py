"""Which causal LM forwards the chunked loss reproduces: the model's ``forward`` is read as code, and
anything between its base model and its return that the chunked loss would not do is refused."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import torch.nn as nn

from ..._wrapper import has_hooks
from ...select import SelectionError


@dataclasses.dataclass(frozen=True)
class _Forward:
    """What a causal LM's forward does between its base model and its return, as far as the
    chunked loss must do it too: ``softcap`` (Gemma 2's final soft-capping of the logits) and
    ``router`` (the statement adding a mixture of experts' router loss, run only when
    ``output_router_logits`` is on; the chunked loss refuses those calls)."""

    softcap: bool = False
    router: str | None = None


def head_problem(head: Any) -> str:
    """Why the chunked loss cannot compute ``head``'s logits from its weight and bias ("" if it
    can): the head must be a plain ``nn.Linear``, whose forward is ``linear(x, weight, bias)``, with
    no hooks. A subclass or a layer standing for one (a PEFT LoRA ``Linear``, a quantized linear,
    a shrinkwrap wrapper) computes something else, which reading the weight would bypass."""
    if head is None:
        return "it has no lm_head"
    kind = type(head)
    where = f"{kind.__module__}.{kind.__qualname__}"
    if not isinstance(head, nn.Linear) or kind.forward is not nn.Linear.forward:
        return (f"its lm_head is {where}, not a plain torch.nn.Linear: the chunked loss reads the head's weight and "
                f"bias, and would bypass that module's forward (a LoRA adapter on the head would get no gradient)")
    if has_hooks(head):
        return "its lm_head has hooks, which the chunked loss would not run (it reads the head's weight)"
    return ""


def _read_forward(model: nn.Module) -> _Forward:
    """Read ``type(model).forward``'s code: the head's input must be the base model's output (its
    hidden states, sliced, moved), its output the logits (cast, or soft-capped as Gemma 2's), and the loss HF's
    ``loss_function`` and nothing else, but for a router loss under ``output_router_logits``.
    Anything else (a scale on the logits or on the hidden states, a vocabulary slice, a z-loss, a
    soft-cap of another form) raises ``SelectionError`` quoting the statement: a list of the forms
    that are known to be reproduced, not of those known not to be, so that a new model's forward is
    refused rather than silently trained on another loss."""
    what = type(model).__name__
    leave = "Leave chunked_loss() out of the plan for it."

    def unhandled(text: str, does: str) -> SelectionError:
        return SelectionError(f"shrinkwrap: {what}.forward {does} (`{text}`), which chunked_loss() does not "
                              f"reproduce, so its loss would differ. {leave}")

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    assigned = [] if tree is None else list(_assignments(tree))
    heads = [node for node, _ in assigned if isinstance(node, ast.Assign)
             and any(_is_self_call(n, "lm_head") for n in ast.walk(node.value))]
    calls = [] if tree is None else [n for n in ast.walk(tree) if _is_self_call(n, "loss_function")]
    if len(heads) != 1 or not calls:
        raise SelectionError(
            f"shrinkwrap: chunked_loss() cannot tell how {what}.forward computes its logits and loss (it expects "
            f"`logits = self.lm_head(hidden_states)` and `self.loss_function(...)`, as Hugging Face's *ForCausalLM). "
            f"{leave}")
    head = heads[0]
    logits = head.targets[0].id
    value = head.value
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _CASTS:
        value = value.func.value  # logits.float(), .contiguous(), .to(dtype): the loss is computed wide anyway
    hidden = _view_of(value.args[0]) if _is_self_call(value, "lm_head") and len(value.args) == 1 else None
    if hidden is None:
        raise unhandled(ast.unparse(head.value), "computes its logits otherwise")
    # The head's input, and what it is a view of, back to the base model's call.
    base = {name for name, child in model.named_children() if child is getattr(model, "base_model", None)}
    views = {hidden}
    while True:
        more = {_view_of(n.value) for n, _ in assigned if _target(n).id in views and n.value is not None} - {None}
        if more <= views:
            break
        views |= more
    losses = {"loss"} | {_target(n).id for n, _ in assigned if isinstance(n, ast.Assign)
                         and _is_self_call(n.value, "loss_function")}
    for node in ast.walk(tree):
        # In place, or into a part: `logits.mul_(s)`, `logits[..., n:] = x`, `loss.data = ...`.
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _root(node.value) in views | {
                logits} | losses:
            raise unhandled(ast.unparse(node), "changes a tensor of its head or loss in place")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                not isinstance(t, ast.Name) and _root(t) in views | {logits} | losses
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            raise unhandled(ast.unparse(node), "writes into a tensor of its head or loss")
    for call in calls:
        extra = [k.arg for k in call.keywords if k.arg not in (None, "logits", "labels", "vocab_size", "pad_token_id")]
        given = dict(zip(("logits", "labels"), call.args)) | {k.arg: k.value for k in call.keywords if k.arg}
        if extra or ast.unparse(given.get("logits", ast.Constant(None))) != logits or ast.unparse(
                given.get("labels", ast.Constant(None))) != "labels":
            raise unhandled(ast.unparse(call), "calls its loss function with other arguments")
        if not any(n.value is call for n, _ in assigned if isinstance(n, ast.Assign)):
            raise unhandled(ast.unparse(call), "uses its loss function's value inside an expression")
    softcap, router = [], None
    for node, tests in assigned:
        name, text = _target(node).id, ast.unparse(node)
        if node is head or node.value is None:
            continue
        if name in views and _view_of(node.value) is None and not any(_calls(node.value, b) for b in base):
            raise unhandled(text, "changes the hidden states before its head")
        if name == logits and not _is_logits(node.value, logits):
            step = _softcap_step(node.value, logits)
            if step is None:
                raise unhandled(text, "changes its logits")
            softcap.append(step)
        if name in losses and not (isinstance(node, ast.Assign) and (
                _is_self_call(node.value, "loss_function") or isinstance(node.value, ast.Constant))):
            if not any("output_router_logits" in test for test in tests):
                raise unhandled(text, "adds to its loss")
            router = text
        elif name not in losses and any(isinstance(n, ast.Name) and n.id in losses for n in ast.walk(node.value)):
            raise unhandled(text, "builds another loss on its loss")
    if softcap and softcap != ["divide", "tanh", "multiply"]:
        raise SelectionError(f"shrinkwrap: {what}.forward soft-caps its logits in steps ({', '.join(softcap)}) "
                             f"other than Gemma 2's (divide, tanh, multiply), which chunked_loss() reproduces. {leave}")
    return _Forward(softcap=bool(softcap), router=router)


def _root(node: ast.AST) -> str | None:
    """The name an attribute, item or method call starts from (``logits`` of ``logits[0].mul_``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _calls(node: ast.AST, attr: str) -> bool:
    """A call of ``self.<attr>`` or of a module under it (``self.model.decoder(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    while isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
        func = func.value
    return isinstance(func, ast.Attribute) and func.attr == attr and isinstance(func.value, ast.Name) and (
        func.value.id == "self")


_CASTS = ("float", "contiguous", "to")


def _is_self_call(node: ast.AST, attr: str) -> bool:
    """``self.<attr>(...)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def _view_of(node: ast.AST) -> str | None:
    """The variable that ``node`` is a plain view of (``h``, ``h[:, s, :]``, ``h.to(device)``,
    ``slice_logits_to_keep(h, k)``, ``outputs[0]``, ``outputs.last_hidden_state``), else None."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute) and node.attr == "last_hidden_state":
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "slice_logits_to_keep":
            node = node.args[0]
        else:
            return None


def _softcap_step(node: ast.AST, logits: str) -> str | None:
    """Which step of Gemma 2's soft-capping of ``logits`` a statement's value is: ``divide``
    (``logits / cap``), ``tanh`` (``torch.tanh(logits)``) or ``multiply`` (``logits * cap``),
    ``cap`` being ``config.final_logit_softcapping``; None for anything else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Mult)):
        if _is_logits(node.left, logits) and isinstance(node.right, ast.Attribute) and (
                node.right.attr == "final_logit_softcapping"):
            return "divide" if isinstance(node.op, ast.Div) else "multiply"
        return None
    if (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.tanh" and len(node.args) == 1
            and _is_logits(node.args[0], logits)):
        return "tanh"
    return None


def _is_logits(node: ast.AST, logits: str) -> bool:
    """``logits``, or a cast of it (``logits.float()``)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS:
        node = node.func.value
    return isinstance(node, ast.Name) and node.id == logits


def _target(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> ast.AST:
    return node.targets[0] if isinstance(node, ast.Assign) else node.target


def _assignments(tree: ast.AST, tests: tuple[str, ...] = ()):
    """Every assignment to one plain name, with the conditions of the ``if`` statements around it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and isinstance(_target(node), ast.Name) and (
                not isinstance(node, ast.Assign) or len(node.targets) == 1):
            yield node, tests
        yield from _assignments(node, tests + (ast.unparse(node.test),) if isinstance(node, ast.If) else tests)
