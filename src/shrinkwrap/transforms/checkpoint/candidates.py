"""The regions autoplan tries for ``checkpoint``: stages, groups of blocks, blocks alone, and the
modules before a model's first stack (a ResNet's stem) as one chain."""

from __future__ import annotations

import math

import torch.nn as nn

from ... import _rewrite
from ..._wrapper import unwrap
from ...select import block_groups, has_params, pattern_for
from ...step import Candidate, Context


def checkpoint_candidates(cls: type, model: nn.Module, context: Context) -> list[Candidate]:
    """Every stage of two or more same-type blocks (where it has a forward) and groups of its
    consecutive blocks; an inner stage (an EfficientNet stage inside ``features``, a ConvNeXt or
    Swin stage of blocks) gives the whole stage as one region and every block of it as a region
    of its own (with four blocks or more, each half's blocks too), or its blocks in two groups
    where it has no forward. One region over a whole stage recomputes the stage at once in
    backward and holds all of its activations then; a region per block holds one block's
    at a time. A stack of six or more blocks also gives every second and every third block:
    half or a third of the recompute for about that share of the saving, points between the
    groups; a stack of at most twelve (a transformer's layers) also gives each block alone, so
    the search can take as many blocks as the time allows (longer stacks would cost a
    measurement per block). The modules a parent calls before its first stack (a ResNet's
    stem) give one chain region (see :func:`_stems`).

    Args:
        cls: the step class (``Checkpoint``), called for each region.
        model: the model the candidates are for.
        context: the search's settings (``max_groups``: how many groups a long stack is cut into).

    Returns:
        One candidate a region, each one step that applies to ``model``.
    """
    out: list[Candidate] = []
    groups = block_groups(model)
    for container, blocks, nested in groups:
        stage = bool(container) and isinstance(model.get_submodule(container), nn.Sequential)
        regions = [[container]] if stage else []
        if nested and stage:
            regions += [blocks] + (_chunks(blocks, 2) if len(blocks) >= 4 else [])
        else:
            regions += _chunks(blocks, 2 if nested else context.max_groups)
            regions += [blocks[k - 1::k] for k in (2, 3) if not nested and len(blocks) >= 6]
            regions += [[b] for b in blocks] if not nested and len(blocks) <= _SINGLES else []
        for names in regions:
            step = cls(tuple(names))
            if all(tuple(names) != c.covers for c in out) and step.applies(model):
                out.append(Candidate((step,), tuple(names)))
    for names in _stems(model, groups):
        step = cls(pattern_for(model, names), chain=True)
        if step.applies(model):
            out.append(Candidate((step,), tuple(names)))
    return out


_SINGLES = 12  # the longest stack whose blocks are candidates one by one


def _stems(model: nn.Module, groups: list[tuple[str, list[str], bool]]) -> list[list[str]]:
    """Chains worth a candidate: per module holding a stack of blocks (``groups``, from
    :func:`block_groups`), the children right before its first stack, two or more of them with
    parameters among them: a ResNet's ``conv1 -> bn1 -> relu -> maxpool`` before ``layer1``.
    Checkpointed one by one each would keep its own input; as one chain only the first's is kept.

    Only before an ``nn.Sequential`` stack (a ResNet's stage, called as one module in a line of
    calls): before a ``ModuleList`` of transformer layers the modules are embeddings whose outputs
    are added up, not chained. The run stops at a module with no forward (``ModuleList``)."""
    stacks: dict[str, set[str]] = {}  # parent -> the keys of its children that are, or start, a stack
    for container, blocks, _ in groups:
        if isinstance(unwrap(_rewrite.get_module(model, container)), nn.Sequential):
            for name in (container, blocks[0]) if container else blocks[:1]:
                parent, _, key = name.rpartition(".")
                stacks.setdefault(parent, set()).add(key)
    stems = []
    for parent, keys in stacks.items():
        run: list[tuple[str, nn.Module]] = []
        for key, child in _rewrite.get_module(model, parent)._modules.items():
            if key in keys:
                break
            runs = child is not None and type(unwrap(child)).forward is not nn.Module.forward
            run = run + [(f"{parent}.{key}" if parent else key, child)] if runs else []
        if len(run) >= 2 and any(has_params(m) for _, m in run):
            stems.append([n for n, _ in run])
    return stems


def _chunks(items: list[str], n: int) -> list[list[str]]:
    size = math.ceil(len(items) / n)
    return [items[i:i + size] for i in range(0, len(items), size)]

