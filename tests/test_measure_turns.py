"""Timing plans in turns with the baseline, forward times, and gradients given back after a row."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw


pytestmark = pytest.mark.usefixtures("one_thread")


def test_time_interleaved_takes_turns_and_restores_the_models():
    order = []
    models = {}
    for name in "abc":
        model = nn.Linear(4, 4)
        model.register_forward_hook(lambda m, i, o, name=name: order.append(name))
        models[name] = model
    before = {n: m.weight.detach().clone() for n, m in models.items()}
    timings = sw.time_interleaved(models, torch.randn(2, 4), sw.Options(device="cpu", warmup=1), rounds=3, per_round=2)
    assert order[:3] == ["a", "b", "c"]                          # warm-up
    rounds = order[3:]
    assert rounds == list("aabbcc" + "bbccaa" + "ccaabb")        # turns, with a new first each round
    assert all(len(t.rounds_ms) == 3 and t.median > 0 and t.spread >= 0 for t in timings.values())
    assert all(torch.equal(models[n].weight, before[n]) for n in models)


def test_time_interleaved_goes_on_round_by_round_until_told_and_no_further_than_the_most():
    models = {"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}
    seen = []

    def until(timings):
        seen.append(len(timings["a"].rounds_ms))
        return len(seen) == 4

    opts = sw.Options(device="cpu", warmup=1)
    told = []  # each round as it ends
    timings = sw.time_interleaved(models, torch.randn(2, 4), opts, rounds=2, per_round=1, until=until, max_rounds=9,
                                  progress=lambda r: told.append((r, len(seen))))
    assert seen == [2, 3, 4, 5] and all(len(t.rounds_ms) == 5 for t in timings.values())
    assert told == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
    capped = sw.time_interleaved(models, torch.randn(2, 4), opts, rounds=2, per_round=1, until=lambda t: False,
                                 max_rounds=4)
    assert all(len(t.rounds_ms) == 4 for t in capped.values())


def test_a_plan_timed_against_the_baseline_runs_rounds_of_per_round_iterations_whatever_the_options_say():
    """Rounds of PER_ROUND iterations of each model (the options' iterations are a row's), after
    each model's warm-up, five rounds at least."""
    from shrinkwrap.measuring.ratios import PER_ROUND, timed_against

    calls = []

    def loss(out):
        calls.append(out.shape[-1])
        return out.mean()

    base, plan = nn.Linear(4, 3), nn.Linear(4, 5)
    opts = sw.Options(loss_fn=loss, device="cpu", warmup=2, iterations=7)
    b, p = timed_against(base, plan, torch.randn(2, 4), opts, max_slowdown=1.0)
    rounds = len(b.rounds_ms)
    assert PER_ROUND == 3 and rounds == len(p.rounds_ms) >= 5
    assert calls.count(3) == calls.count(5) == 2 + rounds * PER_ROUND


def test_forward_times_reads_each_modules_forward_once_per_iteration_not_its_recompute():
    import time

    from shrinkwrap.measuring.turns import forward_times

    class Slow(nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds, self.lin = seconds, nn.Linear(4, 4)

        def forward(self, x):
            time.sleep(self.seconds)
            return torch.tanh(self.lin(x))

    # The recompute in backward runs 0.0 to its end again (what 0.1 and 0.2 saved comes after it): not a forward.
    model = nn.Sequential(nn.Sequential(Slow(0.03), nn.Linear(4, 4), nn.Tanh()), Slow(0.0), nn.Linear(4, 1))
    sw.apply_checkpoint(model, "0")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ms = forward_times(model, torch.randn(8, 4), sw.Options(device="cpu", warmup=1, iterations=3))
    assert 30 <= ms["0.0"] < 60 and ms["1"] < 30 and ms["2"] < 30  # counted twice it would be 60 and more
    assert ms["0"] >= ms["0.0"] and ms[""] >= ms["0"] + ms["1"] + ms["2"]  # a module holds its children
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # restored


def test_restored_gives_gradients_back_without_holding_them_meanwhile():
    import weakref

    from shrinkwrap.measuring.restore import restored

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model(torch.randn(2, 4)).sum().backward()
    weight, grads = model.weight.detach().clone(), [p.grad.clone() for p in model.parameters()]
    seen = weakref.ref(model.weight.grad)
    with restored(model):
        model.zero_grad(set_to_none=True)
        assert seen() is None  # the measured model's memory does not include the old gradients
        model.double()  # a measurement may change dtypes and devices; they come back
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight, weight)
    for p, g in zip(model.parameters(), grads):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, g)
