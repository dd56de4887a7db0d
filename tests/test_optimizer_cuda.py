"""On a GPU: the step inside backward takes the gradient term out of the peak, the state on the CPU
takes the state term too, and both train as the GPU's AdamW (to rounding where the CPU steps)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw

pytestmark = pytest.mark.cuda
MiB = 2**20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)], nn.Linear(2048, 1))


def test_the_gradient_and_state_terms_leave_the_peak_and_training_matches_adamw():
    x = torch.randn(64, 2048)
    params = sum(p.numel() * 4 for p in mlp().parameters())
    held = torch.cuda.memory_allocated()  # not these models': what the process held before
    plain = sw.measure(mlp().cuda(), x, device="cuda").peak - held
    rows = {}
    for state in ("device", "cpu"):
        model = sw.apply(mlp().cuda(), f"step_in_backward(torch.optim.AdamW, state='{state}')")
        rows[state] = sw.measure(model, x, device="cuda")
        del model
    # The plain step holds parameters, gradients and AdamW's two moments: 16 bytes a parameter.
    assert plain >= 3.5 * params
    assert rows["device"].peak - held <= plain - 0.8 * params  # no gradient waits for the others
    # The state in CPU memory: AdamW's two moments leave the peak. Gradients on their way down
    # still count (this MLP's backward outruns the copies: an H100 read 2.16x the parameters).
    assert rows["cpu"].optimizer_state == 0 and rows["cpu"].peak - held <= plain - 1.5 * params
    ref, model = mlp().cuda(), sw.apply(mlp().cuda(), "step_in_backward(torch.optim.AdamW, state='cpu')")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), foreach=False), sw.optimizer(model)
    xc = x.cuda()
    lr = opt_ref.param_groups[0]["lr"]
    for i in range(3):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(xc).square().mean().backward()
            o.step()
        pairs = [(a.detach(), b.detach()) for a, b in zip(ref.parameters(), model.parameters())]
        if i == 0:  # one step from the same weights: the CPU's AdamW to the GPU's rounding
            for a, b in pairs:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Later steps start from weights a rounding apart, and AdamW divides by the root of each
    # gradient's square: where a gradient is near zero, that moves an update by a share of the
    # learning rate (an H100 read 3.8e-5 at most, in 0.1% of the weights, after three steps).
    diff = torch.cat([(a - b).abs().flatten() for a, b in pairs])
    assert diff.max() <= 0.1 * lr and (diff > 1e-6).float().mean() <= 0.01, (diff.max(), (diff > 1e-6).float().mean())


def test_autoplan_reaches_a_budget_only_the_step_in_backward_reaches_and_says_what_it_cut():
    # Parameters, gradients and AdamW's two moments hold 16 bytes a parameter, the activations of a
    # 64-row batch next to nothing: no activation step reaches 4.2 x the parameters' bytes; the
    # step in backward does (an H100, torch 2.11: 470 MiB, 3.67 x, with cuBLAS's workspace).
    x = torch.randn(64, 2048)
    params = sum(p.numel() * 4 for p in mlp().parameters())
    plan, report = sw.autoplan(mlp, x, budget=int(4.2 * params), max_slowdown=5.0, device="cuda")
    assert any(s.name == "step_in_backward" for s in plan.steps), "\n".join(report.notes)
    assert any(n.startswith("the answer cuts more than activations: gradients") for n in report.notes), report.notes
    assert any(n.startswith("fits in ") for n in report.notes), "\n".join(report.notes)


def test_a_gpu_parameter_steps_with_the_fused_kernel_and_matches_the_fused_loop_bit_for_bit():
    ref, model = mlp().cuda(), sw.apply(mlp().cuda(), "step_in_backward(torch.optim.AdamW, options={'lr': 0.01})")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True), sw.optimizer(model)
    assert all(o.defaults["fused"] for o in opt.optimizers.values())
    x = torch.randn(64, 2048, device="cuda")
    for _ in range(3):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # A plain optimizer's state_dict loads without turning the per-parameter steps to foreach.
    plain = torch.optim.AdamW([{"params": [p]} for p in mlp().cuda().parameters()], lr=0.01)
    opt.load_state_dict(plain.state_dict())
    assert all(o.param_groups[0]["fused"] for o in opt.optimizers.values())


def test_low_bit_adamw_compiles_its_slice_update_on_cuda_to_the_eager_numbers_once_for_every_learning_rate():
    # float32 weights (no stochastic rounding): the compiled update gives the eager one's weights to
    # float32 rounding, but where a moment's rounding flips its 8-bit code (a step of the learning
    # rate's order); a scheduler's new learning rate compiles nothing new.
    import importlib

    from torch._dynamo.utils import counters

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.lowbit")
    torch.manual_seed(0)
    weights = [torch.randn(3 * (1 << 20) + 1000, device="cuda"), torch.randn(300, 7, device="cuda")]
    grads = [[torch.randn_like(w) * 1e-2 for w in weights] for _ in range(4)]
    results = []
    for compiled in (True, False):
        params = [nn.Parameter(w.clone()) for w in weights]
        opt = sw.LowBitAdamW(params, lr=0.1)
        if not compiled:
            opt_module._COMPILED[:] = [opt_module._adamw_slice]  # the same function, eager
        for i, step_grads in enumerate(grads):
            if i == 2:
                graphs = counters["stats"]["unique_graphs"]
                opt.param_groups[0]["lr"] = 0.05
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        if compiled:
            assert counters["stats"]["unique_graphs"] == graphs  # the new learning rate compiled nothing
        opt_module._COMPILED.clear()
        results.append([p.detach() for p in params])
    for (a, b), w in zip(zip(*results), weights):
        assert torch.isclose(a, b, rtol=1e-5, atol=1e-6).float().mean() > 0.999
        assert (a - b).abs().max() < 0.05 and not torch.equal(a, w)  # it trained


@pytest.mark.parametrize("half", [False, True])
def test_weights_loaded_after_apply_are_what_the_cpu_state_steps_from_on_a_gpu(half):
    # lr 0 and no decay: a step leaves the weight it started from, the model's own since the load
    # (with bf16 weights, through the values that differ from the master copy's rounding).
    plan = "half(torch.bfloat16), " if half else ""
    model = sw.apply(mlp().cuda(), plan + "step_in_backward(torch.optim.AdamW, options={'lr': 0.0, "
                                         "'weight_decay': 0.0}, state='cpu')")
    opt = sw.optimizer(model)
    x = torch.randn(64, 2048, device="cuda")
    for load in (False, True):
        if load:
            torch.manual_seed(1)
            model.load_state_dict({k: torch.randn_like(v) * 0.01 for k, v in model.state_dict().items()})
        want = [p.detach().clone() for p in model.parameters()]
        fetched = []
        for _ in range(2):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
            fetched.append(opt.fetched)
        assert all(torch.equal(a, b) for a, b in zip(want, model.parameters()))
        # A weight comes down where it changed since its last step wrote it (the load), only.
        n = len(list(model.parameters()))
        assert fetched == ([0, 0] if not load else [n, n]), fetched


def _delayed_by_hand(model: nn.Module, xs: list) -> None:
    """ZeRO-Offload's delayed update written out on the GPU: a gradient applied one iteration late."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    pending = None
    for x in xs:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if pending is not None:
            for p, g in zip(model.parameters(), pending):
                p.grad = g
            opt.step()
        pending = grads
    for p, g in zip(model.parameters(), pending):
        p.grad = g
    opt.step()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_delayed_update_on_a_gpu_trains_as_the_hand_written_delayed_loop(rounding):
    xs = [torch.randn(64, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(4)]
    ref = mlp().cuda()
    model = sw.apply(copy.deepcopy(ref), "step_in_backward(torch.optim.AdamW, options={'lr': 1e-3}, state='cpu', "
                                         "delayed=True)")
    _delayed_by_hand(ref, xs)
    opt = sw.optimizer(model)
    for x in xs:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    opt.wait()
    # The CPU's AdamW to the GPU's rounding, which AdamW's division by each gradient's root
    # magnifies where a gradient is near zero (as in the exact step's test above).
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(ref.parameters(), model.parameters())])
    assert diff.max() <= 0.1 * 1e-3 and (diff > 1e-6).float().mean() <= 0.01, (diff.max(), (diff > 1e-6).float().mean())
    # bf16 weights from the master: each a bf16 neighbour of it, whichever the rounding.
    half = sw.apply(mlp().cuda(), "half(torch.bfloat16), step_in_backward(torch.optim.AdamW, options={'lr': 1e-3}, "
                                  f"state='cpu', delayed=True, rounding='{rounding}')")
    opt = sw.optimizer(half)
    for x in xs:
        opt.zero_grad()
        half(x.bfloat16()).float().square().mean().backward()
        opt.step()
    opt.wait()
    for p, on in zip(half.parameters(), opt.cpu.values()):
        lo = (on.master.detach().view(torch.int32) & -65536).view(torch.float32)
        hi = (lo.view(torch.int32) + 65536).view(torch.float32)
        w = p.detach().float().cpu()
        assert ((w == lo) | (w == hi)).all()
        if rounding == "nearest":
            assert torch.equal(p.detach().cpu(), on.master.detach().to(torch.bfloat16))
