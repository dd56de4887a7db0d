"""Selective recompute: the operators whose outputs a region keeps (``checkpoint(pattern, save=...)``).

A region recomputes its whole forward in backward; ``save`` keeps the outputs of the operators it
names instead, so the recompute takes them from memory (torch's selective checkpoint). Kinds:
``"matmul"`` (``mm``, ``addmm``, ``bmm``, ``baddbmm``: every Linear), ``"attention"`` (the fused
scaled-dot-product kernels), ``"conv"`` (``convolution``); or an aten operator's name
(``"addmm"``). It buys step time with memory: on a transformer block the matrix products are most
of the recompute's time and their outputs a fraction of what the block keeps without a checkpoint.

Exact as a plain region: a kept output is the value the recompute would compute. An operator that
draws random numbers is never kept (it would shift the random stream of the dropout after it in
the recompute): a fused attention with dropout in training is recomputed, and a random operator
named in ``save`` is refused, and so is one that changes a tensor in place or that torch
decomposes before a checkpoint sees it (``linear``: name ``addmm``/``mm``, or ``"matmul"``). The
kept outputs are held by the checkpoint, not saved through autograd's saved-tensor hooks, so an
``offload`` region does not move them.

Limits of torch's selective checkpoint, raised by torch in backward: an in-place operation on a
kept output inside the region (``Linear`` then ``ReLU(inplace=True)``, timm's squeeze-excite;
raised again naming the region's in-place modules and the fix, :class:`_KeptMutated`), and a
second backward through the region (``retain_graph=True``).

Under ``torch.compile`` the compiler's partitioner keeps the same outputs, and that is where it
pays: eager, torch's selective checkpoint runs every operator of the region through a Python
dispatch mode, which costs more than the matrix products it saves (benchmarks/RESULTS.md,
"Language models: activations", gpt2's ``save=`` rows).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ... import _compat
from .restore import _dotted


# What ``save`` may name besides an aten operator: kinds of operators, by their aten names.
SAVE_KINDS: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"),
    "conv": ("convolution",),
}


def _overloads(op: Any) -> list:
    return [getattr(op, o) for o in op.overloads() if o != "out"]


def save_ops(save: tuple[str, ...]) -> frozenset:
    """The names of the aten operators whose outputs a region keeps, for ``save``'s names (names,
    not the operators: a model holding them pickles). Raises ``ValueError`` for a name that is
    neither a kind nor an aten operator, for one that never reaches the checkpoint (decomposed
    before it: ``linear``), for one that changes a tensor in place (a kept output changed in place
    fails in backward), and for a random one (unless, like a fused attention, it draws only with a
    ``dropout_p`` above 0: then it is kept where that is 0)."""
    names = set()
    for name in save:
        if not isinstance(name, str):
            raise ValueError(f"shrinkwrap: checkpoint(save=...) takes names, got {name!r}")
        for op_name in SAVE_KINDS.get(name, (name,)):
            op = getattr(torch.ops.aten, op_name, None)
            if not isinstance(op, _compat.op_overload_packet()):
                if name in SAVE_KINDS:
                    continue  # a kernel this build of torch lacks
                raise ValueError(
                    f"shrinkwrap: checkpoint(save=...) cannot keep {name!r}: it is neither one of "
                    f"{', '.join(map(repr, SAVE_KINDS))} nor an aten operator (torch.ops.aten.{name})")
            why = _unkeepable(op)
            if why and name not in SAVE_KINDS:
                raise ValueError(f"shrinkwrap: checkpoint(save=...) cannot keep {name!r}: {why}")
            names.add(op_name)
    return frozenset(names)


def _unkeepable(op: Any) -> str | None:
    overloads = _overloads(op)
    if overloads and all(o._can_decompose() for o in overloads):
        return ("torch breaks it into other operators before a checkpoint sees them (linear into mm or "
                "addmm, scaled_dot_product_attention into a fused kernel); name what it becomes, or "
                f"one of {', '.join(map(repr, SAVE_KINDS))}")
    if overloads and all(o._schema.is_mutable for o in overloads):
        return ("it changes a tensor in place, and an output kept by the checkpoint and then changed fails "
                "in backward. Keep the operator before it")
    seeded = any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads)
    if seeded and not any(a.name == "dropout_p" for o in overloads for a in o._schema.arguments):
        return ("it draws random numbers, and keeping its output would shift the random stream of what "
                "the recompute draws after it (a dropout mask would differ from the forward's). Leave it "
                "to the recompute")
    return None


def _save_policy(names: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective-checkpoint policy of ``save``: keep the outputs of the aten operators
    ``names``, but never of a call that draws random numbers. It answers alike in the forward and
    in the recompute (torch 2.11 asks it in both, and takes a kept output only where the answers
    agree; 2.13 asks in the forward only)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op.namespace == "aten" and op._overloadpacket.__name__ in names and not _draws(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _draws(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers: a seeded operator, unless its ``dropout_p`` is 0."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs["dropout_p"] if "dropout_p" in kwargs else args[i] if i < len(args) else arg.default_value
            return value != 0
    return True


def selective(names: frozenset) -> dict:
    """torch checkpoint's keyword arguments for a region keeping the outputs of the aten
    operators ``names`` (none: {})."""
    if not names:
        return {}
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = functools.partial(_save_policy, names)
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


class _KeptMutated:
    """Recompute context of a region keeping outputs: torch's error for a kept output that the
    region then changed in place ("Tensor cached during selective activation checkpoint has been
    mutated", raised in backward with no module named) raised again naming the region's in-place
    modules and the fix."""

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        self.named = named

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, RuntimeError) and "selective activation checkpoint has been mutated" in str(exc):
            inplace = [f"{_dotted(region, sub)} ({type(m).__name__}(inplace=True))"
                       for region, module in self.named for sub, m in module.named_modules()
                       if getattr(m, "inplace", None) is True]
            raise RuntimeError(
                f"shrinkwrap: the checkpoint region {' -> '.join(repr(n) for n, _ in self.named)} keeps the output "
                f"of an operator named in save=, and then changes that output in place (an in-place activation "
                f"right after a convolution or a Linear), so the kept value is no longer the one the recompute "
                f"needs. In-place modules in it: {', '.join(inplace) or 'none (an in-place operation in its code)'}. "
                f"Set inplace=False on them, or leave that operator out of save=.") from exc

