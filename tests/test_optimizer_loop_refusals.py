"""What cannot work with step_in_backward raises a ``shrinkwrap:`` error naming what the loop did, before any
parameter changed where that can be known in advance, else at once, naming what was stepped."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from toymodels import Net, below
from optimizer_loops_helpers import OPTIONS, STATES, _batch, _beside, _loss, _pair, _same_dict, _steps, plain_step


pytestmark = pytest.mark.usefixtures("one_thread")


# -- refused, and how ----------------------------------------------------------------------------------

def _snapshot(model: nn.Module, opt: Any) -> tuple:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])


def _unchanged(model: nn.Module, opt: Any, snap: tuple) -> None:
    """The parameters and optimizer state as in ``snap`` (a forward updates BatchNorm's statistics)."""
    _same_dict({n: snap[0][n] for n, _ in model.named_parameters()}, model)
    now = opt.state_dict()["state"]
    assert now.keys() == snap[1].keys()
    for i, s in snap[1].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(now[i][k])) for k, v in s.items())


@pytest.mark.parametrize("state", STATES)
def test_a_grad_scaler_is_refused_at_its_first_call_before_any_parameter_changes(state):
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    snap = _snapshot(model, opt)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"shrinkwrap: GradScaler\.scale\(\).*bfloat16"):
        scaler.scale(_loss(model, 1))
    _unchanged(model, opt, snap)
    other = nn.Linear(3, 1).double()  # another model's loss is the scaler's to scale
    scaler.scale(other(torch.randn(2, 3, dtype=torch.float64)).sum()).backward()
    assert torch.amp.GradScaler("cpu", enabled=False).scale(_loss(model, 2)) is not None  # disabled: a no-op


def test_a_float16_autocast_step_in_the_plan_is_refused():
    with pytest.raises(sw.PlanError, match="GradScaler.*bfloat16"):
        sw.Plan.parse("autocast(torch.float16), step_in_backward(torch.optim.AdamW)")


class GlobalNormSGD(torch.optim.Optimizer):
    """LAMB-style: each update scaled by the norm over every gradient of the step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total, alpha=-g["lr"])


class NeedsClosure(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure):
        closure()


@pytest.mark.parametrize("cls, message", [
    (torch.optim.LBFGS, "LBFGS evaluates the loss again"),
    (GlobalNormSGD, "differs from its update of each alone"),
    (NeedsClosure, "could not step two small tensors"),
])
def test_classes_that_cannot_step_a_parameter_at_a_time_are_refused_at_apply(cls, message):
    model = Net().double()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        sw.apply(model, sw.step_in_backward(cls, {"lr": 0.1}))
    _same_dict(before, model)
    assert not sw.records(model)


def test_a_second_apply_with_other_options_is_refused_and_the_same_one_changes_nothing():
    model = Net().double()
    sw.apply(model, sw.step_in_backward(torch.optim.AdamW, OPTIONS))
    opt = sw.optimizer(model)
    sw.apply(model, sw.step_in_backward(torch.optim.AdamW, OPTIONS))
    assert sw.optimizer(model) is opt
    for other in (sw.step_in_backward(torch.optim.SGD, {"lr": 0.1}), sw.step_in_backward(torch.optim.AdamW),
                  sw.step_in_backward(torch.optim.AdamW, OPTIONS, state="cpu")):
        with pytest.raises(ValueError, match=r"steps in backward already as step_in_backward\(torch\.optim\.AdamW"):
            sw.apply(model, other)


@pytest.mark.parametrize("state", STATES)
def test_accumulating_over_micro_batches_is_refused_at_the_second_forward(state):
    _, _, model, opt = _pair(state)
    opt.zero_grad()
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"a training forward after a backward that no step\(\) followed.*"
                                           r"accumulates"):
        _loss(model, 1).backward()


@pytest.mark.parametrize("state", STATES)
def test_a_second_backward_into_uncleared_gradients_is_refused_naming_accumulation(state):
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    snap = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"a backward into gradients that no zero_grad\(\) cleared"):
        _loss(model, 1).backward()
    _unchanged(model, opt, snap)


@pytest.mark.parametrize("use, message", [
    (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-6), r"clip_grad_norm_ above its limit"),
    (lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-9), r"clip_grad_value_ below the largest"),
    (lambda m: m.head.weight.grad.sum(), r"reading the gradient of 'head.weight'"),
    (lambda m: m.head.weight.grad.div_(4), r"reading the gradient of 'head.weight'"),
])
def test_what_needs_the_gradient_s_values_is_refused_naming_what_the_loop_did(use, message):
    _, _, model, opt = _pair("device")
    opt.zero_grad()
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"shrinkwrap: " + message + r".*steps inside backward"):
        use(model)


@pytest.mark.parametrize("clears", [False, True])
def test_a_gan_whose_generator_loss_steps_the_discriminator_is_refused_naming_it(clears):
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4).double(), nn.Sequential(nn.Linear(4, 1)).double()
    sw.apply(d, sw.step_in_backward(torch.optim.AdamW, OPTIONS))
    d_opt, g_opt = sw.optimizer(d), torch.optim.AdamW(g.parameters())
    z = torch.randn(8, 4, dtype=torch.float64)
    d_opt.zero_grad()
    d(g(z).detach()).mean().backward()
    d_opt.step()
    if not clears:  # D's stand-ins are there: the generator's backward cannot add to them
        g_opt.zero_grad()
        with pytest.raises(RuntimeError, match=r"a backward into gradients that no zero_grad\(\) cleared.*GAN"):
            (-d(g(z)).mean()).backward()
        return
    d_opt.zero_grad()
    g_opt.zero_grad()
    (-d(g(z)).mean()).backward()  # D's gradients too: a plain loop discards them at D's zero_grad
    g_opt.step()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward that no step\(\) followed.*'0\.weight'"
                                           r".*GAN"):
        d_opt.zero_grad()


def _boom(g):
    raise RuntimeError("boom")


class _Split(Net):
    def forward(self, x, nan=False):
        x = self.layer2(self.layer1(self.stem(x)))
        x = below(lambda g: g * float("nan"))(x) if nan else x
        return self.head(self.layer3(x).mean((2, 3)))


def _buckets_of_one(monkeypatch):
    import importlib

    backward = importlib.import_module("shrinkwrap.transforms.optimizer.backward")
    monkeypatch.setattr(backward, "_BUCKET", 1)
    monkeypatch.setattr(backward, "_SHARE", 1)


def _fused(monkeypatch):
    """What a GPU's parameters step with (torch's fused kernel, checked on the device through its
    found_inf), with torch's fused CPU kernel."""
    import importlib

    binding = importlib.import_module("shrinkwrap.transforms.optimizer.binding")
    one = binding._one_optimizer
    monkeypatch.setattr(binding, "_one_optimizer", lambda cls, p, options, fused: one(cls, p, options, True))


KINDS = ["device", "cpu", "fused"]


def _kind(kind: str, monkeypatch) -> tuple[str, bool]:
    """(the state, whether fused) of one of KINDS: "fused" is the state on the device, fused."""
    if kind == "fused":
        _fused(monkeypatch)
    return ("device" if kind == "fused" else kind), kind == "fused"


@pytest.mark.parametrize("state", KINDS)
def test_a_non_finite_gradient_after_some_were_stepped_raises_naming_them_and_is_never_stepped(state, monkeypatch):
    _buckets_of_one(monkeypatch)
    state, _ = _kind(state, monkeypatch)
    torch.manual_seed(0)
    model = _Split().double()
    sw.apply(model, sw.step_in_backward(torch.optim.AdamW, OPTIONS, state=state))
    opt = sw.optimizer(model)
    _steps(1)(model, opt)
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"non-finite gradient of 'layer2\..*after the optimizer had stepped "
                                           r"'head\.bias'"):
        model(_batch(1), nan=True).square().mean().backward()
        opt.step()  # with the state on the CPU the worker's verdict comes here
    now = model.state_dict()
    assert not torch.equal(before["head.weight"], now["head.weight"])  # stepped before the NaN
    assert all(torch.equal(before[k], now[k]) for k in before if k.startswith(("stem.", "layer1.", "layer2.")) and
               "running" not in k and "num_batches" not in k)
    assert all(torch.isfinite(v).all() for v in now.values() if v.is_floating_point())


@pytest.mark.parametrize("state", KINDS)
def test_a_non_finite_backward_steps_nothing_and_step_after_it_raises(state, monkeypatch):
    state, _ = _kind(state, monkeypatch)
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    snap = _snapshot(model, opt)
    opt.zero_grad()
    (_loss(model, 1) * float("nan")).backward()
    with pytest.raises(RuntimeError, match=r"step\(\) after a backward whose gradient of .* was not finite"):
        opt.step()
    _unchanged(model, opt, snap)


@pytest.mark.parametrize("state", STATES)
def test_a_backward_that_raised_after_steps_is_reported_at_the_next_call_naming_them(state, monkeypatch):
    _buckets_of_one(monkeypatch)

    class Model(_Split):
        def forward(self, x, boom=False):
            x = self.layer2(self.layer1(self.stem(x)))
            return self.head(self.layer3(below(_boom)(x) if boom else x).mean((2, 3)))

    torch.manual_seed(0)
    model = Model().double()
    sw.apply(model, sw.step_in_backward(torch.optim.AdamW, OPTIONS, state=state))
    opt = sw.optimizer(model)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="boom"):
        model(_batch(0), boom=True).sum().backward()
    with pytest.raises(RuntimeError, match=r"the last backward raised after the optimizer had stepped 'head\.bias'"):
        opt.zero_grad()
    opt.zero_grad()  # told once; the loop may go on
    _steps(1)(model, opt)


@pytest.mark.parametrize("state", STATES)
def test_a_model_cast_after_training_began_is_refused_at_its_next_forward(state):
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    model.float()  # the gradients' stand-ins are cast with it
    assert model.head.weight.grad.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"moved from cpu torch.float64 to cpu torch.float32 after training began"):
        _steps(1)(model, opt)


def test_add_param_group_refuses_what_torch_refuses_and_a_tensor_outside_the_model():
    _, _, model, opt = _pair("device")
    opt.add_param_group({"params": model.head.weight, "lr": 0.5})
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.head.weight]})
    with pytest.raises(ValueError, match="not one of them"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert [len(g["params"]) for g in opt.param_groups] == [len(list(model.parameters())) - 1, 1]


def test_a_state_dict_of_other_groups_is_refused_naming_both_layouts():
    _, _, model, opt = _pair("device")
    other = torch.optim.AdamW([model.head.weight])
    with pytest.raises(ValueError, match=r"groups of \[1\] parameters cannot load into this handle's groups of"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_weights_set_after_apply_are_what_the_cpu_state_steps_from(dtype):
    # lr 0: each step leaves the weight it started from, which must be the one the model holds
    # (a half model's master copy takes the values that differ from its rounding).
    torch.manual_seed(0)
    model = Net().to(dtype)
    sw.apply(model, sw.step_in_backward(torch.optim.AdamW, {"lr": 0.0, "weight_decay": 0.0}, state="cpu"))
    opt = sw.optimizer(model)
    plain_step(model, opt, 0) if dtype == torch.float64 else None
    donor = Net().to(dtype)
    model.load_state_dict(donor.state_dict())
    with torch.no_grad():
        model.head.weight.clamp_(-0.01, 0.01)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(2):
        opt.zero_grad()
        model(_batch(i).to(dtype)).float().square().mean().backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n


def _nan_head_at(i_bad):
    """A loop whose batch ``i_bad`` gives the head alone NaN gradients (the first the step meets),
    guarded on clip_grad_norm_'s total: the other gradients' stand-ins are clipped by a NaN
    factor, which changes nothing the step used."""
    def loop(model, opt):
        for i in range(4):
            opt.zero_grad()
            hooks = [p.register_hook(lambda g: g * float("nan")) for p in model.head.parameters()] if i == i_bad else []
            _loss(model, i).backward()
            for hook in hooks:
                hook.remove()
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)):
                opt.zero_grad()
                continue
            opt.step()
    return loop


@pytest.mark.parametrize("state", KINDS)
def test_a_guard_on_the_total_norm_skips_a_batch_with_one_gradient_not_finite(state, monkeypatch):
    state, fused = _kind(state, monkeypatch)
    _beside(state, _nan_head_at(1), plain=lambda m: torch.optim.AdamW(
        m.parameters(), foreach=False, fused=fused or None, **OPTIONS))


def test_a_skipped_first_batch_leaves_no_state_behind_with_fused_sgd(monkeypatch):
    # torch's fused SGD makes its momentum buffers with empty_like, then found_inf skips the kernel.
    _fused(monkeypatch)
    options = {"lr": 0.05, "momentum": 0.9}
    _beside("device", _nan_head_at(0), cls=torch.optim.SGD, options=options,
            plain=lambda m: torch.optim.SGD(m.parameters(), fused=True, **options))


@pytest.mark.parametrize("state", KINDS)
def test_finite_gradients_too_large_for_a_float32_norm_are_stepped(state, monkeypatch):
    # Their 2-norm overflows float32; their largest magnitude, which decides, does not.
    state, fused = _kind(state, monkeypatch)
    def big(model, opt):
        for i in range(3):
            opt.zero_grad()
            torch.manual_seed(100 + i)  # dropout
            (model(_batch(i).float()).square().mean() * 1e25).backward()
            opt.step()
    _beside(state, big, make=lambda: Net(), plain=lambda m: torch.optim.AdamW(
        m.parameters(), foreach=False, fused=fused or None, **OPTIONS))


@pytest.mark.parametrize("state", STATES)
def test_a_non_finite_gradient_kept_for_step_by_retain_graph_is_never_stepped(state):
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    snap = _snapshot(model, opt)
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (_loss(model, 1) * float("nan")).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"step\(\) after a backward whose gradient of .* was not finite"):
        opt.step()
    _unchanged(model, opt, snap)


@pytest.mark.parametrize("where", ["a step pre-hook", "the loop"])
@pytest.mark.parametrize("state", STATES)
def test_options_changed_between_backward_and_step_are_refused(where, state):
    _, _, model, opt = _pair(state)
    _steps(1)(model, opt)
    if where == "a step pre-hook":  # a warmup in a hook: a plain optimizer steps this batch with it
        opt.register_step_pre_hook(lambda o, args, kwargs: o.param_groups[0].__setitem__("lr", 0.5))
    opt.zero_grad()
    _loss(model, 1).backward()
    if where == "the loop":
        opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match=r"lr of param group 0 changed after backward and before step\(\)"):
        opt.step()


class _StopGradient(nn.Module):
    """``w`` used directly, and read through ``w.detach()`` by a node that runs after ``w``'s own
    gradient arrived (a target branch)."""

    def __init__(self):
        super().__init__()
        self.w, self.v = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return ((x @ self.v) @ self.w.detach()).sum() + (x @ self.w).square().sum()


@pytest.mark.parametrize("state", STATES)
def test_a_weight_a_later_node_reads_after_its_step_raises_as_on_the_device(state, monkeypatch):
    _buckets_of_one(monkeypatch)
    torch.manual_seed(0)
    model = _StopGradient().double()
    sw.apply(model, sw.step_in_backward(torch.optim.SGD, {"lr": 0.1}, state=state))
    opt = sw.optimizer(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(4, 6, dtype=torch.float64)).backward()
        opt.step()


def test_the_state_on_the_cpu_refuses_fsdp2_shards_naming_the_parameter():
    from shrinkwrap.transforms.optimizer.handle import InBackward

    class Shard(nn.Parameter):  # what bind() reads of a DTensor: its local tensor
        pass

    model = nn.Linear(3, 2).double()
    model.weight = Shard(model.weight.detach())
    model.weight._local_tensor = model.weight.detach()
    handle = InBackward(torch.optim.AdamW, {}, on_cpu=True)
    with pytest.raises(RuntimeError, match=r"state='cpu'\) does not take FSDP2's sharded parameters \('weight'\)"):
        handle.bind(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_s_fingerprint_shows_a_value_changed_and_rows_moved(dtype):
    from shrinkwrap.transforms.optimizer.cpu import _differs, fingerprint

    w = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    then = fingerprint(w)
    assert not bool(_differs(fingerprint(w.clone()), then, w.device))
    changes = [lambda t: t.view(-1)[7].add_(t.view(-1)[7].abs() * 2 ** -6 + 1e-3),  # one value, a little
               lambda t: t.view(-1)[-3:].zero_(),  # in the last, partial block
               lambda t: t.__setitem__([0, 1], t[[1, 0]].clone())]  # rows swapped
    if dtype == torch.float32:  # two values swapped within a block: bf16's product is too coarse to show it
        changes.append(lambda t: t.view(-1)[:2].copy_(t.view(-1)[:2].flip(0).clone()))
    for change in changes:
        moved = w.clone()
        change(moved)
        assert not torch.equal(moved, w) and bool(_differs(fingerprint(moved), then, w.device))
    assert fingerprint(w.t()) is None and bool(_differs(None, then, w.device))


@pytest.mark.parametrize("state", STATES)
def test_a_tensor_learning_rate_set_in_place_after_backward_is_refused(state):
    options = {"lr": torch.tensor(0.01), "weight_decay": 0.1}
    _, _, model, opt = _pair(state, options=options, plain=lambda m: None)
    _steps(1)(model, opt)
    opt.zero_grad()
    _loss(model, 1).backward()
    opt.param_groups[0]["lr"].fill_(0.5)
    with pytest.raises(RuntimeError, match=r"lr of param group 0 changed after backward"):
        opt.step()
