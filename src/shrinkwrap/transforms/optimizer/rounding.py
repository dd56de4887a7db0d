"""A float32 master copy rounded into the bf16 weight the model holds, on the CPU: to nearest, or
stochastically (each value up or down with the probability of its distance, so that updates below
bf16's spacing still move the weight on average, as they move the master).

The stochastic rounding adds 16 random bits under each value's bf16 part and keeps the top half.
The random bits come from one random permutation of every 16-bit number, read from a random offset
a chunk: each value's noise is uniform over the 2**16 values, drawn anew each step, at the cost of
one pass over a cached table, not a random number a value (torch's CPU generator runs on one core).
"""

from __future__ import annotations

import functools
import sys

import torch

_SPAN = 1 << 16  # the noise's values: every 16-bit number once
_CHUNK = 1 << 22  # values rounded at a time, through a scratch buffer that stays in cache
_HIGH = 1 if sys.byteorder == "little" else 0  # where an int32's top half is, as two int16s


@functools.cache
def _table() -> torch.Tensor:
    """The permutation, repeated to cover a chunk from any offset (int32)."""
    perm = torch.randperm(_SPAN, generator=torch.Generator().manual_seed(0x5EED), dtype=torch.int32)
    return perm.repeat(_CHUNK // _SPAN + 1)


def round_into(out: torch.Tensor, master: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Write float32 ``master`` into ``out`` (bf16, same shape, contiguous, on the CPU): rounded to
    nearest where ``generator`` is None, else stochastically with its random offsets.

    Args:
        out: the bf16 tensor written.
        master: the float32 values.
        generator: a CPU ``torch.Generator`` for the stochastic rounding, or None for nearest.

    Example::

        >>> round_into(weight_bf16, master, torch.Generator().manual_seed(0))
    """
    if generator is None:
        out.copy_(master)
        return
    bits, dest = master.detach().reshape(-1).view(torch.int32), out.reshape(-1).view(torch.int16)
    table = _table()
    scratch = torch.empty(min(_CHUNK, bits.numel()), dtype=torch.int32)
    offsets = torch.randint(0, _SPAN, ((bits.numel() + _CHUNK - 1) // _CHUNK,), generator=generator).tolist()
    for i, start in enumerate(range(0, bits.numel(), _CHUNK)):
        part = bits[start:start + _CHUNK]
        n = part.numel()
        work = scratch[:n]
        # The carry of the noise into the bf16 part is the rounding up; a value's sign bit stays,
        # so negative values round away from zero as positive ones do.
        torch.add(part, table[offsets[i]:offsets[i] + n], out=work)
        dest[start:start + n].copy_(work.view(torch.int16)[_HIGH::2])  # each value's top half: its bf16 bits
