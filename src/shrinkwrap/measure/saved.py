"""Bytes that autograd saves for backward: activation memory you can count without a GPU."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


def _storage_key(t: torch.Tensor) -> tuple | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors with no storage of their own
        return None
    return (t.device, storage.data_ptr(), storage.nbytes())


class SavedTensors:
    """Context manager that counts the unique storages autograd saves for backward inside it.

    Parameters (``nn.Parameter`` and views of them) are left out: they are in memory anyway.
    After the block, ``bytes`` is the total size of the unique storages saved and ``count`` their
    number. Uses ``torch.autograd.graph.saved_tensors_hooks``; what a checkpointed region saves is
    what torch's checkpoint saves (its inputs), since its own hooks take over inside the region.

    Example::

        >>> with SavedTensors() as saved:
        ...     loss = model(x).sum()
        >>> saved.bytes, saved.count   # bytes and number of unique storages
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0
        self._seen: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter):
            return t
        key = _storage_key(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self.bytes += key[2]
            self.count += 1
        return t

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes of the unique storages autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    Parameters are not counted. The result is what the forward leaves in memory for backward,
    measured on any device (it is not a GPU peak).

    Example::

        >>> x = torch.randn(64, 512)
        >>> saved_tensor_bytes(nn.Sequential(nn.Linear(512, 512), nn.ReLU()), x)
        262144
    """
    with SavedTensors() as saved:
        fn(*args, **kwargs)
    return saved.bytes
