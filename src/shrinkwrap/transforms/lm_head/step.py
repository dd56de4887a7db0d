"""The ``chunked_loss`` step: what it accepts, and its forward put under the root's other forwards."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from ... import _rewrite
from ...select import SelectionError, require_module
from ...step import Candidate, Context, Step, Targets, applied_steps
from .forward import _ChunkedLossForward, _output_class, _router_message
from .read_forward import _read_forward, head_problem


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
