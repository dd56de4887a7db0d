"""Fresh processes for rows: a new spawned process each (:class:`FreshProcesses`), optionally
started ahead and primed with cuDNN's first-use calls, and how a pool's processes are ended
(:func:`stop_pool`, :func:`end_pool`)."""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import multiprocessing.connection
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .._compat import pool_processes
from ..measuring.first_use import Calls, replay
from .copies import ModelCopies
from .sendable import why_unsendable
from .settings import module_order, take_module_order


def first_error_line(exc: BaseException) -> str:
    """An error as a row or a note shows it: its type and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


PROCESS_MARGIN = 2**30  # what a process holds beside its row's peak: its CUDA context and workspaces


def _ready(make: Callable[[], nn.Module] | None, modules: Sequence[str] = (),
           order: list[str] | None = None) -> None:
    """A spawned process's first task: what a row does before it measures anything. ``make`` was
    unpickled to get here, importing the modules it comes from; the ``modules`` that define the
    model's classes are imported now, which the factory itself may import only when called (a
    transformers model's imports are a large part of its row: docs/architecture.md, "autoplan's
    processes"); then ``sys.modules`` takes the parent's ``order`` (see
    :func:`~.settings.take_module_order`); and CUDA starts. The factory is not called: it may
    cache what it builds, or act."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start; the row imports what it needs
            pass
    take_module_order(order)
    if torch.cuda.is_available():
        torch.cuda.init()


def stop_pool(pool: concurrent.futures.ProcessPoolExecutor) -> tuple:
    """Tell ``pool``'s processes to exit, without waiting; returns what :func:`end_pool` waits for.
    The pool is held in it, so that it is not collected while its thread shuts them down."""
    ending = pool, *pool_processes(pool)
    pool.shutdown(wait=False, cancel_futures=True)
    return ending


def end_pool(ending: tuple, grace: float) -> None:
    """Terminate the processes of a stopped pool (see :func:`stop_pool`) still alive after ``grace``
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
    that asks for rows one after another (autoplan: a row's process spends seconds importing torch
    and starting CUDA before it builds the model), :attr:`depth` processes wait (:data:`AHEAD`),
    each started as a row starts, and :meth:`prime` has each make the rows' library calls while it
    waits: two rows asked back to back then both find a process that is ready (what that saves:
    docs/architecture.md, "autoplan's processes"). A start overlaps a row in another process: that
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
        self.make = None if isinstance(make, ModelCopies) else make
        self.modules = tuple(modules)
        self.ahead = ahead
        # How many wait with ``ahead`` (a caller short of GPU memory keeps one: each holds a CUDA context).
        self.depth = AHEAD if ahead else 1
        self._waiting: list[concurrent.futures.ProcessPoolExecutor] = []  # started, in the order they will run rows
        self._primer: tuple[Calls, int] | None = None  # see prime
        # Stopped pools whose row is done (see stop_pool), which close() waits for.
        self._exiting: list[tuple] = []

    def start_next(self, count: int | None = None) -> None:
        """Start the next row's process (with ``ahead``, the next :attr:`depth`; or ``count``),
        unless started, or none can be (see :func:`why_unsendable`: ``run`` then raises, and callers
        check before)."""
        # Cheap to ask each time: a factory and module names (an instance's copies do not go ahead).
        while len(self._waiting) < (count or self.depth) and not why_unsendable((self.make, self.modules)):
            pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._waiting.append(pool)
            # module_order: a row's process keys its compiled graphs as this one does
            pool.submit(_ready, self.make, self.modules, module_order())
            if self._primer is not None:
                pool.submit(replay, *self._primer)

    def prime(self, calls: Calls, keep: int = 0) -> None:
        """Have each process started ahead, from now on and those waiting now, make ``calls``
        (:func:`~shrinkwrap.measuring.first_use.replay`, leaving ``keep`` bytes free) while it
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
                end_pool(stop_pool(pool), grace=0)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the next fresh process (a row: ``compare.measure_row``); what it returns."""
        if not self._waiting:
            self.start_next(1)  # the rest as the row starts, not beside its start
        if not self._waiting:
            raise RuntimeError(f"shrinkwrap: a row's fresh process cannot start: {why_unsendable((self.make, *args))}")
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
            # Not waited for here: the process exits while this one goes on (an exit takes seconds
            # after a large model's row), and close() waits for it. Its CUDA context is not this
            # process's allocator's, so no reading here counts it.
            self._exiting.append(stop_pool(pool))

    def stop_next(self) -> None:
        """Stop the processes started ahead, if any, at once: they have measured nothing. Before
        work that reads the GPU's free memory (their CUDA contexts would count as taken); the next
        :meth:`run` starts them again."""
        for pool in self._waiting:
            end_pool(stop_pool(pool), grace=0)  # it may still be importing
        self._waiting.clear()

    def close(self) -> None:
        self.stop_next()
        for ending in self._exiting:
            end_pool(ending, grace=10)  # its row came back: nothing is left for it to do
        self._exiting.clear()

    def __enter__(self) -> "FreshProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
