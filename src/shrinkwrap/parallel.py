"""Several ranks: join torchrun's process group, shard or replicate a model after its plan, and
start the ranks of ``shrinkwrap profile --nproc N``.

shrinkwrap composes with the distributed engine, it does not replace it: the plan goes on the
model first, then FSDP2's ``fully_shard`` (each block, then the root) or DDP wraps it (a plan
applied after ``fully_shard`` is refused). :func:`fsdp` and :func:`ddp` are that second step as
``plan_report(..., parallelize=...)`` takes it; under ``torchrun`` every rank measures and rank 0's
report shows every rank (see :mod:`shrinkwrap.measuring.ranks`).

``torch.distributed``'s submodules (fsdp, device_mesh, DDP) are imported inside the functions: a
single-process user imports none of them.

Example (``torchrun --nproc-per-node 2 script.py``)::

    device = shrinkwrap.parallel.init()            # nccl on each rank's GPU, gloo on a CPU
    report = sw.plan_report(plan, make_model, batch, device=device,
                            parallelize=functools.partial(shrinkwrap.parallel.fsdp, device=device))
    if torch.distributed.get_rank() == 0:
        print(report)                              # a column per rank
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import torch
import torch.nn as nn

from .measuring.step import resolve_device
from .select import Pattern, block_groups, select

# What torchrun puts in each rank's environment.
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process is a rank that ``torchrun`` (``torch.distributed.run``) started."""
    return all(k in os.environ for k in _TORCHRUN)


def init(device: str | torch.device | None = None, timeout_s: float | None = None) -> torch.device:
    """Join the process group this process's environment describes (``torchrun``'s ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and return this rank's device.

    On CUDA (``device`` "cuda", or None with a GPU) each rank takes GPU ``LOCAL_RANK`` and the
    backend is NCCL; on the CPU it is gloo. A group already joined is kept.
    """
    wanted = torch.device(device) if device is not None else None
    cuda = wanted.type == "cuda" if wanted is not None else torch.cuda.is_available()
    if cuda:
        resolve_device("cuda")  # a clear error where torch has no CUDA
        index = wanted.index if wanted is not None and wanted.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = resolve_device(wanted or "cpu")
    if not torch.distributed.is_initialized():
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        torch.distributed.init_process_group("nccl" if cuda else "gloo", **kwargs)
    return dev


def _device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    t = next(model.parameters(), None)
    return t.device if t is not None else torch.device("cpu")


def block_names(model: nn.Module, pattern: Pattern | None = None) -> list[str]:
    """The blocks :func:`fsdp` shards one by one: the outermost modules ``pattern`` selects, or by
    default those of the model's stacks of same-type blocks (:func:`shrinkwrap.select.block_groups`,
    outermost stacks only). Checkpointed blocks count as the blocks they wrap."""
    if pattern is not None:
        return select(model, pattern, outermost=True)
    return [b for _, names, nested in block_groups(model) if not nested for b in names]


def fsdp(model: nn.Module, device: str | torch.device | None = None, blocks: Pattern | None = None) -> nn.Module:
    """``fully_shard`` each of :func:`block_names` (``blocks`` picks them: a pattern as in
    :func:`shrinkwrap.select.select`), then the root, over every rank of the default process
    group (a 1-D mesh on ``device``'s type: the model's by default); returns the model.

    Apply the plan before: ``fsdp(sw.apply(model, plan))``. This is torchtitan's order
    (checkpoint, then FSDP2 per block, then the root).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(_device(model, device).type, (torch.distributed.get_world_size(),))
    for name in block_names(model, blocks):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def ddp(model: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """The model in ``DistributedDataParallel`` on ``device`` (the model's by default), after its plan."""
    from torch.nn.parallel import DistributedDataParallel

    dev = _device(model, device)
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m shrinkwrap *argv`` as ``nproc`` ranks on this machine through
    ``torch.distributed.run --standalone``, and return its exit status. The ranks import what this
    process can (its ``sys.path`` goes before ``PYTHONPATH``), and inherit its standard output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, set here so that it does not warn
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "shrinkwrap", *argv]
    return subprocess.run(cmd, env=env).returncode
