"""One checkpoint region: ``CheckpointModule`` and how it runs, eager and under ``torch.compile``.

``CheckpointModule`` runs the wrapped module under non-reentrant ``torch.utils.checkpoint`` and
fixes what the plain recipe gets wrong:

- names: the wrapper adds no level to parameter or buffer names (see ``_wrapper``);
- BatchNorm: the recompute would update running statistics a second time; they are restored
  after the recompute, so ``running_mean``, ``running_var`` and ``num_batches_tracked`` match the
  unwrapped model's;
- other buffers the forward changes (an EvoNorm's running variance, a spectral norm's
  power-iteration vectors, which its weight is computed from): the recompute starts from their
  values before the forward and leaves them as the forward did (see ``restore._Buffers``: found
  at the region's first forward, copied at each forward after it only where it changed them);
- in-place input: a region that modifies its own input in place would recompute from the
  modified value; that is refused at apply time where it can be seen (the region is, or starts
  with, a module with ``inplace=True``) and raised with the module's name at the first forward
  otherwise. ``clone_inputs=True`` gives such a region a private copy of its inputs instead;
- containers: a region that writes into a dict or list it was given (``state["h"] = h``) would
  recompute from the written container; the recompute gets a copy of the containers as they were
  before the forward, so it starts where the forward started;
- autocast: its weight cache is off inside a region, so the low-precision copies of the region's
  weights are freed with the region, not kept to the end of the forward (see ``_uncached_autocast``);
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
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ... import _compat
from ..._wrapper import TRACED_REGIONS, TransparentWrapper, refuse_functorch
from .restore import _Buffers, _Guarded, _NestedContexts
from .save import _KeptMutated, save_ops, selective


_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")


def _uncached_autocast() -> contextlib.ExitStack:
    """Autocast as it is, but with its weight cache off: for a checkpoint region's forward.

    Autocast keeps the low-precision copy of every weight it casts until the outermost autocast
    region exits (the whole forward, loss included). A plain forward saves those copies for
    backward anyway; a checkpoint region drops what it would save, but the cache still holds them:
    2 bytes per parameter of every checkpointed layer, kept through the rest of the forward.
    Uncached, each copy is freed when its region is done, and the recompute (torch's checkpoint
    replays the autocast state, this flag too) casts again, as it would anyway."""
    stack = contextlib.ExitStack()
    if torch.is_autocast_cache_enabled():
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
    return stack


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
        return forward, _NestedContexts(_KeptMutated(named), _NestedContexts(restore, recompute))

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
            with _compat.no_dispatch_modes():
                self.guarded = _Guarded(fn, self.named, self.buffers, self.what, self.clone, args, kwargs)
            out = self.guarded.run(kwargs, *args)
            with _compat.no_dispatch_modes():
                self.guarded.done()
            return out
        restore = self.guarded.recomputing()
        with _compat.no_dispatch_modes():
            restore.__enter__()
        try:
            return self.guarded.run(kwargs, *args)
        finally:
            with _compat.no_dispatch_modes():
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
            (``"matmul"``, ``"attention"``, ``"conv"``, aten names; see ``checkpoint.save``).

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

