"""step_in_backward: the optimizer steps each parameter inside backward and drops its gradient. Exact against the
plain loop (AdamW with foreach off, which computes one tensor at a time as the per-parameter optimizers do): weights
bit for bit after N iterations, float64 and float32, with and without checkpoint regions, with an LR scheduler driving
the handle, across a state_dict save and load; the state on the CPU alike. What cannot work raises, naming the step:
global-norm clipping, using a gradient, accumulating gradients over backwards, DDP. The measuring harness steps
through the handle and shows the gradient term gone; the Hugging Face Trainer trains, saves and resumes with the
handle; autoplan tries it. FSDP2 on two ranks: tests/test_distributed.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from toymodels import Net, below


pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = {"lr": 0.01, "weight_decay": 0.1}


def plain_loop(model, batch, steps, scheduler=True):
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **OPTIONS)
    return _loop(model, opt, batch, steps, scheduler)


def _loop(model, opt, batch, steps, scheduler=True):
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if scheduler else None
    losses = []
    for _ in range(steps):
        torch.manual_seed(3)  # dropout
        opt.zero_grad()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.detach())
    return losses


def _beside_plain(plan, steps):
    """A float64 Net trained ``steps`` iterations with ``plan`` beside the plain loop, the losses
    checked equal: (the plain loop's model, the plan's, the plan's handle)."""
    torch.manual_seed(0)
    ref = Net().double()
    model = copy.deepcopy(ref)
    batch = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    want = plain_loop(ref, batch, steps)
    opt = in_backward(model, plan)
    got = _loop(model, opt, batch, steps)
    assert [a.item() for a in want] == [b.item() for b in got]
    return ref, model, opt


def in_backward(model, plan):
    sw.apply(model, plan)
    return sw.optimizer(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("plan", ["", r"checkpoint(r'layer[12]'), "])
@pytest.mark.parametrize("state", ["device", "cpu"])
def test_weights_after_n_steps_are_the_plain_loop_s_bit_for_bit(dtype, plan, state):
    torch.manual_seed(0)
    ref = Net().to(dtype)
    model = copy.deepcopy(ref)
    batch = torch.randn(4, 3, 8, 8, dtype=dtype)
    want = plain_loop(ref, batch, 5)
    opt = in_backward(model, plan + f"step_in_backward(torch.optim.AdamW, options={OPTIONS}, state='{state}')")
    got = _loop(model, opt, batch, 5)
    assert [a.item() for a in want] == [b.item() for b in got]
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5 ** 2


def test_a_compiled_model_steps_in_backward_as_the_plain_loop():
    # The compiled graph's backward accumulates each gradient in eager autograd, where the hook runs.
    ref, model, _ = _beside_plain(f"step_in_backward(torch.optim.AdamW, options={OPTIONS}), compile(backend='aot_eager')", 3)
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_checkpoint_of_the_handle_resumes_training_exactly(tmp_path):
    torch.manual_seed(0)
    plan = f"step_in_backward(torch.optim.AdamW, options={OPTIONS})"
    ref = Net().double()
    batch = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model = copy.deepcopy(ref)
    want = plain_loop(ref, batch, 6, scheduler=False)
    opt = in_backward(model, plan)
    first = _loop(model, opt, batch, 3, scheduler=False)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    resumed = Net().double()
    opt2 = in_backward(resumed, plan)
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    rest = _loop(resumed, opt2, batch, 3, scheduler=False)
    assert [a.item() for a in want] == [b.item() for b in first + rest]
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), resumed.parameters()))


def test_a_plain_optimizer_s_state_dict_loads_and_each_parameter_keeps_its_own_step():
    torch.manual_seed(0)
    ref = Net().double()
    batch = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model = copy.deepcopy(ref)
    # A plain loop of one group a parameter, default (foreach unset), saved after two steps.
    plain = torch.optim.AdamW([{"params": [p]} for p in ref.parameters()], **OPTIONS)
    _loop(ref, plain, batch, 2, scheduler=False)
    model.load_state_dict(ref.state_dict())
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, options={OPTIONS})")
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))  # as torch.load gives it: tensors of its own
    assert all(o.param_groups[0]["foreach"] is False for o in opt.optimizers.values())
    _loop(ref, plain, batch, 2, scheduler=False)
    _loop(model, opt, batch, 2, scheduler=False)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_a_parameter_bound_again_steps_as_its_new_optimizer_does_in_the_group_a_scheduler_holds(monkeypatch):
    # FSDP2 swaps a GPU parameter (whose optimizer is fused) for its shard (whose optimizer is the
    # single-tensor step): the group a scheduler holds carries over, and with it how the new
    # optimizer steps, not the old one's fused kernel (on two GPUs the weights then differed from
    # the plain sharded loop's by an ulp). Here a CPU optimizer stands for the fused one.
    import importlib

    opt_module = importlib.import_module("shrinkwrap.transforms.optimizer.binding")
    real = opt_module._one_optimizer
    monkeypatch.setattr(opt_module, "_one_optimizer",
                        lambda cls, p, options, fused: real(cls, p, options, not hasattr(p, "_shard")))
    model = nn.Linear(4, 3).double()
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, options={OPTIONS})")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    group = opt.optimizers["weight"].param_groups[0]
    assert group["fused"] is True
    shard = nn.Parameter(model.weight.detach().clone())
    shard._shard = True
    model.weight = shard
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()  # bound again at the forward
    new = opt.optimizers["weight"]
    assert new.param_groups[0] is group and group["params"] == [shard]
    assert not group["fused"] and group["foreach"] is False
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == OPTIONS["lr"] * 0.5
    opt.zero_grad()
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert new.param_groups[0]["lr"] == OPTIONS["lr"] * 0.5  # the group's, as the step read it


def test_a_bucket_s_norms_are_each_gradient_s_own_whatever_their_dtypes():
    # One launch a dtype; half gradients' norms widened to float32, as clip_grad_norm_ and the
    # per-parameter stand-in take them, in the bucket's order.
    import importlib

    from shrinkwrap.transforms.optimizer.standin import norms as _norms

    torch.manual_seed(0)
    grads = [torch.randn(300).to(d) for d in (torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16)]
    norms, peaks = _norms(grads)
    want = [torch.linalg.vector_norm(g, 2, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    assert [n.dtype for n in norms] == [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32]
    assert all(torch.equal(a, b) for a, b in zip(norms, want))


def _buckets(monkeypatch, size):
    """The optimizer module with buckets of ``size`` bytes, whatever share of the model that is."""
    module = __import__("sys").modules["shrinkwrap.transforms.optimizer.backward"]
    monkeypatch.setattr(module, "_BUCKET", size)
    monkeypatch.setattr(module, "_SHARE", 1)
    return module


class _Tied(nn.Module):
    """``w`` inside a reentrant checkpoint and outside it: two gradients accumulate into it."""

    def __init__(self):
        super().__init__()
        self.w, self.v = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t @ self.w), x, use_reentrant=True)
        return (h @ self.v @ self.w).sum()


def test_buckets_on_a_hugging_face_gpt2_give_the_plain_loop_s_weights_bit_for_bit(monkeypatch):
    # A third-party model with tied embeddings and dropout, in several buckets of 64 KiB.
    transformers = pytest.importorskip("transformers")
    _buckets(monkeypatch, 64 << 10)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    ref = transformers.GPT2LMHeadModel(config).double().train()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 100, (2, 16))
    plain = torch.optim.AdamW(ref.parameters(), foreach=False, **OPTIONS)
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, options={OPTIONS})")
    for _ in range(3):
        for m, o in ((ref, plain), (model, opt)):
            torch.manual_seed(1)  # dropout
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    assert len(opt.together) > 1  # several buckets
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_buckets_of_fused_optimizers_step_as_the_fused_loop_bit_for_bit(monkeypatch):
    # What a GPU's parameters do (a fused optimizer each, a bucket stepped through one fused
    # call), with torch's fused CPU kernel.
    _buckets(monkeypatch, 4096)
    binding = __import__("sys").modules["shrinkwrap.transforms.optimizer.binding"]
    one = binding._one_optimizer
    monkeypatch.setattr(binding, "_one_optimizer", lambda cls, p, options, fused: one(cls, p, options, True))
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    batch = torch.randn(4, 3, 8, 8)
    want = _loop(ref, torch.optim.AdamW(ref.parameters(), fused=True, **OPTIONS), batch, 4)
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, options={OPTIONS})")
    got = _loop(model, opt, batch, 4)
    assert opt.together and all(o.param_groups[0]["fused"] for o in opt.together.values())
    assert [a.item() for a in want] == [b.item() for b in got]
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_a_second_gradient_into_a_parameter_in_one_backward_raises(monkeypatch):
    _buckets(monkeypatch, 1 << 30)
    torch.manual_seed(0)
    model = _Tied()
    in_backward(model, "step_in_backward(torch.optim.AdamW)")
    opt = sw.optimizer(model)
    with pytest.raises(RuntimeError, match=r"shrinkwrap: .*step_in_backward\(\)"):
        model(torch.randn(2, 4, requires_grad=True)).backward()
    assert float(opt.optimizers["w"].state[model.w].get("step", 0)) <= 1  # never stepped twice


def test_gradients_a_backward_that_raised_left_waiting_are_not_stepped(monkeypatch):
    _buckets(monkeypatch, 1 << 30)

    def error(g):
        raise RuntimeError("boom")

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, boom=False):
            h = self.a(x)
            return self.b(below(error)(h) if boom else h)

    torch.manual_seed(0)
    model = Two()
    opt = in_backward(model, "step_in_backward(torch.optim.AdamW)")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4), boom=True).sum().backward()
    # b's gradients came before the error and wait, unstepped, in .grad as a plain optimizer's would.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert type(model.b.weight.grad) is torch.Tensor and model.a.weight.grad is None
    model.zero_grad()
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()  # trains on
    assert all(getattr(type(p.grad), "_sw_consumed", False) for p in model.parameters())
    assert not torch.equal(before["a.weight"], model.a.weight)


def test_under_compiled_autograd_each_parameter_steps_in_its_hook(monkeypatch):
    from torch._dynamo import compiled_autograd

    _buckets(monkeypatch, 1 << 30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    ref = copy.deepcopy(model)
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, options={OPTIONS})")
    x = torch.randn(2, 4, dtype=torch.float64)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        model(x).sum().backward()
    plain = torch.optim.AdamW(ref.parameters(), foreach=False, **OPTIONS)
    ref(x).sum().backward()
    plain.step()
    assert not opt.waiting and all(getattr(type(p.grad), "_sw_consumed", False) for p in model.parameters())
    # Stepped once each (torch 2.13's compiled autograd runs the hooks' steps 7e-8 from eager's).
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bucket", [1, 4096, 1 << 30])
def test_gradients_stepped_in_buckets_give_the_plain_loop_s_weights_bit_for_bit(bucket, monkeypatch):
    # Each parameter alone (1 byte), buckets of a few parameters, all of them at the end of backward.
    module = _buckets(monkeypatch, bucket)
    sizes, real = [], module.BackwardSteps._step_waiting

    def spy(self):
        sizes.append(len(self.waiting))
        real(self)

    monkeypatch.setattr(module.BackwardSteps, "_step_waiting", spy)
    ref, model, opt = _beside_plain(f"step_in_backward(torch.optim.AdamW, options={OPTIONS})", 4)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    n, stepped = sum(1 for _ in ref.parameters()), [k for k in sizes if k]
    assert sum(stepped) == 4 * n  # every parameter once an iteration
    if bucket == 1:
        assert max(stepped) == 1 and not opt.together
    elif bucket == 4096:
        assert 1 < max(stepped) < n and opt.together  # several buckets, stepped a bucket at a time
    else:
        assert stepped == [n] * 4 and len(opt.together) == 1  # one bucket, at the end of each backward


@pytest.mark.parametrize("state", ["device", "cpu"])
def test_a_model_dropped_without_revert_lets_go_of_its_parameters_and_state(state):
    import gc
    import weakref

    model, opt = _stepped(state)
    opt.step()  # as a loop does: the CPU's steps are done (those in flight hold their parameter until then)
    params = [weakref.ref(p) for p in model.parameters()]
    state_tensors = [weakref.ref(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state_tensors
    del model, opt
    gc.collect()
    assert not any(r() is not None for r in params + state_tensors)


def _stepped(state="device"):
    torch.manual_seed(0)
    model = Net().double()
    opt = in_backward(model, f"step_in_backward(torch.optim.AdamW, state='{state}')")
    model(torch.randn(4, 3, 8, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    return model, opt


def test_the_global_norm_is_the_plain_model_s_and_clipping_within_it_changes_nothing():
    torch.manual_seed(0)
    ref = Net().double()
    model = copy.deepcopy(ref)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.manual_seed(5)  # dropout
    ref(x).sum().backward()
    opt = in_backward(model, "step_in_backward(torch.optim.SGD, options={'lr': 0.0})")  # lr 0: weights stay
    torch.manual_seed(5)
    model(x).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    for foreach in (False, True):
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), foreach=foreach)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2 * want.item(), foreach=foreach)  # within: a no-op


@pytest.mark.parametrize("use", ["clip_grad_norm_", "read", "accumulate"])
def test_what_cannot_work_with_the_gradient_gone_raises_naming_the_step(use):
    model, opt = _stepped()
    with pytest.raises(RuntimeError, match=r"shrinkwrap: .* this model's optimizer steps inside backward "
                                           r"\(step_in_backward\(\)\)"):
        if use == "clip_grad_norm_":  # a norm over the limit: clipping would have scaled what the step used
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-6)
        elif use == "read":
            model.head.weight.grad.abs().max()
        else:  # a second backward without zero_grad: accumulation
            model(torch.randn(4, 3, 8, 8, dtype=torch.float64)).sum().backward()
    assert "used and dropped" in repr(model.head.weight.grad)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_revert_stops_stepping_and_drops_the_handle():
    model, opt = _stepped("cpu")
    sw.revert(model)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 3, 8, 8, dtype=torch.float64)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step in backward any more
    assert all(p.grad is not None and not hasattr(p.grad, "_sw_consumed") for p in model.parameters())
    with pytest.raises(ValueError, match="has no step_in_backward"):
        sw.optimizer(model)


@pytest.mark.parametrize("bad, message", [
    ("step_in_backward(torch.nn.Linear)", "optimizer= an optimizer class"),
    ("step_in_backward(options=5)", "options= a dict"),
    ("step_in_backward(state='disk')", "state is 'device' or 'cpu'"),
    ("step_in_backward(options={'foreach': True})", "leave foreach= and fused= out"),
])
def test_bad_arguments_are_refused(bad, message):
    with pytest.raises((TypeError, ValueError, sw.PlanError), match=message):
        sw.Plan.parse(bad)


def test_the_plan_text_round_trips():
    step = sw.step_in_backward(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, state="cpu")
    assert str(step) == "step_in_backward(torch.optim.SGD, options={'lr': 0.1, 'momentum': 0.9}, state='cpu')"
    assert sw.Plan.parse(str(step)).steps == (step,)


def test_measure_steps_through_the_handle_shows_no_gradient_term_and_restores_the_state():
    torch.manual_seed(0)
    model = Net()
    opt = in_backward(model, "step_in_backward(torch.optim.AdamW)")
    _loop(model, opt, torch.randn(4, 3, 8, 8), 2, scheduler=False)
    state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if isinstance(v, torch.Tensor)}
    weights = [p.detach().clone() for p in model.parameters()]
    prof = sw.measure(model, torch.randn(4, 3, 8, 8), device="cpu")
    assert prof.gradients == 0 and prof.optimizer_state > 0
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(v, after[k]) for k, v in state.items())  # its iterations stepped a copy's worth, undone
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


@pytest.mark.parametrize("state", ["device", "cpu"])
def test_the_trainer_trains_saves_and_resumes_with_the_handle(tmp_path, state):
    # resume_from_checkpoint loads the weights into the model after apply: the state on the CPU
    # steps from them, not from the fresh model's.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def model():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
        return sw.apply(transformers.GPT2LMHeadModel(config),
                        f"step_in_backward(torch.optim.AdamW, options={{'lr': 0.01}}, state={state!r})")

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 100, (16, 16), generator=g)]

    def train(m, steps, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=steps, max_grad_norm=0.0,
            report_to=[], use_cpu=True, save_strategy="steps", save_steps=2, logging_strategy="no", seed=0)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=data, optimizers=(sw.optimizer(m), None))
        trainer.train(resume_from_checkpoint=resume)
        return m

    whole = train(model(), 4)
    import shutil
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    resumed = train(model(), 4, resume=str(tmp_path / "out" / "checkpoint-2"))
    for (n, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ above its limit"):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "o2"), per_device_train_batch_size=4,
                                              max_steps=1, max_grad_norm=1e-6, report_to=[], use_cpu=True,
                                              save_strategy="no")
        m = model()
        transformers.Trainer(model=m, args=args, train_dataset=data, optimizers=(sw.optimizer(m), None)).train()


def test_autoplan_tries_the_step_in_backward_with_a_budget_on_cuda_and_its_default_optimizer():
    from shrinkwrap.step import Context
    from shrinkwrap.transforms.optimizer import LowBitAdamW, StepInBackward

    cuda = torch.device("cuda")
    got = lambda **kw: [str(c) for c in StepInBackward.candidates(Net(), Context(**kw))]  # noqa: E731
    assert got(device=cuda, budget=True) == ["step_in_backward(torch.optim.AdamW)",
                                            "step_in_backward(torch.optim.AdamW, state='cpu')"]
    lossy = StepInBackward.candidates(Net(), Context(device=cuda, budget=True, allow_lossy=True))
    assert [c.steps[0].optimizer for c in lossy] == [torch.optim.AdamW, torch.optim.AdamW, LowBitAdamW]
    assert lossy[-1].lossy and not lossy[0].lossy
    # Not without a budget, not on a CPU (whose figure is the bytes saved for backward, which the
    # step does not change), not with the caller's own optimizer (it cannot be built again a
    # parameter at a time).
    assert got(device=cuda) == [] and got(device=torch.device("cpu"), budget=True) == []
    assert got(device=cuda, budget=True, optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) == []


def test_one_step_in_backward_a_plan_and_its_candidates_exclude_each_other():
    from shrinkwrap.autoplan.choose import Effect, _search, candidates
    from shrinkwrap.step import Context
    from shrinkwrap.transforms.optimizer import StepInBackward

    with pytest.raises(sw.PlanError, match="keep one step_in_backward"):
        sw.Plan.parse("step_in_backward(torch.optim.AdamW), step_in_backward(torch.optim.AdamW, state='cpu')")
    on_device, on_cpu = StepInBackward.candidates(Net(), Context(device=torch.device("cuda"), budget=True))
    others = candidates(Net(), device="cpu")
    assert on_device.overlaps(on_cpu) and others and not any(on_device.overlaps(c) for c in others)
    # Their savings do not add: a budget neither reaches alone is not "reached" by both.
    effects = [Effect(on_device, 200.0, 1.0), Effect(on_cpu, 300.0, 5.0)]
    assert [e.candidate for e in _search(effects, 1000.0, 10.0, 600.0, None)] == [on_cpu]


def test_an_answer_that_steps_in_backward_says_which_terms_it_cut_and_that_its_options_are_defaults():
    from shrinkwrap.autoplan import _bill_cut
    from shrinkwrap.report import Row

    x = torch.randn(8, 3, 16, 16)
    plan = sw.Plan.parse("step_in_backward(torch.optim.AdamW)")
    base = Row(sw.Plan(), sw.measure(Net(), x, iterations=1, warmup=1), role="baseline")
    final = Row(plan, sw.measure(sw.apply(Net(), plan), x, iterations=1, warmup=1), role="chosen")
    cut, options = _bill_cut(base, final)
    grads = base.profile.gradients / 2**20
    assert cut == f"the answer cuts more than activations: gradients {grads:.1f} -> 0.0 MiB" and grads > 0
    assert "options={'lr': ...}" in options and "sw.optimizer(model)" in options
    assert _bill_cut(base, base) == [] and _bill_cut(base, Row(sw.Plan.parse("swish()"), base.profile)) == []


def test_a_gpu_parameter_s_state_on_the_cpu_steps_with_the_fused_one_optimizer_to_rounding():
    from shrinkwrap.transforms.optimizer.cpu import _one_optimizer
    from shrinkwrap.transforms.optimizer.lowbit import LowBitAdamW

    options = {"lr": 1e-3, "weight_decay": 0.01, "foreach": False}
    torch.manual_seed(0)
    a = torch.randn(1000, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    fused, single = _one_optimizer(torch.optim.AdamW, a, options, fused=True), _one_optimizer(
        torch.optim.AdamW, b, options, fused=False)
    assert fused.defaults["fused"] and not single.defaults.get("fused")
    for _ in range(3):
        g = torch.randn(1000)
        a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        single.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # A class without a fused form takes the options as given.
    for cls in (torch.optim.RMSprop, LowBitAdamW):
        opt = _one_optimizer(cls, torch.zeros(4, requires_grad=True), {"lr": 0.1}, fused=True)
        assert type(opt) is cls and not opt.defaults.get("fused")
