"""Bytes that autograd saves for backward: activation memory you can count without a GPU."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ..select import wrong


def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors with no storage of their own
        return None
    return (t.device, storage.data_ptr(), storage.nbytes())


class _CountedSave:
    """What autograd keeps instead of the saved tensor: its release tells us the storage is freed."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: tuple, owner: "SavedTensors") -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        owner = getattr(self, "owner", None)  # unset where a compiler built the object without __init__
        if owner is not None:
            owner._release(self.key)


class SavedTensors:
    """Context manager that counts the unique storages autograd saves for backward inside it.

    Parameters (``nn.Parameter`` and views of them) are left out: they are in memory anyway.
    After the block, ``bytes`` is the total size of the unique storages saved and ``count`` their
    number. ``live`` is the size of those still held by the autograd graph right now (it falls as
    backward frees them), ``peak_live`` its maximum. Uses
    ``torch.autograd.graph.saved_tensors_hooks``; what a checkpointed region saves is what torch's
    checkpoint saves (its inputs), since its own hooks take over inside the region.

    Example::

        >>> with SavedTensors() as saved:
        ...     loss = model(x).sum()
        >>> saved.bytes
        1048576
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0
        self.live = 0
        self.peak_live = 0
        self._seen: set = set()
        self._holders: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            return t
        key = _storage_key(t)
        if key is None:
            return t
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += key[2]
            self.count += 1
        if key not in self._holders:
            self._holders[key] = 0
            self.live += key[2]
            self.peak_live = max(self.peak_live, self.live)
        self._holders[key] += 1
        return _CountedSave(t, key, self)

    def _release(self, key: tuple) -> None:
        self._holders[key] -= 1
        if not self._holders[key]:
            del self._holders[key]
            self.live -= key[2]

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _CountedSave) else packed


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes of the unique storages autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    Parameters are not counted. The result is what the forward leaves in memory for backward,
    measured on any device (it is not a GPU peak).

    Example::

        >>> x = torch.randn(64, 512)
        >>> saved_tensor_bytes(nn.Sequential(nn.Linear(512, 512), nn.ReLU()), x)
        262144
    """
    if not callable(fn):
        raise TypeError(wrong("saved_tensor_bytes()", "a function or model to run, then its arguments", fn))
    with SavedTensors() as saved:
        fn(*args, **kwargs)
    return saved.bytes
