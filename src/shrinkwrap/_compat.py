"""Every private torch or standard-library name shrinkwrap reaches, in one place.

Each entry says why it is needed and the torch versions it was checked on. A torch or Python
that moves one of these breaks here, not in the middle of a measurement. Imports of torch's
private modules are made inside the functions: importing inductor costs seconds, and most
callers never need it.

Private attributes that torch's own tools and most libraries read on every tensor, module and
optimizer (``Tensor._version``, ``Tensor._base``, ``Module._buffers``, ``Optimizer._patch_step_function``)
stay where they are used.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import types
from typing import Any

# --- torch: the compiler's configuration ----------------------------------------------------------


def functorch_config() -> types.ModuleType:
    """AOTAutograd's configuration module (``torch._functorch.config``): its activation memory
    budget, and the settings its caches key on; no public API exports it. Checked on torch 2.11
    and 2.13."""
    import torch._functorch.config as config

    return config


def compiler_configs() -> tuple[types.ModuleType, types.ModuleType]:
    """inductor's and AOTAutograd's configuration modules (``torch._inductor.config``,
    :func:`functorch_config`): a spawned process takes the settings the compiler's caches key on
    from its parent through their ``save_config_portable``/``load_config``. Checked on torch 2.11
    and 2.13."""
    import torch._inductor.config as inductor_config

    return inductor_config, functorch_config()


def aot_autograd_cache_counts() -> tuple[int, int]:
    """AOTAutograd's cache hits and misses so far in this process (``torch._dynamo.utils.counters``):
    the only record of whether a graph compiled from the on-disk caches. Checked on torch 2.11 and
    2.13."""
    counters = dynamo_counters()
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


# --- torch: autograd's engine -----------------------------------------------------------------------


def in_compiled_autograd() -> bool:
    """Whether backward runs under compiled autograd (``torch._dynamo.compiled_autograd``), whose
    engine takes no end-of-backward callback but from a full graph. Read from ``sys.modules``: not
    imported means not running. A flag in some versions, a function in others. Checked on torch
    2.11 and 2.13."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    region = getattr(ca, "in_compiled_autograd_region", False)
    return bool(region() if callable(region) else region)


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``): the engine's graph
    task says so (``torch._C._autograd._get_current_graph_task_keep_graph``), and nothing public
    does. False where torch lacks it. Checked on torch 2.11 and 2.13."""
    import torch

    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(keep()) if keep is not None else False


def at_end_of_backward(callback: Any) -> None:
    """Run ``callback`` once the running backward has finished (the engine's ``queue_callback``,
    as FSDP and DDP use): the one point after every gradient hook of a backward. Checked on torch
    2.11 and 2.13."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def set_version(t: Any, version: int) -> None:
    """Set a tensor's version counter (``torch._C._autograd._unsafe_set_version_counter``), for a
    torch without ``torch.autograd.graph.increment_version`` (before 2.6). It takes tuples from
    torch 2.6 and one tensor in 2.4-2.5. Checked on torch 2.13 (tuples)."""
    import torch

    unsafe = torch._C._autograd._unsafe_set_version_counter
    try:
        unsafe((t,), (version,))
    except TypeError:
        unsafe(t, version)


def innermost_saved_tensors_hooks() -> Any:
    """The innermost saved-tensor hooks in force (``torch._C._autograd._top_saved_tensors_default_hooks``),
    or None: whether a checkpoint region is around a call is told by whose they are. Checked on
    torch 2.11 and 2.13."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform is running (``torch._C._functorch.peek_interpreter_stack``):
    saved-tensor hooks and autograd Functions without ``setup_context`` do not run under one.
    Checked on torch 2.11 and 2.13."""
    import torch

    return torch._C._functorch.peek_interpreter_stack() is not None


# --- torch: tensor subclasses and dispatch ---------------------------------------------------------


def wrapper_subclass(cls: type, like: Any, device: Any) -> Any:
    """A tensor of subclass ``cls`` shaped like ``like`` with a storage of no bytes
    (``Tensor._make_wrapper_subclass``, what torch's own subclasses use): what counts storages sees
    none. Checked on torch 2.11 and 2.13."""
    import torch

    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=device, storage_size=0)


def disabled_torch_function() -> Any:
    """``torch._C._disabled_torch_function_impl``: a subclass's ``__torch_function__`` that keeps
    the subclass out of the Python-level dispatch, as torch's wrapper subclasses do. Checked on
    torch 2.11 and 2.13."""
    import torch

    return torch._C._disabled_torch_function_impl


def no_dispatch_modes() -> Any:
    """A context with the running dispatch modes off (``torch.utils._python_dispatch._disable_current_modes``):
    a recompute's bookkeeping is not the model's computation, and a mode recording the step must
    not see it. Checked on torch 2.11 and 2.13."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def op_overload_packet() -> type:
    """``torch._ops.OpOverloadPacket``, the type of ``torch.ops.aten.<name>``: a name that is no
    aten operator of this build is told apart by it. Checked on torch 2.11 and 2.13."""
    import torch

    return torch._ops.OpOverloadPacket


def fake_tensor() -> tuple[type, type]:
    """``FakeTensor`` and ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors of shape
    and dtype without data, what ``shrinkwrap.estimate`` runs a model on. Checked on torch 2.11 and
    2.13."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode


def mem_tracker() -> type:
    """``torch.distributed._tools.mem_tracker.MemTracker``: torch's count of the bytes a step
    allocates by kind (parameters, gradients, state, activations). Checked on torch 2.11 and
    2.13."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


def mod_tracker() -> type:
    """``torch.distributed._tools.mod_tracker.ModTracker``: the modules running at a moment, forward
    or backward, by dotted name (``parents``), what an estimate names its peak's place by. Checked on
    torch 2.11 and 2.13."""
    from torch.distributed._tools.mod_tracker import ModTracker

    return ModTracker


def tracked_peak(tracker: Any) -> int:
    """A ``MemTracker``'s peak so far, in bytes over its devices (``MemTracker._peak_mem``): read
    after every operation, where the public snapshot's deep copy would cost more than the
    operation under fake tensors. Checked on torch 2.11 and 2.13."""
    return sum(tracker._peak_mem.values())


def flash_attention_cpu(*args: Any, **kwargs: Any) -> Any:
    """aten's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``), which has a
    fake kernel where the public ``scaled_dot_product_attention`` dispatches by device. Checked
    on torch 2.11 and 2.13."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


# --- torch: foreach kernels and memory formats -------------------------------------------------------


def foreach_norm(tensors: list, order: float, dtype: Any) -> Any:
    """One norm per tensor in one kernel launch (``torch._foreach_norm``, as ``clip_grad_norm_``
    uses). Checked on torch 2.11 and 2.13."""
    import torch

    return torch._foreach_norm(tensors, order, dtype=dtype)


def foreach_copy_(dst: list, src: list) -> None:
    """Copy tensor by tensor in one kernel launch (``torch._foreach_copy_``, as the optimizers use).
    Checked on torch 2.11 and 2.13."""
    import torch

    torch._foreach_copy_(dst, src)


def suggest_memory_format(t: Any) -> Any:
    """A tensor's memory format as eager's ``Tensor.suggest_memory_format`` reads it
    (``torch._prims_common.suggest_memory_format``), which dynamo traces. Checked on torch 2.11
    and 2.13."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


# --- torch: the compiler ----------------------------------------------------------------------------


def compile_backend(backend: str, mode: str | None, dynamic: bool | None) -> Any:
    """What ``torch.compile`` makes of a backend name and a mode (``torch._TorchCompileInductorWrapper``,
    ``torch._TorchCompileWrapper``): a backend wrapped with a setting of its own still compiles as
    torch.compile would. Checked on torch 2.11 and 2.13."""
    import torch

    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, None, dynamic)
    return torch._TorchCompileWrapper(backend, mode, None, dynamic)


def inductor_modes() -> list[str]:
    """inductor's modes (``torch._inductor.list_mode_options``): a mode is refused at apply, not
    late inside the first compiled call. Checked on torch 2.11 and 2.13."""
    import torch._inductor

    return list(torch._inductor.list_mode_options())


def dynamo_config() -> types.ModuleType:
    """dynamo's configuration module (``torch._dynamo.config``): a setting read as dynamo traces
    and none of its guards. Checked on torch 2.11 and 2.13."""
    import torch._dynamo.config as config

    return config


def dynamo_counters() -> Any:
    """dynamo's counters (``torch._dynamo.utils.counters``): graph breaks and recompilations of a
    measured step. Checked on torch 2.11 and 2.13."""
    from torch._dynamo.utils import counters

    return counters


def cudagraph_trees() -> types.ModuleType:
    """inductor's CUDA-graph trees (``torch._inductor.cudagraph_trees``): the memory pools the
    graphs of ``mode='reduce-overhead'`` hold. Checked on torch 2.11 and 2.13."""
    from torch._inductor import cudagraph_trees as trees

    return trees


# --- torch: CUDA memory history ---------------------------------------------------------------------


def record_memory_history(enabled: bool) -> None:
    """Start or stop the caching allocator's record of allocations and their stacks
    (``torch.cuda.memory._record_memory_history``), for a snapshot of what is live at a peak.
    Checked on torch 2.11."""
    import torch

    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's recorded history to ``path`` (``torch.cuda.memory._dump_snapshot``),
    the file https://pytorch.org/memory_viz reads. Checked on torch 2.11."""
    import torch

    torch.cuda.memory._dump_snapshot(path)
