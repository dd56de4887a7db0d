"""A wrapper module that adds no level to the module tree's names.

A plain wrapper (``self.module = inner``) renames every parameter from ``layer1.0.weight`` to
``layer1.module.0.weight``, which breaks checkpoints, optimizers keyed by name, PEFT and FSDP.
``TransparentWrapper`` instead *shares* the wrapped module's ``_parameters``, ``_buffers`` and
``_modules`` dictionaries, so the tree below it is the wrapped module's own tree, under the same
names, while ``print(model)`` still shows the wrapper. The wrapped module is kept outside the tree
(in ``__dict__``), so it is the very same object that :func:`shrinkwrap.revert` puts back.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.nn as nn

# Attributes that belong to the wrapper itself: what every nn.Module has, torch.compile's compiled
# call, and shrinkwrap's own (_sw_*). Any other attribute set on a wrapper is set on the wrapped
# module, where its forward reads it: Hugging Face's gradient_checkpointing_enable() sets
# `_gradient_checkpointing_func` and `gradient_checkpointing` on each layer it finds, and both must
# land on the layer.
# Also the wrapper's: `forward` set on it (a library patching the module it finds in the tree,
# as accelerate's hooks do, patches what is called) and dunders (FSDP2's fully_shard swaps the
# __class__ of the module it is given).
_OWN = frozenset(nn.Module().__dict__) | {"_compiled_call_impl", "forward"}
# The module's tree and its state_dict hooks, shared with the wrapper: a hook that a library
# (sharding, quantization, tied weights) registered on the module before or after wrapping still
# runs, and still sits on the module after revert. Load post-hooks are the exception (see
# _inner_load_post_hooks): torch passes them the module it walks, which would be the wrapper.
_SHARED = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
           "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _inner_load_post_hooks(wrapper: "TransparentWrapper", incompatible_keys: Any) -> None:
    """The wrapped module's load_state_dict post-hooks, run with the wrapped module."""
    inner = wrapper.wrapped
    for hook in inner._load_state_dict_post_hooks.values():
        if hook(inner, incompatible_keys) is not None:
            raise AssertionError("load_state_dict post-hooks must return None and change incompatible_keys in place")


class TransparentWrapper(nn.Module):
    """Base class of shrinkwrap's wrappers. Subclasses define ``forward`` and ``label``, and set
    ``recomputes`` when what runs inside them is recomputed in backward rather than kept (the
    measuring layer reads it: it counts such a region as one unit), and ``spans_siblings`` when
    a call runs more than the wrapped module (its siblings too): such a wrapper cannot be
    compiled on its own, only with its parent."""

    label = "Wrapped"
    recomputes = False
    spans_siblings = False

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"shrinkwrap: expected an nn.Module to wrap, got {type(module).__name__}")
        super().__init__()
        object.__setattr__(self, "_sw_inner", module)
        # Shared, not copied: .to(), load_state_dict, register_buffer on either object act on both.
        for attr in _SHARED:
            object.__setattr__(self, attr, getattr(module, attr))
        object.__setattr__(self, "training", module.training)
        self.register_load_state_dict_post_hook(_inner_load_post_hooks)

    @property
    def wrapped(self) -> nn.Module:
        """The original module (the same object that was wrapped)."""
        return self.__dict__["_sw_inner"]

    # -- attribute access reaches the wrapped module ----------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_sw_inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_sw_inner")
        if inner is None or name.startswith(("_sw_", "__")) or name in _OWN:
            super().__setattr__(name, value)
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
