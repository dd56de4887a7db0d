"""Index ranges checked where fake tensors cannot check them.

An estimate runs the model on fake tensors (shape and dtype, no data), where an embedding indexed
past its last row answers as if the input fit: a 4096-token input on a model of 1024 positions
would get a figure where the real run raises ``IndexError``. :class:`KnownIndices` follows the
values of the integer tensors it can know: the batch's, the model's integer buffers, and what
operations on those alone make (positions from ``arange``, their offsets and views). It computes
them for real, which costs little beside the model's floats, and raises at an embedding or an
``index_select`` whose indices reach past the table, as the real run would. An integer tensor
made from floats (a router's ``topk``) or one too large to compute cheaply is left unknown, and
its lookups unchecked.

Example::

    >>> with fake_mode, KnownIndices([(fake_ids, ids, True)], {id(wpe.weight): "transformer.wpe"}):
    ...     model(fake_ids)   # IndexError: shrinkwrap: the model's embedding 'transformer.wpe' has 64 rows ...
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .. import _compat
from .._tree import tensors, tree_map

LIMIT = 2**22  # elements: a larger integer tensor (a mask over two long axes) is left unknown
_UNSET = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")  # no values to follow


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


class KnownIndices(_compat.dispatch_mode()):
    """A dispatch mode, entered above a ``FakeTensorMode``, that keeps the real values of the
    integer tensors it can know and checks every embedding and ``index_select`` against them.

    Args:
        seeds: ``(fake, real, from_batch)`` for the tensors whose values are known at the start:
            the batch's (``from_batch`` True) and the model's integer buffers.
        names: ``id(table) -> name`` of the model's parameters, to name the table in the error.
    """

    def __init__(self, seeds: Iterable[tuple[torch.Tensor, torch.Tensor, bool]], names: dict[int, str]) -> None:
        super().__init__()
        self.values: Any = WeakTensorKeyDictionary()  # fake tensor -> (its real value, whether the batch made it)
        for fake, real, from_batch in seeds:
            if _integral(fake) and fake.shape == real.shape:
                # A copy: an operation in place on a known tensor is made on its value too, and the
                # user's batch must come back as it was given.
                with _compat.no_dispatch_modes():
                    self.values[fake] = (real.detach().clone(), from_batch)
        self.names = names

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.embedding.default:
            self._check(args[0], 0, args[1])
        elif func is torch.ops.aten.index_select.default:
            self._check(args[0], args[1], args[2])
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or _integral(out):  # most calls make one float tensor: passed over
            if any(_integral(t) for t in tensors(out)):
                self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Compute ``out``'s real values where every tensor ``func`` read has known ones; a tensor
        changed in place from unknown values makes every value known so far unsure (a view may
        share it), so all are dropped."""
        inputs = list(tensors((args, kwargs)))
        known = [self.values.get(t) for t in inputs]
        small = all(t.numel() <= LIMIT for t in tensors(out))
        got = None
        if all(k is not None for k in known) and small and func.overloadpacket.__name__ not in _UNSET:
            real = {id(t): k[0] for t, k in zip(inputs, known)}
            try:
                with _compat.no_dispatch_modes():
                    got = func(*tree_map(lambda t: real[id(t)], args), **tree_map(lambda t: real[id(t)], kwargs))
            except Exception:  # noqa: BLE001 - an operator that runs only on the fake: its result stays unknown
                got = None
        if got is not None:
            from_batch = any(k[1] for k in known)
            for fake, value in zip(tensors(out), tensors(got)):
                if _integral(fake):
                    self.values[fake] = (value, from_batch)
        elif func._schema.is_mutable:
            self.values.clear()

    def _check(self, table: torch.Tensor, dim: int, index: torch.Tensor) -> None:
        known = self.values.get(index)
        if known is None or known[0].numel() == 0:
            return
        value, from_batch = known
        rows = table.shape[dim]
        with _compat.no_dispatch_modes():
            low, high = int(value.min()), int(value.max())
        if low >= 0 and high < rows:
            return
        bad = high if high >= rows else low
        name = self.names.get(id(table))
        what = f"the model's embedding {name!r}" if name else f"a table of the model's ({tuple(table.shape)})"
        if from_batch:
            source, fix = "a value of the batch", f"give the batch values from 0 to {rows - 1} (token ids within the vocabulary)"
        else:
            source = "an index the model computes from the input's shape (a position, for one)"
            fix = f"give a shorter input (at most {rows} positions, if that is what it counts) or a model made for longer ones"
        raise IndexError(f"shrinkwrap: {what} has {rows} rows, and {source} reaches row {bad}: the real run "
                         f"fails there (IndexError: index out of range in self); {fix}")
