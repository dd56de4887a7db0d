"""What the two activation steps share."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ...select import Pattern
from ...step import Candidate, Context, Step


@dataclasses.dataclass(frozen=True)
class _WholeModelStep(Step):
    """What the activation steps share: an optional pattern (default: the whole model), and one
    candidate for autoplan, the step itself, where it finds something to do."""

    pattern: Pattern | None = None

    @classmethod
    def candidates(cls, model: nn.Module, context: Context) -> list[Candidate]:
        return cls.itself(model)
