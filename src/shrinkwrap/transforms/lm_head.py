"""The output head of causal language models: ``chunked_loss`` computes the head and the loss
chunk by chunk over tokens, never materialising the full batch x sequence x vocabulary logits.

:class:`ChunkedLoss` (``chunked_loss(chunk_size=1024)``) acts on a Hugging Face ``*ForCausalLM``
(any model whose forward is ``hidden = base_model(...).last_hidden_state; logits =
lm_head(hidden); loss = loss_function(logits, labels, ...)``, ``lm_head`` an ``nn.Linear``). In
training, called with ``labels``, the model's forward runs its base model as its own forward
would, then computes the loss over ``chunk_size`` tokens at a time: each chunk's logits
(``hidden_chunk @ W.T + b``, soft-capped where the config has ``final_logit_softcapping``) give
the chunk's loss and, at once, its gradients (softmax minus one-hot), which go straight into the
gradients of the hidden states and of the head's weight. Autograd keeps those two (the weight's
gradient is what backward would make anyway; a frozen head gets none) and no tensor of
``tokens x vocab``: what the forward leaves for backward loses the logits and their log-softmax
(``2 x tokens x vocab`` floats, and more under autocast), and the head costs the same three
matmuls as the model's own, with no recompute.

Exact, not bit for bit: the same label shift (or ``shift_labels``), ``ignore_index=-100``, mean
over the counted tokens or the sum over ``num_items_in_batch`` (HF's gradient accumulation),
tied embeddings (the gradient of the shared weight gets both uses), and soft-capping, as the
model's own loss; sums run in another order, so float64 agrees to ``rtol=1e-12``. One deliberate
difference: HF computes its loss in float32 (``logits.float()``) even in a float64 model; the
chunked loss is computed in the wider of float32 and the logits' dtype, so a float64 model gets
a float64 loss (the tests compare against the model's float64 logits and ``cross_entropy``).
Under autocast the chunk matmuls run in the autocast dtype and the loss in float32, as HF's.

In chunked training the output's ``logits`` is None (they were never whole): a user who needs
them turns the step off (``sw.revert``) or calls in ``eval()``. Without labels, in ``eval()``,
or with ``logits_to_keep`` set, the model's own forward runs, unchanged.

The step's forward is set on the root (``_rewrite.RootForward``) and goes under every other
root forward (autocast, whatever the order of the plan), so autocast covers the base model and
the chunks, and torch.compile traces it into the model's graph.
"""

from __future__ import annotations

__all__ = ['ChunkedLoss', 'apply_chunked_loss']

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _rewrite
from .._wrapper import functorch_level, has_hooks
from ..select import SelectionError, require_module
from ..step import Candidate, Context, Step, Targets, applied_steps

IGNORE_INDEX = -100


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on, else the tensor's."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


_OUT_DTYPE = [True]  # whether addmm takes out_dtype on CUDA here (older torch: not, or not in place)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in ``acc``'s dtype, in place where it can be: a bfloat16 product goes into a
    float32 sum without a bfloat16 copy of it (``addmm``'s ``out_dtype``, CUDA, recent torch)."""
    if torch.compiler.is_compiling():
        return acc + (a @ b).to(acc.dtype)  # the compiler fuses the sum
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if acc.is_cuda and _OUT_DTYPE[0]:
        try:
            with torch.autocast("cuda", enabled=False):  # autocast would round the sum to bfloat16
                return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (TypeError, RuntimeError):  # no out_dtype, or not into a wider sum (torch < 2.10)
            _OUT_DTYPE[0] = False
    return acc.add_(a @ b)


class _HeadLoss(torch.autograd.Function):
    """Summed cross-entropy of ``linear(hidden, weight, bias)`` against ``labels``, scaled by
    ``scale``, one chunk of rows at a time. Where ``grads`` (grad mode was on) the forward
    computes each chunk's gradients with its loss (softmax minus one-hot, through the soft-cap)
    and keeps only the gradients of ``hidden`` (rows x hidden) and of ``weight`` and ``bias``
    (the weight's gradient, which backward makes in any case): the head costs the three matmuls
    of the plain model, with no recompute, and no tensor of ``rows x vocabulary`` outlives its
    chunk. Backward multiplies by the incoming gradient, in float32.

    Matmuls run in the compute dtype (autocast's), the softmax and the sums in at least float32.
    The gradient matmuls take softmax minus one-hot unscaled (entries within [-1, 1]), and the
    scale (1 / counted tokens) comes after them in float32: scaled first, a float16 gradient would
    underflow before the GradScaler's factor arrives in backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, scale: torch.Tensor, chunk_size: int, softcap: float | None,
                ignore_index: int, dtype: torch.dtype, grads: bool) -> torch.Tensor:
        want_h, want_w, want_b = (grads and need for need in ctx.needs_input_grad[:3])
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        acc = torch.promote_types(dtype, torch.float32)
        rows = hidden.shape[0]
        total = hidden.new_zeros((), dtype=acc)
        # Kept until backward in the narrower of their own dtype and bfloat16 where the matmuls run in
        # bfloat16 (see the end of forward).
        kept = (lambda d: dtype if dtype == torch.bfloat16 and d.itemsize > 2 else d)
        grad_h = torch.empty_like(hidden, dtype=kept(hidden.dtype)) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, acc)) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.promote_types(bias.dtype, acc)) if want_b else None
        # Eager, the narrow chunk gradients of two chunks go into one buffer and into the weight's
        # float32 gradient with one matmul: each such sum reads and writes the whole of it (1 GiB at
        # a 128k vocabulary), and the buffer is no larger than one chunk's float32 log-softmax.
        compiling = torch.compiler.is_compiling()
        group = 2 * chunk_size if want_w and not want_b and dtype != acc and not compiling else chunk_size
        buffer = hidden.new_empty((min(group, rows), weight.shape[0]), dtype=dtype) if group > chunk_size else None
        # The matmuls run in `dtype` explicitly; autocast would add float32 copies of the chunk.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_size):
                h = hidden[start:start + chunk_size].to(dtype)
                y = labels[start:start + chunk_size]
                z = F.linear(h, w, b)
                if softcap is not None:
                    t = torch.tanh(z.to(acc) / softcap)
                    z = t * softcap
                counted = y != ignore_index
                target = torch.where(counted, y, 0).unsqueeze(1)
                g = torch.log_softmax(z, dim=-1, dtype=acc)  # one pass from the narrow logits
                del z
                total = total - (g.gather(1, target).squeeze(1) * counted).sum()
                if not (want_h or want_w or want_b):
                    continue
                g = g.exp_()  # d(sum of losses)/dz: softmax - one-hot, on counted rows
                g.scatter_add_(1, target, torch.full_like(target, -1, dtype=g.dtype))
                if softcap is not None:
                    g.mul_(1 - t * t)
                mask = counted.unsqueeze(1)
                at = start % group
                if want_b or dtype == acc or compiling:
                    gd = g.mul_(mask).to(dtype)
                    if want_b:
                        grad_b += g.sum(0)
                else:  # masked and narrowed in one pass
                    gd = torch.mul(g, mask, out=(buffer[at:at + len(g)] if buffer is not None else
                                                 torch.empty(g.shape, dtype=dtype, device=g.device)))
                del g
                if want_h:
                    grad_h[start:start + chunk_size] = (gd @ w).to(acc) * scale
                if not want_w:
                    continue
                if buffer is None:
                    grad_w = _add_product(grad_w, gd.t(), h)
                elif at + len(gd) == group or start + len(gd) == rows:
                    first = start - at
                    grad_w = _add_product(grad_w, buffer[:at + len(gd)].t(),
                                          hidden[first:start + len(gd)].to(dtype))
        # The sums scaled in float32, then kept until backward in the narrower of the parameter's
        # dtype and bfloat16 where the matmuls ran in bfloat16 (rounded once): the plain model under
        # bfloat16 autocast rounds its head's gradients to bfloat16 too (its matmuls' outputs), and
        # a float32 copy of a 128k-vocabulary head's weight gradient would hold 1 GiB from forward
        # to backward. float16 keeps float32: without the GradScaler's factor, which arrives in
        # backward, small gradients would underflow.
        grad_w = grad_w.mul_(scale).to(kept(weight.dtype)) if want_w else None
        grad_b = grad_b.mul_(scale).to(kept(bias.dtype)) if want_b else None
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():
            # Second derivatives would come out zero, not wrong by rounding: refused.
            raise RuntimeError(
                "shrinkwrap: chunked_loss() computes the head's gradients in the forward, as numbers with no "
                "graph, so backward with create_graph=True (a gradient penalty) cannot differentiate them again. "
                "Compute this loss from the logits: call the model without labels and apply the loss yourself, "
                "or revert the plan (shrinkwrap.revert(model)).")
        wide = grad_out.to(torch.promote_types(grad_out.dtype, torch.float32))
        scaled = [(g * wide).to(d) if g is not None else None for g, d in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*scaled, None, None, None, None, None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          shift_labels: torch.Tensor, *, chunk_size: int = 1024, softcap: float | None = None,
                          num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of ``linear(hidden, weight, bias)`` against ``shift_labels`` (already shifted,
    one per row of ``hidden``), ``chunk_size`` rows at a time (see :class:`_HeadLoss`): the sum
    over counted rows divided by their number, or by ``num_items_in_batch`` when given.

    Example::

        >>> loss = chunked_cross_entropy(hidden, model.lm_head.weight, None, labels[:, 1:], chunk_size=512)
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    dtype = _compute_dtype(hidden)
    acc = torch.promote_types(dtype, torch.float32)
    if num_items_in_batch is None:
        scale = 1 / (shift_labels != ignore_index).sum().to(acc)
    else:
        scale = 1 / torch.as_tensor(num_items_in_batch, device=hidden.device).to(acc)
    return _HeadLoss.apply(hidden, weight, bias, shift_labels, scale, chunk_size, softcap, ignore_index, dtype,
                           torch.is_grad_enabled())


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


def _router_message(what: str, statement: str) -> str:
    return (f"shrinkwrap: with output_router_logits on, {what}.forward adds its router's load-balancing loss "
            f"(`{statement}`), which chunked_loss() does not, so the loss would differ. Turn it off "
            f"(model.config.output_router_logits = False, and no output_router_logits=True in the call), or "
            f"leave chunked_loss() out of the plan for this model.")


class _ChunkedLossForward(_rewrite.RootForward):
    """The root's forward: in training with labels, base model + chunked loss; otherwise what ran
    before, untouched."""

    def __init__(self, module: nn.Module, chunk_size: int, softcap: float | None, router: str | None,
                 output: type) -> None:
        super().__init__(module)
        self.chunk_size, self.softcap, self.router, self.output = chunk_size, softcap, router, output
        self.signature = inspect.signature(type(module).forward)
        # Found here, not in the call: dynamo cannot trace dataclasses.fields of a class.
        self.fields = tuple(f.name for f in dataclasses.fields(output) if f.name not in ("loss", "logits"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.module
        bound = self.signature.bind(model, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop(next(iter(named)))  # self
        extra = {}
        for p in self.signature.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                extra = named.pop(p.name, {})
        labels, keep = named.get("labels"), named.get("logits_to_keep", 0)
        # Under a torch.func transform the model's own loss: _HeadLoss has no setup_context.
        if not model.training or labels is None or not (isinstance(keep, int) and keep == 0) or functorch_level():
            return self.inner(*args, **kwargs)
        why = head_problem(model.lm_head)
        if why:
            raise ValueError(f"shrinkwrap: chunked_loss() on {type(model).__name__}: {why}. Leave the head out of "
                             f"what changes it (a PEFT adapter's target_modules), or revert chunked_loss() first "
                             f"(shrinkwrap.revert(model)).")
        named.pop("labels")
        named.pop("logits_to_keep", None)
        if self.router:
            asked = named.get("output_router_logits", extra.get("output_router_logits"))
            if asked if asked is not None else getattr(model.config, "output_router_logits", False):
                raise ValueError(_router_message(type(model).__name__, self.router))
        return_dict = extra.pop("return_dict", named.pop("return_dict", None))
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        base_out = model.base_model(**named, **extra)  # as the model's own forward calls it
        hidden = base_out.last_hidden_state if hasattr(base_out, "last_hidden_state") else base_out[0]
        shift_labels = extra.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        head = model.lm_head
        loss = chunked_cross_entropy(hidden, head.weight, head.bias, shift_labels, chunk_size=self.chunk_size,
                                     softcap=self.softcap, num_items_in_batch=extra.get("num_items_in_batch"))
        out = self.output(loss=loss, logits=None,
                          **{k: getattr(base_out, k) for k in self.fields if getattr(base_out, k, None) is not None})
        # The tuple keeps the logits' place (None): to_tuple() drops None fields, which would move
        # the cache to where the caller's out[1] expects the logits.
        return out if return_dict else (loss, None, *out.to_tuple()[1:])


def _output_class(model: nn.Module) -> type:
    """The ModelOutput class the model's forward returns (from its annotation), or
    ``CausalLMOutputWithPast``."""
    try:
        hint = typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back
        hint = None
    for cls in (hint, *typing.get_args(hint)):
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and {"loss", "logits"} <= {
                f.name for f in dataclasses.fields(cls)}:
            return cls
    from transformers.modeling_outputs import CausalLMOutputWithPast  # an HF model: transformers is there
    return CausalLMOutputWithPast


@dataclasses.dataclass
class _Unlink:
    """Undo entry: take the step's forward out of the root's chain of forwards, wherever other
    steps put theirs around it, and give the root its previous label."""

    forward: _ChunkedLossForward
    label: Any = None

    def undo(self, model: nn.Module) -> None:
        ours = self.forward
        if model.__dict__.get("forward") is ours:
            if ours.previous is None:
                model.__dict__.pop("forward", None)
            else:
                model.__dict__["forward"] = ours.previous
        else:
            current = model.__dict__.get("forward")
            while isinstance(current, _rewrite.RootForward):
                if current.previous is ours:
                    current.previous = ours.previous
                    break
                current = current.previous
        if self.label is None:
            model.__dict__.pop("_get_name", None)
        else:
            model.__dict__["_get_name"] = self.label


@dataclasses.dataclass(frozen=True)
class ChunkedLoss(Step):
    """Step: a causal language model's head and loss, computed ``chunk_size`` tokens at a time in
    training with ``labels``, never materialising the full logits. See the module docstring for
    what is exact and what the model returns.

    Refused (``SelectionError``, naming the model and the fix): a model without an ``lm_head``
    ``nn.Linear`` and a base model (``base_model``) under it, with a loss other than HF's causal
    LM loss (``loss_type``, a ``loss_function`` set by the user), or whose forward does anything
    between its base model and its return that this step does not reproduce (it reads the
    forward's code: see :func:`_read_forward`; Cohere's ``logit_scale``, Granite's
    ``logits_scaling``, RecurrentGemma's soft-cap, Bamba's z-loss). ``final_logit_softcapping``
    (Gemma 2 and 3) is applied per chunk. A mixture of experts' router loss is not computed: with
    ``config.output_router_logits`` on the step is refused, and a call with it on raises
    ``ValueError``. Names, ``state_dict`` keys
    and parameters do not change; ``revert`` gives the model's own forward back.

    Example::

        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> sw.apply(model, sw.Plan([sw.chunked_loss(chunk_size=512), sw.autocast(torch.bfloat16)]))
        >>> out = model(input_ids, attention_mask=mask, labels=input_ids)
        >>> out.loss.backward()     # out.logits is None in chunked training
    """

    chunk_size: int = 1024
    name = "chunked_loss"
    order = 60

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"shrinkwrap: chunked_loss(chunk_size={self.chunk_size!r}): chunk_size is a number "
                             f"of tokens, a positive int (e.g. 1024).")

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the root (its forward) and ``lm_head``; payload: the soft-capping value."""
        what = type(model).__name__
        for done in applied_steps(model):
            if isinstance(done, ChunkedLoss):
                if done != self:
                    raise ValueError(f"shrinkwrap: cannot apply {self} to {what}, which already has {done}. "
                                     f"Call shrinkwrap.revert(model) first.")
                return Targets()  # applied already
        head, base, config = (getattr(model, a, None) for a in ("lm_head", "base_model", "config"))
        why = head_problem(head)
        if why or not isinstance(base, nn.Module) or base is model or config is None:
            has = why or (f"its base_model is {type(base).__name__}" if config is not None else "it has no config")
            raise SelectionError(
                f"shrinkwrap: chunked_loss() needs a causal language model with an nn.Linear `lm_head`, a base "
                f"model (`base_model`) under it and a `config`, as Hugging Face's *ForCausalLM have; in {what}, "
                f"{has}. Leave chunked_loss() out of the plan for it.")
        if "_loss_function" in model.__dict__ or getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
            raise SelectionError(
                f"shrinkwrap: chunked_loss() computes Hugging Face's causal LM loss, but {what} has "
                f"loss_type={getattr(model, 'loss_type', None)!r} or a loss_function of its own. Leave "
                f"chunked_loss() out of the plan, or use the model's default loss.")
        forward = _read_forward(model)
        if forward.router and getattr(config, "output_router_logits", False):
            raise SelectionError(_router_message(what, forward.router))
        softcap = getattr(config, "final_logit_softcapping", None) if forward.softcap else None
        return Targets(["", "lm_head"], payload=(softcap, forward.router))

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        if not targets.matched:
            return []
        forward = _ChunkedLossForward(model, self.chunk_size, *targets.payload, _output_class(model))
        entry = _Unlink(forward, model.__dict__.get("_get_name"))
        # Under every other root forward already there: autocast and the rest wrap the whole of it.
        above = model.__dict__.get("forward")
        lowest = None
        while isinstance(above, _rewrite.RootForward):
            lowest, above = above, above.previous
        if lowest is None:
            model.__dict__["forward"] = forward
        else:
            lowest.previous = forward  # forward.previous is already what lowest ran before
        forward.previous = above
        model.__dict__["_get_name"] = _rewrite.Label(f"ChunkedLoss[{model._get_name()}]")
        return [entry]

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """The step on any causal language model it can handle exactly (it saves memory only when
        the batch has labels)."""
        return cls.itself(model)


def apply_chunked_loss(model: nn.Module, chunk_size: int = 1024) -> nn.Module:
    """Compute ``model``'s head and loss chunk by chunk in training with labels, in place; return
    it. See :class:`ChunkedLoss`; ``shrinkwrap.revert(model)`` gives its own forward back.

    Example::

        >>> apply_chunked_loss(model, chunk_size=512)
        >>> model(input_ids, labels=input_ids).loss.backward()
    """
    return ChunkedLoss(chunk_size).apply(require_module(model, "apply_chunked_loss()"))
