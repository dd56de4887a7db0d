"""torch's automatic selective activation checkpointing (auto-SAC), as an anchor of the suite.

``torch.distributed._tools`` ships a planner for selective activation checkpointing, and no way to
apply its answer. This module runs the planner as torch's own tests do and applies what it chose:

1. **Statistics** of one training iteration, on fake tensors (``FakeTensorMode``: nothing runs on
   the GPU, shapes only) of a copy of the model: ``MemTracker`` (memory per module), and
   ``RuntimeEstimator`` and ``SACEstimator`` (each operator's time by a roofline model of the
   GPU, its output's bytes, which of them are random, views or in place), gathered by
   ``aggregate_stats``.
2. ``sac_milp``: which modules to checkpoint and what share of each one's activation memory to
   discard, for the least estimated recompute time under a peak-memory budget (parameters,
   gradients and activations; not the optimizer's state). It needs ``pulp`` (its CBC solver),
   and step 1 needs ``pwlf`` (piecewise-linear fits of each module's trade-off curve), hence scipy.
3. Per chosen module, ``get_optimal_checkpointing_policy_per_module``: which of its operators to
   save so that the module keeps at most ``1 - discard`` of its activation memory.
4. Each chosen module runs under torch's non-reentrant checkpoint with a selective policy that
   saves those operators, matched by operator and occurrence (see ``_Region``).

The budget is given as a share of what the planner's own estimate of the model's activation
peak is: ``budget = parameters + gradients + share * (estimated baseline peak - parameters -
gradients)``. Statistics are taken under the same autocast the row trains with (bfloat16 by
hand, as the suite's other anchors do it), since autocast's casts are operators of the regions.

    from auto_sac import torch_auto_sac
    model = torch_auto_sac(model, batch, share=0.5, dtype=torch.bfloat16)   # then train it under autocast

On a machine that installs nothing (the project's GPU machine), the two packages travel with the
tree: ``pip install --target .sacdeps pulp pwlf --no-deps`` here (untracked; pulp's CBC binaries
for other platforms can go), carry ``.sacdeps``, and run with ``PYTHONPATH=$PWD/src:$PWD/.sacdeps``;
numpy and scipy are the machine's own.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch
import torch.nn as nn


def _statistics(model: nn.Module, batch: Any, dtype: torch.dtype | None) -> tuple[Any, dict]:
    """Step 1: the module graph ``sac_milp`` takes, and each module's ``SACStats`` by its name."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import _ModState, MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    from shrinkwrap._tree import tree_map
    from shrinkwrap.measuring.step import call_model, default_loss

    device = next(model.parameters()).device
    fake_mode = FakeTensorMode()
    with FakeCopyMode(fake_mode):
        fake = copy.deepcopy(model)
    inputs = tree_map(lambda t: fake_mode.from_tensor(t.to(device)), batch)
    cast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    mode = "operator-level-cost-model"
    with fake_mode:
        opt = torch.optim.AdamW(fake.parameters(), foreach=True)

        def loss() -> torch.Tensor:
            with cast():
                return default_loss(call_model(fake, inputs))

        tracker = MemTracker()
        tracker.track_external(fake, opt)
        with tracker as mt:
            for i in range(2):  # the first iteration makes the optimizer's state
                loss().backward()
                if i == 1:
                    last = mt.get_tracker_snapshot("current")
                opt.step()
                opt.zero_grad()
                if i == 0:
                    mt.reset_mod_stats()
        for stats in tracker.memory_tracking.values():
            # As torch's tests do: a module whose inputs need no gradient gets no post-backward hook.
            stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
        runtime = RuntimeEstimator()
        with runtime(estimate_mode_type=mode):
            loss().backward()
            opt.step()
            opt.zero_grad()
        sac = SACEstimator()
        with sac(estimate_mode_type=mode):
            value = loss()
        value.backward()
        info = aggregate_stats(fake, tracker, runtime, sac, device)
    order = info["mod_order"]["fw_pre_order"]
    again = sorted({name for name in order if order.count(name) > 1})
    if again:
        # parse_module_info would fail on a bare assertion: its graph has one node per module call.
        raise RuntimeError(f"auto-SAC: torch's planner takes each module to run once per forward; "
                           f"{again[0]!r} runs {order.count(again[0])} times ({len(again)} such modules)")
    return parse_module_info(info), sac.sac_mod_stats


def plan(model: nn.Module, batch: Any, share: float,
         dtype: torch.dtype | None = None) -> dict[str, tuple[list[int], list[str]]]:
    """Steps 1-3: ``{module name: (save (1) or recompute (0) per operator, the operators' names)}``
    for the modules the planner checkpoints at ``share`` of its estimated activation peak (``""``:
    the whole model); ``{}`` where it checkpoints nothing. Raises where the solver finds no answer."""
    import builtins

    from torch.distributed._tools import sac_ilp
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module, sac_milp

    # An operator with neither memory nor runtime (a view) has a zero coefficient everywhere, so
    # pulp leaves its variable out of the problem and it comes back with no value, on which the
    # planner's round() fails (efficientnet_b0). It costs nothing either way: counted as recompute.
    sac_ilp.round = lambda value, *digits: builtins.round(0 if value is None else value, *digits)

    graph, stats = _statistics(model, batch, dtype)
    peak, _ = get_peak_memory_runtime_baseline(graph)
    fixed = 2 * graph.nodes[0]["param_per_module"]  # parameters and their gradients
    budget = fixed + share * max(0, peak - fixed)
    decisions, _, found = sac_milp(graph, memory_budget=budget / 2**30)
    if found < 0:
        raise RuntimeError(f"auto-SAC: the solver found no plan within {budget / 2**30:.2f} GiB")
    root = graph.nodes[0]["fqn"]
    return {fqn.removeprefix(root).lstrip("."):
            (get_optimal_checkpointing_policy_per_module(stats[fqn], 1 - discard), stats[fqn].func_names)
            for fqn, discard in decisions.items()}


class _Region(nn.Module):
    """A module auto-SAC checkpoints, with its per-operator decisions (step 4).

    The decisions are keyed by operator and occurrence (the third ``addmm`` the region dispatches
    is the third the estimator saw), as torch's SAC keys what it stores: the estimator runs on fake
    tensors, where a constant is made by other operators (``scalar_tensor``, where the real run
    dispatches ``copy_``), so positions in the whole sequence do not line up, while the matrix
    products, attention and the like do. An operator the estimator did not see is recomputed, and
    counted in ``unseen``; the policy never raises, since an error inside torch's selective
    checkpoint leaves its dispatch mode behind for every later forward in the process."""

    def __init__(self, name: str, module: nn.Module, saves: list[int], names: list[str]) -> None:
        super().__init__()
        self.module, self.name = module, name
        self.saves: dict[str, list[int]] = {}
        for op, save in zip(names, saves, strict=True):
            self.saves.setdefault(op, []).append(save)
        self.unseen: set[str] = set()

    def _context(self) -> Any:
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        # Counted apart in the forward and in the recompute: torch 2.11 asks the policy again in
        # the recompute (is_recompute=True), and takes a saved output only where it answers alike.
        seen: dict[bool, dict[str, int]] = {False: {}, True: {}}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if op in OPS_TO_ALWAYS_SKIP:
                return CheckpointPolicy.PREFER_RECOMPUTE
            name = op._overloadpacket.__name__
            counts = seen[ctx.is_recompute]
            i = counts[name] = counts.get(name, -1) + 1
            flags = self.saves.get(name, [])
            if i >= len(flags):
                if not ctx.is_recompute:
                    self.unseen.add(name)
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if flags[i] else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not (self.training and torch.is_grad_enabled()):
            return self.module(*args, **kwargs)
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._context, **kwargs)


def torch_auto_sac(model: nn.Module, batch: Any, share: float, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` with auto-SAC's regions applied (steps 1-4) at ``share`` of the planner's estimated
    activation peak, statistics taken under ``torch.autocast`` of ``dtype`` where given. Each chosen
    module is replaced by a ``_Region`` holding it (its parameter names gain ``.module``, as
    ``checkpoint_wrapper``'s gain a prefix). ``model.auto_sac`` records the regions and how many
    operators each saves, ``model.auto_sac_s`` the planner's seconds (steps 1-3)."""
    started = time.perf_counter()
    decisions = plan(model, batch, share, dtype)
    seconds = time.perf_counter() - started
    for name, (saves, names) in decisions.items():
        if not name:
            model = _Region("(the model)", model, saves, names)
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, _Region(name, owner.get_submodule(leaf), saves, names))
    model.auto_sac = {name or "(the model)": f"saves {sum(saves)} of {len(saves)} operators"
                      for name, (saves, _) in decisions.items()}
    model.auto_sac_s = round(seconds, 1)
    return model


def describe(model: nn.Module) -> str:
    """The regions of a model ``torch_auto_sac`` rewrote, and the operators its regions dispatched
    that the estimator had not seen (recomputed); after a training forward."""
    regions = [m for m in model.modules() if isinstance(m, _Region)]
    unseen = sorted(set().union(*(r.unseen for r in regions)))
    return ("auto-SAC: " + ", ".join(f"{k} {v}" for k, v in model.auto_sac.items())
            + (f"; not seen by the estimator, recomputed: {', '.join(unseen)}" if unseen else ""))

