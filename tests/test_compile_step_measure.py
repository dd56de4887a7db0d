"""Measuring compiled models: the memory CUDA graphs keep, graph trees, recordings and replays, and dynamo's recompile
limit."""

import pytest
import torch

import shrinkwrap as sw

from compile_step_helpers import Block, MLP, OtherMLP, _mlp


@pytest.mark.cuda
def test_measure_counts_the_memory_cuda_graphs_keep():
    """A replayed CUDA graph writes into its private pool without the allocator's counters seeing
    it: with mode='reduce-overhead' they read almost nothing (45 MiB of resnet18's 1283 MiB on
    an H100). Measured fresh, the graphed model is read at the iteration that recorded its
    graphs: at least what the same program keeps without graphs (on an H100 this MLP read 117.2
    MiB against 80.7: a recording allocates some 30-36 MiB more, in every model tried), and no
    more than the pool counted whole (130.2). Recorded before (the second measure), the pool is
    counted whole, and so is a model run once before the measure, which records in the measure's
    first iteration (that one also makes the optimizer's state: not the steady step's). With
    warmup=1 the steady step is the recording, read as it is; with measure's default warmup=2 the
    steady step follows the recording and reads what warmup=3 reads. A plain compiled model
    measured beside them is not counted as graphed."""
    x = torch.randn(16384, 64)
    plain = sw.apply(_mlp(), [sw.compile()])
    graphed = sw.apply(_mlp(OtherMLP), [sw.compile(mode="reduce-overhead")])
    g1, p, g2 = (sw.measure(m, x, device="cuda", warmup=3) for m in (graphed, plain, graphed))
    once = sw.apply(_mlp(type("ThirdMLP", (MLP,), {})).cuda(), [sw.compile(mode="reduce-overhead")])
    once(x.cuda()).sum().backward()
    fresh = sw.apply(_mlp(type("FourthMLP", (MLP,), {})), [sw.compile(mode="reduce-overhead")])
    default = sw.apply(_mlp(type("FifthMLP", (MLP,), {})), [sw.compile(mode="reduce-overhead")])
    g3, g4 = sw.measure(once, x, device="cuda", warmup=3), sw.measure(fresh, x, device="cuda", warmup=1)
    g5 = sw.measure(default, x, device="cuda")  # warmup=2: the recording's gradients are counted, then replaced unseen
    assert g3.cuda_graphs and not g3.graph_recorded and g3.peak - g3.static >= p.peak - p.static
    for g in (g4, g5):
        assert g.cuda_graphs and g.graph_recorded
        assert p.peak - p.static <= g.peak - g.static <= g2.peak - g2.static, [(m.peak - m.static) / 2**20 for m in (g, p, g2)]
    assert abs((g5.peak - g5.static) - (g1.peak - g1.static)) <= 0.05 * (g1.peak - g1.static)  # the same program
    act = [(m.peak - m.static) / 2**20 for m in (g1, p, g2)]
    assert not p.cuda_graphs and p.graph_pool is None and not p.graph_recorded
    assert g1.graph_recorded and not g2.graph_recorded, act
    for g in (g1, g2):
        assert g.cuda_graphs and g.graph_pool > 0
        assert g.peak - g.static >= 0.9 * (p.peak - p.static), act
    assert g1.peak - g1.static <= g2.peak - g2.static, act
    assert "recorded them" in str(g1) and "upper bound" in str(g2)


def test_graph_trees_counts_every_node_of_the_cuda_graph_trees(monkeypatch):
    from types import SimpleNamespace

    from torch._inductor import cudagraph_trees

    from shrinkwrap.measuring.graphs import _graph_trees

    def node(*children):
        return SimpleNamespace(children={"f": list(children)} if children else {})

    manager = SimpleNamespace(roots={"fwd": [node(node(), node(node()))], "other": [node()]})
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: manager)
    assert _graph_trees(torch.device("cuda", 0)) == 5
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: None)
    assert _graph_trees(torch.device("cuda", 0)) == 0  # nothing compiled with graphs yet
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: object())
    assert _graph_trees(torch.device("cuda", 0)) is None  # a torch whose trees say nothing: the upper bound


def test_an_iteration_is_read_as_a_recording_only_where_it_recorded_and_replayed_nothing():
    from shrinkwrap.measuring.graphs import _recorded_whole

    assert _recorded_whole(2, 4, [11, 12])  # forward and backward recorded (each replayed once as it is)
    assert not _recorded_whole(2, 3, [11, 12])  # the backward re-recorded, the forward replayed unseen
    assert not _recorded_whole(2, 4, [11, 11])  # one recorded and replayed as it was, then replayed again
    assert not _recorded_whole(4, 4, [11, 12])  # replayed only
    assert not _recorded_whole(4, 4, [])  # a warm-up, or no graphs at all
    assert not _recorded_whole(2, 4, [])  # recordings that never ran: a torch that works otherwise
    assert not _recorded_whole(None, 4, [11, 12]) and not _recorded_whole(2, None, [11, 12])


def test_the_steady_step_is_read_as_the_warm_up_that_recorded_every_graph_it_replays():
    from shrinkwrap.measuring.graphs import _as_recorded
    from shrinkwrap.measuring.profile import Phase

    mib = 2**20
    steady = [Phase("zero_grad", 10 * mib, 12 * mib), Phase("backward", 11 * mib, 11 * mib),  # replays: counters miss them
              Phase("step", 30 * mib, 50 * mib)]  # an optimizer step the recording's iteration skipped (a GradScaler's)
    recording = [Phase("zero_grad", 8 * mib, 9 * mib), Phase("backward", 9 * mib, 40 * mib), Phase("step", 9 * mib, 10 * mib)]
    partial = [Phase("zero_grad", 8 * mib, 9 * mib), Phase("backward", 9 * mib, 20 * mib), Phase("step", 9 * mib, 9 * mib)]
    read = _as_recorded(steady, [1, 2], [(partial, [1, 2, 3], False), (recording, [1, 2], True)], unseen_grads=3 * mib)
    # aligned at zero_grad (the steady step holds 2 MiB more there: its optimizer's state, say), and never below
    # the steady step's own counters with the gradients a replay wrote
    assert read == [Phase("zero_grad", 10 * mib, 12 * mib), Phase("backward", 14 * mib, 42 * mib),
                    Phase("step", 33 * mib, 53 * mib)]
    assert _as_recorded(steady, [1, 2, 4], [(recording, [1, 2], True)], 0) is None  # it replays a graph recorded elsewhere
    assert _as_recorded(steady, [1, 2], [(partial, [1, 2], False)], 0) is None  # no whole recording
    assert _as_recorded(steady, [1, 2], [], 0) is None  # warmup=1


def test_replays_lists_cuda_graph_replays_and_puts_replay_back(monkeypatch):
    from shrinkwrap.measuring.graphs import _replays

    class Base:
        def replay(self):
            self.replayed = True

    class Graph(Base):
        pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    with _replays() as replayed:
        g, h = Graph(), Graph()
        g.replay(), h.replay(), g.replay()
    assert replayed == [g, h, g] and g.replayed
    assert "replay" not in vars(Graph) and Graph.replay is Base.replay  # inherited again, as it was
    Graph.replay = own = lambda self: None
    with _replays() as replayed:
        g.replay()
    assert replayed == [g] and Graph.replay is own


def test_a_model_compiled_past_dynamos_limit_of_recompiles_is_not_measured_as_compiled():
    # Every model compiled whole shares nn.Module._call_impl's limit: the ninth of another shape
    # runs eagerly, which dynamo says in its log only; measure says it instead of reading it.
    torch._dynamo.reset()
    for width in range(4, 12):
        model = sw.apply(Block(width), [sw.compile(backend="aot_eager")])
        assert sw.measure(model, torch.randn(2, 4), device="cpu", iterations=1, warmup=1).compiled
    ninth = sw.apply(Block(12), [sw.compile(backend="aot_eager")])
    with pytest.raises(RuntimeError, match=r"shrinkwrap: dynamo met its limit of recompiles .*recompile_limit"):
        sw.measure(ninth, torch.randn(2, 4), device="cpu", iterations=1, warmup=1)
    torch._dynamo.reset()
    assert sw.measure(ninth, torch.randn(2, 4), device="cpu", iterations=1, warmup=1).compiled
