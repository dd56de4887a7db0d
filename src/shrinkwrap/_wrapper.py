"""A wrapper module that adds no level to the module tree and answers for the module it wraps.

A plain wrapper (``self.module = inner``) renames every parameter from ``layer1.0.weight`` to
``layer1.module.0.weight``, which breaks checkpoints, optimizers keyed by name, PEFT and FSDP.
``TransparentWrapper`` instead *shares* the wrapped module's ``_parameters``, ``_buffers`` and
``_modules`` dictionaries, so the tree below it is the wrapped module's own tree, under the same
names, while ``print(model)`` still shows the wrapper. The wrapped module is kept outside the tree
(in ``__dict__``), so it is the very same object that :func:`shrinkwrap.revert` puts back.

What a tool walking a transformed model may rely on (the transparency rule, kept here once for
every step):

- **Type.** A wrapper is an instance of the wrapped module's class as well as of its own: each
  wrapper's class is made per wrapped class (``CheckpointModule[BatchNorm2d]``, a subclass of both,
  as FSDP2's ``fully_shard`` makes its classes), so ``isinstance(m, nn.BatchNorm2d)`` over
  ``model.modules()`` finds a fused BatchNorm (freezing it, weight-decay groups by type,
  ``SyncBatchNorm.convert_sync_batchnorm``), and ``type(m).__name__`` is the wrapped class's name.
  Attributes and methods of the wrapped class are read from, and written to, the wrapped module
  (as before wrapping); ``nn.Module``'s own API (``train``, ``state_dict``, ``to``, hooks) acts on
  the shared state.
- **Names and state.** ``named_parameters``, ``named_buffers``, ``state_dict`` keys and their
  hooks are the wrapped module's.
- **Hooks.** A forward or backward hook registered on a wrapper is registered on the wrapped
  module: it runs where the module runs, as one registered before the plan does (in a checkpoint
  region's recompute too), receives the module, and stays on it after ``revert``, its handle
  valid. ``state_dict`` hooks are shared by the two.
- **Replacement.** A module a tool puts in a wrapper's slot is the tool's: ``revert`` keeps it and
  warns. A step that fuses two modules (``bn_act``) checks at every call that both are still where
  it put them, and runs them apart otherwise.
- **What is not transparent** raises a ``shrinkwrap:`` error: a ``torch.func`` transform over a
  region that recomputes or offloads (:func:`functorch_level`), say.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn as nn

from . import _compat

# Attributes that belong to the wrapper itself: what every nn.Module has, torch.compile's compiled
# call, and shrinkwrap's own (_sw_*). Any other attribute set on a wrapper is set on the wrapped
# module, where its forward reads it: Hugging Face's gradient_checkpointing_enable() sets
# `_gradient_checkpointing_func` and `gradient_checkpointing` on each layer it finds, and both must
# land on the layer.
# Also the wrapper's: `forward` set on it (a library patching the module it finds in the tree,
# as accelerate's hooks do, patches what is called) and dunders (FSDP2's fully_shard swaps the
# __class__ of the module it is given).
# The module's tree and its state_dict hooks, shared with the wrapper: a hook that a library
# (sharding, quantization, tied weights) registered on the module before or after wrapping still
# runs, and still sits on the module after revert. Load post-hooks are the exception (see
# _inner_load_post_hooks): torch passes them the module it walks, which would be the wrapper.
# Forward and backward hooks are registered on the module itself (see TransparentWrapper's
# register_* methods).
_SHARED = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
           "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
_OWN = frozenset(nn.Module().__dict__) | {"_compiled_call_impl", "forward"}
# Names a class body defines that are no attribute to forward.
# How copy and pickle remake an object: never the wrapped class's (its __deepcopy__ would copy the
# module alone, not the wrapper).
_COPYING = frozenset({"__copy__", "__deepcopy__", "__getstate__", "__setstate__", "__getnewargs__",
                      "__getnewargs_ex__", "__reduce__", "__reduce_ex__"})
_CLASS_ONLY = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__annotations__",
                         "__slots__", "__init_subclass__", "__class_getitem__", "__orig_bases__", "__parameters__",
                         "__firstlineno__", "__static_attributes__", "__abstractmethods__", "_abc_impl",
                         "__annotate__", "__type_params__"})


def _inner_load_post_hooks(wrapper: "TransparentWrapper", incompatible_keys: Any) -> None:
    """The wrapped module's load_state_dict post-hooks, run with the wrapped module."""
    inner = wrapper.wrapped
    for hook in inner._load_state_dict_post_hooks.values():
        if hook(inner, incompatible_keys) is not None:
            raise AssertionError("load_state_dict post-hooks must return None and change incompatible_keys in place")


class _Forwarded:
    """A name the wrapped module's class defines, read from and written to the wrapped module: on
    a wrapper's class it stands where the wrapped class's own attribute would, so a wrapper reads
    the module's value (an instance's ``gradient_checkpointing = True``, not the class's False)."""

    def __init__(self, name: str, owner: type) -> None:
        self.name, self.owner = name, owner

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return getattr(self.owner, self.name)
        return getattr(obj.__dict__["_sw_inner"], self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.__dict__["_sw_inner"], self.name, value)

    def __delete__(self, obj: Any) -> None:
        delattr(obj.__dict__["_sw_inner"], self.name)


_CLASSES: dict[tuple[type, type], type] = {}


def wrapper_class(base: type, inner: type) -> type:
    """The class of a ``base`` wrapper around a module of class ``inner``: a subclass of both, so
    that ``isinstance`` answers for either, named as ``inner`` is. Names that ``inner`` defines
    below ``nn.Module`` are forwarded to the wrapped module (:class:`_Forwarded`), except those the
    wrapper defines: ``nn.Module``'s API and the wrapper's own stay the wrapper's, as they were
    before wrapping. A class that cannot be combined (a metaclass conflict, a class hook that
    refuses) gives ``base`` itself: the wrapper then answers ``isinstance`` for its own class only."""
    key = (base, inner)
    cls = _CLASSES.get(key)
    if cls is not None:
        return cls
    if inner is nn.Module or not issubclass(inner, nn.Module) or issubclass(inner, TransparentWrapper):
        _CLASSES[key] = base
        return base
    own = {name: vars(k)[name] for k in reversed(base.__mro__) for name in vars(k)}
    namespace: dict[str, Any] = {"__module__": base.__module__, "__qualname__": f"{base.__qualname__}[{inner.__qualname__}]",
                                 "__doc__": base.__doc__, "_sw_base": base, "_sw_for": inner}
    for k in inner.__mro__:
        if k in nn.Module.__mro__:
            continue
        for name in vars(k):
            if name in namespace or name in _CLASS_ONLY:
                continue
            if name in _COPYING:
                namespace[name] = own.get(name)  # None: copy and pickle use __reduce_ex__
                continue
            # The wrapper's resolution where it has one: the inner class's override of an
            # nn.Module method (an RNN's _apply, a __setstate__) would run on the wrapper.
            namespace[name] = own[name] if name in own else _Forwarded(name, inner)
    try:
        cls = type(base)(inner.__name__, (base, inner), namespace)
    except Exception:  # noqa: BLE001 - a metaclass conflict, or a class hook that refuses the class
        cls = base
    _CLASSES[key] = cls
    return cls


def _remake(base: type, inner: type) -> "TransparentWrapper":
    """An empty wrapper of the class :func:`wrapper_class` gives (unpickling, ``copy``): its
    state comes after, as for any module."""
    return object.__new__(wrapper_class(base, inner))


# Checkpoint regions that torch.compile is tracing now, one inside another: a wrapper inside one
# keeps state of its own out of the region's graph (torch.compile cannot trace a change to
# state outside a checkpoint region from inside it), and the region recomputes it all anyway.
TRACED_REGIONS = [0]


def functorch_level() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) is running: torch's
    saved-tensor hooks (checkpoint, offload) and autograd Functions without ``setup_context``
    (the fused activations) do not run under one. False while torch.compile traces (it is
    asked first, so the compiler never sees the question)."""
    return not torch.compiler.is_compiling() and _compat.in_functorch_transform()


def refuse_functorch(what: str, keeps: str) -> None:
    """Raise, naming ``what`` (a region), if a ``torch.func`` transform runs: torch's own error
    for saved-tensor hooks under one names no module. ``keeps``: what goes through such hooks."""
    if functorch_level():
        raise RuntimeError(
            f"shrinkwrap: {what} cannot run under a torch.func transform (grad, vjp, jacrev, vmap): {keeps} "
            "through saved-tensor hooks, which torch.func does not support. Differentiate with "
            "torch.autograd.grad over torch.func.functional_call instead (a region runs, and recomputes, with the "
            "tensors it substitutes), or run this computation on the model without the plan (shrinkwrap.revert(model)).")


def has_hooks(module: nn.Module) -> bool:
    """Whether forward or backward hooks are registered on ``module`` (a wrapper's are on the
    module it wraps): a step that computes a module's work without calling it would skip them.
    Hooks marked ``_sw_observes`` (the measuring harness's, which only read) do not count: what
    runs under them must be what runs without them."""
    while True:
        for table in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            if any(not getattr(h, "_sw_observes", False) for h in table.values()):
                return True
        if not isinstance(module, TransparentWrapper):
            return False
        module = module.wrapped


class TransparentWrapper(nn.Module):
    """Base class of shrinkwrap's wrappers. Subclasses define ``forward`` and ``label``, and set
    ``recomputes`` when what runs inside them is recomputed in backward rather than kept (the
    measuring layer reads it: it counts such a region as one unit), and ``spans_siblings`` when
    a call runs more than the wrapped module (its siblings too): such a wrapper cannot be
    compiled on its own, only with its parent."""

    label = "Wrapped"
    recomputes = False
    spans_siblings = False

    def __new__(cls, module: Any = None, *args: Any, **kwargs: Any) -> "TransparentWrapper":
        base = cls.__dict__.get("_sw_base", cls)
        if not isinstance(module, nn.Module):
            return object.__new__(base)  # __init__ says what is wrong
        return object.__new__(wrapper_class(base, type(unwrap(module))))

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"shrinkwrap: expected an nn.Module to wrap, got {type(module).__name__}")
        what = type(module).__name__
        if module.__dict__.get("_compiled_call_impl") is not None:
            raise ValueError(f"shrinkwrap: cannot wrap {what}: it is compiled in place (nn.Module.compile), and its "
                             "wrapper would run it uncompiled. Apply the plan first, then compile (compile() as the "
                             "plan's last step).")
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"shrinkwrap: cannot wrap {what}: a lazy module not yet initialised changes its own class "
                             "at its first forward. Run one forward first, then apply the plan.")
        nn.Module.__init__(self)  # not super(): after the wrapper's classes comes the wrapped module's
        object.__setattr__(self, "_sw_inner", module)
        # Shared, not copied: .to(), load_state_dict, register_buffer on either object act on both.
        for attr in _SHARED:
            object.__setattr__(self, attr, getattr(module, attr))
        object.__setattr__(self, "training", module.training)
        self.register_load_state_dict_post_hook(_inner_load_post_hooks)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A wrapper's class is made at run time: pickle and copy remake it from its two classes.
        cls = type(self)
        if cls.__dict__.get("_sw_base") is None:
            return object.__reduce_ex__(self, protocol)
        return _remake, (cls._sw_base, cls._sw_for), self.__dict__

    @property
    def wrapped(self) -> nn.Module:
        """The original module (the same object that was wrapped)."""
        return self.__dict__["_sw_inner"]

    # -- hooks live on the wrapped module ----------------------------------------------------
    # Registered on the module that runs, where a hook registered before wrapping already is: it
    # runs where the module's forward does (inside a checkpoint region's recompute too, as a
    # spectral norm's pre-hook must), and stays on the module after revert, its handle valid.
    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.register_forward_pre_hook(*args, **kwargs)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.register_forward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.register_full_backward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.register_full_backward_hook(*args, **kwargs)

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.register_backward_hook(*args, **kwargs)

    # -- attribute access reaches the wrapped module ----------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            inner = self.__dict__.get("_sw_inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_sw_inner")
        if inner is None or name.startswith(("_sw_", "__")) or name in _OWN:
            nn.Module.__setattr__(self, name, value)
        else:
            setattr(inner, name, value)

    def __getitem__(self, idx: Any) -> Any:
        return self.wrapped[idx]

    def __len__(self) -> int:
        return len(self.wrapped)

    def __bool__(self) -> bool:
        # Defining __len__ would otherwise make `if module:` raise for wrapped non-containers.
        return True

    def __iter__(self) -> Iterator[Any]:
        return iter(self.wrapped)

    # -- module behaviour that must follow the wrapped module --------------------------------
    def train(self, mode: bool = True) -> "TransparentWrapper":
        # The wrapped module's own train() runs (it may freeze its BatchNorm, say) and walks the
        # shared children; the wrapper only mirrors the flag.
        self.wrapped.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def apply(self, fn):  # type: ignore[override]
        self.wrapped.apply(fn)
        return self

    @property
    def _version(self) -> int:  # type: ignore[override]
        # state_dict metadata records the wrapped module's format version, not the wrapper's.
        return getattr(self.wrapped, "_version", 1)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        # The wrapped module's own state_dict, so its hooks run and receive the module itself.
        return self.wrapped.state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        self.wrapped._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[override]
        self.wrapped._load_from_state_dict(*args, **kwargs)

    def transfers(self, reset: bool = False) -> dict[str, int]:
        """Bytes this wrapper moved between devices since the last reset, by direction (none
        here; offload regions count theirs). The measuring harness sums them per iteration."""
        return {}

    def _get_name(self) -> str:
        return f"{self.label}[{self.wrapped._get_name()}]"

    def extra_repr(self) -> str:
        return self.wrapped.extra_repr()


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside any number of shrinkwrap wrappers (the module itself if unwrapped)."""
    while isinstance(module, TransparentWrapper):
        module = module.wrapped
    return module
