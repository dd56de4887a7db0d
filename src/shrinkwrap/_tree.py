"""Nested inputs and outputs: the one walker over the tensors inside them.

Model inputs and outputs nest tensors in tuples (named ones too), lists, dicts (``OrderedDict``,
Hugging Face ``ModelOutput``) and dataclasses. :func:`tree_map` rebuilds such a structure with a
function applied to every tensor; :func:`tensors` lists the tensors in order.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterator

import torch


def tree_map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it; containers keep their types.

    Example::

        >>> tree_map(lambda t: t.to("cuda"), {"input_ids": ids, "labels": labels})
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [tree_map(fn, o) for o in obj]
        return type(obj)._make(items) if hasattr(type(obj), "_make") else type(obj)(items)
    if isinstance(obj, dict):
        items = {key: tree_map(fn, value) for key, value in obj.items()}
        if type(obj) is dict:  # the common case, and one torch.compile traces without a break
            return items
        # Dynamo does not trace copy.copy (a graph break on torch 2.11 / Python 3.12): a Hugging
        # Face ModelOutput (a dataclass and a dict with a to_tuple) whose keys are all fields is
        # built anew by its own constructor, as the model's forward built it, which dynamo traces.
        cls = type(obj)
        if hasattr(cls, "to_tuple") and set(items) <= set(getattr(cls, "__dataclass_fields__", ())):
            return cls(**items)
        new = copy.copy(obj)  # keeps the dict's own type and attributes (OrderedDict, defaultdict)
        for key, value in items.items():
            new[key] = value
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: tree_map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``, in order, through the structures :func:`tree_map` knows."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name))
