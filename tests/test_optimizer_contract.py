"""step_in_backward's handle against torch's optimizer contract: schedulers of every kind, step hooks,
``add_param_group``, ``state_dict`` both ways with a plain optimizer of the same class, copies, hand-written and
sparse optimizers, adapters added later."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from toymodels import Net
from optimizer_loops_helpers import OPTIONS, S, STATES, _beside, _loss, _pair, _same, _same_dict, _steps, plain_step


pytestmark = pytest.mark.usefixtures("one_thread")


# -- loop shapes that train exactly as the plain loop --------------------------------------------------

SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.8),
    "StepLR": lambda o: S.StepLR(o, 2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [1, 3], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.2, total_iters=3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.7),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, 4),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, 2),
    "CyclicLR": lambda o: S.CyclicLR(o, 0.001, 0.01, step_size_up=2),  # cycles betas: the class's defaults
    "OneCycleLR": lambda o: S.OneCycleLR(o, 0.02, total_steps=10),  # cycles betas too
    "SequentialLR": lambda o: S.SequentialLR(o, [S.ConstantLR(o, 0.5, 2), S.ExponentialLR(o, 0.8)], [2]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, 0.5, 2), S.ExponentialLR(o, 0.8)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("state", STATES)
def test_every_lr_scheduler_drives_the_handle_as_a_plain_optimizer(name, state):
    ref, opt_ref, model, opt = _pair(state)
    loop = _steps(5)
    loop(ref, opt_ref, SCHEDULERS[name](opt_ref))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        loop(model, opt, SCHEDULERS[name](opt))
    _same(ref, model)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt_ref.param_groups]


@pytest.mark.parametrize("state", STATES)
def test_a_resumed_run_matches_the_uninterrupted_one_through_state_dict(state, tmp_path):
    ref, opt_ref, model, opt = _pair(state)
    _steps(5)(ref, opt_ref)
    _steps(2)(model, opt)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    torch.manual_seed(1)
    fresh = Net().double()  # other weights: the load must win
    sw.apply(fresh, sw.step_in_backward(torch.optim.AdamW, OPTIONS, state=state))
    saved = torch.load(tmp_path / "ckpt.pt")
    fresh.load_state_dict(saved["model"])
    sw.optimizer(fresh).load_state_dict(saved["opt"])
    loop = _steps(5)
    for i in range(2, 5):
        plain_step(fresh, sw.optimizer(fresh), i)
    _same(ref, fresh)


@pytest.mark.parametrize("direction", ["handle to plain", "plain to handle"])
@pytest.mark.parametrize("state", STATES)
def test_state_dict_round_trips_with_a_plain_optimizer_of_the_class_both_ways(direction, state):
    ref, opt_ref, model, opt = _pair(state)
    _steps(2)(ref, opt_ref)
    _steps(2)(model, opt)
    if direction == "handle to plain":
        sd = copy.deepcopy(opt.state_dict())
        other = torch.optim.AdamW(ref.parameters(), foreach=False, **OPTIONS)
        other.load_state_dict(sd)
        assert other.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
        opt_ref = other
    else:
        opt.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    for i in range(2, 5):
        plain_step(ref, opt_ref, i)
        plain_step(model, opt, i)
    _same(ref, model)


@pytest.mark.parametrize("state", STATES)
def test_step_hooks_fire_and_an_ema_of_them_follows_the_plain_one(state):
    ref, opt_ref, model, opt = _pair(state)
    emas, calls = [], []
    for m, o in ((ref, opt_ref), (model, opt)):
        ema = copy.deepcopy(m).requires_grad_(False)
        emas.append(ema)

        def post(optimizer, args, kwargs, m=m, ema=ema):
            with torch.no_grad():
                for e, p in zip(ema.parameters(), m.parameters()):
                    e.lerp_(p, 0.1)
        o.register_step_post_hook(post)
        o.register_step_pre_hook(lambda optimizer, args, kwargs: calls.append(type(optimizer).__name__))
        _steps(3)(m, o)
    _same(ref, model)
    _same(emas[0], emas[1])
    assert calls == ["AdamW"] * 3 + ["InBackward"] * 3


@pytest.mark.parametrize("state", STATES)
def test_the_handle_shows_the_plain_optimizer_s_groups_defaults_and_parameters(state):
    _, opt_ref, model, opt = _pair(state, plain=lambda m: torch.optim.AdamW(m.parameters(), **OPTIONS))
    assert opt.defaults == opt_ref.defaults  # betas too: CyclicLR and OneCycleLR read them
    assert [p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters())] == [True] * len(
        list(model.parameters()))
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in opt_ref.param_groups[0].items() if k != "params"}
    _steps(1)(model, opt)
    assert set(map(id, opt.state)) == set(map(id, model.parameters()))


class HandMadeSGD(torch.optim.Optimizer):
    """A hand-written optimizer without foreach=, as most third-party ones are."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


@pytest.mark.parametrize("state", STATES)
def test_a_hand_written_optimizer_class_without_foreach_steps_exactly(state):
    _beside(state, _steps(3), cls=HandMadeSGD, options={"lr": 0.05})


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)

    def forward(self, x):
        return self.emb((x.abs() * 5).long().clamp(0, 19)).mean((-1, -2, -3))[:, None]


def test_sparse_adam_on_a_sparse_embedding_steps_exactly():
    _beside("device", _steps(3), cls=torch.optim.SparseAdam, options={"lr": 0.01},
            make=lambda: _Embedding().double(), plain=lambda m: torch.optim.SparseAdam(m.parameters(), lr=0.01))


def test_sparse_gradients_with_the_state_on_the_cpu_are_refused_before_a_step():
    _, _, model, opt = _pair("cpu", cls=torch.optim.SparseAdam, options={"lr": 0.01},
                             make=lambda: _Embedding().double(),
                             plain=lambda m: torch.optim.SparseAdam(m.parameters(), lr=0.01))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="sparse gradient.*state='device'"):
        _loss(model, 0).backward()
    _same_dict(before, model)


@pytest.mark.parametrize("state", STATES)
def test_copies_pickles_and_averaged_models_train_like_the_original(state):
    ref, opt_ref, model, opt = _pair(state)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
              torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
    averaged = [torch.optim.swa_utils.AveragedModel(m) for m in (ref, model)]
    _steps(3)(ref, opt_ref)
    for m in [model, *copies]:
        _steps(3)(m, sw.optimizer(m))
        _same(ref, m)
    for avg, m in zip(averaged, (ref, model)):
        avg.update_parameters(m)
    _same(averaged[0], averaged[1])
    assert sw.optimizer(copies[0]) is not opt and not sw.optimizer(copies[0]).state or True


def test_a_deepcopy_after_training_starts_from_fresh_state_and_keeps_the_groups():
    _, _, model, opt = _pair("device")
    _steps(2, )(model, opt)
    opt.param_groups[0]["lr"] = 0.123
    twin = copy.deepcopy(model)
    handle = sw.optimizer(twin)
    assert handle is not opt and not handle.state and handle.param_groups[0]["lr"] == 0.123
    assert [id(p) for p in handle.param_groups[0]["params"]] == [id(p) for p in twin.parameters()]


def test_peft_adapters_added_after_the_plan_are_stepped_as_the_plain_loop_steps_them():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    base = transformers.GPT2LMHeadModel(config).double()
    twin = copy.deepcopy(base)
    sw.apply(twin, sw.step_in_backward(torch.optim.AdamW, OPTIONS))
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)
    torch.manual_seed(1)
    ref = peft.get_peft_model(base, lora)
    torch.manual_seed(1)
    model = peft.get_peft_model(twin, lora)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), foreach=False, **OPTIONS), sw.optimizer(model)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    for m, o in ((ref, opt_ref), (model, opt)):
        for i in range(3):
            o.zero_grad()
            torch.manual_seed(i)  # dropout
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    _same(ref, model)


def test_a_gan_that_freezes_the_discriminator_for_the_generator_s_loss_trains_exactly():
    def make():
        return nn.ModuleDict({"g": nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)),
                              "d": nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))}).double()

    torch.manual_seed(0)
    ref, model = make(), None
    model = copy.deepcopy(ref)
    opts_ref = [torch.optim.AdamW(ref[k].parameters(), foreach=False, **OPTIONS) for k in "gd"]
    for k in "gd":
        sw.apply(model[k], sw.step_in_backward(torch.optim.AdamW, OPTIONS))
    opts = [sw.optimizer(model[k]) for k in "gd"]
    for m, (g_opt, d_opt) in ((ref, opts_ref), (model, opts)):
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            real, z = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g,
                                                                                      dtype=torch.float64)
            d_opt.zero_grad()
            (m["d"](m["g"](z).detach()).mean() - m["d"](real).mean()).backward()
            d_opt.step()
            g_opt.zero_grad()
            m["d"].requires_grad_(False)
            (-m["d"](m["g"](z)).mean()).backward()
            m["d"].requires_grad_(True)
            g_opt.step()
    _same(ref, model)
