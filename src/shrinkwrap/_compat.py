"""Every private torch or standard-library name shrinkwrap reaches, in one place.

Each entry says why it is needed and the torch versions it was checked on. A torch or Python
that moves one of these breaks here, not in the middle of a measurement. Imports of torch's
private modules are made inside the functions: importing inductor costs seconds, and most
callers never need it.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import types
from typing import Any

# --- torch: the compiler's configuration ----------------------------------------------------------


def compiler_configs() -> tuple[types.ModuleType, types.ModuleType]:
    """inductor's and AOTAutograd's configuration modules (``torch._inductor.config``,
    ``torch._functorch.config``): a spawned process takes the settings the compiler's caches key
    on from its parent through their ``save_config_portable``/``load_config``; no public API
    exports them. Checked on torch 2.11 and 2.13."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return inductor_config, functorch_config


def aot_autograd_cache_counts() -> tuple[int, int]:
    """AOTAutograd's cache hits and misses so far in this process (``torch._dynamo.utils.counters``):
    the only record of whether a graph compiled from the on-disk caches. Checked on torch 2.11 and
    2.13."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]


# --- torch: CUDA ------------------------------------------------------------------------------------


def clear_cublas_workspaces() -> None:
    """Let go of cuBLAS's workspaces (``torch._C._cuda_clearCublasWorkspaces``, a CUDA build's
    only): a caller's matmuls leave them, and a fresh process would count them as its own rows'.
    Nothing where the build has none. Checked on torch 2.11 and 2.13."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# --- torch: dispatch --------------------------------------------------------------------------------


def dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of a mode that sees every aten
    call below autograd and autocast: the only way to record the calls cuDNN plans at (see
    ``measuring/first_use.py``). Checked on torch 2.11 and 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def overload_name(func: Any) -> str:
    """An aten operator overload's name (``OpOverload._overloadname``: ``"default"``, ``"out"``):
    a recorded call is made again through ``torch.ops.aten.<name>.<overload>``, and the overload
    has no public name. Checked on torch 2.11 and 2.13."""
    return func._overloadname


# --- standard library -------------------------------------------------------------------------------


def pool_processes(pool: concurrent.futures.ProcessPoolExecutor) -> tuple[list, threading.Thread | None]:
    """A process pool's processes and the thread that reaps them (``_processes``,
    ``_executor_manager_thread``): ``shutdown(wait=False)`` returns at once, and a pool whose
    processes must be ended within a grace period, without a second thread racing the pool's own
    ``waitpid``, needs both. Checked on Python 3.11."""
    return list((pool._processes or {}).values()), pool._executor_manager_thread


def caller_frame(depth: int) -> types.FrameType | None:
    """The frame ``depth`` calls up from the caller (``sys._getframe``): the line of the main
    script that called shrinkwrap, to tell whether it sits under the script's main guard.
    Checked on Python 3.11."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:  # fewer frames than that
        return None
