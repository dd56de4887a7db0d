"""Low-bit AdamW state: the moments kept to a percent at two bytes a parameter, stochastic rounding, and its compiled
update in slices and packs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw


pytestmark = pytest.mark.usefixtures("one_thread")


# -- smaller state and weights (lossy) --------------------------------------------------------------


def test_low_bit_state_keeps_the_moments_to_a_percent_and_costs_two_bytes_a_parameter():
    from shrinkwrap.transforms.optimizer.lowbit import _dequantize, _quantize

    g = torch.Generator().manual_seed(0)
    m = torch.randn(10_000, generator=g) * 1e-3
    v = torch.rand(10_000, generator=g) * 1e-6
    for x, signed in ((m, True), (v, False)):
        codes, scale = _quantize(x, signed)
        back = _dequantize(codes, scale, x, signed)
        assert ((back - x).norm() / x.norm()).item() < 0.01
        assert codes.element_size() == 1 and scale.numel() == -(-x.numel() // 256)


def test_stochastic_rounding_is_unbiased_where_bf16_cannot_hold_the_update():
    from shrinkwrap.transforms.optimizer.lowbit import _stochastic_round

    x = torch.full((200_000,), 1.0 + 2 ** -10, dtype=torch.float32)  # between two bf16 values (1, 1 + 2**-7)
    rounded = _stochastic_round(x, torch.bfloat16)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(rounded.float().mean().item() - x[0].item()) < 2e-5  # round-to-nearest would give 1.0 always


def test_low_bit_adamw_in_bf16_trains_as_adamw_does_to_within_its_loss():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    low = copy.deepcopy(ref)
    sw.apply(low, "half(torch.bfloat16, keep=()), step_in_backward(shrinkwrap.LowBitAdamW, options={'lr': 0.01})")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=0.01), sw.optimizer(low)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    for _ in range(150):
        for m, o in ((ref, opt_ref), (low, opt)):
            o.zero_grad()
            (m(x).float() - y).square().mean().backward()
            o.step()
    losses = [(m(x).float() - y).square().mean().item() for m in (ref, low)]
    assert losses[1] < 0.05 and losses[0] < 0.05, losses
    assert sw.records(low)[-1].step.lossy and not sw.step_in_backward().lossy
    state = opt.state_dict()["state"][0]
    assert state["m"].dtype == torch.int8 and state["v"].dtype == torch.uint8


def _low_bit_trained(weights: list, grads: list, lr: Any = 0.1) -> tuple[list, dict]:
    """The weights and state_dict state after LowBitAdamW's steps over ``grads`` (one list a step);
    ``lr``: a number, or a function of the step's index."""
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = sw.LowBitAdamW(params)
    for i, step_grads in enumerate(grads):
        opt.param_groups[0]["lr"] = lr(i) if callable(lr) else lr
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


def test_low_bit_adamw_steps_a_large_parameter_in_slices_as_in_one(monkeypatch):
    # float32 weights (no stochastic rounding): slice by slice and all at once are the same numbers,
    # a non-contiguous parameter going in one slice, and a zero first moment starts as _quantize's
    # zeros.
    import importlib

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.lowbit")  # the package exports a function of this name
    assert torch.equal(opt_module._quantize(torch.zeros(1000), True)[0], torch.zeros(4, 256, dtype=torch.int8))
    torch.manual_seed(0)
    weights = [torch.randn(3 * 256 + 17, 5), torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for slice_values in (256, 1 << 20):
        monkeypatch.setattr(opt_module, "_SLICE", slice_values)
        results.append(_low_bit_trained(weights, grads))
    (sliced, sliced_state), (whole, whole_state) = results
    for a, b in zip(sliced, whole):
        assert torch.equal(a, b)
    assert torch.equal(sliced_state[0]["v"], whole_state[0]["v"])
    assert not torch.equal(sliced[0], weights[0])  # it trained


def test_low_bit_adamw_s_compiled_update_packs_small_parameters_and_pads_last_blocks(monkeypatch):
    # On CUDA the slices go through the compiled update shaped (blocks, 256): a slice of whole
    # blocks as it lies, small pieces packed into one call, each from a block's start with its last
    # block padded with zeros. Traced here (aot_eager: the same graph, no code generated), that
    # gives the eager update's numbers bit for bit, in two graphs for every length and learning rate
    # (one dtype, no call of one block: each of those is a graph of its own).
    import importlib

    from torch._dynamo.utils import counters

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.lowbit")
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]  # a count over the process
    traced = torch.compile(opt_module._adamw_slice, dynamic=True, fullgraph=True, backend="aot_eager")
    shapes = []

    def spy(*args):
        shapes.append(tuple(args[0].shape))
        return traced(*args)

    monkeypatch.setattr(opt_module, "_SLICE", 3 * 256)
    monkeypatch.setattr(opt_module, "_COMPILED_SLICE", 4 * 256)
    torch.manual_seed(0)
    weights = [torch.randn(9 * 256 + 17), torch.randn(3 * 256, 2), torch.randn(100)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for compiled in (spy, None):
        monkeypatch.setattr(opt_module, "_compiled_slice", lambda p, c=compiled: c)
        results.append(_low_bit_trained(weights, grads, lr=lambda i: 0.1 / (i + 1)))
    (a, a_state), (b, b_state) = results
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a_state[i][k], b_state[i][k]) for i in range(3) for k in ("m", "v", "m_scale"))
    # 2321 values in slices of 1024: 4 + 4 blocks, then 273 values padded to 2 (the next slice, 4
    # blocks, would overflow the call); 1536: 4, then 2 blocks packed with the 100 values' 1.
    assert shapes[:5] == [(4, 256), (4, 256), (2, 256), (4, 256), (3, 256)] and len(shapes) == 15
    assert counters["stats"]["unique_graphs"] - graphs == 2  # views of a parameter, and a packed buffer


def test_low_bit_adamw_never_decodes_a_small_second_moment_as_zero():
    # A value whose gradient was a thousandth of its block's largest, then zero (an embedding row
    # whose token the batch lacks): its momentum is still there, and its second moment, a millionth
    # of the block's, is below the 8-bit code's first step. Decoded as zero it would divide the
    # momentum by eps alone, moving the weight by thousands of learning rates; floored at the first
    # code it moves by less than AdamW's usual step, the learning rate.
    lr = 1e-3
    p = nn.Parameter(torch.zeros(256))
    opt = sw.LowBitAdamW([p], lr=lr, weight_decay=0.0)
    for small in (1e-3, 0.0):
        before = p.detach().clone()
        p.grad = torch.zeros(256)
        p.grad[0], p.grad[1] = 1.0, small
        opt.step()
    moved = (p.detach() - before).abs()
    assert moved[0] == pytest.approx(lr, rel=0.05)
    assert 0 < moved[1] < lr, moved[1].item()


def test_low_bit_adamw_packs_parameters_of_one_kind_together_where_kinds_alternate(monkeypatch):
    # A transformer's bucket alternates bf16 weights with float32 norms: the packed update takes the
    # pieces of each dtype into one call (not a call a run of one dtype), with the eager update's
    # numbers bit for bit.
    import importlib

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.lowbit")
    shapes = []

    def spy(*args):
        shapes.append((tuple(args[0].shape), args[1].dtype))
        return opt_module._adamw_slice(*args)

    torch.manual_seed(0)
    weights = [torch.randn(300, dtype=dtype) for dtype in (torch.float32, torch.float64) * 3]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(2)]
    results = []
    for compiled in (spy, None):
        monkeypatch.setattr(opt_module, "_compiled_slice", lambda p, c=compiled: c)
        results.append(_low_bit_trained(weights, grads))
    (a, a_state), (b, b_state) = results
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a_state[i][k], b_state[i][k]) for i in range(6) for k in ("m", "v", "m_scale", "v_scale"))
    # Three pieces of 300 values a kind, each padded to 2 blocks: one call of 6 blocks a dtype a step.
    assert shapes == [((6, 256), torch.float32), ((6, 256), torch.float64)] * 2
    assert not torch.equal(a[1], weights[1])  # it trained


def test_low_bit_adamw_keeps_float32_numbers_and_8_bit_state_whatever_the_default_dtype_and_through_a_reload():
    # Under a bf16 default dtype (as some model-loading code sets) 0.999 would round to 1: the steps
    # are the float32 default's bit for bit. A bf16 parameter's state, saved and loaded, stays 8-bit
    # codes with float32 scales, and training goes on as it would have without the reload.
    def run(default: torch.dtype, reload_at: int | None) -> tuple:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(1000).to(torch.bfloat16))
        grads = [torch.randn(1000).to(torch.bfloat16) for _ in range(4)]
        opt = sw.LowBitAdamW([p], lr=0.01)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            for i, g in enumerate(grads):
                if i == reload_at:
                    saved = copy.deepcopy(opt.state_dict())
                    opt = sw.LowBitAdamW([p], lr=0.01)
                    opt.load_state_dict(saved)
                torch.manual_seed(i)  # the stochastic rounding's bits
                p.grad = g.clone()
                opt.step()
        finally:
            torch.set_default_dtype(previous)
        return p.detach().clone(), opt.state[p]

    plain, state = run(torch.float32, None)
    for default, reload_at in ((torch.bfloat16, None), (torch.float32, 2)):
        weights, other = run(default, reload_at)
        assert torch.equal(weights, plain), (default, reload_at)
        assert [other[k].dtype for k in ("m", "v", "m_scale", "v_scale")] == [torch.int8, torch.uint8, torch.float32,
                                                                              torch.float32]
        assert all(torch.equal(other[k], state[k]) for k in ("m", "v", "m_scale", "v_scale"))


def test_low_bit_adamw_s_temporaries_are_one_slice_s_not_one_parameter_s(monkeypatch):
    # A 64 MiB parameter stepped in backward, estimated: beside the parameter, its gradient and the
    # 8-bit state, what the step allocates is a few 4 MiB slices' temporaries, where in one slice it
    # is a few of the parameter's size.
    import importlib

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.lowbit")

    def wide():
        return nn.Sequential(nn.Linear(4096, 4096, bias=False))

    size = 4096 * 4096
    state = size * 2 + size // 256 * 4 * 2  # two 8-bit moments and their float32 scales

    def temporaries() -> int:
        est = sw.estimate(wide, torch.randn(2, 4096), "step_in_backward(shrinkwrap.LowBitAdamW)")
        assert est.parameters == est.gradients == size * 4
        return est.peak - est.parameters - est.gradients - state

    sliced = temporaries()
    monkeypatch.setattr(opt_module, "_SLICE", 1 << 30)
    whole = temporaries()
    assert sliced < 12 * 2**20 * 4 and whole > 2 * size * 4, (sliced / 2**20, whole / 2**20)
