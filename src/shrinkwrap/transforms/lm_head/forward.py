"""The forward set on the model's root: in training with labels, the base model then the chunked
loss; otherwise the model's own forward."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

from ... import _rewrite
from ..._wrapper import functorch_level
from .kernel import IGNORE_INDEX, chunked_cross_entropy
from .read_forward import head_problem


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
