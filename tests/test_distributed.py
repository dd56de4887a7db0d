"""shrinkwrap under FSDP2 (``fully_shard``) and DDP, on two ranks (tests/distributed.py).

A plan applied before sharding or replicating trains as the same setup without the plan: losses,
gradients (gathered: ``full_tensor()``), parameters and BatchNorm statistics after two SGD steps,
each rank with its own batch. Tolerances as the single-process suites: checkpoint bit for bit
(float64); bn_act to float64 rounding (``FUSED``: its backward recomputes the BatchNorm output in
another order of operations). autocast (the model in float32): losses, and the parameters and
statistics as a whole, to bfloat16 rounding (``TOL_BF16``, relative) or as close as
``torch.autocast`` by hand comes, where the GPU's bf16 kernels move it further; gradients are not compared
with float32's (on this small BatchNorm net bf16 moves them 10-20% in one process too: BatchNorm's
backward cancels), but with every rank given the same batch, the plan under FSDP or DDP trains bit
for bit as the same plan in one process: the engine adds nothing to what the plan computes.
state_dict keys are the plain model's, a torch.distributed.checkpoint of the sharded transformed
model loads into the sharded plain one and the reverse, and a plan after ``fully_shard`` is
refused. ``measure`` and ``plan_report`` report every rank.

Every test runs on the CPU through gloo (CI), and the same body through NCCL on two GPUs
(``-m multigpu``; skipped with fewer than two). SyncBatchNorm runs only on GPUs (torch raises for
CPU tensors): its test is NCCL only.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shrinkwrap as sw
from distributed import Ranks, device
from equivalence import F64, Case, Trace, assert_same, train
from shrinkwrap import parallel
from shrinkwrap._wrapper import unwrap
from toymodels import Net

FUSED = dict(rtol=1e-9, atol=1e-10)
TOL_BF16 = 2e-2  # the relative error the precision module documents for bfloat16
BLOCKS = r"layer\d"  # fully_shard each of Net's three blocks, then the root

# The plans, with the dtype they are checked in and the tolerance (None: bit for bit).
PLANS = {
    "checkpoint": ("checkpoint(r'layer[123]')", F64, None),
    "bn_act": ("bn_act()", F64, FUSED),
    "checkpoint+bn_act": ("checkpoint(r'layer[12]'), bn_act()", F64, FUSED),
    "autocast": ("autocast(torch.bfloat16)", torch.float32, "bf16"),
    "checkpoint+autocast": ("checkpoint(r'layer[123]'), autocast(torch.bfloat16)", torch.float32, "bf16"),
}


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.multigpu)],
                ids=["gloo", "nccl"])
def ranks(request):
    with Ranks(request.param) as r:
        yield r


# -- run on the ranks ---------------------------------------------------------------------------


def net(dtype: torch.dtype = F64, seed: int = 0, sync_bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(device(), dtype)


def batch(dtype: torch.dtype, same: bool = False) -> dict:
    """Each rank its own images (``same``: every rank the same)."""
    gen = torch.Generator().manual_seed(1 + (0 if same else torch.distributed.get_rank()))
    return {"x": torch.randn(4, 3, 8, 8, generator=gen, dtype=dtype).to(device())}


def loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, torch.arange(out.shape[0], device=out.device) % out.shape[1])


def case(dtype: torch.dtype, same: bool = False) -> Case:
    return Case(functools.partial(net, dtype), functools.partial(batch, dtype, same), loss, BLOCKS, 3)


WRAPS = {
    "fsdp": functools.partial(parallel.fsdp, blocks=BLOCKS),
    "ddp": parallel.ddp,
}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered from every rank), on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def gathered(trace: Trace) -> Trace:
    """The trace with whole tensors on the CPU, named as in the model itself (not DDP's ``module.``)."""
    def names(d: dict) -> dict:
        return {n.removeprefix("module."): full(t) for n, t in d.items()}

    return Trace([full(t) for t in trace.losses], [names(step) for step in trace.grads], names(trace.state))


class HandAutocast(Net):
    """Net with ``torch.autocast(bfloat16)`` around its forward, as a user writes it by hand."""

    def forward(self, x, scale=1.0):
        with torch.autocast(device().type, torch.bfloat16):
            return super().forward(x, scale)


def bf16_error(ref: Trace, got: Trace) -> float:
    """How far ``got`` trained from ``ref``: the largest relative error of a loss, and of the
    parameters and statistics after training as a whole. The gradient names must be the same and
    the integers (num_batches_tracked) equal."""
    assert [list(g) for g in ref.grads] == [list(g) for g in got.grads] and list(ref.state) == list(got.state)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (torch.linalg.norm((b - a).double()) / torch.linalg.norm(a.double())).item()

    floats = [n for n, t in ref.state.items() if t.is_floating_point()]
    assert all(torch.equal(ref.state[n], got.state[n]) for n in ref.state if n not in floats)
    whole = err(torch.cat([ref.state[n].flatten() for n in floats]), torch.cat([got.state[n].flatten() for n in floats]))
    return max([whole, *(err(a, b) for a, b in zip(ref.losses, got.losses))])


def trains_like_without_the_plan(wrap: str, plan: str, dtype: torch.dtype, tol) -> None:
    c = case(dtype)
    plain = WRAPS[wrap](net(dtype))
    transformed = WRAPS[wrap](sw.apply(net(dtype), plan))
    assert list(transformed.state_dict()) == list(plain.state_dict())
    ref, got = gathered(train(plain, c)), gathered(train(transformed, c))
    if tol != "bf16":
        assert_same(ref, got, **(tol or {}))
        return
    # Within bfloat16 rounding of float32, or, where the GPU's bfloat16 kernels move this small
    # BatchNorm net further (2.1% on two H200s, 0.4% on the CPU), as close as autocast by hand.
    torch.manual_seed(0)
    hand = gathered(train(WRAPS[wrap](HandAutocast().to(device(), dtype)), c))
    error, hand_error = bf16_error(ref, got), bf16_error(ref, hand)
    assert 0 < error <= max(TOL_BF16, 1.25 * hand_error), (error, hand_error)
    same = case(dtype, same=True)
    alone = train(sw.apply(net(dtype), plan), same)  # this rank by itself, no collective
    assert_same(gathered(alone), gathered(train(WRAPS[wrap](sw.apply(net(dtype), plan)), same)))


def sync_batchnorm_statistics_match() -> None:
    c = case(F64)
    c = Case(functools.partial(net, F64, sync_bn=True), c.batch, loss, BLOCKS, 3)
    plain = parallel.ddp(c.build())
    transformed = parallel.ddp(sw.apply(c.build(), "checkpoint(r'layer[123]')"))
    ref, got = gathered(train(plain, c)), gathered(train(transformed, c))
    assert_same(ref, got)
    stats = [n for n in got.state if "running_" in n or "num_batches" in n]
    assert stats and all(int(got.state[n]) == 2 for n in stats if n.endswith("num_batches_tracked"))
    # SyncBatchNorm statistics are the batch of every rank: the same on each rank.
    mean = got.state["layer1.bn1.running_mean"].to(device())
    others = [torch.empty_like(mean) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(others, mean)
    assert all(torch.equal(o, mean) for o in others)


def checkpoint_loads_both_ways(directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    def state(model):
        return {n: full(t) for n, t in model.state_dict().items()}

    def save_then_load(source, target, path):
        dcp.save(get_model_state_dict(source), checkpoint_id=path)
        sd = get_model_state_dict(target)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(target, sd)
        assert_same_state(state(source), state(target))

    def assert_same_state(a, b):
        assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)

    # Trained (parameters changed, running statistics moved) on the same batch on every rank:
    # FSDP2 leaves buffers unsharded and does not synchronise them, and DCP saves one rank's copy.
    shard, same = WRAPS["fsdp"], case(F64, same=True)
    transformed = shard(sw.apply(net(seed=0), "checkpoint(r'layer[123]'), bn_act()"))
    train(transformed, same, (0,))
    plain = shard(net(seed=1))
    save_then_load(transformed, plain, f"{directory}/transformed")
    train(plain, same, (1,))
    again = shard(sw.apply(net(seed=2), "checkpoint(r'layer[123]'), bn_act()"))
    save_then_load(plain, again, f"{directory}/plain")


def plan_after_fully_shard_is_refused() -> None:
    for plan in ("checkpoint(r'layer[123]')", "bn_act()", "autocast(torch.bfloat16)"):
        model = WRAPS["fsdp"](net())
        before = [(n, type(m)) for n, m in model.named_modules()]
        with pytest.raises(ValueError, match=r"fully_shard already manages the root, 'layer1'.*"
                                             r"Apply the plan first, then shard"):
            sw.apply(model, plan)
        assert [(n, type(m)) for n, m in model.named_modules()] == before and not sw.records(model)
    transformed = WRAPS["fsdp"](sw.apply(net(), "checkpoint(r'layer[123]')"))
    with pytest.raises(ValueError, match="cannot revert .*Revert before sharding"):
        sw.revert(transformed)
    assert isinstance(transformed.layer1, sw.CheckpointModule)


def why_the_order_matters() -> tuple[str, str]:
    """What the refusal prevents: a wrapper put around a block after fully_shard (as checkpoint
    would) hides the block from FSDP, which keeps its parameters unsharded after forward; the
    plan first, FSDP reshards them. Returns the parameter types after forward, in that order."""
    x = batch(F64)["x"]

    def after_forward(model):
        model(x)
        return type(unwrap(model.layer1).conv1.weight).__name__

    late = WRAPS["fsdp"](net())
    sw._rewrite.set_module(late, "layer1", sw.CheckpointModule(late.layer1, name="layer1"))  # apply's refusal bypassed
    first = WRAPS["fsdp"](sw.apply(net(), "checkpoint(r'layer1')"))
    return after_forward(late), after_forward(first)


def measured(wrap: str) -> tuple[sw.Profile, int, int]:
    """measure on every rank; also the bytes of what this rank holds of the parameters and buffers,
    and of the whole model. Training after measuring equals training a model never measured."""
    c = case(F64)
    model = WRAPS[wrap](sw.apply(net(), "checkpoint(r'layer[123]')"))
    profile = sw.measure(model, batch(F64), iterations=1, warmup=1, device=device())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in (*model.parameters(), *model.buffers())]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())  # padding too
    whole = sum(t.nbytes for t in (*net().parameters(), *net().buffers()))
    fresh = WRAPS[wrap](sw.apply(net(), "checkpoint(r'layer[123]')"))
    ref, got = gathered(train(fresh, c)), gathered(train(model, c))
    assert_same(ref, got)
    return profile, held, whole


def reported(wrap: str) -> dict:
    report = sw.plan_report("checkpoint(r'layer[123]'), bn_act()", functools.partial(net, F64), batch(F64),
                            iterations=1, warmup=1, device=device(), parallelize=WRAPS[wrap])
    return report.to_dict()


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("name", PLANS)
def test_a_plan_applied_before_sharding_or_replicating_trains_like_without_it(ranks, wrap, name):
    plan, dtype, tol = PLANS[name]
    ranks.run(trains_like_without_the_plan, wrap, plan, dtype, tol)


def test_sync_batchnorm_statistics_under_ddp_with_checkpointing(ranks):
    with pytest.raises(ValueError, match="SyncBatchNorm has a forward of its own"):
        sw.apply(nn.SyncBatchNorm.convert_sync_batchnorm(Net()), "bn_act()")  # fusing would drop the sync
    if ranks.kind == "cpu":
        pytest.skip("SyncBatchNorm runs on GPUs only: torch raises for CPU tensors")
    ranks.run(sync_batchnorm_statistics_match)


def test_a_distributed_checkpoint_of_the_transformed_model_loads_into_the_plain_one_and_back(ranks, tmp_path):
    ranks.run(checkpoint_loads_both_ways, str(tmp_path))


def test_a_plan_after_fully_shard_is_refused_and_says_to_apply_it_first(ranks):
    ranks.run(plan_after_fully_shard_is_refused)


def test_why_a_plan_goes_before_fully_shard(ranks):
    late, first = ranks.run(why_the_order_matters)[0]
    assert (late, first) == ("Parameter", "DTensor")


@pytest.mark.parametrize("wrap", WRAPS)
def test_measure_on_every_rank_gathers_every_ranks_profile(ranks, wrap):
    results = ranks.run(measured, wrap)
    for rank, (profile, held, whole) in enumerate(results):
        assert profile.rank == rank and [p.rank for p in profile.ranks] == [0, 1]
        assert not any(p.ranks for p in profile.ranks)
        assert profile.ranks[rank].saved == profile.saved and profile.saved > 0
        assert profile.parameters == held and (held < whole if wrap == "fsdp" else held == whole)  # shards
        assert "rank 1: " in str(profile)
    if ranks.kind == "cuda":
        assert all(p.peak is not None for p in results[0][0].ranks)


@pytest.mark.parametrize("wrap", WRAPS)
def test_plan_report_on_every_rank_shows_every_rank(ranks, wrap):
    data = ranks.run(reported, wrap)[0]
    assert data["world_size"] == 2 and [r["step"] for r in data["rows"]] == [
        "baseline", "checkpoint('layer[123]')", "bn_act()"]
    for row in data["rows"]:
        assert [q["rank"] for q in row["ranks"]] == [0, 1] and row["rank"] == 0
        assert row["value_mib"] == max(q["value_mib"] for q in row["ranks"])
    assert data["rows"][1]["value_mib"] < data["rows"][0]["value_mib"]
    assert data["rows"][1]["matched"] == ["layer1", "layer2", "layer3"]


def small_model() -> nn.Module:
    """A factory for `profile test_distributed:small_model`."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4))


def test_profile_command_starts_the_ranks_and_rank_0_prints_every_ranks_figures(capfd):
    from shrinkwrap.cli import main

    argv = ["profile", f"{__name__}:small_model", "--batch", "2", "--input", "3,8,8", "--plan", "checkpoint(r'[34]')",
            "--iterations", "1", "--device", "cpu", "--nproc", "2", "--fsdp", "--json", "-"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    data = json.loads(out)  # one report: rank 0's, and nothing from rank 1
    assert data["world_size"] == 2 and [r["step"] for r in data["rows"]] == ["baseline", "checkpoint('[34]')"]
    assert all([q["rank"] for q in r["ranks"]] == [0, 1] for r in data["rows"])


# -- the optimizer step inside backward -----------------------------------------------------------


def _trained_in_backward(wrap: str) -> tuple[list, list] | str:
    """The plain sharded or replicated model with AdamW, and the same with the step in backward:
    every parameter, gathered, after three steps; under DDP the message it refuses with."""
    plain, model = net(F64), net(F64)
    sw.apply(model, "step_in_backward(torch.optim.AdamW, options={'lr': 0.01})")
    handle = sw.optimizer(model)
    plain, model = WRAPS[wrap](plain), WRAPS[wrap](model)
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01, foreach=False)
    b = batch(F64)
    for m, o in ((plain, opt), (model, handle)):
        for step in range(3):
            torch.manual_seed(step)  # dropout: the same masks for both
            o.zero_grad()
            try:
                loss(m(**b)).backward()
            except RuntimeError as exc:
                return str(exc)
            o.step()
    return [full(p) for p in plain.parameters()], [full(p) for p in model.parameters()]


def test_the_step_in_backward_under_fsdp2_trains_as_the_plain_sharded_model(ranks):
    for result in ranks.run(_trained_in_backward, "fsdp"):
        assert not isinstance(result, str), result
        plain, stepped = result
        assert len(plain) == len(stepped) and all(torch.equal(a, b) for a, b in zip(plain, stepped))


def _low_bit_sharded() -> str | None:
    """What LowBitAdamW in backward says under FSDP2 at the first backward, or None."""
    model = net(F64)
    sw.apply(model, "step_in_backward(shrinkwrap.LowBitAdamW, options={'lr': 0.01})")
    handle, model = sw.optimizer(model), WRAPS["fsdp"](model)
    try:
        loss(model(**batch(F64))).backward()
        handle.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_low_bit_adamw_under_fsdp2_is_refused_naming_the_step(ranks):
    for said in ranks.run(_low_bit_sharded):
        assert isinstance(said, str) and "shrinkwrap: LowBitAdamW" in said and "fully_shard" in said, said


def test_the_step_in_backward_under_ddp_is_refused(ranks):
    for said in ranks.run(_trained_in_backward, "ddp"):
        assert isinstance(said, str) and "before DDP averages it across ranks" in said, said
