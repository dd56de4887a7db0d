"""What a region's recompute starts from, and what it puts back after it.

torch's checkpoint replays a region's forward in backward, where the module and its inputs may no
longer be as the forward found them. The contexts here make the recompute start where the forward
started and leave the model as the forward left it: BatchNorm statistics and other buffers the
forward changes (:class:`_Buffers`, :class:`_RestoreBuffers`), the parameters, attributes and
``torch.Generator`` objects of its modules (:class:`_AsInForward`), and the containers among its
inputs (:class:`_Run`). :class:`_Guarded` puts them together for one forward.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn as nn

from ..._tree import tensors, tree_map
from ..._wrapper import unwrap


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
    value before that forward is gone. The region's buffers are listed at every forward (a walk
    over its modules), so that a module added inside it later is seen."""

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
    dictionaries are copied and compared by identity (C loops, cheap beside the
    region's forward), the generators found once (``cache``, the region's :class:`_Buffers`) and
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


class _NestedContexts:
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

    def recomputing(self) -> _NestedContexts:
        """The recompute's context: the modules as the forward found them first (the buffers
        copied next are theirs), then their buffers."""
        return _NestedContexts(self.found, _RestoreBuffers(self.modules, self.start))

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

