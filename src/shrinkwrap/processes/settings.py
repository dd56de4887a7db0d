"""What a spawned process takes on from its parent so that what it compiles lands in the caches
the parent reads: the compiler's settings (:func:`compile_settings`, :func:`take_settings`) and the
order of ``sys.modules`` (:func:`take_module_order`)."""

from __future__ import annotations

import sys

import torch

from .._compat import compiler_configs


def compile_settings() -> dict:
    """What this process set that the compiler's caches key on and a spawned process would not
    inherit: matmul precision (:func:`_matmul_settings`), deterministic algorithms, the default
    dtype, inductor's and AOTAutograd's configuration, and the order of ``sys.modules``
    (:func:`module_order`). Set elsewhere, a process compiles graphs that this
    one then misses in the caches."""
    inductor_config, functorch_config = compiler_configs()
    return {"matmul": _matmul_settings(), "dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "inductor": inductor_config.save_config_portable(), "functorch": functorch_config.save_config_portable(),
            "modules": module_order()}


_REDUCED = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")


def _matmul_settings() -> dict:
    """CUDA matmuls' settings as inductor's cache keys them: float32 precision
    (``torch.backends.cuda.matmul.fp32_precision``, ``"none"`` until set) and the reduced-precision
    reductions, with the precision as the legacy API reads it (``"legacy"``), where this process
    did not set it through the newer one (then that API raises on reading it)."""
    matmul = torch.backends.cuda.matmul
    out = {name: getattr(matmul, name) for name in ("fp32_precision", *_REDUCED) if hasattr(matmul, name)}
    try:
        out["legacy"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # "mix of the legacy and new APIs": this process uses the new one
        pass
    return out


def _take_matmul_settings(settings: dict) -> None:
    """Take ``settings`` (:func:`_matmul_settings`), each only where it differs, through the API
    the process that sent them used. Setting float32 precision to the "highest" it already was
    turns torch's cache key "none" into "ieee", and every graph a process ahead compiled would
    then miss the caches in the process that sent it (tests/test_measure_processes.py checks the key)."""
    matmul, mine = torch.backends.cuda.matmul, _matmul_settings()
    if "legacy" in settings:
        precision = ("legacy", "fp32_precision")
        if [mine.get(k) for k in precision] != [settings.get(k) for k in precision]:
            torch.set_float32_matmul_precision(settings["legacy"])
    elif "fp32_precision" in settings and mine.get("fp32_precision") != settings["fp32_precision"]:
        matmul.fp32_precision = settings["fp32_precision"]
    for name in _REDUCED:
        if name in settings and mine.get(name) != settings[name]:
            setattr(matmul, name, settings[name])


def take_settings(settings: dict) -> None:
    """In a spawned process: take on ``settings`` (:func:`compile_settings`), each only where it
    differs from this process's own (see :func:`_take_matmul_settings`), and keep no kernel
    tuning on disk: configurations tuned beside other processes on the GPU would be used by a
    process that compiles the plan from the caches and times it, which tunes them itself, alone.
    A process ahead that measures its own plan (:func:`compile_ahead`'s ``then``) runs the
    kernels it tuned as it compiled, beside the others' compilations (mostly CPU work): tuning
    them again alone would mean compiling the plan again from the caches, the cost it saves."""
    inductor_config, functorch_config = compiler_configs()
    _take_matmul_settings(settings["matmul"])
    if torch.get_default_dtype() != settings["dtype"]:
        torch.set_default_dtype(settings["dtype"])
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if deterministic != settings["deterministic"]:
        torch.use_deterministic_algorithms(settings["deterministic"][0], warn_only=settings["deterministic"][1])
    inductor_config.load_config(settings["inductor"])
    functorch_config.load_config(settings["functorch"])
    inductor_config.autotune_local_cache = False
    take_module_order(settings.get("modules"))


def module_order() -> list[str]:
    """The names in this process's ``sys.modules``, in order: read here, never changed, and sent
    to the spawned processes (see :func:`take_module_order`)."""
    return list(sys.modules)


def take_module_order(order: list[str] | None) -> None:
    """In a spawned process, before anything is compiled: put the modules of ``sys.modules`` that
    its parent has (``order``: :func:`module_order` there) in the parent's order, those it alone
    has after them; None leaves them as they are. The caches key on tensors' metadata pickled,
    and C pickle names an object without a module of its own (``torch.contiguous_format``) after
    the first module in ``sys.modules`` that reaches it, skipping ``__main__`` but not
    ``__mp_main__``, the main script under its second name, which a spawned process puts before
    torch's own modules. A main script that imports torch would otherwise make every key of a
    process differ from its parent's, and the parent would find none of the graphs compiled ahead
    (tests/test_measure_processes.py checks both orders). The parent's own ``sys.modules`` is left as it is."""
    if order is None:
        return
    rank = {name: i for i, name in enumerate(order)}
    for name in sorted(sys.modules, key=lambda n: rank.get(n, len(rank))):  # stable: the rest keep their order
        module = sys.modules.pop(name, None)
        if module is not None:
            sys.modules[name] = module
