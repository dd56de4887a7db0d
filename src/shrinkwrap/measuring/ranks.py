"""Measuring on several ranks: where a ``torch.distributed`` process group is initialised (under
``torchrun``, FSDP2 or DDP), every rank measures its own iteration and the ranks' profiles are
gathered, so that rank 0's report shows each rank's figures.

Without a process group nothing here communicates, and nothing is imported beyond what
``import torch`` already did.
"""

from __future__ import annotations

from typing import Any

import torch


def rank_and_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group, or None where there is none."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def gather(obj: Any) -> list[Any] | None:
    """``obj`` from every rank, in rank order (every rank must call this), or None without a
    process group. Objects travel pickled (``all_gather_object``); on NCCL through the current
    CUDA device, which each rank sets to its own."""
    if rank_and_world() is None:
        return None
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: the local shard of a DTensor (FSDP2's sharded parameters,
    their gradients and optimizer state), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
