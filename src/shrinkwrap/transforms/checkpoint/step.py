"""The ``checkpoint`` plan step: which modules become regions, and what is refused at apply time.

``checkpoint(pattern, clone_inputs=False, chain=False, save=())`` wraps each module ``pattern``
selects (outermost matches only) in a ``CheckpointModule``, or, with ``chain=True``, each run of
selected siblings in ``ChainMember`` wrappers. Refused when the step is made or applied: a
``save`` name it cannot keep, a region that starts with an in-place module (unless
``clone_inputs=True``), a chain member with no selected neighbour.

Hugging Face models: the KV cache would be written again by the recompute; a model holding
checkpoint regions is called with ``use_cache=False`` in training, as HF's own
``gradient_checkpointing_enable()`` does (the record's notes say so; ``revert`` undoes it).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn as nn

from ... import _rewrite
from ..._wrapper import unwrap
from ...select import Pattern, SelectionError, has_params, pattern_for, require_module
from ...step import Candidate, Context, Step, Targets
from .candidates import checkpoint_candidates
from .chain import ChainMember, _Chain, _chains
from .region import CheckpointModule
from .save import save_ops, selective


class _NoCacheInTraining:
    """Forward pre-hook of a Hugging Face model that holds checkpoint regions: in training, call
    it with ``use_cache=False``. Its blocks would otherwise write their KV cache in the forward and
    again in the recompute, and backward fails (or, worse, reads the doubled cache)."""

    def __init__(self, position: int) -> None:
        self.position = position  # use_cache's index among the positional parameters after self

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if len(args) > self.position:
            return (*args[: self.position], False, *args[self.position + 1 :]), kwargs
        return args, {**kwargs, "use_cache": False}


def _cache_hooks(model: nn.Module, regions: list[str]) -> tuple[list, list[str]]:
    """Hook the outermost modules taking ``use_cache`` (Hugging Face models) that hold or are one
    of ``regions``; return the undo entries and a note per module."""
    undo, notes, owners = [], [], []
    for name, module in model.named_modules():
        if any(not o or name.startswith(o + ".") for o in owners):
            continue
        params = list(inspect.signature(type(unwrap(module)).forward).parameters)
        if "use_cache" not in params or not any(r == name or not name or r.startswith(name + ".") for r in regions):
            continue
        owners.append(name)
        if any(isinstance(h, _NoCacheInTraining) for h in module._forward_pre_hooks.values()):
            continue  # an earlier checkpoint step hooked it
        hook = _NoCacheInTraining(params.index("use_cache") - 1)
        undo.append(_rewrite.Hooked(module.register_forward_pre_hook(hook, with_kwargs=True)))
        notes.append(f"{name or type(model).__name__} runs with use_cache=False in training: "
                     "the recompute would write its KV cache a second time")
    return undo, notes


def _first_leaf(module: nn.Module) -> nn.Module:
    while True:
        children = list(module.children())
        if not children:
            return module
        module = children[0]


@dataclasses.dataclass(frozen=True)
class Checkpoint(Step):
    """Step: checkpoint the submodules that ``pattern`` selects (outermost matches only).

    Args:
        pattern: which modules (see :func:`shrinkwrap.select`); each is one region.
        clone_inputs: give each region a private copy of its inputs (regions that start in place).
        chain: selected siblings next to each other in their parent's order are one region, for
            modules the parent calls one after another (see ``checkpoint.chain``); a selected
            module with no selected neighbour is an error.
        save: operators whose outputs each region keeps instead of recomputing: ``"matmul"``,
            ``"attention"``, ``"conv"``, or aten operator names (see ``checkpoint.save``). A
            name that is neither, or a random operator, is refused when the step is made.

    Example::

        >>> sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]")]))
        >>> sw.apply(resnet, sw.Plan([sw.checkpoint(r"conv1|bn1|relu|maxpool", chain=True)]))  # the stem
        >>> sw.apply(gpt2, "checkpoint(r'transformer\\.h\\.\\d+', save=('matmul',))")  # recompute all but the Linears
    """

    name = "checkpoint"
    order = 10
    recomputes = True

    pattern: Pattern
    clone_inputs: bool = False
    chain: bool = False
    save: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.save, str):
            object.__setattr__(self, "save", (self.save,))
        super().__post_init__()
        save_ops(self.save)  # a name it cannot keep is refused here, not at the first forward

    def targets(self, model: nn.Module) -> Targets:
        """Matched: the modules to wrap; payload: the regions, a list of names each (one name
        each, or the members of each chain)."""
        wrap, skipped = _rewrite.wrap_targets(model, self.pattern, CheckpointModule, "checkpoint", "checkpointed")
        regions = _chains(model, wrap) if self.chain else [[name] for name in wrap]
        for region in regions:
            first = _first_leaf(model.get_submodule(region[0]))
            if not self.clone_inputs and getattr(first, "inplace", False):
                what = f"the chain {' -> '.join(map(repr, region))}" if self.chain else repr(region[0])
                raise SelectionError(
                    f"shrinkwrap: cannot checkpoint {what}: it starts with an in-place "
                    f"{type(first).__name__}, which modifies the region's input that the "
                    "recompute needs. Checkpoint a region that starts after it, or pass clone_inputs=True."
                )
        return Targets(wrap, skipped, payload=regions)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        undo = _rewrite.unwrap_inside(model, targets.matched, CheckpointModule)
        if self.chain:
            chains: dict[str, _Chain] = {}
            keep = selective(save_ops(self.save))
            for names in targets.payload:
                chains.update(dict.fromkeys(names, _Chain(names, self.clone_inputs, keep)))
            make = lambda n, m: ChainMember(m, chains[n], name=n)  # noqa: E731
        else:
            make = lambda n, m: CheckpointModule(  # noqa: E731
                m, name=n, clone_inputs=self.clone_inputs, save=self.save)
        undo += _rewrite.replace(model, targets.matched, make)
        hooks, notes = _cache_hooks(model, targets.matched)
        targets.notes += notes
        return undo + hooks

    def under_budget(self, model: nn.Module) -> Step | None:
        """Under the partitioner's memory budget a chain keeps a region over its first module with
        parameters (a ResNet stem's convolution ``conv1``), recomputed whole; other regions are
        left to the partitioner.

        The partitioner recomputes cheap operators (normalisation, activation, pooling) but never
        a convolution or a matmul. A stem's convolution writes the model's largest activation,
        which the normalisation after it keeps for backward; a region over the convolution alone
        takes it out of what the graph keeps (benchmarks/RESULTS.md, "Per model", resnet18's
        ``checkpoint('conv1')`` rows). The whole chain as a region would not: its recompute in
        the stem's backward becomes the peak.

        Example::

            >>> Checkpoint(r"conv1|bn1|relu|maxpool", chain=True).under_budget(resnet)
            Checkpoint(pattern='conv1', clone_inputs=False, chain=False, save=())
        """
        if not self.chain:
            return None
        heads = [[n for n in region if has_params(model.get_submodule(n))][:1] for region in self.targets(model).payload]
        heads = [n for head in heads for n in head]
        # Not the chain's save=: with save=('conv',) a region over the convolution would keep its output.
        return Checkpoint(pattern_for(model, heads), self.clone_inputs) if heads else None

    @classmethod
    def merge(cls, steps: list[Step], model: nn.Module) -> list[Step]:
        """Regions chosen by name become one step with one regex selecting exactly them
        (``checkpoint(r'layer3\\.\\d+|layer4\\.[01]')``, not a tuple of names). Chain steps stay
        as they are: merged with each other, two chains side by side would become one."""
        named = [s for s in steps if not s.chain and isinstance(s.pattern, tuple)
                 and all(isinstance(p, str) for p in s.pattern)]
        if not named or len({(s.clone_inputs, s.save) for s in named}) > 1:
            return steps
        names = [n for s in named for n in s.pattern]
        names.sort(key=[n for n, _ in model.named_modules()].index)
        return [s for s in steps if s not in named] + [
            cls(pattern_for(model, names), named[0].clone_inputs, save=named[0].save)]

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        """Stages, groups of blocks, blocks alone and a stem chain: see :func:`.candidates.checkpoint_candidates`."""
        return checkpoint_candidates(cls, model, context)


def apply_checkpoint(model: nn.Module, pattern: Pattern, *, clone_inputs: bool = False,
                     chain: bool = False, save: tuple[str, ...] = ()) -> nn.Module:
    """Checkpoint the submodules of ``model`` that ``pattern`` selects, in place; return ``model``.

    See :class:`CheckpointModule` for what is preserved, and ``checkpoint.chain`` for
    ``chain=True``. Raises ``SelectionError`` for a pattern that matches nothing, a module with no
    forward (``ModuleList``), a region that starts with an in-place operation (unless
    ``clone_inputs=True``), or, with ``chain=True``, a module with no selected neighbour.

    Example::

        >>> apply_checkpoint(resnet, r"layer[12]")
        >>> print(resnet.layer1)   # Checkpoint[Sequential](...)
    """
    step = Checkpoint(pattern, clone_inputs=clone_inputs, chain=chain, save=save)
    return step.apply(require_module(model, "apply_checkpoint()"))

