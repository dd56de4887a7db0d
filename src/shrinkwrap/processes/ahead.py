"""Plans compiled ahead, side by side, each in a fresh process of its own (:func:`compile_ahead`),
and the turns those processes take once every plan has compiled (:class:`_Turns`): each then
measured where it compiled, one at a time."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .._compat import aot_autograd_cache_counts
from .._tree import tree_map
from ..measuring.profile import Options
from ..measuring.step import clean_device, setup_iteration, resolve_device
from ..plan import Plan
from .copies import build_model
from .fresh import PROCESS_MARGIN, end_pool, first_error_line, stop_pool
from .sendable import why_unsendable
from .settings import compile_settings, take_settings


def _first_steps(make: Callable[[], nn.Module], plan: Plan, batch: Any, options: Options,
                 settings: dict) -> str | None:
    """In a spawned process: ``settings`` taken on (:func:`take_settings`), then ``plan``'s
    model built and run for its warm-up iterations and one more (where a compiled plan compiles
    its forward and backward); None, or what stopped it."""
    take_settings(settings)
    device = torch.device(options.device)
    try:
        model = build_model(make, device, plan)
        step, _ = setup_iteration(model, batch, options, device)
        for _ in range(options.warmup + 1):
            step()
        return None
    except Exception as exc:  # noqa: BLE001 - only a head start: the plan's own row says what fails
        return first_error_line(exc)
    finally:
        model = step = None
        clean_device(device)


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
    cached: Any  # RawArray of ints, two a plan: AOTAutograd's cache hits and misses in its first iterations

    @classmethod
    def make(cls, context: Any, n: int, before: Sequence[float] = ()) -> "_Turns":
        """Turns for ``n`` processes, after second turns (of an earlier wave) that left ``before``."""
        return cls(context.RawArray("b", n), context.RawValue("b", 0), context.Lock(),
                   context.RawArray("d", [math.nan] * n), context.RawArray("d", n), context.RawArray("b", n),
                   context.RawValue("i", len(before)), context.RawArray("d", [*before] + [math.inf] * n),
                   context.RawArray("i", 2 * n))

    def _until(self, ready: Callable[[], bool]) -> bool:
        """Poll until ``ready()``; False where a process died first."""
        while not ready():
            if self.broken.value:
                return False
            time.sleep(TURN_POLL)
        return True

    def wait(self, i: int, seconds: float, cached: tuple[int, int] = (0, 0)) -> bool:
        """Plan ``i`` compiled in ``seconds``, ``cached`` (its graphs from the on-disk caches, and
        anew): wait until every plan has and this process holds the lock; False (without the
        lock) where a process died first."""
        self.seconds[i] = seconds
        self.cached[2 * i], self.cached[2 * i + 1] = cached
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
    started, before = time.perf_counter(), aot_autograd_cache_counts()
    error = _first_steps(make, plan, batch, options, settings)
    cached = tuple(a - b for a, b in zip(aot_autograd_cache_counts(), before))
    if then is None or _TURNS is None or not _TURNS.wait(i, time.perf_counter() - started, cached):
        return error
    failed = None  # what a turn raised, as text: the plan's entry
    try:
        result = then(make, plan, batch, options)
    except Exception as exc:  # noqa: BLE001 - this plan's failure, not the end of the others' turns
        failed = first_error_line(exc)
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
        failed = first_error_line(exc)
    finally:
        _TURNS.taken.value += 1  # only the process whose turn it is writes it
    return failed or result


def _processes_fitting(device: torch.device, room: int | None) -> int | None:
    """How many processes of a row of ``room`` bytes each the device's free memory holds; None:
    no limit (not CUDA, or no ``room``). What this process's allocator keeps cached and unused
    counts as free: it is handed back first (a large model's cached blocks can be a process's
    worth: tests/test_measure_processes.py's CUDA test)."""
    if device.type != "cuda" or room is None:
        return None
    clean_device(device)
    return int(torch.cuda.mem_get_info(device)[0] // (room + PROCESS_MARGIN))


def compile_ahead(make: Callable[[], nn.Module], plans: Sequence[Plan], batch: Any, options: Options,
                  room: int | None = None, then: Callable | None = None,
                  compiled: Callable[[list[float], tuple[int, int]], None] | None = None,
                  after: Callable | None = None, finished: Callable[[int], None] | None = None
                  ) -> tuple[int, list[Any]]:
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
    plan's entry is its error or None, as without ``then``. With ``then``, ``compiled(seconds,
    cached)`` (which must not raise) is called here within :data:`TURN_POLL` seconds of the last
    plan's compiling, with the seconds each plan's first iterations took (where the time went:
    compiling, then measuring; NaN for a plan of an earlier wave whose process died first) and
    how many graphs they all compiled from the on-disk caches and how many anew (AOTAutograd's);
    never where a process of the last wave died first. An exception in ``then`` or ``after`` is
    the plan's entry (its text), and the others' turns go on.

    ``after``: with ``then``, each process's second turn, once every first turn is over (``then``
    then returns its result and a number, the key), one process at a time, least key first (alike
    keys in plan order): ``after(make, plan, batch, options, result, before)``, where ``result`` is
    what its ``then`` returned and ``before`` the numbers the earlier second turns left (an
    earlier wave's first). It returns the plan's entry and the number it leaves for the later
    ones (a turn can depend on what the earlier ones found: a plan outdone by one before it need
    not be timed).

    ``finished(i)`` (which must not raise) is called here as plan ``i``'s entry arrives: its
    process's last turn ended (or without ``then``, its first iterations).

    ``room``: the device memory one plan's row takes at its peak (each process holds a model, its
    optimizer state and a step's activations, and its own CUDA context besides, counted here as
    :data:`PROCESS_MARGIN`); on CUDA as many run at once as the free memory holds. ``None``: no
    limit. The processes take this process's settings that the caches key on
    (:func:`compile_settings`); kernels' tuning is not kept from them. Without ``then`` nothing
    they run is timed; this process waits until every one has exited.

    A plan compiled cold takes minutes, from the caches seconds, and several side by side about
    as long as one alone (benchmarks/RESULTS.md, "What compile=True pays per plan").

    Example::

        >>> compile_ahead(make, [Plan.parse("compile()"), Plan.parse("autocast(torch.bfloat16), compile()")], batch,
        ...               Options(device="cuda"))
        (2, [None, None])
    """
    device = resolve_device(options.device)
    held = _processes_fitting(device, room)
    at_once = len(plans) if held is None else min(len(plans), held)
    if at_once < 2:
        return 0, []
    options = dataclasses.replace(options, device=str(device))
    batch = tree_map(lambda t: t.to("cpu"), batch)  # CUDA tensors would be shared with the processes, not copied
    try:
        settings = compile_settings()
    except Exception:  # noqa: BLE001 - a torch without these configurations' export: this process compiles them itself
        return 0, []
    if why_unsendable((make, list(plans), batch, options, settings, then, after)):
        return 0, []
    context = multiprocessing.get_context("spawn")
    turns: _Turns | None = None
    seconds: list[float] = []  # each plan's first iterations, of the waves before
    cached = [0, 0]  # graphs from the caches and anew, of the waves before
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
                    end_pool(stopped.pop(), grace=10)
                if then is not None:
                    before = [] if turns is None else list(turns.left)
                    seconds += [] if turns is None else list(turns.seconds)
                    cached = cached if turns is None else _cached(cached, turns)
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
                compiled(seconds + list(turns.seconds), tuple(_cached(cached, turns)))
            for future in done:
                i, pool = running.pop(future)
                try:
                    out[i] = future.result()
                except Exception as exc:  # noqa: BLE001 - a process that died (BrokenProcessPool)
                    out[i] = first_error_line(exc)
                    if turns is not None:
                        turns.broken.value = 1  # the others' turns never come: they end without one
                stopped.append(stop_pool(pool))
                if finished is not None:
                    finished(i)
    except Exception as exc:  # noqa: BLE001 - a process that cannot start: this process compiles the rest itself
        for i, _ in waiting + list(running.values()):
            out[i] = first_error_line(exc)
    finally:
        for ending in stopped:
            end_pool(ending, grace=10)
        for _, pool in running.values():
            end_pool(stop_pool(pool), grace=0)
    return at_once, out


def _cached(before: list[int], turns: _Turns) -> list[int]:
    """``before`` (graphs from the caches, anew) with what the plans of ``turns`` compiled added."""
    return [before[0] + sum(turns.cached[0::2]), before[1] + sum(turns.cached[1::2])]
