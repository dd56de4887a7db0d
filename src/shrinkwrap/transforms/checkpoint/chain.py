"""Chains (``checkpoint(pattern, chain=True)``): sibling modules their parent calls one after
another, recomputed as one region.

A ResNet's forward calls ``conv1``, ``bn1``, ``relu`` and ``maxpool`` one after another;
checkpointed one by one each region keeps its own input, so nothing is saved. A chain makes
selected siblings that are adjacent in their parent's registration order one region, which keeps
only the first member's input. Each member is wrapped in a ``ChainMember`` (names unchanged).

When the parent calls the first member in training, one checkpoint (the same machinery as a
plain region: BatchNorm statistics put back, containers copied, an in-place input named) runs
every member in turn and returns all their outputs; the first member returns its own, and each
later member, called with exactly the previous member's output (``is``) and nothing else, returns
its precomputed one. The parent's data flow keeps the real tensors, so a skip connection that
reuses an inner output gets its value and gradient. The outputs are dropped when the last member
returns. Guarantees:

- exact as a plain region: outputs, gradients and buffers bit-equal to the unwrapped model's in
  float64; BatchNorm counted once; dropout masks equal in the recompute; an in-place module inside
  the chain is fine, and one at its start is refused at apply time as for a plain region;
- the parent is checked: the first training forward runs the members plainly and watches that
  the parent calls each once, in order, on the previous member's output alone. Where it does not
  (``self.b(self.a(x) * 2)``, a member called twice) a ``RuntimeError`` names the chain, the
  member and the fix, and it does so at any later forward that breaks the chain, never returning
  a precomputed output for other inputs or running a member a second time. A forward that stops
  after some members is named at the next forward; by then the chain had run the rest (a
  BatchNorm among them counted that step);
- a selected module with no selected neighbour is refused (``SelectionError``): a chain has two
  or more members;
- ``eval``, ``no_grad`` and ``inference_mode`` run each member plainly; under ``torch.compile``
  the chain is one checkpoint region in the graph (no break, recomputed by the compiler), and the
  parent's calls are checked as the graph is traced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ... import _rewrite
from ...select import SelectionError
from .region import CheckpointModule, _checkpointed, _refuse_functorch, _traced, _Untraced
from .restore import _Buffers


class _Chain:
    """One chain region: its members (the wrappers, in their parent's order) and where the parent's
    forward is in it.

    ``step`` is the index of the member the parent must call next (0: no forward in progress),
    ``last`` the output that member must be called with, ``outs`` every member's output computed
    at the first member's call (None while the first training forward observes the members run
    plainly: ``verified`` turns true once it saw the parent chain them)."""

    def __init__(self, names: list[str], clone: bool, keep: dict) -> None:
        self.names, self.clone, self.keep = names, clone, keep
        self.text = " -> ".join(map(repr, names))  # for messages; a string, which dynamo can format
        self.members: list[ChainMember] = []
        self.buffers = _Buffers()
        self.verified = False
        self._reset()

    def _reset(self) -> None:
        self.step, self.last, self.outs = 0, None, None

    def __getstate__(self) -> dict:
        # A copy starts between forwards: the outputs held for the parent are not copied with it.
        state = dict(self.__dict__)
        state.update(step=0, last=None, outs=None)
        return state

    def run(self, *args: Any, **kwargs: Any) -> tuple:
        """The region: each member on the previous member's output; every member's output."""
        outs = [self.members[0].wrapped(*args, **kwargs)]
        for member in self.members[1:]:
            outs.append(member.wrapped(outs[-1]))
        return tuple(outs)

    def call(self, i: int, args: tuple, kwargs: dict) -> Any:
        """The parent calls member ``i`` with ``args``, ``kwargs``."""
        member = self.members[i]
        if i == 0 and self.step:
            raise self._broken(f"the forward before called {self.names[self.step - 1]!r} and not "
                               f"{self.names[self.step]!r} after it")
        if not self.step and not (torch.is_grad_enabled() and any(m.training for m in self.members)):
            return member.wrapped(*args, **kwargs)
        if i == 0:
            if torch.compiler.is_compiling():
                # As CheckpointModule's compiled form: the region traced into the graph, recomputed
                # by the compiler's partitioner. The calls below are checked as the graph is traced.
                untraced = _Untraced(list(zip(self.names, self.members)), self.buffers, f"chain {self.text}",
                                     self.clone)
                self.outs = _traced(untraced, self.run, kwargs, *args, **self.keep)
            elif self.verified:
                _refuse_functorch(f"chain {self.text}")
                self.outs = _checkpointed(self.run, list(zip(self.names, self.members)), self.buffers,
                                          f"chain {self.text}", self.clone, args, kwargs, self.keep)
            out = member.wrapped(*args, **kwargs) if self.outs is None else self.outs[0]
            self.step, self.last = 1, out
            return out
        if not self.step:
            raise self._broken(f"{member._sw_name!r} was called without {self.names[0]!r} before it")
        if i != self.step:
            raise self._broken(f"{member._sw_name!r} was called where {self.names[self.step]!r} comes next")
        if kwargs or len(args) != 1 or args[0] is not self.last:
            raise self._broken(f"{member._sw_name!r} was called with something other than the output "
                               f"of {self.names[i - 1]!r} alone")
        if self.outs is not None:
            out = self.outs[i]
        else:
            try:
                out = member.wrapped(*args)
            except BaseException:
                self._reset()  # a forward that raised inside a member is not a parent that stops there
                raise
        if i < len(self.members) - 1:
            self.step, self.last = i + 1, out
            return out
        if not torch.compiler.is_compiling():
            self.verified = True
        self._reset()
        return out

    def _broken(self, what: str) -> RuntimeError:
        self._reset()
        return RuntimeError(
            f"shrinkwrap: checkpoint chain {self.text}: {what}. A chain region runs all its members when "
            "the first is called, so their parent must call each member once, in order, on the "
            "previous member's output alone (x = self.conv1(x); x = self.bn1(x); ...). Checkpoint "
            "these modules without chain=True, or checkpoint a module that holds them."
        )


class ChainMember(CheckpointModule):
    """One member of a checkpoint chain: siblings their parent calls one after another, recomputed
    in backward as one region (see the module docstring). The first member runs the whole chain
    under checkpoint; each later one returns its precomputed output. Built by
    ``checkpoint(pattern, chain=True)``; names and ``state_dict`` are unchanged."""

    label = "CheckpointChain"
    spans_siblings = True

    def __init__(self, module: nn.Module, chain: _Chain, *, name: str = "") -> None:
        super().__init__(module, name=name, clone_inputs=chain.clone)
        self._sw_chain = chain
        self._sw_index = len(chain.members)
        chain.members.append(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._sw_chain.call(self._sw_index, args, kwargs)


def _chains(model: nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` (outermost, in ``named_modules`` order) as chains: runs of siblings adjacent in
    their parent's registration order. A name with no selected sibling next to it is an error."""
    runs: list[list[str]] = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        keys = list(_rewrite.get_module(model, parent)._modules)
        before = keys.index(leaf) - 1
        if runs and before >= 0 and runs[-1][-1] == (f"{parent}.{keys[before]}" if parent else keys[before]):
            runs[-1].append(name)
        else:
            runs.append([name])
    for run in runs:
        if len(run) == 1:
            raise SelectionError(
                f"shrinkwrap: cannot checkpoint {run[0]!r} as a chain: no module next to it in its "
                "parent's order is selected, and a chain is two or more sibling modules that their "
                "parent calls one after another. Select its neighbours too, or checkpoint it "
                "without chain=True."
            )
    return runs

