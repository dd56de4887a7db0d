"""Fresh processes: where a configuration runs with nothing of another in its allocator.

On CUDA each measured row (``compare``), each plan compiled ahead (:func:`compile_ahead`) and each
probe of a memory cap (``fit``) runs in a new spawned process: allocator caches, cuDNN workspaces
and CUDA graph pools of one cannot count in the next. Here: how a model travels to such a process
(a factory, or :class:`_Copies` of an instance), how a plan's model is built there (:func:`_build`),
the compiler settings a process takes on so that its work lands in the caches this one reads
(:func:`compile_settings`, :func:`take_settings`), how processes are started ahead and ended
(:class:`FreshProcesses`, :func:`_stop`, :func:`_end`), and whether one can start at all: what it
is sent must pickle, and the main script, which it runs again, must let it (:func:`_unsendable`).
"""

from __future__ import annotations

import ast
import concurrent.futures
import copy
import dataclasses
import functools
import importlib
import io
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import time
import types
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from ._tree import tree_map
from .measure.first_use import Calls, replay
from .measure.profile import Options
from .measure.step import _clean, _setup, resolve_device
from .plan import Plan
from .select import wrong


class _Copies:
    """Fresh copies of one model instance, so the user's own model is never touched.

    In this process a copy is a ``deepcopy`` (given a ``device``, made there directly: see
    :func:`_copy_onto`); sent to a subprocess, the model travels as ``torch.save`` bytes loaded onto
    the CPU (no CUDA memory shared between processes).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__name__ = type(model).__name__

    def __call__(self, device: torch.device | None = None) -> nn.Module:
        return copy.deepcopy(self.model) if device is None else _copy_onto(self.model, device)

    def __getstate__(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.model, buf)
        return {"blob": buf.getvalue(), "name": self.__name__}

    def __setstate__(self, state: dict) -> None:
        self.model = torch.load(io.BytesIO(state["blob"]), map_location="cpu", weights_only=False)
        self.__name__ = state["name"]


def model_maker(model_or_factory: nn.Module | Callable[[], nn.Module], where: str) -> Callable[[], nn.Module]:
    """A function returning a fresh model each call: the factory itself, or copies of an instance;
    ``where`` names the public function for the message if it is neither."""
    if isinstance(model_or_factory, nn.Module):
        return _Copies(model_or_factory)
    if callable(model_or_factory):
        return model_or_factory
    raise TypeError(wrong(where, "a model or a function returning one", model_or_factory))


def _copy_onto(model: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are made on ``device`` straight from
    the originals, not cloned on the CPU first and then moved: on an H100 machine a copy of
    resnet152 onto the GPU took 0.09 s this way and 0.15 s the plain way, 33 times in one autoplan
    call. Parameter subclasses, tensors with a gradient, and tensors sharing memory take the plain
    path, which keeps what they are."""
    originals = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    storages = [t.untyped_storage().data_ptr() for t in originals if t.numel()]
    if len(set(storages)) < len(storages) or any(
            type(t) not in (torch.Tensor, nn.Parameter) or t.grad is not None or t.layout != torch.strided
            for t in originals):
        return copy.deepcopy(model).to(device)
    memo: dict = {}
    for t in originals:
        new = t.detach().to(device, copy=True)
        new = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new.requires_grad_(t.requires_grad)
        new.__dict__.update(copy.deepcopy(t.__dict__, memo))
        memo[id(t)] = new
    return copy.deepcopy(model, memo)


def _build(make: Callable[[], nn.Module], device: torch.device, plan: Plan) -> nn.Module:
    model = make(device) if isinstance(make, _Copies) else make()
    if not isinstance(model, nn.Module):
        raise TypeError(f"shrinkwrap: the model factory returned {type(model).__name__}, not an nn.Module")
    return plan.apply(model.to(device))


def _said(exc: BaseException) -> str:
    """An error as a row or a note shows it: its type and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


PROCESS_MARGIN = 2**30  # what a process holds beside its row's peak: its CUDA context and workspaces


def compile_settings() -> dict:
    """What this process set that the compiler's caches key on and a spawned process would not
    inherit: matmul precision (:func:`_matmul_settings`), deterministic algorithms, the default
    dtype, and inductor's and AOTAutograd's configuration. Set elsewhere, a process compiles graphs
    that this one then misses in the caches."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return {"matmul": _matmul_settings(), "dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "inductor": inductor_config.save_config_portable(), "functorch": functorch_config.save_config_portable()}


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
    turns torch's cache key "none" into "ieee": on an H100 (torch 2.11, 2026-11-26) every graph a
    process ahead compiled then missed the caches in the process that sent it."""
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
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    _take_matmul_settings(settings["matmul"])
    if torch.get_default_dtype() != settings["dtype"]:
        torch.set_default_dtype(settings["dtype"])
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if deterministic != settings["deterministic"]:
        torch.use_deterministic_algorithms(settings["deterministic"][0], warn_only=settings["deterministic"][1])
    inductor_config.load_config(settings["inductor"])
    functorch_config.load_config(settings["functorch"])
    inductor_config.autotune_local_cache = False
    _main_last()


def _main_last() -> None:
    """Move ``__mp_main__`` (the main script under a second name) to the end of ``sys.modules``,
    in the parent and in each spawned process (ahead, and a row's), before anything is compiled.
    The caches key on tensors' metadata pickled; C pickle names an object without a module of its own
    (``torch.contiguous_format``) after the first module in ``sys.modules`` that reaches it,
    skipping ``__main__`` but not ``__mp_main__``, which a spawned process puts before torch's own
    modules and the parent where ``multiprocessing`` was first imported. A main script that
    imports torch then made every key of one process differ from the other's: the parent found
    none of the graphs compiled ahead (resnet18 @64 on an H100: 0 of 5 plans)."""
    main = sys.modules.pop("__mp_main__", None)
    if main is not None:
        sys.modules["__mp_main__"] = main


def _first_steps(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options,
                 settings: dict) -> str | None:
    """In a spawned process: ``settings`` taken on (:func:`take_settings`), then ``plan``'s
    model built and run for its warm-up iterations and one more (where a compiled plan compiles
    its forward and backward); None, or what stopped it."""
    take_settings(settings)
    device = torch.device(options.device)
    try:
        model = _build(make, device, plan)
        step, _ = _setup(model, batch, options, device)
        for _ in range(options.warmup + 1):
            step()
        return None
    except Exception as exc:  # noqa: BLE001 - only a head start: the plan's own row says what fails
        return _said(exc)
    finally:
        model = step = None
        _clean(device)


_TURNS: _Turns | None = None  # in a process ahead, with compile_ahead's ``then``
TURN_POLL = 0.2  # seconds between a waiting process's looks at the others


@dataclasses.dataclass
class _Turns:
    """How the processes ahead take turns (:func:`compile_ahead`'s ``then`` and ``after``): a flag
    each sets once its plan has compiled, one the parent sets when a process died, and the lock a
    turn holds; for the second turns, each plan's key, a flag each sets once its first turn is
    over, how many second turns were taken, and what each left for the next. Flags in shared
    memory, read by polling: a condition (``multiprocessing.Barrier``) waits for every sleeper to
    wake, and one killed while waiting (the OOM killer) would hang the others and the parent."""

    compiled: Any  # multiprocessing RawArray of one byte a plan
    broken: Any  # multiprocessing RawValue
    lock: Any  # multiprocessing Lock
    seconds: Any  # multiprocessing RawArray of doubles: each plan's first iterations, in seconds (NaN: not run)
    keys: Any  # RawArray of doubles: each plan's key from its first turn (the second turns' order)
    firsts: Any  # RawArray of one byte a plan: its first turn is over
    taken: Any  # RawValue: how many second turns were taken, an earlier wave's too
    left: Any  # RawArray of doubles: what each second turn left for the later ones, in turn order

    @classmethod
    def make(cls, context: Any, n: int, before: Sequence[float] = ()) -> "_Turns":
        """Turns for ``n`` processes, after second turns (of an earlier wave) that left ``before``."""
        return cls(context.RawArray("b", n), context.RawValue("b", 0), context.Lock(),
                   context.RawArray("d", [math.nan] * n), context.RawArray("d", n), context.RawArray("b", n),
                   context.RawValue("i", len(before)), context.RawArray("d", [*before] + [math.inf] * n))

    def _until(self, ready: Callable[[], bool]) -> bool:
        """Poll until ``ready()``; False where a process died first."""
        while not ready():
            if self.broken.value:
                return False
            time.sleep(TURN_POLL)
        return True

    def wait(self, i: int, seconds: float) -> bool:
        """Plan ``i`` compiled in ``seconds``: wait until every plan has and this process holds
        the lock; False (without the lock) where a process died first."""
        self.seconds[i] = seconds
        self.compiled[i] = 1
        if not self._until(lambda: all(self.compiled)):
            return False
        while not self.lock.acquire(timeout=TURN_POLL):
            if self.broken.value:  # one died, maybe holding the lock
                return False
        return True

    def second(self, i: int, key: float) -> int | None:
        """Plan ``i``'s first turn gave ``key``: wait until every plan's first turn is over and
        then for this plan's second turn, by key (least first; alike keys in plan order), after
        an earlier wave's. Returns its place among the second turns; None where a process died
        first."""
        self.keys[i] = key if key == key else math.inf  # NaN would not sort
        self.firsts[i] = 1
        if not self._until(lambda: all(self.firsts)):
            return None
        order = sorted(range(len(self.keys)), key=lambda j: (self.keys[j], j))
        place = len(self.left) - len(self.keys) + order.index(i)  # after the earlier waves' turns
        return place if self._until(lambda: self.taken.value == place) else None


def _take_turns(turns: _Turns | None) -> None:
    global _TURNS
    _TURNS = turns


def _ahead(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options, settings: dict,
           then: Callable | None, i: int, after: Callable | None = None) -> Any:
    """A process ahead's work (:func:`compile_ahead`): plan ``i``'s first iterations, then, with
    ``then``, once every process has run its own, ``then``'s result, one process at a time (and
    with ``after``, a second turn: ``after``'s result); or the first iterations' error or None,
    where a turn never came. An exception in a turn is this plan's entry, what it says: the
    others' turns go on (a plan out of memory where it is timed beside the baseline fails alone)."""
    started = time.perf_counter()
    error = _first_steps(make, plan, batch, options, settings)
    if then is None or _TURNS is None or not _TURNS.wait(i, time.perf_counter() - started):
        return error
    failed = None  # what a turn raised, as text: the plan's entry
    try:
        result = then(make, plan, batch, options)
    except Exception as exc:  # noqa: BLE001 - this plan's failure, not the end of the others' turns
        failed = _said(exc)
    finally:
        _TURNS.lock.release()
    if after is None:
        return failed or result
    result, key = (None, math.inf) if failed else result
    place = _TURNS.second(i, key)
    if place is None:
        return error
    try:
        if not failed:  # one that failed leaves nothing: its turn passes
            result, _TURNS.left[place] = after(make, plan, batch, options, result, list(_TURNS.left[:place]))
    except Exception as exc:  # noqa: BLE001 - as in the first turn
        failed = _said(exc)
    finally:
        _TURNS.taken.value += 1  # only the process whose turn it is writes it
    return failed or result


def _unsendable(args: tuple) -> str | None:
    """Why ``args`` cannot be sent to a spawned process, or None: they do not pickle; the main
    script would run again there to harm (:func:`_main_reruns`); or they name a function or
    class of ``__main__`` that a spawned process cannot find: one of an interactive session
    (``python -c``, a notebook), or one the script defines under ``if __name__ == "__main__":``,
    which the process does not run. Each reason says the fix.

    Example::

        >>> _unsendable((lambda: None,))
        "the factory, batch, loss or plan does not pickle (Can't pickle <function <lambda> ...>): use ..."
    """
    finder = _MainNames(io.BytesIO())
    try:
        finder.dump(args)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types (PicklingError, AttributeError, TypeError)
        return (f"the factory, batch, loss or plan does not pickle ({exc}): use module-level functions for the "
                "factory and the loss")
    main = sys.modules.get("__main__")
    rerun = _main_reruns(main)
    if rerun or not finder.names:
        return rerun
    if _spawn_main_by(main) is None:
        return (f"{finder.names[0]} is defined in __main__ here (an interactive session, python -c or a "
                "notebook), which a spawned process cannot import: define it in a module and import it")
    tree = _script(main.__file__) if getattr(main, "__file__", None) else None
    bound = _defined_unguarded(tree) if tree is not None else None
    hidden = [n for n in finder.names if bound is not None and n.split(".")[0] not in bound]
    if hidden:
        return (f"{hidden[0]} is defined under `if __name__ == \"__main__\":`, which a spawned process does not "
                "run, so it cannot find it there: define it above that line")
    return None


class _MainNames(pickle.Pickler):
    """A pickler that notes the functions and classes of ``__main__`` it pickles by name, and
    the module classes of ``__main__`` in a model that travels as ``torch.save`` bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.names.append(getattr(obj, "__qualname__", repr(obj)))
        elif isinstance(obj, _Copies):
            self.names += [type(m).__qualname__ for m in obj.model.modules() if type(m).__module__ == "__main__"]
        return NotImplemented


def _spawn_main_by(main: types.ModuleType | None) -> str | None:
    """How a spawned process runs this process's main module before its task, as
    :mod:`multiprocessing.spawn` does: ``"name"`` (imported by module name) or ``"path"`` (run from
    its file); None: it does not (an interactive session, ``python -c``, ``python -m`` of a
    package's ``__main__``)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else "name"
    path = getattr(main, "__file__", None)
    return None if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython" else "path"


def _main_reruns(main: types.ModuleType | None) -> str | None:
    """Why the main script, which a spawned process runs before its task, would fail or do
    harm there: it is no file (a script read from standard input), or the call that starts the
    process sits at its top level, outside ``if __name__ == "__main__":``, so that the spawned
    process runs the script's work again (whatever comes before the call) and then fails to start
    processes of its own. None where the script is not run there, where the call is under that
    line, or where the call's line cannot be read (a thread; a script that cannot be parsed). A
    script edited since it started is read as it is now."""
    by = _spawn_main_by(main)
    path = getattr(main, "__file__", None)
    if by is None or path is None:
        return None
    if by == "path" and not os.path.isfile(path):
        return f"the main script {path!r} is not a file that a spawned process can run: run it from a file"
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    tree = _script(path)
    if frame is None or tree is None or any(_in_guard(tree, frame.f_lineno)):
        return None
    return (f"{os.path.basename(path)} calls shrinkwrap at its top level (line {frame.f_lineno}), outside "
            "`if __name__ == \"__main__\":`, and a spawned process would run the script again: put the "
            "script's work under that line")


@functools.lru_cache(maxsize=8)
def _script(path: str) -> ast.Module | None:
    """The syntax tree of the script at ``path`` (its encoding as Python reads it), or None."""
    try:
        with open(path, "rb") as file:
            return ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _is_main_test(test: ast.expr) -> bool:
    """Whether ``test`` holds only where ``__name__ == "__main__"`` (alone, or in an ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    return _compares_name(test, ast.Eq)


def _compares_name(test: ast.expr, op: type) -> bool:
    """Whether ``test`` is ``__name__`` compared with ``"__main__"`` by ``op`` (either side first)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _guarded(node: ast.stmt) -> tuple[list[ast.stmt], list[ast.stmt]] | None:
    """For an ``if`` on the main guard, the branch that runs only in the main script and the
    other: ``if __name__ == "__main__":``'s body, or the ``else:`` of ``if __name__ != "__main__":``
    (``if not __name__ == "__main__":``); None for any other statement."""
    if not isinstance(node, ast.If):
        return None
    if _is_main_test(node.test):
        return node.body, node.orelse
    negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) and \
        _is_main_test(node.test.operand)
    if negated or _compares_name(node.test, ast.NotEq):
        return node.orelse, node.body
    return None


def _in_guard(tree: ast.Module, line: int) -> Iterator[ast.If]:
    """The main guards (:func:`_guarded`) whose guarded branch holds ``line``."""
    for node in ast.walk(tree):
        branches = _guarded(node)
        if branches and any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in branches[0]):
            yield node


def _defined_unguarded(tree: ast.Module) -> set[str]:
    """The names a script binds at its top level outside its main guards' guarded branches
    (functions, classes, assignments, imports), which a spawned process running it defines."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        branches = _guarded(node)
        if branches:
            todo += branches[1]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:  # if, try, with, for, while: their bodies run at the top level
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return names


def _held(device: torch.device, room: int | None) -> int | None:
    """How many processes of a row of ``room`` bytes each the device's free memory holds; None:
    no limit (not CUDA, or no ``room``). What this process's allocator keeps cached and unused
    counts as free: it is handed back first. On an H100 (torch 2.11, 2026-11-27), after maxvit_t
    @64's baseline row (peak 19311 MiB) the free memory read 58908 MiB with that row's blocks
    still cached (two processes at its peak) and 80240 MiB with them handed back (three)."""
    if device.type != "cuda" or room is None:
        return None
    _clean(device)
    return int(torch.cuda.mem_get_info(device)[0] // (room + PROCESS_MARGIN))


def compile_ahead(make: Callable[[], nn.Module], plans: Sequence[Plan], batch: Any, options: Options,
                  room: int | None = None, then: Callable | None = None,
                  compiled: Callable[[list[float]], None] | None = None,
                  after: Callable | None = None) -> tuple[int, list[Any]]:
    """Run each plan's first iterations in a fresh process of its own, several at once, so that
    what they compile is in the compiler's on-disk caches (inductor's FX graphs and kernels,
    AOTAutograd's joint graphs) before this process compiles the same plans. Returns how many
    processes ran at once, and each plan's error or None; ``(0, [])`` where fewer than two would
    (one process ahead of this one only adds its start) or the plans cannot be sent to a process.

    ``then``: what each process does next, once every plan has compiled (nothing compiles beside
    it), one process at a time: ``then(make, plan, batch, options)``, a function that pickles
    (module-level, or a method of a module-level class's instance) whose result takes the error's
    place (a plan that failed to compile gets it too: its row says what failed). Where not every
    plan's process runs at once (a process waiting for its turn
    holds what it compiled, and its CUDA context), the plans go in waves of as many as do, each
    wave compiling side by side and then taking its turns before the next one starts. For a
    process whose turn never came (one beside it died, which ends the others' waiting), the
    plan's entry is its error or None, as without ``then``. With ``then``, ``compiled(seconds)``
    (which must not raise) is called here within :data:`TURN_POLL` seconds of the last plan's
    compiling, with the seconds each plan's first iterations took (where the time went:
    compiling, then measuring; NaN for a plan of an earlier wave whose process died first);
    never where a process of the last wave died first. An exception in ``then`` or ``after`` is
    the plan's entry (its text), and the others' turns go on.

    ``after``: with ``then``, each process's second turn, once every first turn is over (``then``
    then returns its result and a number, the key), one process at a time, least key first (alike
    keys in plan order): ``after(make, plan, batch, options, result, before)``, where ``result`` is
    what its ``then`` returned and ``before`` the numbers the earlier second turns left (an
    earlier wave's first). It returns the plan's entry and the number it leaves for the later
    ones (a turn can depend on what the earlier ones found: a plan outdone by one before it need
    not be timed).

    ``room``: the device memory one plan's row takes at its peak (each process holds a model, its
    optimizer state and a step's activations, and its own CUDA context besides, counted here as
    :data:`PROCESS_MARGIN`); on CUDA as many run at once as the free memory holds. ``None``: no
    limit. The processes take this process's settings that the caches key on
    (:func:`compile_settings`); kernels' tuning is not kept from them. Without ``then`` nothing
    they run is timed; this process waits until every one has exited.

    On an H100 (torch 2.11, 2026-11-26), resnet152 @64's
    first two iterations under ``autocast(bf16), compile()`` took 97.0 s cold and 6.4 s from the
    caches; three such plans compiled side by side in 114 s, where one after another took 97-119 s
    each.

    Example::

        >>> compile_ahead(make, [Plan.parse("compile()"), Plan.parse("autocast(torch.bfloat16), compile()")], batch,
        ...               Options(device="cuda"))
        (2, [None, None])
    """
    device = resolve_device(options.device)
    _main_last()
    held = _held(device, room)
    at_once = len(plans) if held is None else min(len(plans), held)
    if at_once < 2:
        return 0, []
    options = dataclasses.replace(options, device=str(device))
    batch = tree_map(lambda t: t.to("cpu"), batch)  # CUDA tensors would be shared with the processes, not copied
    try:
        settings = compile_settings()
    except Exception:  # noqa: BLE001 - a torch without these configurations' export: this process compiles them itself
        return 0, []
    if _unsendable((make, list(plans), batch, options, settings, then, after)):
        return 0, []
    context = multiprocessing.get_context("spawn")
    turns: _Turns | None = None
    seconds: list[float] = []  # each plan's first iterations, of the waves before
    out: list[Any] = [None] * len(plans)
    waiting = list(enumerate(plans))
    running: dict[concurrent.futures.Future, tuple[int, concurrent.futures.ProcessPoolExecutor]] = {}
    watching = False
    # Pools told to stop are ended together, so their processes exit side by side: ended as each
    # result comes, processes whose turns end at once (plans not timed) would exit one by one.
    stopped: list[tuple] = []
    try:
        while waiting or running:
            # With ``then``, in waves of as many as run at once, each taking its turns once all of
            # it has compiled; else each plan starts as a process ends.
            if waiting and len(running) < at_once and (then is None or not running):
                while stopped:  # gone, and their memory with them, before the next one starts
                    _end(stopped.pop(), grace=10)
                if then is not None:
                    before = [] if turns is None else list(turns.left)
                    seconds += [] if turns is None else list(turns.seconds)
                    turns = _Turns.make(context, min(at_once, len(waiting)), before)
                    watching = compiled is not None and len(waiting) <= at_once  # the last wave
                while waiting and len(running) < at_once:
                    i, plan = waiting.pop(0)
                    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_take_turns,
                                                                  initargs=(turns,))
                    running[pool.submit(_ahead, make, plan, batch, options, settings, then, i % at_once,
                                        after)] = (i, pool)
            done, _ = concurrent.futures.wait(running, timeout=TURN_POLL if watching else None,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if watching and all(turns.compiled):
                watching = False
                compiled(seconds + list(turns.seconds))
            for future in done:
                i, pool = running.pop(future)
                try:
                    out[i] = future.result()
                except Exception as exc:  # noqa: BLE001 - a process that died (BrokenProcessPool)
                    out[i] = _said(exc)
                    if turns is not None:
                        turns.broken.value = 1  # the others' turns never come: they end without one
                stopped.append(_stop(pool))
    except Exception as exc:  # noqa: BLE001 - a process that cannot start: this process compiles the rest itself
        for i, _ in waiting + list(running.values()):
            out[i] = _said(exc)
    finally:
        for ending in stopped:
            _end(ending, grace=10)
        for _, pool in running.values():
            _end(_stop(pool), grace=0)
    return at_once, out


def _ready(make: Callable[[], nn.Module] | None, modules: Sequence[str] = ()) -> None:
    """A spawned process's first task: what a row does before it measures anything. ``make`` was
    unpickled to get here, importing the modules it comes from; the ``modules`` that define the
    model's classes are imported now, which the factory itself may import only when called
    (transformers: 7.8 of the 16.8 s an isolated bert row took on an H100, with the process started
    ahead); and CUDA starts. The factory is not called: it may cache what it builds, or act."""
    _main_last()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start; the row imports what it needs
            pass
    if torch.cuda.is_available():
        torch.cuda.init()


def _stop(pool: concurrent.futures.ProcessPoolExecutor) -> tuple:
    """Tell ``pool``'s processes to exit, without waiting; returns what :func:`_end` waits for.
    The pool is held in it, so that it is not collected while its thread shuts them down."""
    ending = pool, list((pool._processes or {}).values()), pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    return ending


def _end(ending: tuple, grace: float) -> None:
    """Terminate the processes of a stopped pool (see :func:`_stop`) still alive after ``grace``
    seconds, and return once the pool's thread has reaped them. Only that thread joins them: a
    second thread joining the same child races it (the loser's ``waitpid`` fails, and the child
    stays listed as running)."""
    _, processes, thread = ending
    deadline = time.monotonic() + grace
    for process in processes:
        if not multiprocessing.connection.wait([process.sentinel], max(0.0, deadline - time.monotonic())):
            process.terminate()
    if thread is not None:
        thread.join()


# Processes :class:`FreshProcesses` keeps started ahead for a caller that asks for rows one after
# another: each holds a CUDA context while it waits.
AHEAD = 2


class FreshProcesses:
    """Where isolated rows run: a new spawned process for each row. :meth:`start_next` starts the
    next row's process now, so that its start (imports, those of the model's classes
    (``modules``), and the CUDA context: see :func:`_ready`) overlaps what this process does until
    that row comes; it is still fresh (it has measured nothing) then. With ``ahead``, for a caller
    that asks for rows one after another (autoplan: on an H200, a row's process took 3-5 s to
    import torch and 0.5-3 s to start CUDA before it built the model), :attr:`depth` processes
    wait (:data:`AHEAD`), each started as a row starts, and :meth:`prime` has each make the
    rows' library calls while it waits: two rows asked back to back then both find a process
    that is ready (on an H100, efficientnet_b0's second row, asked 2 s after the first, waited
    20 s for its process's start and calls). A start overlaps a row in another process: that
    row's step time may read the start's load; its memory is its own process's. Those started
    and never used are stopped by :meth:`close`.

    Example::

        >>> with FreshProcesses(make) as fresh:
        ...     fresh.start_next()
        ...     measure_plans(make, [Plan()], batch, isolate=True, processes=fresh)   # or fresh.run(fn, *args)
    """

    def __init__(self, make: Callable[[], nn.Module] | None = None, modules: Sequence[str] = (),
                 ahead: bool = False) -> None:
        # A copied instance would travel twice (torch.save bytes): only the imports and the CUDA start go ahead.
        self.make = None if isinstance(make, _Copies) else make
        self.modules = tuple(modules)
        self.ahead = ahead
        # How many wait with ``ahead`` (a caller short of GPU memory keeps one: each holds a CUDA context).
        self.depth = AHEAD if ahead else 1
        self._waiting: list[concurrent.futures.ProcessPoolExecutor] = []  # started, in the order they will run rows
        self._primer: tuple[Calls, int] | None = None  # see prime
        # Stopped pools whose row is done (see _stop), which close() waits for.
        self._exiting: list[tuple] = []

    def start_next(self, count: int | None = None) -> None:
        """Start the next row's process (with ``ahead``, the next :attr:`depth`; or ``count``),
        unless started, or none can be (see :func:`_unsendable`: ``run`` then raises, and callers
        check before)."""
        # Cheap to ask each time: a factory and module names (an instance's copies do not go ahead).
        while len(self._waiting) < (count or self.depth) and not _unsendable((self.make, self.modules)):
            _main_last()  # a row's process keys its compiled graphs as this one does
            pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._waiting.append(pool)
            pool.submit(_ready, self.make, self.modules)
            if self._primer is not None:
                pool.submit(replay, *self._primer)

    def prime(self, calls: Calls, keep: int = 0) -> None:
        """Have each process started ahead, from now on and those waiting now, make ``calls``
        (:func:`~shrinkwrap.measure.first_use.replay`, leaving ``keep`` bytes free) while it
        waits for its row: cuDNN's plans for the layouts and types the rows will run are then made
        before the row, not in its first iteration. What the row reads is unchanged (see the
        module). Primed again, a process makes the calls it was not given yet. A row asked for
        before the replay is over waits for it: the calls it makes itself take about as long."""
        given = self._primer[0].calls if self._primer is not None else {}
        new = Calls({key: None for key in calls.calls if key not in given})
        self._primer = (Calls({**given, **new.calls}), keep)
        for pool in list(self._waiting) if new else ():
            try:
                pool.submit(replay, new, keep)
            except Exception:  # noqa: BLE001 - it died waiting (killed for memory): a row starts its own
                self._waiting.remove(pool)
                _end(_stop(pool), grace=0)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the next fresh process (a row: ``compare._row``); what it returns."""
        if not self._waiting:
            self.start_next(1)  # the rest as the row starts, not beside its start
        if not self._waiting:
            raise RuntimeError(f"shrinkwrap: a row's fresh process cannot start: {_unsendable((self.make, *args))}")
        pool = self._waiting.pop(0)
        try:
            future = pool.submit(fn, *args)
            if self.ahead:
                try:  # as the row starts, not as it ends: a primed process needs the row's time to replay
                    self.start_next()
                except Exception:  # noqa: BLE001 - only a head start: the next run starts its own, or says why not
                    pass
            return future.result()
        finally:
            # Not waited for here: the process exits while this one goes on (on an H100 machine its
            # exit took 4.1 s after a resnet152 row), and close() waits for it. Its CUDA context is
            # not this process's allocator's, so no reading here counts it.
            self._exiting.append(_stop(pool))

    def stop_next(self) -> None:
        """Stop the processes started ahead, if any, at once: they have measured nothing. Before
        work that reads the GPU's free memory (their CUDA contexts would count as taken); the next
        :meth:`run` starts them again."""
        for pool in self._waiting:
            _end(_stop(pool), grace=0)  # it may still be importing
        self._waiting.clear()

    def close(self) -> None:
        self.stop_next()
        for ending in self._exiting:
            _end(ending, grace=10)  # its row came back: nothing is left for it to do
        self._exiting.clear()

    def __enter__(self) -> "FreshProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


