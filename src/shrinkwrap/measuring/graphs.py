"""What a compiled model's iteration shows besides the allocator's counters: the CUDA graphs it
replayed or recorded and the private pools they hold, and dynamo's counts of graphs, graph breaks
and recompile limits met."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator

import torch

from .. import _compat
from ..transforms.optimizer.interface import holds_no_gradient
from .profile import Phase
from .ranks import local
from .sizes import _bytes


def graph_pool_bytes(device: torch.device, grads: list[torch.Tensor | None]) -> tuple[int, int]:
    """Bytes reserved on ``device`` in private memory pools (CUDA graphs'), and the bytes of
    ``grads`` whose storage (a DTensor's: this rank's shard) lies in them outside every block the
    allocator counts as allocated: written by a replayed graph, unseen by its counters (one a
    recording made is counted)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    segments = [s for s in torch.cuda.memory_snapshot()
                if s.get("device", index) == index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    counted = [(b["address"], b["address"] + b["size"]) for s in segments for b in s.get("blocks", ())
               if b.get("state") == "active_allocated" and "address" in b]

    def within(g: torch.Tensor, spans: Iterable[tuple[int, int]]) -> bool:
        at = local(g).untyped_storage().data_ptr()
        return any(a <= at < b for a, b in spans)

    pools = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    return sum(b - a for a, b in pools), _bytes(g for g in grads if g is not None and not holds_no_gradient(g)
                                                and within(g, pools) and not within(g, counted))


def _graph_trees(device: torch.device) -> int | None:
    """How many graphs ``torch.compile``'s CUDA graph trees have recorded for ``device`` in this
    thread (each node of a tree is one recording); None where this torch's trees cannot say."""
    try:
        cudagraph_trees = _compat.cudagraph_trees()

        index = torch.cuda.current_device() if device.index is None else device.index
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        nodes, count = [n for ns in manager.roots.values() for n in ns] if manager is not None else [], 0
        while nodes:
            count += 1
            nodes.extend(c for cs in nodes.pop().children.values() for c in cs)
        return count
    except Exception:  # noqa: BLE001 - private structures of torch: without them, the upper bound
        return None


@contextlib.contextmanager
def _replays() -> Iterator[list[Any]]:
    """List the CUDA graphs replayed (``torch.cuda.CUDAGraph.replay``, through which graph trees
    run each) while open, in the list it gives. The trees' own structures cannot
    tell which graphs an iteration ran: the path they keep can begin anew within one iteration."""
    cls = torch.cuda.CUDAGraph
    own = "replay" in vars(cls)
    original = cls.replay
    replayed: list[Any] = []  # the graphs themselves: an id could be reused by another

    def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
        replayed.append(graph)
        return original(graph, *args, **kwargs)

    cls.replay = replay
    try:
        yield replayed
    finally:
        if own:
            cls.replay = original
        else:
            del cls.replay


def _as_recorded(steady: list[Phase], replayed: list[Any], warm: list[tuple[list[Phase], list[Any], bool]],
                 unseen_grads: int) -> list[Phase] | None:
    """The steady step's phases as a warm-up iteration that recorded, whole, every CUDA graph the
    steady step replayed (``replayed``) made them in the open: that iteration's phases, aligned
    with the steady step's at zero_grad, where both have freed their gradients and hold the same
    state. No phase reads less than the steady step's own counters, with the ``unseen_grads`` a
    replay wrote from backward on (a phase that differs between iterations, such as a first
    optimizer step, or leftovers freed between them, would otherwise read low). ``warm`` holds
    each warm-up's phases, the graphs it replayed and whether it recorded them whole. None where
    no warm-up did."""
    for phases, graphs, whole in warm:
        if whole and set(replayed) <= set(graphs):
            shift = steady[0].allocated - phases[0].allocated
            grads = [unseen_grads if p.name in ("backward", "step") else 0 for p in steady]
            return [Phase(r.name, max(r.allocated + shift, s.allocated + g), max(r.peak + shift, s.peak + g))
                    for r, s, g in zip(phases, steady, grads)]
    return None


def _recorded_whole(before: int | None, after: int | None, replayed: list[Any]) -> bool:
    """Whether an iteration, between two readings of :func:`_graph_trees`, recorded every CUDA
    graph it ran: graph trees replay a graph once as they record it (capture computes nothing),
    so its replays are exactly its recordings, each once, one at least. One that re-recorded one
    function and replayed the others would read low: their memory unseen."""
    return (before is not None and after is not None and after > before
            and len(replayed) == len(set(replayed)) == after - before)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    counters = _compat.dynamo_counters()  # imported already where a model is compiled

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@contextlib.contextmanager
def _recompile_limit() -> Iterator[list[str]]:
    """The limits of recompiles dynamo meets in the block, as its log names them (``recompile_limit
    (8)``): a frame past its limit runs eagerly from then on, which dynamo says in a warning only."""
    met: list[str] = []

    class Met(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("torch._dynamo hit config."):
                met.append(record.getMessage().splitlines()[0].removeprefix("torch._dynamo hit config."))

    logger, handler = logging.getLogger("torch._dynamo.convert_frame"), Met(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield met
    finally:
        logger.removeHandler(handler)
