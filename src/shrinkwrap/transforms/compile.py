"""Compile: ``torch.compile`` the model in place, as the last step of a plan.

:class:`Compile` (``compile(mode=None, fullgraph=False, dynamic=None, memory_budget=None,
backend='inductor', pattern=None)``) compiles the root module's call the way
``nn.Module.compile`` does: the module object, its names and its ``state_dict`` keys stay as
they were (no ``_orig_mod.`` prefix), and whatever the earlier steps of the plan did is compiled
with it; a module whose forward is torch's own (an ``nn.Sequential``), where that way traces
nothing, and each region of ``pattern`` are compiled through a call of this package's own (see
``_entered``). With ``pattern`` it compiles the selected modules instead, each in place
(regional compilation), and the rest of the model runs eagerly: for a part the compiler makes
worse than eager. Inductor traces BERT's attention (a padding mask and attention dropout) into
unfused math that keeps the probabilities and the dropout mask, where eager runs a fused kernel;
compiling every part of the layer but ``attention.self`` keeps the fused kernel
(benchmarks/RESULTS.md, What fits: bert's best plan). A whole model shares dynamo's limit of
recompiles with every other compiled through ``nn.Module._call_impl``, as under
``nn.Module.compile``: past eight models of other structures compiled in one process, the next
runs eagerly, with a warning in torch's log (``measure`` raises where that happens as it
measures).

Checkpoint regions whose forward has a Python side effect (it sets an attribute, or changes a
list or dict) are traced into the graph, where under ``torch.compile`` by hand dynamo breaks the
graph at them (see ``_replaying_once``): the side effect happens once a step, as in the model
without checkpoint.

``memory_budget`` is the activation memory budget of the min-cut partitioner
(``torch._functorch.config.activation_memory_budget``: 1.0 saves what the default strategy saves,
lower values recompute more in backward) for this model only. The partitioner reads that global
while it partitions a joint graph, which happens inside the compiler backend (on the first
compiled call and on each recompile), so this step hands ``torch.compile`` a backend that sets
the budget for the length of its own call and leaves the global as it was. The backend also
compares equal only to one with the same budget: dynamo shares compiled code between the models
of one class, and the global budget is no part of its guards, so without that a model compiled
first would decide the budget of the others.
"""

from __future__ import annotations

__all__ = ['Compile']

import dataclasses
import itertools
from typing import Any

import torch
import torch.nn as nn

from .. import _compat
from ..select import Pattern, SelectionError, lies_inside, compiled_how, select
from ..step import Step, Targets, applied_steps

# Backends that partition with the default strategy (or not at all): they would ignore a budget.
_NO_BUDGET = ("eager", "aot_eager")
PARTITIONING = ("inductor", "aot_eager_decomp_partition")  # backends known to take the memory budget
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch 2.x's; others asked of torch


class _Budgeted:
    """A compiler backend: torch's own for ``backend`` and ``mode``, run with the partitioner's
    activation memory budget set to ``budget`` for the length of the call."""

    def __init__(self, backend: str, mode: str | None, dynamic: bool | None, budget: float) -> None:
        # What torch.compile itself makes of a backend name and a mode: a callable backend gets
        # no mode from torch.compile.
        self.inner: Any = _compat.compile_backend(backend, mode, dynamic)
        self.key = (backend, mode, dynamic, budget)
        self.__name__ = f"{backend}[memory_budget={budget}]"  # torch.compile names the backend by it

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        functorch_config = _compat.functorch_config()
        with functorch_config.patch(activation_memory_budget=self.key[-1]):
            return self.inner(gm, example_inputs)

    def __eq__(self, other: object) -> bool:
        # Dynamo reuses compiled code only under an equal backend: equal settings, equal budget.
        return isinstance(other, _Budgeted) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


def _torchs_own(module: nn.Module) -> bool:
    """Whether ``module``'s forward is torch's own code (``nn.Sequential``'s, and a subclass's
    that keeps it, as torchvision's ``Conv2dNormActivation``): dynamo runs such a module's
    ``_call_impl`` eagerly, tracing nothing (torch 2.13: ``nn.Module.compile`` on an
    ``nn.Sequential`` compiles nothing either)."""
    return (getattr(type(module).forward, "__module__", None) or "").startswith("torch.")


def _entered(call: Any) -> Any:
    """``call`` behind a frame of this package's own, which dynamo traces, inlining torch's; a
    code object of its own for each module, since dynamo keeps compiled code and its limit of
    recompiles (8) per code object. Sequentials of different contents sharing one would leave
    all but eight of them eager, silently, and so would ``pattern``'s regions through
    ``nn.Module._call_impl``, the one every module's call shares (blocks of other shapes, beyond
    eight: efficientnet_b0's blocks of its own classes meet that limit, and swin_t's are recompiled
    for dynamic shapes, far slower than a code object each; docs/steps/compile.md). A whole model keeps ``nn.Module._call_impl``, as
    ``nn.Module.compile`` does: there dynamo guards the model's hooks, and a second model of one
    plan runs the code compiled for the first (each module's own frame would trace it again, and
    one frame shared by alike modules would not see a hook on one of them)."""
    def entered(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)
    entered.__code__ = entered.__code__.replace(co_name=f"entered_{next(_ENTERED)}")
    return entered


_ENTERED = itertools.count()
_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # torch._dynamo.config's, where torch has it


def _replaying_once(compiled: Any) -> Any:
    """``compiled`` called with dynamo tracing checkpoint regions whose forward has a Python side
    effect (a module setting an attribute, or changing a list it holds). Without it dynamo cannot
    trace such a region: it breaks the graph there, and torch's checkpoint runs the region
    eagerly, outside the compiled graphs, and recomputes it eagerly in backward (see
    ``checkpoint.region._Untraced``). Traced, the side effect happens once, in the forward, and the
    compiled backward recomputes the region's tensors without it: once a step, as in the model
    without checkpoint (a region that reads a Python value it changes is then compiled again at
    every step, as that model would be). The setting is read as dynamo traces, which happens
    inside the call, and is none of dynamo's guards (a model sharing code compiled for another
    runs that code); setting it and putting it back costs microseconds a call."""
    config = _compat.dynamo_config()
    if not hasattr(config, _SIDE_EFFECTS):
        return compiled

    def call(*args: Any, **kwargs: Any) -> Any:
        before = getattr(config, _SIDE_EFFECTS)
        setattr(config, _SIDE_EFFECTS, True)
        try:
            return compiled(*args, **kwargs)
        finally:
            setattr(config, _SIDE_EFFECTS, before)
    return call


class CompiledCall:
    """Undo entry: the compiled call :class:`Compile` set on a module (the root, or each region).

    It holds that module, so that a copy of the model (``copy.deepcopy``, ``torch.save``,
    pickling), which PyTorch makes without the compiled call, is compiled again, with the same
    settings, as it is rebuilt.
    """

    def __init__(self, step: "Compile", model: nn.Module, name: str = "") -> None:
        self.step = step
        self.model = model
        self.name = name  # the module's name in the model ("": the root), for revert's messages
        self.install()

    def install(self) -> None:
        # What nn.Module.compile does; through __dict__, since a copy being rebuilt has no state yet.
        call = self.model._call_impl
        if self.name or _torchs_own(self.model):
            call = _entered(call)
        self.call = _replaying_once(torch.compile(call, **self.step.compile_kwargs()))
        self.model.__dict__["_compiled_call_impl"] = self.call

    def undo(self, model: nn.Module) -> str | None:
        """Remove the compiled call, unless it is no longer ours: then it stays, and its name comes back."""
        if self.model.__dict__.get("_compiled_call_impl") is not self.call:
            return f"{self.name}._compiled_call_impl" if self.name else "_compiled_call_impl"
        del self.model.__dict__["_compiled_call_impl"]
        return None

    def __getstate__(self) -> dict:
        return {"step": self.step, "model": self.model, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.install()

    def __repr__(self) -> str:
        return f"CompiledCall({self.step})"


@dataclasses.dataclass(frozen=True)
class Compile(Step):
    r"""Step: compile the model in place with ``torch.compile``, as ``nn.Module.compile`` does.

    ``mode``, ``fullgraph``, ``dynamic`` and ``backend`` are ``torch.compile``'s. ``memory_budget``
    (a float in (0, 1], None: the global setting) is the partitioner's activation memory budget
    for this model only (see the module docstring); backends that partition with min-cut honour
    it (``inductor``, ``aot_eager_decomp_partition``), and one that would ignore it
    (``eager``, ``aot_eager``) is refused.

    ``pattern`` (a regex over module names, as for every step; None: the whole model) compiles
    the outermost selected modules instead, each in place, and leaves the rest eager: regional
    compilation. Each region is traced on its own (blocks alike compile from the compiler's
    caches), so that regions of other shapes do not share dynamo's limit of recompiles. Use it to
    keep a part out of the compiler, as the module docstring's BERT attention.

    Always the last step of a plan (``last``): a plan with a step after it is refused, and so is
    any other step on a model that has it (``revert`` first). The object you hold, its names and
    its ``state_dict`` stay the same; a copy of the model (``copy.deepcopy``, ``torch.save``) is
    compiled too; ``revert`` removes it and the model runs eagerly again. Not lossy.

    Example::

        >>> sw.apply(model, sw.Plan([sw.checkpoint(r"layer[12]"), sw.compile(memory_budget=0.5)]))
        >>> model._compiled_call_impl is not None, list(model.state_dict())[0]
        (True, 'conv1.weight')
        >>> sw.apply(bert, r"autocast(torch.bfloat16), "
        ...          r"compile(pattern=r'bert\.encoder\.layer\.\d+\.(?:attention\.output|intermediate|output)')")
    """

    name = "compile"
    order = 90
    last = True

    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    memory_budget: float | None = None
    backend: str = "inductor"
    pattern: Pattern | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the types of mode, fullgraph, dynamic, backend, memory_budget
        # Every other step takes its pattern first: compile('layer1') would be a mode, which
        # inductor refuses late and other backends ignore.
        if self.mode is not None and self.backend == "inductor" and self.mode not in _MODES:
            if self.mode not in _compat.inductor_modes():
                raise ValueError(
                    f"shrinkwrap: compile() got mode={self.mode!r}, which is no mode of inductor's "
                    f"({', '.join(_compat.inductor_modes())}). To compile some modules only, "
                    f"write compile(pattern={self.mode!r})."
                )
        budget = self.memory_budget
        if budget is not None:
            if not 0 < budget <= 1:
                raise ValueError(f"shrinkwrap: compile() takes memory_budget= a float in (0, 1] or None; got {budget!r}")
            if self.backend in _NO_BUDGET:
                raise ValueError(
                    f"shrinkwrap: compile(backend={self.backend!r}) does not partition by memory budget, so "
                    f"memory_budget={budget!r} would do nothing. Use backend {' or '.join(map(repr, PARTITIONING))}, "
                    "or leave memory_budget out."
                )
            object.__setattr__(self, "memory_budget", float(budget))  # 1 and 1.0 are one step

    def compile_kwargs(self) -> dict[str, Any]:
        """The arguments of ``torch.compile`` for this step."""
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.memory_budget is None:
            return {**kwargs, "backend": self.backend, "mode": self.mode}
        return {**kwargs, "backend": _Budgeted(self.backend, self.mode, self.dynamic, self.memory_budget)}

    def conflict(self, other: Step) -> str | None:
        if isinstance(other, Compile) and other != self:
            return "a model is compiled once; keep one compile step"
        return None

    def targets(self, model: nn.Module) -> Targets:
        """The root (""), or the outermost modules ``pattern`` selects; nothing if this step
        already compiled them."""
        if self in applied_steps(model):
            return Targets([], [("", "already compiled")])
        names = [""] if self.pattern is None else select(model, self.pattern, outermost=True)
        by_hand = {n: how for n, m in model.named_modules() if (how := compiled_how(m))}
        for name in names:
            module = model.get_submodule(name)
            what = f"{name or type(model).__name__} ({module._get_name()})"
            # A selected module or one above it: compiling inside a compiled module would compile
            # twice, one graph nested in the other.
            compiled = [n for n in by_hand if lies_inside(name, n)]
            if compiled:
                raise ValueError(
                    f"shrinkwrap: {self}: {compiled[0] or type(model).__name__} is already compiled "
                    f"{by_hand[compiled[0]]}, and this step would "
                    f"{'replace that' if compiled[0] == name else f'compile {what} inside it'}. Leave this "
                    "step out, or apply it to the model before compiling it yourself."
                )
            if getattr(module, "spans_siblings", False):
                raise ValueError(
                    f"shrinkwrap: {self}: {what} is a member of a region over several sibling modules "
                    "(a checkpoint chain), whose call runs its siblings too: it cannot be compiled "
                    "alone. Select the modules' parent instead, or leave the members out of the pattern."
                )
            if name and type(module).forward is nn.Module.forward:
                raise SelectionError(
                    f"shrinkwrap: {self}: {what} has no forward of its own (it is never called), so "
                    f"compiling it would compile nothing. Select the modules inside it, e.g. r'{name}\\.\\d+'."
                )
        return Targets(names)

    def rewrite(self, model: nn.Module, targets: Targets) -> list:
        return [CompiledCall(self, model.get_submodule(name), name) for name in targets.matched]
