"""Activation checkpointing: recompute a region's activations in backward instead of storing them.

``CheckpointModule`` runs the wrapped module under non-reentrant ``torch.utils.checkpoint`` and
fixes what the plain recipe gets wrong:

- names: the wrapper adds no level to parameter or buffer names (see ``_wrapper``);
- BatchNorm: the recompute would update running statistics a second time; they are restored
  after the recompute, so ``running_mean``, ``running_var`` and ``num_batches_tracked`` match the
  unwrapped model's;
- other buffers the forward changes (an EvoNorm's running variance, a spectral norm's
  power-iteration vectors, which its weight is computed from): the recompute starts from their
  values before the forward and leaves them as the forward did (see ``_Buffers``: found at the
  region's first forward, copied at each forward after it only where it changed them);
- in-place input: a region that modifies its own input in place would recompute from the
  modified value; that is refused at apply time where it can be seen (the region is, or starts
  with, a module with ``inplace=True``) and raised with the module's name at the first forward
  otherwise. ``clone_inputs=True`` gives such a region a private copy of its inputs instead;
- containers: a region that writes into a dict or list it was given (``state["h"] = h``) would
  recompute from the written container; the recompute gets a copy of the containers as they were
  before the forward, so it starts where the forward started;
- autocast: its weight cache is off inside a region, so the low-precision copies of the region's
  weights are freed with the region, not kept to the end of the forward (see ``_uncached_autocast``);
- Hugging Face models: the KV cache would be written again by the recompute; a model holding
  checkpoint regions is called with ``use_cache=False`` in training, as HF's own
  ``gradient_checkpointing_enable()`` does (the record's notes say so; ``revert`` undoes it);
- eval mode, ``no_grad`` and ``inference_mode`` run the module directly, with no checkpoint, and
  so does a Hugging Face layer whose own gradient checkpointing is on (``gradient_checkpointing_enable()``,
  ``TrainingArguments(gradient_checkpointing=True)``): it is checkpointed once, by Hugging Face;
- under ``torch.compile`` the region is traced into the graph with no break, and the compiler
  recomputes it inside its backward (any AOTAutograd backend: inductor, aot_eager; the debugging
  backend ``"eager"`` would replay BatchNorm updates). A region dynamo cannot trace (a graph
  break inside it; under ``torch.compile`` by hand also a Python side effect, such as a write
  into a container it was given) makes dynamo raise under ``fullgraph=True``; otherwise torch's
  checkpoint runs it eagerly, and it gets the safeguards above in its forward and its recompute
  (see ``_Untraced``). shrinkwrap's ``compile()`` step traces regions with Python side effects.

Dropout masks match between forward and recompute (the RNG state is preserved), and inputs that
do not require grad still give gradients to the region's parameters (non-reentrant checkpoint).

Selective recompute (``checkpoint(pattern, save=("matmul",))``). A region recomputes its whole
forward in backward; ``save`` keeps the outputs of the operators it names instead, so the
recompute takes them from memory (torch's selective checkpoint). Kinds: ``"matmul"`` (``mm``,
``addmm``, ``bmm``, ``baddbmm``: every Linear), ``"attention"`` (the fused scaled-dot-product
kernels), ``"conv"`` (``convolution``); or an aten operator's name (``"addmm"``). It buys step
time with memory: on a transformer block the matrix products are most of the recompute's time and
their outputs a fraction of what the block keeps without a checkpoint. Exact as a plain region: a
kept output is the value the recompute would compute. An operator that draws random numbers is
never kept (it would shift the random stream of the dropout after it in the recompute): a fused
attention with dropout in training is recomputed, and a random operator named in ``save`` is
refused, and so is one that changes a tensor in place or that torch decomposes before a
checkpoint sees it (``linear``: name ``addmm``/``mm``, or ``"matmul"``). The kept outputs are held
by the checkpoint, not saved through autograd's saved-tensor hooks, so an ``offload`` region does
not move them. Limits of torch's selective checkpoint, raised by torch in backward: an in-place
operation on a kept output inside the region (``Linear`` then ``ReLU(inplace=True)``, timm's
squeeze-excite; raised again naming the region's in-place modules and the fix), and a second backward through
the region (``retain_graph=True``). Under ``torch.compile`` the compiler's partitioner keeps the
same outputs, and that is where it pays: eager, torch's selective checkpoint runs every operator
of the region through a Python dispatch mode, which on an H100 cost gpt2 more than the matrix
products it saved (1.3x the plain regions' step time; compiled, 0.90x).

Chains (``checkpoint(pattern, chain=True)``). A ResNet's forward calls ``conv1``, ``bn1``, ``relu``
and ``maxpool`` one after another; checkpointed one by one each region keeps its own input, so
nothing is saved. A chain makes selected siblings that are adjacent in their parent's
registration order one region, which keeps only the first member's input. Each member is wrapped
in a ``ChainMember`` (names unchanged). When the parent calls the first member in training, one
checkpoint (the same machinery as above: BatchNorm statistics put back, containers copied, an
in-place input named) runs every member in turn and returns all their outputs; the first member
returns its own, and each later member, called with exactly the previous member's output (``is``)
and nothing else, returns its precomputed one. The parent's data flow keeps the real tensors, so
a skip connection that reuses an inner output gets its value and gradient. The outputs are
dropped when the last member returns. Guarantees:

- exact as a plain region: outputs, gradients and buffers bit-equal to the unwrapped model's in
  float64; BatchNorm counted once; dropout masks equal in the recompute; an in-place module inside
  the chain is fine, and one at its start is refused at apply time as above;
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

__all__ = ['ChainMember', 'Checkpoint', 'CheckpointModule', 'apply_checkpoint']

import contextlib
import dataclasses
import functools
import inspect
import math
import operator
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import _rewrite
from .._tree import tensors, tree_map
from .._wrapper import TRACED_REGIONS, TransparentWrapper, refuse_functorch, unwrap
from ..select import Pattern, SelectionError, block_groups, has_params, pattern_for, require_module
from ..step import Candidate, Context, Step, Targets


def _dotted(*parts: str) -> str:
    """A dotted name from its parts, the empty ones (the region's root) left out."""
    return ".".join(p for p in parts if p)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(unwrap(m), nn.modules.batchnorm._NormBase)  # also a BatchNorm inside bn_act


class _Buffers:
    """The buffers a region's forward changes besides BatchNorm statistics (an EvoNorm's running
    variance, a spectral norm's power-iteration vectors, an EMA codebook written through
    ``.data``), which its recompute would change again, and may read (the spectral norm's weight
    comes from them).

    Found at the region's first checkpointed forward, which copies every such buffer of the
    region and compares (version counters miss writes through ``.data``); later forwards copy
    only those found so far (none, in most models), and find more by version and identity. The
    recompute starts from the copies, as the forward did, and the values the forward left are
    put back after it. A forward that changes a buffer none before it did raises, naming it: its
    value before that forward is gone. The region's buffers are listed at every forward (10 us
    for 16 modules on a CPU), so that a module added inside it later is seen."""

    def __init__(self) -> None:
        self.changed: set[tuple[int, str]] | None = None  # (id(module), name); None: no forward yet
        # Where the region's modules hold a torch.Generator, as (attributes, name); None: to be found
        # (at the first forward, and after one that changed attributes). See _AsInForward.
        self.generators: list[tuple[dict, str]] | None = None

    def __getstate__(self) -> dict:
        return {"changed": None, "generators": None}  # a copy finds them again, on its own modules

    def watch(self, named: list[tuple[str, nn.Module]]) -> Callable[[str], dict]:
        """Before the forward; returns what to call after it (with the region's description),
        which gives the copies the recompute starts from, by (module, name)."""
        slots = [(m, n, b, b._version) for _, module in named for m in module.modules() if not _is_norm(m)
                 for n, b in m._buffers.items() if b is not None]
        first = self.changed is None
        copies = {(id(m), n): b.clone() for m, n, b, _ in slots if first or (id(m), n) in self.changed}

        def after(what: str) -> dict:
            changed = {(id(m), n) for m, n, b, v in slots
                       if m._buffers.get(n) is not b or b._version != v or (first and not torch.equal(
                           copies[(id(m), n)], b))}
            unseen = changed - copies.keys()
            if unseen:
                names = [_dotted(region, sub, n) for region, module in named
                         for sub, m in module.named_modules() for n in m._buffers if (id(m), n) in unseen]
                raise RuntimeError(
                    f"shrinkwrap: checkpointed {what} changed {', '.join(map(repr, names))} in this forward, which "
                    f"its earlier forwards did not change, so the value its recompute must start from is gone. "
                    f"Checkpoint a region without the module that changes it.")
            self.changed = (self.changed or set()) | changed
            return {(m, n): copies[(id(m), n)] for m, n, _, _ in slots if (id(m), n) in self.changed
                    and m._buffers.get(n) is not None}
        return after


class _RestoreBuffers:
    """Recompute context: the buffers in ``start`` set to the values the forward started from, and
    every buffer the recompute changes (those, and BatchNorm running statistics) put back as it
    was before the recompute."""

    def __init__(self, modules: list[nn.Module], start: dict) -> None:
        self.modules, self.start = modules, start

    def __enter__(self) -> None:
        norms = [buf for module in self.modules for m in module.modules() if _is_norm(m)
                 for buf in m.buffers(recurse=False)]
        started = [m._buffers[n] for m, n in self.start]
        self.saved = [(buf, buf.clone()) for buf in norms + started]
        with torch.no_grad():
            for buf, value in zip(started, self.start.values()):
                buf.copy_(value)

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for buf, value in self.saved:
                buf.copy_(value)


_MISSING = object()
# Where a parameter or buffer is one of these, the recompute may put back the one the forward
# used; a tensor subclass (FSDP2's sharded DTensor) is the engine's that placed it.
_PLAIN = (torch.Tensor, nn.Parameter, nn.Buffer) if hasattr(nn, "Buffer") else (torch.Tensor, nn.Parameter)


class _AsInForward:
    """Recompute context: the region's modules as its forward found them, in what the rest of the
    machinery here does not cover (buffers' values, the global RNG):

    - the parameter and buffer tensors that stood in them: ``torch.func.functional_call`` puts
      its own for the call's duration, and the recompute, in backward, comes after it put the
      module's own back (the gradients would go to the wrong tensors). A plain tensor that the
      slot no longer holds at the recompute is put there for it; a tensor subclass (FSDP2's
      sharded DTensor, which its engine swaps for the unsharded parameter) is left alone;
    - attributes the forward changed (a Python counter that picks a branch, a cached tensor): the
      recompute starts from their values before the forward, so it takes the forward's branch;
    - ``torch.Generator`` objects among the modules' attributes (a module's own noise): the
      recompute replays the forward's draws, as torch's checkpoint does for the global RNG.

    Each is put back as it was before the recompute, after it. Taken at every forward: the
    dictionaries are copied and compared by identity (C loops; 30 us for a GPT-2 block's 13
    modules on a CPU), the generators found once (``cache``, the region's :class:`_Buffers`) and
    again after a forward that changed attributes. State outside the region's modules (a
    global, a closure, a list changed in place) cannot be seen: the recompute changes it again."""

    def __init__(self, modules: list[nn.Module], cache: _Buffers) -> None:
        mods = list({id(m): m for module in modules for m in map(unwrap, module.modules())}.values())
        self.tensors = [(d, dict(d)) for m in mods for d in (m._parameters, m._buffers) if d]
        self.attrs = [(m.__dict__, dict(m.__dict__)) for m in mods]
        if cache.generators is None:
            cache.generators = [(d, k) for d, _ in self.attrs for k, g in d.items() if type(g) is torch.Generator]
        self.cache = cache
        self.generators = [(d[k], d[k].get_state()) for d, k in cache.generators if type(d.get(k)) is torch.Generator]
        self.changed: list[tuple[dict, str, Any]] = []

    def after(self) -> None:
        """After the forward: note the attributes it changed (shrinkwrap's own, ``_sw_*``, aside)."""
        for now, before in self.attrs:
            if len(now) != len(before) or any(map(operator.is_not, now.values(), before.values())):
                self.changed += [(now, k, before.get(k, _MISSING)) for k in now.keys() | before.keys()
                                 if not k.startswith("_sw_") and now.get(k, _MISSING) is not before.get(k, _MISSING)]
        if self.changed:
            self.cache.generators = None  # a generator may have been set: found again at the next forward
        self.attrs = []  # the copies are no longer needed

    def __enter__(self) -> None:
        self.undo: list[tuple[dict, str, Any]] = []
        for d, before in self.tensors:
            for k, t in before.items():
                if d.get(k, _MISSING) is not t and type(t) in _PLAIN:
                    self._put(d, k, t)
        for d, k, value in self.changed:
            self._put(d, k, value)
        self.states = [(g, g.get_state()) for g, _ in self.generators]
        for g, state in self.generators:
            g.set_state(state)

    def _put(self, d: dict, k: str, value: Any) -> None:
        self.undo.append((d, k, d.get(k, _MISSING)))
        if value is _MISSING:
            d.pop(k, None)
        else:
            d[k] = value

    def __exit__(self, *exc: Any) -> None:
        for g, state in self.states:
            g.set_state(state)
        for d, k, value in reversed(self.undo):
            if value is _MISSING:
                d.pop(k, None)
            else:
                d[k] = value


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Run:
    """What torch's checkpoint runs: the region on the caller's inputs in the forward, and in the
    recompute on a copy of the containers among them as they were before the forward, so that a
    region writing into a dict it was given recomputes from what it was given.

    The positional tensors are not kept here: the recompute gets them from torch's checkpoint,
    which saved them for backward through the saved-tensor hooks around it. Kept here they would
    stay on the device whatever those hooks do (an offload region around the checkpoint)."""

    def __init__(self, module: Callable[..., Any], clone: bool, args: tuple, kwargs: dict) -> None:
        self.module, self.clone = module, clone
        # the containers copied, the tensors in them not; a positional tensor left out
        self.before = ([None if isinstance(a, torch.Tensor) else tree_map(_same, a) for a in args],
                       tree_map(_same, kwargs))
        self.calls = 0

    def __call__(self, kwargs: dict, *args: Any) -> Any:
        # kwargs travel as one positional dict (here and in _in_graph) so that a module kwarg named
        # like one of torch.utils.checkpoint's own options (debug, preserve_rng_state, ...) cannot collide.
        if self.calls:
            before, kwargs = tree_map(_same, self.before)
            args = tuple(a if isinstance(a, torch.Tensor) else b for a, b in zip(args, before))
        self.calls += 1
        if self.clone:
            args, kwargs = tree_map(torch.clone, (args, kwargs))
        return self.module(*args, **kwargs)


_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")


def _uncached_autocast() -> contextlib.ExitStack:
    """Autocast as it is, but with its weight cache off: for a checkpoint region's forward.

    Autocast keeps the low-precision copy of every weight it casts until the outermost autocast
    region exits (the whole forward, loss included). A plain forward saves those copies for
    backward anyway; a checkpoint region drops what it would save, but the cache still holds them:
    2 bytes per parameter of every checkpointed layer, kept through the rest of the forward (on
    an H100, 1.8 GB of a 1.2B-parameter Llama's 1.65 GB activation peak, which fell in its loss).
    Uncached, each copy is freed when its region is done, and the recompute (torch's checkpoint
    replays the autocast state, this flag too) casts again, as it would anyway."""
    stack = contextlib.ExitStack()
    if torch.is_autocast_cache_enabled():
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
    return stack


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
            if not isinstance(op, torch._ops.OpOverloadPacket):
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


def _keep(names: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
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

    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep, names))}


class _Both:
    """Two contexts as one, entered in order and left in reverse; entered again at each recompute
    (a second backward through the region with ``retain_graph=True``)."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


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


class _Guarded:
    """A region's forward and recompute with the eager safeguards: the buffers of the region
    (``named``: its modules by name) that the recompute would change again put back after it, and
    those its forward reads started where the forward started (see :class:`_Buffers`); the
    containers among the inputs copied for it (``run``, a :class:`_Run`), and an input changed in
    place raised after the forward (:meth:`done`), naming the region (``what``: "module
    'layer1'")."""

    def __init__(self, fn: Callable[..., Any], named: list[tuple[str, nn.Module]], buffers: _Buffers, what: str,
                 clone: bool, args: tuple, kwargs: dict) -> None:
        self.inputs = list(tensors((args, kwargs)))
        self.versions = [t._version for t in self.inputs]
        self.modules = [m for _, m in named]
        self.what = what
        self.after = buffers.watch(named)
        self.found = _AsInForward(self.modules, buffers)
        self.start: dict = {}  # filled after the forward: the recompute's context is made before it
        self.run = _Run(fn, clone, args, kwargs)

    def recomputing(self) -> _Both:
        """The recompute's context: the modules as the forward found them first (the buffers
        copied next are theirs), then their buffers."""
        return _Both(self.found, _RestoreBuffers(self.modules, self.start))

    def done(self) -> None:
        """After the forward."""
        if any(t._version != v for t, v in zip(self.inputs, self.versions)):
            raise RuntimeError(
                f"shrinkwrap: checkpointed {self.what} modified its input in place; "
                "its recompute in backward would start from the modified value. Checkpoint a region "
                "that starts after the in-place operation, or pass clone_inputs=True."
            )
        self.inputs = self.versions = []  # held to the backward, they would outlive what saved-tensor hooks moved
        self.start.update(self.after(self.what))
        self.found.after()


def _checkpointed(fn: Callable[..., Any], named: list[tuple[str, nn.Module]], buffers: _Buffers, what: str,
                  clone: bool, args: tuple, kwargs: dict, keep: dict | None = None) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint, with the eager safeguards
    (:class:`_Guarded`), autocast's weight cache off inside it (:func:`_uncached_autocast`), and
    the outputs ``keep`` names kept (:func:`selective`)."""
    guarded = _Guarded(fn, named, buffers, what, clone, args, kwargs)

    def contexts() -> tuple:
        restore = guarded.recomputing()
        if not keep:
            return contextlib.nullcontext(), restore
        forward, recompute = keep["context_fn"]()
        # The buffers are copied and put back outside the selective mode, which would take
        # those copies for operators of the region that the forward never ran.
        return forward, _Both(_KeptMutated(named), _Both(restore, recompute))

    with _uncached_autocast():
        out = _torch_checkpoint(guarded.run, kwargs, *args, use_reentrant=False, context_fn=contexts)
    guarded.done()
    return out


def _traced(untraced: "_Untraced", fn: Callable[..., Any], kwargs: dict, *args: Any, **keep: Any) -> Any:
    """torch's checkpoint as torch.compile traces a region, counted in ``TRACED_REGIONS``;
    ``untraced`` runs it where the compiler could not trace it."""
    TRACED_REGIONS[0] += 1
    try:
        return _torch_checkpoint(_in_graph, untraced, fn, kwargs, *args, use_reentrant=False, **keep)
    finally:
        TRACED_REGIONS[0] -= 1


def _in_graph(untraced: "_Untraced", fn: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    """The region traced into the compiled graph; or, called outside the compiler, run eagerly."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    return untraced(fn, kwargs, args)


class _Untraced:
    """One forward of a region that torch.compile meant to trace, where it could not: dynamo broke
    the graph inside it (an unsupported call, a ``.item()``), so torch's checkpoint runs the region
    eagerly and recomputes it eagerly in backward, outside the compiled graph. Its first call (the
    forward) and the later ones (each recompute) get the eager safeguards (:class:`_Guarded`), as
    a region outside the compiler does: without them the recompute would count BatchNorm a second
    time and start from the buffers, attributes and containers the forward left. (Autocast's
    weight cache stays on there, and a kept output changed in place gets torch's error, not the
    one naming the region's in-place modules.) Made at every traced forward, where it costs
    nothing once compiled; used only where the trace broke.
    (Python side effects, which break the trace under ``torch.compile`` by hand, are traced
    under shrinkwrap's ``compile()`` step: see ``transforms.compile._replaying_once``.)"""

    def __init__(self, named: list[tuple[str, nn.Module]], buffers: _Buffers, what: str, clone: bool) -> None:
        self.named, self.buffers, self.what, self.clone = named, buffers, what, clone
        self.guarded: _Guarded | None = None

    def __call__(self, fn: Callable[..., Any], kwargs: dict, args: tuple) -> Any:
        # Inside torch's checkpoint: the safeguards' own copies run outside its selective mode (a
        # region with save=), which would look for them among the forward's kept outputs.
        if self.guarded is None:
            with _disable_current_modes():
                self.guarded = _Guarded(fn, self.named, self.buffers, self.what, self.clone, args, kwargs)
            out = self.guarded.run(kwargs, *args)
            with _disable_current_modes():
                self.guarded.done()
            return out
        restore = self.guarded.recomputing()
        with _disable_current_modes():
            restore.__enter__()
        try:
            return self.guarded.run(kwargs, *args)
        finally:
            with _disable_current_modes():
                restore.__exit__(None, None, None)


def _refuse_functorch(what: str) -> None:
    refuse_functorch(f"checkpointed {what}", "torch's checkpoint keeps its inputs")


class CheckpointModule(TransparentWrapper):
    """Run ``module`` under activation checkpointing, changing no parameter or buffer name.

    Args:
        module: the region to recompute in backward.
        name: its dotted name in the model, used in messages.
        clone_inputs: give the region a private copy of its tensor inputs, for regions that
            modify their input in place. The caller's tensor is then left unmodified.
        save: names of the operators whose outputs the region keeps instead of recomputing
            (``"matmul"``, ``"attention"``, ``"conv"``, aten names; see the module docstring).

    Example::

        >>> model.layer1 = CheckpointModule(model.layer1)   # or apply_checkpoint(model, "layer1")
        >>> model.state_dict().keys()                        # unchanged: 'layer1.0.conv1.weight', ...
    """

    label = "Checkpoint"
    recomputes = True

    def __init__(self, module: nn.Module, *, name: str = "", clone_inputs: bool = False,
                 save: tuple[str, ...] = ()) -> None:
        if isinstance(module, CheckpointModule):
            raise ValueError(f"shrinkwrap: {name or 'module'} is already checkpointed")
        super().__init__(module)
        self._sw_name = name or type(module).__name__
        self._sw_clone_inputs = clone_inputs
        self._sw_keep = selective(save_ops(save))
        self._sw_buffers = _Buffers()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped
        # A Hugging Face layer with its own gradient checkpointing on (Trainer's
        # gradient_checkpointing=True) checkpoints itself: the region steps aside, and the layer is
        # recomputed once, not once inside another recompute.
        if not (self.training and torch.is_grad_enabled()) or getattr(inner, "gradient_checkpointing", False) is True:
            return inner(*args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced into the graph: the compiler's partitioner recomputes the region inside its
            # backward kernels. It never replays a mutation, so BatchNorm statistics are updated
            # once, and its graphs are functional, so an in-place input change cannot leak into
            # the recompute; the eager safeguards below are neither needed nor traceable (where
            # dynamo cannot trace the region, _Untraced gives them to it).
            untraced = _Untraced([(self._sw_name, inner)], self._sw_buffers, f"module {self._sw_name!r}",
                                 self._sw_clone_inputs)
            return _traced(untraced, inner, kwargs, *args, **self._sw_keep)
        _refuse_functorch(f"module {self._sw_name!r}")
        return _checkpointed(inner, [(self._sw_name, inner)], self._sw_buffers, f"module {self._sw_name!r}",
                             self._sw_clone_inputs, args, kwargs, self._sw_keep)


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
            modules the parent calls one after another (see the module docstring); a selected
            module with no selected neighbour is an error.
        save: operators whose outputs each region keeps instead of recomputing: ``"matmul"``,
            ``"attention"``, ``"conv"``, or aten operator names (see the module docstring). A
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
        which the normalisation after it keeps for backward: resnet18 @128 under
        ``channels_last(), autocast(bf16), compile(memory_budget=0.6)`` kept 803.6 MiB, and 624.9
        MiB with ``checkpoint('conv1')`` added (H100, torch 2.11, 2026-11-24). The whole chain as
        a region kept 976.9 MiB: its recompute in the stem's backward became the peak.

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
        """Every stage of two or more same-type blocks (where it has a forward) and groups of its
        consecutive blocks; an inner stage (an EfficientNet stage inside ``features``, a ConvNeXt or
        Swin stage of blocks) gives the whole stage as one region and every block of it as a region
        of its own (with four blocks or more, each half's blocks too), or its blocks in two groups
        where it has no forward. One region over a whole stage recomputes the stage at once in
        backward and holds all of its activations then; a region per block holds one block's: on
        ConvNeXt-T and Swin-T @64 (H200, torch 2.11) every block alone kept 35-43% less than the
        stages did. A stack of six or more blocks also gives every second and every third block:
        half or a third of the recompute for about that share of the saving, points between the
        groups; a stack of at most twelve (a transformer's layers) also gives each block alone, so
        the search can take as many blocks as the time allows (longer stacks would cost a
        measurement per block). The modules a parent calls before its first stack (a ResNet's
        stem) give one chain region (see :func:`_stems`)."""
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


def apply_checkpoint(model: nn.Module, pattern: Pattern, *, clone_inputs: bool = False,
                     chain: bool = False, save: tuple[str, ...] = ()) -> nn.Module:
    """Checkpoint the submodules of ``model`` that ``pattern`` selects, in place; return ``model``.

    See :class:`CheckpointModule` for what is preserved, and the module docstring for
    ``chain=True``. Raises ``SelectionError`` for a pattern that matches nothing, a module with no
    forward (``ModuleList``), a region that starts with an in-place operation (unless
    ``clone_inputs=True``), or, with ``chain=True``, a module with no selected neighbour.

    Example::

        >>> apply_checkpoint(resnet, r"layer[12]")
        >>> print(resnet.layer1)   # Checkpoint[Sequential](...)
    """
    step = Checkpoint(pattern, clone_inputs=clone_inputs, chain=chain, save=save)
    return step.apply(require_module(model, "apply_checkpoint()"))
