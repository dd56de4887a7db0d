"""Bytes a model's tensors hold: unique storages counted once, a DTensor's shard on this rank,
and no gradient the optimizer step in backward used and dropped (asked of the optimizer package's
interface, not its insides)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from .._tree import tensors
from ..transforms.optimizer.interface import holds_no_gradient
from .ranks import local


def _bytes(ts: Iterable[torch.Tensor | None], device: torch.device | None = None) -> int:
    """Total size of the unique storages behind ``tensors`` (tied weights counted once); of a
    DTensor, this rank's shard; on ``device`` only, where given. A gradient the optimizer step in
    backward used and dropped holds nothing."""
    seen: dict[int, int] = {}
    for t in ts:
        if isinstance(t, torch.Tensor) and not holds_no_gradient(t) and (device is None or _same_device(t.device, device)):
            storage = local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_tensors(opt: Any) -> Iterator[torch.Tensor]:
    """The tensors an optimizer keeps: its ``state``, or, for one that has none (torchao's
    ``CPUOffloadOptimizer`` keeps an optimizer per parameter), every tensor its ``state_dict``
    holds, however nested."""
    state = getattr(opt, "state", None)
    if state is not None:
        for s in state.values():
            yield from tensors(s)
    elif hasattr(opt, "state_dict"):
        yield from tensors(opt.state_dict())



def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
