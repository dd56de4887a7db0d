"""step_in_backward in the training loops fine-tuners write: each loop shape beside the plain loop (``loss.backward();
opt.step(); opt.zero_grad()``, AdamW with foreach off) on the same model, seed and data, float64 on the CPU: the
weights and buffers bit for bit, with the state on the device and on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from toymodels import Net
from optimizer_loops_helpers import OPTIONS, STATES, _batch, _beside, _loss, _steps, plain_step


pytestmark = pytest.mark.usefixtures("one_thread")


def _resume_weights(state):
    # Weights loaded after apply (a resume, pretrained weights): the step starts from them.
    donor = Net().double()
    _steps(2)(donor, torch.optim.SGD(donor.parameters(), lr=0.1))

    def loop(model, opt):
        _steps(1)(model, opt)
        model.load_state_dict(donor.state_dict())
        _steps(3)(model, opt)
    return loop


def _clamp_data(model, opt):  # WGAN's weight clipping, through .data
    for i in range(4):
        plain_step(model, opt, i)
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)


def _clamp_no_grad(model, opt):
    for i in range(4):
        plain_step(model, opt, i)
        with torch.no_grad():
            model.head.weight.mul_(0.5)


def _unfreeze(model, opt):  # gradual unfreezing: the head first, then the rest
    for p in model.parameters():
        p.requires_grad_(False)
    model.head.requires_grad_(True)
    _steps(2)(model, opt)
    model.layer3.requires_grad_(True)
    _steps(2)(model, opt)
    model.requires_grad_(True)
    _steps(2)(model, opt)


def _add_group(model, opt):  # torch's recipe: a new group for the layers unfrozen, its own lr
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    _steps(2)(model, opt)
    model.layer3.requires_grad_(True)
    opt.add_param_group({"params": list(model.layer3.parameters()), "lr": 0.001})
    _steps(3)(model, opt)


def _autocast(model, opt):
    for i in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, i)
        loss.float().backward()
        opt.step()


def _skip_bad_loss(model, opt):  # the usual guard: a non-finite loss skips the batch before backward
    for i in range(4):
        opt.zero_grad()
        loss = _loss(model, i) * (float("nan") if i == 1 else 1.0)
        if not torch.isfinite(loss):
            continue
        loss.backward()
        opt.step()


def _skip_bad_grad(model, opt):  # the guard on the gradient norm after backward
    for i in range(4):
        opt.zero_grad()
        (_loss(model, i) * (float("inf") if i == 2 else 1.0)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        if not torch.isfinite(norm):
            opt.zero_grad()
            continue
        opt.step()


def _clip_within(model, opt):
    for i in range(3):
        opt.zero_grad()
        _loss(model, i).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e6)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6, norm_type=float("inf"))
        opt.step()


def _log_norms(model, opt):
    norms = []
    for i in range(3):
        opt.zero_grad()
        _loss(model, i).backward()
        norms.append(sum(torch.linalg.vector_norm(p.grad).item() ** 2 for p in model.parameters()))
        opt.step()
    model.logged = norms  # compared below


def _retain_two_losses(model, opt):  # two losses' backwards over one graph, one step
    for i in range(3):
        opt.zero_grad()
        torch.manual_seed(100 + i)  # dropout
        out = model(_batch(i))
        out.square().mean().backward(retain_graph=True)
        out.abs().mean().backward()
        opt.step()


def _retain_one(model, opt):
    for i in range(3):
        opt.zero_grad()
        _loss(model, i).backward(retain_graph=True)
        opt.step()


def _closure(model, opt):
    for i in range(3):
        def closure(i=i):
            opt.zero_grad()
            loss = _loss(model, i)
            loss.backward()
            return loss
        opt.step(closure)


def _no_set_to_none(model, opt):
    for i in range(3):
        opt.zero_grad(set_to_none=False)
        _loss(model, i).backward()
        opt.step()


def _module_zero_grad(model, opt):
    for i in range(3):
        model.zero_grad()
        _loss(model, i).backward()
        opt.step()


def _to_double(model, opt):  # built in float32, cast after apply, before the first step
    model.double()
    _steps(3)(model, opt)


def _eval_between(model, opt):  # validation between steps, in no_grad and eval
    for i in range(3):
        plain_step(model, opt, i)
        model.eval()
        with torch.no_grad():
            model(_batch(9))
        model.train()


LOOPS = {
    "zero_grad first": _steps(4),
    "zero_grad last": _steps(4, lambda m, o, i: (_loss(m, i).backward(), o.step(), o.zero_grad())),
    "weights loaded after apply": None,  # _resume_weights
    "weight clamp through .data": _clamp_data,
    "weight change under no_grad": _clamp_no_grad,
    "gradual unfreezing": _unfreeze,
    "add_param_group on unfreezing": _add_group,
    "bf16 autocast": _autocast,
    "a non-finite loss skipped": _skip_bad_loss,
    "a non-finite gradient skipped": _skip_bad_grad,
    "clipping within the limit": _clip_within,
    "logging gradient norms": _log_norms,
    "two losses, retain_graph, one step": _retain_two_losses,
    "retain_graph, one loss": _retain_one,
    "step(closure)": _closure,
    "zero_grad(set_to_none=False)": _no_set_to_none,
    "model.zero_grad()": _module_zero_grad,
    "validation between steps": _eval_between,
}


@pytest.mark.parametrize("name", LOOPS)
@pytest.mark.parametrize("state", STATES)
def test_loop_shapes_train_as_the_plain_loop_bit_for_bit(name, state):
    loop = LOOPS[name] or _resume_weights(state)
    # torch's recipe builds its optimizer over what trains first; the handle's first group is the rest.
    plain = (lambda m: torch.optim.AdamW(m.head.parameters(), foreach=False, **OPTIONS)) if "add_param" in name else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # retain_graph's: its gradients wait for step()
        ref, _, model, _ = _beside(state, loop, plain=plain)
    if name == "logging gradient norms":
        assert ref.logged == model.logged


@pytest.mark.parametrize("state", STATES)
def test_a_model_cast_after_apply_trains_as_one_cast_before(state):
    _beside(state, _to_double, make=lambda: Net(), plain=lambda m: torch.optim.AdamW(
        m.double().parameters(), foreach=False, **OPTIONS))
