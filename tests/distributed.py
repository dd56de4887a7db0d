"""Two ranks for the tests: processes in one torch.distributed process group, kept for a module.

``Ranks("cpu")`` starts two processes (``spawn``) that join a process group as torchrun's ranks
would, through ``shrinkwrap.parallel.init`` (gloo on the CPU; ``Ranks("cuda")``: NCCL, a GPU each),
and then run what they are sent: ``ranks.run(fn, *args)`` runs ``fn(*args)`` on every rank and
returns the results in rank order. ``fn`` is a module-level function (it travels pickled, by
name); inside it, :func:`device` is the rank's device and ``torch.distributed`` is initialised.

An exception on any rank fails the call with that rank's traceback. The processes are then ended
and started again at the next call: a rank left waiting in a collective would hold up the group.
Starting the processes costs seconds; running a function on them, a few milliseconds more than the
function.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 120  # one call, and the process group's collectives

_device: torch.device | None = None


def device() -> torch.device:
    """This rank's device (inside a function sent to the ranks)."""
    assert _device is not None, "not in a rank started by tests/distributed.py"
    return _device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, kind: str, port: int, inbox: Any, outbox: Any) -> None:
    global _device
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a small machine: OpenMP threads would wait for each other
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    from shrinkwrap import parallel

    try:
        _device = parallel.init(kind, timeout_s=TIMEOUT_S)
        outbox.put((rank, True, str(_device)))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        outbox.put((rank, False, traceback.format_exc()))
        return
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            outbox.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001
            outbox.put((rank, False, traceback.format_exc()))
    torch.distributed.destroy_process_group()


class Ranks:
    """``WORLD`` processes in one process group on ``kind`` ("cpu": gloo; "cuda": NCCL)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(WORLD)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, WORLD, self.kind, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(WORLD)]
        for p in self.procs:
            p.start()
        self._collect("joining the process group")

    def _collect(self, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        while len(results) < WORLD:
            try:
                rank, ok, value = self.outbox.get(timeout=TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise AssertionError(f"{what}: no answer from ranks {sorted(set(range(WORLD)) - set(results))} "
                                     f"in {TIMEOUT_S} s") from None
            if not ok:
                self.close()  # the other rank may wait in a collective: start afresh next time
                raise AssertionError(f"{what} failed on rank {rank}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(WORLD)]

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` on every rank; the results in rank order."""
        if not self.procs:
            self._start()
        for box in self.inboxes:
            box.put((fn, args))
        return self._collect(getattr(fn, "__name__", "the function"))

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(10)
        self.procs = []

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.procs:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(30)
        self.close()
