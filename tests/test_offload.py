"""offload(): what regions save for backward goes to CPU memory and comes back, bit for bit.

On this CPU the logic runs through ``devices=("cpu",)``, which copies CPU tensors into separate
CPU storage as the CUDA path copies to pinned host memory."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.transforms import offload as off

from toymodels import net64

CPU = {"devices": ("cpu",), "min_bytes": 4096}


def run(model, x, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def x64(n=4):
    torch.manual_seed(123)
    return torch.randn(n, 3, 8, 8, dtype=torch.float64)


def assert_same(ref, model, x, steps=2):
    for _ in range(steps):
        out_r, g_r = run(ref, x)
        out_m, g_m = run(model, x)
        assert torch.equal(out_r, out_m)
        assert g_r.keys() == g_m.keys() and len(g_r) == len(list(ref.parameters()))
        for n in g_r:
            assert torch.equal(g_r[n], g_m[n]), n
    for (n, b), (_, c) in zip(ref.named_buffers(), model.named_buffers()):
        assert torch.equal(b, c), n  # BatchNorm running statistics


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)),
                         nn.Linear(64, 2)).double()


def pair(pattern=r"layer\d", make=net64, **opts):
    ref = make()
    model = copy.deepcopy(ref)
    sw.apply(model, sw.Plan([sw.offload(pattern, **{**CPU, **opts})]))
    return ref, model


def saved_by(ref, names, x, min_bytes):
    """Bytes the plain model's ``names`` save for backward that offload would move: on the device,
    not parameters or buffers (nor views of them), at least ``min_bytes``; and the small ones."""
    big, small = [0], [0]

    def count(t):
        module = ref.get_submodule(current[0])
        own = {p.untyped_storage().data_ptr() for p in (*module.parameters(), *module.buffers())}
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in own or t.nbytes < min_bytes:
            small[0] += t.nbytes
        else:
            big[0] += t.nbytes
        return t

    current = [""]
    handles = []
    for name in names:
        m = ref.get_submodule(name)
        ctx = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
        handles.append(m.register_forward_pre_hook(lambda m, a, n=name, c=ctx: (current.__setitem__(0, n), c.__enter__())[0] and None))
        handles.append(m.register_forward_hook(lambda m, a, o, c=ctx: c.__exit__(None, None, None)))
    run(ref, x)
    for h in handles:
        h.remove()
    return big[0], small[0]


def test_bit_equal_and_bytes_moved_are_the_regions_saved_bytes(one_thread):
    ref, model = pair()
    assert [isinstance(model.get_submodule(n), sw.OffloadModule) for n in ("layer1", "layer2", "layer3")] == [
        True, True, False]  # the last region stays
    assert type(model.layer3) is type(ref.layer3)
    x = x64()
    big, small = saved_by(copy.deepcopy(ref), ["layer1", "layer2"], x, CPU["min_bytes"])
    assert_same(ref, model, x, steps=1)
    t = sw.offload_traffic(model, reset=True)
    assert t.offloaded == big > 0 and t.reloaded == big
    assert t.kept == small > 0 and t.tensors_kept > 0  # small tensors, parameters, buffers stay
    assert sw.offload_traffic(model) == sw.Traffic()
    assert_same(ref, model, x, steps=1)
    assert sw.offload_traffic(model).offloaded == big  # per step


def test_mlp_bit_equal_with_last_region_too(one_thread):
    ref, model = pair(r"\d", make=mlp, keep_last=False, min_bytes=1024)
    x = torch.randn(32, 64, dtype=torch.float64)
    assert_same(ref, model, x)
    assert sw.offload_traffic(model).offloaded > 0


def test_parameters_and_their_views_are_never_offloaded(one_thread):
    _, model = pair(r"\d", make=mlp, keep_last=False, min_bytes=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stored = []
    orig = off._OffloadedTensor.__init__

    def spy(self, t, device, region):
        stored.append(t)
        orig(self, t, device, region)

    off._OffloadedTensor.__init__ = spy
    try:
        run(model, torch.randn(8, 64, dtype=torch.float64))
    finally:
        off._OffloadedTensor.__init__ = orig
    assert stored and all(t.untyped_storage().data_ptr() not in params for t in stored)
    sizes = {t.shape for t in stored}
    assert torch.Size([64, 64]) not in sizes  # weights (and weight.t() views) stayed


def test_off_device_and_eval_and_no_grad_run_plainly(one_thread):
    ref, model = pair(devices=("cuda",))  # the default: on a CPU nothing moves
    x = x64()
    assert_same(ref, model, x, steps=1)
    assert sw.offload_traffic(model) == sw.Traffic()
    _, model = pair()
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert sw.offload_traffic(model) == sw.Traffic()


def test_names_state_dict_print_and_revert():
    ref, model = pair()
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert str(model.layer1).startswith("Offload[Block]")
    inner = model.layer1.wrapped
    sw.revert(model)
    assert model.layer1 is inner and not any(isinstance(m, sw.OffloadModule) for m in model.modules())


def test_plan_text_round_trip_and_default_pattern():
    plan = sw.Plan([sw.checkpoint(r"\d"), sw.offload(r"\d", min_bytes=1024, devices=("cpu",))])
    assert sw.Plan.parse(str(plan)) == plan
    assert sw.Plan.parse("offload()") == sw.Plan([sw.offload()])
    model = mlp()
    sw.apply(model, sw.Plan([sw.offload()]))  # the largest stack of same-type blocks, last one kept
    assert sw.records(model)[0].matched == ("0", "1", "2")
    assert sw.offload.candidates(model, sw.step.Context()) == []


@pytest.mark.parametrize("order", ["checkpoint first", "offload first"])
def test_composes_with_checkpoint_bit_equal(order, one_thread):
    ref = net64()
    model = copy.deepcopy(ref)
    steps = [sw.checkpoint(r"layer\d"), sw.offload(r"layer\d", keep_last=False, **CPU)]
    if order == "checkpoint first":
        sw.apply(model, sw.Plan(steps))
        assert str(model.layer1).startswith("Offload[Checkpoint[Block]]")
    else:
        for s in reversed(steps):
            s.apply(model)
        assert str(model.layer1).startswith("Checkpoint[Offload[Block]]")
    assert_same(ref, model, x64())
    moved = sw.offload_traffic(model, reset=True).offloaded
    if order == "checkpoint first":  # only the region inputs (what checkpoint keeps) moved
        assert moved == 2 * 3 * (4 * 4 * 8 * 8 * 8)  # two steps, each block's input x (float64)
    else:  # inside a checkpoint region the offload region runs plainly
        assert moved == 0


def test_inside_checkpoint_region_is_passed_over():
    model = net64()
    sw.apply(model, sw.Plan([sw.checkpoint("layer1"), sw.offload(r"layer1\.conv1|layer2|layer3", keep_last=False, **CPU)]))
    rec = sw.records(model)[-1]
    assert rec.matched == ("layer2", "layer3")
    assert rec.skipped[0][0] == "layer1.conv1" and "checkpointed" in rec.skipped[0][1]


def test_prefetch_brings_the_previous_region_back_ahead(one_thread):
    _, model = pair(r"\d", make=mlp, keep_last=False, min_bytes=1024)
    fetched = []
    orig = off._OffloadedTensor.fetch

    def spy(self):
        if self.ready is None:
            fetched.append(self.region._sw_name)
        orig(self)

    off._OffloadedTensor.fetch = spy
    try:
        run(model, torch.randn(32, 64, dtype=torch.float64))
    finally:
        off._OffloadedTensor.fetch = orig
    # Backward reaches region 4 (the head) first: its first unpack starts all of its own copies
    # back, then all of region 3's; region 3's first unpack starts region 2's, and so on.
    runs = [f for i, f in enumerate(fetched) if i == 0 or fetched[i - 1] != f]
    assert runs == ["4", "3", "2", "1", "0"]
    assert model[0]._sw_schedule.order == []


def test_a_region_nothing_prefetched_starts_all_its_copies_back_at_its_first_unpack(one_thread):
    # Region 0 alone: no region after it starts its copies. Its first unpack starts them all, so
    # later tensors arrive while the first is in use, not one after another on demand.
    _, model = pair(r"0", make=mlp, keep_last=False, min_bytes=1024)
    events = []
    fetch, take = off._OffloadedTensor.fetch, off._OffloadedTensor.take

    def spy_fetch(self):
        if self.ready is None:
            events.append("fetch")
        fetch(self)

    def spy_take(self):
        events.append("take")
        return take(self)

    off._OffloadedTensor.fetch, off._OffloadedTensor.take = spy_fetch, spy_take
    try:
        run(model, torch.randn(32, 64, dtype=torch.float64))
    finally:
        off._OffloadedTensor.fetch, off._OffloadedTensor.take = fetch, take
    n = model[0].traffic.tensors_offloaded
    assert n >= 2
    assert events == ["fetch"] * n + ["take"] * n


def test_deepcopy_and_pickle(one_thread):
    ref, model = pair()
    x = x64()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded.layer1, sw.OffloadModule)
    assert loaded.layer1._sw_schedule is loaded.layer2._sw_schedule
    assert_same(copy.deepcopy(ref), loaded, x, steps=1)
    copied = copy.deepcopy(model)
    assert copied.layer1._sw_schedule is copied.layer2._sw_schedule is not model.layer1._sw_schedule
    assert_same(ref, copied, x, steps=1)
    assert sw.offload_traffic(loaded).offloaded > 0
    pickle.loads(pickle.dumps(model))


def test_an_offloaded_tensor_is_not_kept_on_its_device_after_the_region():
    import weakref

    class Region(nn.Module):
        def forward(self, x):
            y = x * 2
            self.seen = weakref.ref(y)
            return torch.sin(y)  # sin saves y for backward

    model = nn.Sequential(Region())
    sw.apply(model, [sw.offload("0", min_bytes=0, devices=("cpu",), keep_last=False)])
    x = torch.randn(64, 64, requires_grad=True)
    out = model(x)
    assert model[0].wrapped.seen() is None  # only the host copy is left (the GPU test measures the bytes)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()), rtol=0, atol=0)


def test_a_checkpointed_regions_input_leaves_the_device_when_offloaded():
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
    ref = copy.deepcopy(model)
    sw.apply(model, [sw.checkpoint(r"\d"), sw.offload(r"\d", min_bytes=0, devices=("cpu",), keep_last=False)])
    x = torch.randn(16, 32, requires_grad=True)
    inputs = []
    hook = model[1].wrapped.wrapped.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])))
    out = model(x)
    hook.remove()
    # The checkpoint keeps block 1's input only as what it saved for backward, which the offload
    # region moved: the device tensor itself is gone (the recompute gets the copy back).
    assert inputs[0]() is None
    out.square().sum().backward()
    ref(x.detach().requires_grad_()).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def _cuda_blocks(blocks=12):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                           for _ in range(blocks))).cuda()


def _cuda_peak(model, x):
    """Bytes allocated above the start of one forward and backward, and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(x).square().sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, {n: p.grad.clone() for n, p in model.named_parameters()}


def _cuda_pair():
    """An input, the plain 12 blocks and the same offloaded, each measured once by ``_cuda_peak``."""
    x = torch.randn(4096, 1024, device="cuda")
    ref = _cuda_blocks()
    model = sw.apply(_cuda_blocks(), sw.Plan([sw.offload(r"\d+")]))
    return x, ref, model, _cuda_peak(ref, x), _cuda_peak(model, x)


@pytest.mark.cuda
def test_cuda_peak_memory_drops_and_gradients_bit_equal():
    _, _, model, (p_ref, g_ref), (p_off, g_off) = _cuda_pair()
    # Each block saves 144 MiB (its input, the GELU's input and output); its gradients take 32 MiB.
    # Offloaded, the device holds at most the last block, the block in flight and the one
    # prefetched ahead of it: about 3 of the 12 blocks' saved tensors, with every gradient.
    assert p_off < 0.5 * p_ref, (p_off / 2**20, p_ref / 2**20)
    assert all(torch.equal(g_ref[n], g_off[n]) for n in g_ref)
    assert sw.offload_traffic(model).offloaded > 0


@pytest.mark.cuda
def test_cuda_offloaded_model_trains_under_a_cap_the_plain_model_exceeds():
    # An offloaded tensor's memory goes back to the allocator when autograd drops it, but is reused
    # only once its copy to the host is done (record_stream): meanwhile the allocator asks the driver
    # for more, so the reserved bytes can exceed the plain model's. Under a cap it waits for the
    # copies instead (it synchronises outstanding events before it gives up), so what fits is what
    # max_memory_allocated says, the figure every report of offload gives.
    x, ref, model, (p_ref, g_ref), (p_off, _) = _cuda_pair()
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_allocated() + (p_off + p_ref) // 2
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        for _ in range(3):
            _, g_off = _cuda_peak(model, x)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            _cuda_peak(ref, x)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert all(torch.equal(g_ref[n], g_off[n]) for n in g_ref)


def test_the_harness_reports_the_bytes_moved_per_iteration():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    sw.apply(model, [sw.offload(r"\d", min_bytes=1024, devices=("cpu",))])
    x = torch.randn(32, 64)
    prof = sw.measure(model, x, iterations=2, warmup=1, device="cpu")
    sw.offload_traffic(model, reset=True)
    model(x).float().mean().backward()  # one iteration by hand, counted the offload step's own way
    by_hand = sw.offload_traffic(model, reset=True)
    assert prof.transfers == {"offloaded": by_hand.offloaded, "reloaded": by_hand.reloaded} and by_hand.offloaded > 0
    assert "moved per iteration" in str(prof)
    assert "traffic" not in model[0].wrapped.__dict__  # the count is the wrapper's, not the module's
    plain = sw.measure(nn.Linear(4, 4), torch.randn(2, 4), iterations=1, warmup=1, device="cpu")
    assert plain.transfers == {}
