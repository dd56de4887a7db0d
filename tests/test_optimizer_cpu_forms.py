"""step_in_backward(state='cpu')'s two forms beyond the exact step: the one-step-delayed update
(against a hand-written delayed loop, float64 on the CPU) and the stochastic rounding of the
float32 master copy into bf16 weights."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.transforms.optimizer.rounding import round_into
from toymodels import Net

OPTIONS = {"lr": 0.01, "weight_decay": 0.1}
DELAYED = f"step_in_backward(torch.optim.AdamW, options={OPTIONS}, state='cpu', delayed=True)"


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, n_positions=16,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    torch.manual_seed(100 + i)  # dropout
    if isinstance(model, Net):
        return model(_batch(i)).square().mean()
    ids = _ids(i)
    return model(input_ids=ids, labels=ids).loss


def delayed_loop(model: nn.Module, steps: int, sched_every: int = 0, exact_first: int = 0) -> list[float]:
    """ZeRO-Offload's delayed update written out: each gradient is applied one iteration late, with
    the learning rate of its own iteration, so that iteration i's gradient is taken at the weights
    before iteration i-1's update; the first ``exact_first`` iterations' gradients at once (the
    warm-up)."""
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **OPTIONS)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if sched_every else None
    pending, losses = None, []

    def apply(grads: list, lr: float) -> None:
        now = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        opt.param_groups[0]["lr"] = now

    for i in range(steps):
        opt.zero_grad()
        loss = _loss(model, i)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in model.parameters()]
        if i < exact_first:
            apply(grads, opt.param_groups[0]["lr"])
        else:
            if pending is not None:
                apply(*pending)
            pending = grads, opt.param_groups[0]["lr"]
        if sched is not None:
            sched.step()
    if pending is not None:
        apply(*pending)  # the last gradient, as wait() writes it
    return losses


def handle_loop(model: nn.Module, steps: int, sched_every: int = 0) -> list[float]:
    opt = sw.optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if sched_every else None
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = _loss(model, i)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    opt.wait()
    return losses


@pytest.mark.parametrize("make", [lambda: Net().double(), _gpt2], ids=["net", "gpt2"])
def test_the_delayed_update_is_the_hand_written_delayed_loop_bit_for_bit(make):
    torch.manual_seed(0)
    ref = make()
    model = sw.apply(copy.deepcopy(ref), DELAYED)
    want = delayed_loop(ref, 5)
    got = handle_loop(model, 5)
    assert want == got
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n


def test_the_delayed_update_differs_from_the_exact_one_and_is_marked_lossy():
    torch.manual_seed(0)
    ref = Net().double()
    exact = sw.apply(copy.deepcopy(ref), DELAYED.replace(", delayed=True", ""))
    delayed = sw.apply(copy.deepcopy(ref), DELAYED)
    assert handle_loop(exact, 4)[2:] != handle_loop(delayed, 4)[2:]
    assert sw.step_in_backward(torch.optim.AdamW, state="cpu", delayed=True).lossy
    assert not sw.step_in_backward(torch.optim.AdamW, state="cpu").lossy


@pytest.mark.parametrize("make", [lambda: Net().double(), _gpt2], ids=["net", "gpt2"])
def test_the_delayed_update_after_its_warm_up_is_the_hand_written_loop_bit_for_bit(make):
    torch.manual_seed(0)
    ref = make()
    exact_ref, exact = copy.deepcopy(ref), sw.apply(copy.deepcopy(ref), DELAYED.replace(", delayed=True", ""))
    model = sw.apply(copy.deepcopy(ref), DELAYED.replace("delayed=True", "delayed=True, delay_after=3"))
    want = delayed_loop(ref, 6, exact_first=3)
    assert handle_loop(model, 6) == want
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    # The warm-up is the exact path's, and the iterations after it are not.
    exact_losses = handle_loop(exact, 6)
    assert exact_losses[:4] == want[:4] and exact_losses[4:] != want[4:]
    assert delayed_loop(exact_ref, 6, exact_first=6) == exact_losses


def test_a_resumed_handle_goes_on_with_the_warm_up_from_the_steps_its_state_counts():
    torch.manual_seed(0)
    text = DELAYED.replace("delayed=True", "delayed=True, delay_after=3")
    model = sw.apply(Net().double(), text)
    handle_loop(model, 2)
    saved = sw.optimizer(model).state_dict()
    resumed = sw.apply(copy.deepcopy(Net().double()), text)
    opt = sw.optimizer(resumed)
    assert not opt.delayed  # before a step: the warm-up's first
    opt.load_state_dict(saved)
    assert opt.steps_taken == 2 and not opt.delayed
    handle_loop(resumed, 1)
    assert opt.delayed and copy.deepcopy(opt).delayed  # a copy goes on from the count too


def test_a_scheduler_steps_the_delayed_update_as_the_hand_written_loop():
    torch.manual_seed(0)
    ref = Net().double()
    model = sw.apply(copy.deepcopy(ref), DELAYED)
    assert delayed_loop(ref, 4, sched_every=1) == handle_loop(model, 4, sched_every=1)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_the_model_trails_its_optimizer_by_one_step_until_wait_an_evaluation_or_a_state_dict():
    torch.manual_seed(0)
    model = sw.apply(Net().double(), DELAYED)
    opt = sw.optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    # The first update is on the CPU, not yet in the model; an evaluation forward writes it.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():
        model.eval()
        model(_batch(0))
        model.train()
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.dim() > 1)
    assert all(on.future is None for on in opt.cpu.values())
    opt.zero_grad()
    _loss(model, 1).backward()
    opt.step()
    written = [p.detach().clone() for p in model.parameters()]
    saved = opt.state_dict()  # brings the weights up to date too
    assert not all(torch.equal(a, b) for a, b in zip(written, model.parameters()))
    assert saved["state"][0]["step"] == 2
    # model.state_dict() (a checkpoint, save_pretrained) reads the latest weights.
    opt.zero_grad()
    _loss(model, 2).backward()
    opt.step()
    trailing = [p.detach().clone() for p in model.parameters()]
    weights = model.state_dict()
    assert not all(torch.equal(a, weights[n]) for a, (n, _) in zip(trailing, model.named_parameters()))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    sw.revert(model)  # and the hook goes with the step
    assert not model._state_dict_pre_hooks


def test_a_non_finite_gradient_drops_the_whole_delayed_backward_and_step_raises():
    torch.manual_seed(0)
    model = sw.apply(Net().double(), DELAYED)
    opt = sw.optimizer(model)
    handle_loop(model, 1)
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [on.master.detach().clone() for on in opt.cpu.values()]
    opt.zero_grad()
    (_loss(model, 1) * float("nan")).backward()
    with pytest.raises(RuntimeError, match="not finite"):
        opt.step()
    opt.wait()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(a, on.master) for a, on in zip(masters, opt.cpu.values()))
    # zero_grad() instead of step() skips such a batch, as on the device.
    opt.zero_grad()
    (_loss(model, 2) * float("inf")).backward()
    opt.zero_grad()
    handle_loop(model, 1)


def test_a_delayed_backward_no_step_followed_is_refused_as_the_exact_step_refuses_it():
    model = sw.apply(Net().double(), DELAYED)
    opt = sw.optimizer(model)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="no step\\(\\) followed"):
        _loss(model, 1).backward()


def test_delay_after_is_a_count_of_steps_and_the_delayed_updates_warm_up():
    with pytest.raises(ValueError, match="delay_after is a count of steps, 0 or more"):
        sw.step_in_backward(torch.optim.AdamW, state="cpu", delayed=True, delay_after=-1)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match="takes delay_after= an int"):
            sw.step_in_backward(torch.optim.AdamW, state="cpu", delayed=True, delay_after=bad)
    with pytest.raises(ValueError, match="warm-up; add delayed=True"):
        sw.step_in_backward(torch.optim.AdamW, state="cpu", delay_after=3)
    step = sw.step_in_backward(torch.optim.AdamW, state="cpu", delayed=True, delay_after=50)
    assert str(step).endswith("delayed=True, delay_after=50)") and sw.Plan.parse(str(step)).steps[0] == step


def test_delayed_and_rounding_need_the_state_on_the_cpu_and_their_values():
    with pytest.raises(ValueError, match="add state='cpu'"):
        sw.step_in_backward(torch.optim.AdamW, delayed=True)
    with pytest.raises(ValueError, match="add state='cpu'"):
        sw.step_in_backward(torch.optim.AdamW, rounding="stochastic")
    with pytest.raises(ValueError, match="'nearest' or 'stochastic'"):
        sw.step_in_backward(torch.optim.AdamW, state="cpu", rounding="up")
    with pytest.raises(TypeError, match="True or False"):
        sw.step_in_backward(torch.optim.AdamW, state="cpu", delayed=1)
    with pytest.raises(ValueError, match="is float16: use half"):
        sw.apply(nn.Linear(4, 4).half(), "step_in_backward(torch.optim.AdamW, state='cpu', rounding='stochastic')")


def test_the_plan_text_round_trips_with_both_forms():
    step = sw.step_in_backward(torch.optim.AdamW, {"lr": 1e-3}, state="cpu", delayed=True, rounding="stochastic")
    text = str(step)
    assert text == ("step_in_backward(torch.optim.AdamW, options={'lr': 0.001}, state='cpu', delayed=True, "
                    "rounding='stochastic')")
    assert str(sw.Plan.parse(text).steps[0]) == text


def test_nearest_rounding_is_torch_s_and_stochastic_rounding_picks_a_neighbour_without_bias():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3_000_001, generator=g) * 3
    near = torch.empty(x.shape, dtype=torch.bfloat16)
    round_into(near, x)
    assert torch.equal(near, x.to(torch.bfloat16))
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    round_into(out, x, torch.Generator().manual_seed(1))
    down = (x.view(torch.int32) & -65536).view(torch.float32)  # toward zero
    up = torch.where(down == x, down, torch.nextafter(down.to(torch.bfloat16).float() * 1, x.sign() * float("inf")))
    up = torch.where(down == x, down, (down.view(torch.int32) + 65536).view(torch.float32))
    assert ((out.float() == down) | (out.float() == up)).all()
    assert not torch.equal(out, near)
    # Unbiased: one value a tenth of its spacing above a bf16 number rounds up a tenth of the time.
    v = torch.full((1 << 21,), 1.0 + 2.0 ** -7 / 10)
    r = torch.empty(v.shape, dtype=torch.bfloat16)
    round_into(r, v, torch.Generator().manual_seed(2))
    share = (r.float() > 1.0).float().mean().item()
    assert abs(share - 0.1) < 0.01
    # bf16 values stay as they are; each step draws new noise.
    exact = torch.randn(70_000).to(torch.bfloat16).float()
    kept = torch.empty(exact.shape, dtype=torch.bfloat16)
    round_into(kept, exact, g)
    assert torch.equal(kept.float(), exact)
    again = torch.empty(x.shape, dtype=torch.bfloat16)
    round_into(again, x, torch.Generator().manual_seed(3))
    assert not torch.equal(again, out)


def test_stochastic_rounding_writes_each_bf16_weight_as_a_neighbour_of_its_master_and_small_updates_arrive():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(torch.bfloat16)
    moved = {}
    for rounding in ("nearest", "stochastic"):
        model = sw.apply(copy.deepcopy(lin), "step_in_backward(torch.optim.SGD, options={'lr': 1e-5}, "
                                             f"state='cpu', rounding='{rounding}')")
        opt = sw.optimizer(model)
        start = model.weight.detach().float()
        model(torch.ones(8, 64, dtype=torch.bfloat16)).float().sum().backward()  # 8e-5 off each weight
        opt.step()
        master = opt.cpu["weight"].master.detach()
        w = model.weight.detach().float()
        lo = (master.view(torch.int32) & -65536).view(torch.float32)
        hi = (lo.view(torch.int32) + 65536).view(torch.float32)
        assert ((w == lo) | (w == hi) | (w == master)).all()
        moved[rounding] = ((w - start).sum() / (master - start).sum()).item()
    # The update is below half bf16's spacing of most weights: to nearest, most do not move; each
    # moves with the probability of its distance, so the forward sees the update on average.
    assert moved["nearest"] < 0.5 and abs(moved["stochastic"] - 1) < 0.15, moved


def test_a_bf16_weight_changed_through_data_is_what_the_stochastic_step_starts_from():
    torch.manual_seed(0)
    model = sw.apply(nn.Linear(8, 8).to(torch.bfloat16),
                     "step_in_backward(torch.optim.AdamW, options={'lr': 0.0, 'weight_decay': 0.0}, state='cpu', "
                     "rounding='stochastic')")
    opt = sw.optimizer(model)
    with torch.no_grad():
        model.weight.data.clamp_(-0.01, 0.01)
    want = model.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    assert torch.equal(model.weight, want)  # lr 0: the clamped weight, not the master's old values


def test_a_measurement_says_what_the_cpu_step_cost_and_when_it_sets_the_step_time():
    model = sw.apply(Net().double(), DELAYED.replace(", delayed=True", ""))
    prof = sw.measure(model, _batch(0), device="cpu", iterations=2, warmup=1)
    assert prof.cpu_step["worker_ms"] > 0 and prof.cpu_step["threads"] >= 1
    assert "the CPU's optimizer step stepped" in str(prof)
    assert sw.measure(Net().double(), _batch(0), device="cpu", iterations=1, warmup=1).cpu_step is None
    slow = dataclasses.replace(prof, step_ms=100.0, cpu_step={"worker_ms": 90.0, "waited_ms": 40.0, "threads": 14})
    fast = dataclasses.replace(slow, cpu_step={**slow.cpu_step, "waited_ms": 5.0})
    assert slow.cpu_bound and not fast.cpu_bound
    assert "the CPU, not the device, sets this step's time" in slow.cpu_note()
    assert "sets" not in fast.cpu_note()
