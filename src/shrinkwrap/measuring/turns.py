"""Timing in turns: several models' iterations timed A B C, B C A, ... in one process, so that
drift falls on every configuration alike; and each module's forward time from the same iterations.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Any, Callable

import torch.nn as nn

from ..select import count, function, require_module, wrong
from .modules import ForwardTimes
from .profile import Options, Timing, require_options
from .restore import restored
from .step import require_batch, setup_iteration, _timed, resolve_device


def time_interleaved(models: dict[str, nn.Module], batch: Any, options: Options = Options(), *,
                     rounds: int = 5, per_round: int = 3,
                     until: Callable[[dict[str, Timing]], bool] | None = None,
                     max_rounds: int | None = None, progress: Callable[[int], None] | None = None
                     ) -> dict[str, Timing]:
    """Time the training iteration of several models in turns (A B C, B C A, ...) in this process.

    Step times on a shared GPU drift between processes and over minutes (docs/measuring.md,
    "Timing in turns"); measured in turns, drift falls on every configuration alike, and each
    result carries its spread. Each model gets ``options.warmup`` iterations first (compilation
    happens there), then ``rounds`` rounds of ``per_round`` iterations each; models are restored
    afterwards, as by :func:`~.step.measure`.
    With ``until``, rounds go on one at a time after the first ``rounds`` while ``until(timings so
    far)`` is false, up to ``max_rounds`` in all (which ``until`` needs): as many repeats as a
    decision needs. ``progress(r)`` is called as each round ``r`` (from 1) ends: a decision can
    take many rounds of a slow model.

    Example::

        >>> t = time_interleaved({"fp32": plain, "plan": transformed}, batch, Options(device="cuda"))
        >>> t["plan"].median / t["fp32"].median, t["plan"].spread
    """
    where = "time_interleaved()"
    if not isinstance(models, dict) or not models:
        raise TypeError(wrong(where, "models= a dict of name -> model, one or more", models))
    for model in models.values():
        require_module(model, where)
    require_batch(batch, where)
    require_options(options, where)
    count(rounds, where, "rounds")
    count(per_round, where, "per_round")
    count(max_rounds, where, "max_rounds", none=True)
    function(until, where, "until", "a function timings -> bool")
    if until is not None and max_rounds is None:
        raise ValueError("shrinkwrap: time_interleaved needs max_rounds with until")
    device = resolve_device(options.device)
    with contextlib.ExitStack() as stack:
        steps = {}
        for name, model in models.items():
            stack.enter_context(restored(require_module(model, "time_interleaved()")))
            steps[name], _ = setup_iteration(model, batch, options, device)
            for _ in range(options.warmup):
                steps[name]()
        names = list(steps)
        out: dict[str, list[float]] = {name: [] for name in names}

        def timings() -> dict[str, Timing]:
            return {name: Timing(tuple(times)) for name, times in out.items()}

        r = 0
        while r < rounds or (until is not None and r < max_rounds and not until(timings())):
            for name in names[r % len(names):] + names[: r % len(names)]:  # a new first each round
                out[name].append(statistics.mean(_timed(steps[name], device, per_round)))
            r += 1
            if progress:
                progress(r)
    return timings()


def forward_times(model: nn.Module, batch: Any, options: Options = Options()) -> dict[str, float]:
    """Each named module's forward time in a training iteration, in milliseconds (GPU time on
    CUDA): the median over ``options.iterations`` iterations after ``options.warmup``; the model
    is restored afterwards, as by :func:`~.step.measure`. What recomputing a region in backward costs,
    read for every region from the same iterations: on a shared GPU one row per region differs
    from the next by more than a region's recompute takes.

    Example::

        >>> forward_times(model, batch, Options(device="cuda"))["layer1"]
        4.1
    """
    device = resolve_device(options.device)
    with restored(require_module(model, "forward_times()")):
        step, _ = setup_iteration(model, batch, options, device)
        for _ in range(options.warmup):
            step()
        with ForwardTimes(model, device if device.type == "cuda" else None) as times:
            for _ in range(options.iterations):
                step(times.mark)
                times.next_iteration()
        return times.ms()
