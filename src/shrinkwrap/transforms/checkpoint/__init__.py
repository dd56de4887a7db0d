"""Activation checkpointing: recompute a region's activations in backward instead of storing them.

``checkpoint(pattern)`` wraps each selected module in a ``CheckpointModule``, which runs it under
non-reentrant ``torch.utils.checkpoint`` and fixes what the plain recipe gets wrong (BatchNorm
statistics updated twice, a recompute starting from buffers, attributes or containers the forward
changed). ``save=`` keeps chosen operators' outputs; ``chain=True`` makes siblings one region. The
files, one concern each:

- ``step.py``: the plan step ``Checkpoint`` and ``apply_checkpoint``; a Hugging Face model's
  ``use_cache`` off in training.
- ``region.py``: ``CheckpointModule``, one region, eager and under ``torch.compile``.
- ``restore.py``: what the recompute starts from and what it puts back (buffers, attributes,
  generators, the containers among the inputs).
- ``save.py``: selective recompute, ``save=``: which operators' outputs a region keeps.
- ``chain.py``: ``chain=True``: siblings their parent calls one after another as one region.
- ``candidates.py``: the regions autoplan tries.

Example::

    >>> sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]")]))
    >>> sw.apply(resnet, sw.Plan([sw.checkpoint(r"conv1|bn1|relu|maxpool", chain=True)]))  # the stem
    >>> sw.apply(gpt2, "checkpoint(r'transformer\\.h\\.\\d+', save=('matmul',))")  # recompute all but the Linears
"""

from .chain import ChainMember
from .region import CheckpointModule
from .save import SAVE_KINDS, save_ops, selective  # noqa: F401  (public: what save= may name)
from .step import Checkpoint, apply_checkpoint

__all__ = ['ChainMember', 'Checkpoint', 'CheckpointModule', 'apply_checkpoint']
