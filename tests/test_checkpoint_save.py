"""Selective recompute (``checkpoint(pattern, save=...)``): the operators a region keeps, never a random one, the plan
text, and kept outputs through copies and backward."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.transforms import checkpoint as ckpt_mod

from equivalence import OpCounter
from checkpoint_helpers import run


# Selective recompute: checkpoint(save=...)
def _mlp_blocks(seed=0):
    torch.manual_seed(seed)
    block = lambda: nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.3),  # noqa: E731
                                  nn.Linear(64, 16))
    return nn.Sequential(*[block() for _ in range(3)], nn.Linear(16, 2)).double()


def _backward_ops(model, x):
    torch.manual_seed(3)
    loss = model(x).square().sum()
    with OpCounter() as ops:
        loss.backward()
    return ops.count


def test_saved_matmuls_are_not_recomputed_and_the_numbers_do_not_change():
    ref = _mlp_blocks()
    plain, kept = copy.deepcopy(ref), copy.deepcopy(ref)
    sw.apply_checkpoint(plain, r"[012]")
    sw.apply_checkpoint(kept, r"[012]", save=("matmul",))
    x = torch.randn(8, 16, dtype=torch.float64)
    for model in (plain, kept):
        out_r, g_r = run(ref, x, seed=7)
        out_m, g_m = run(model, x, seed=7)  # dropout on: the recompute draws the forward's masks
        assert torch.equal(out_r, out_m) and g_r.keys() == g_m.keys()
        assert all(torch.equal(g_r[n], g_m[n]) for n in g_r), [n for n in g_r if not torch.equal(g_r[n], g_m[n])]
    recomputed, saved = _backward_ops(plain, x), _backward_ops(kept, x)
    # The plain regions run each first Linear again in backward (the recompute stops before the
    # second, whose output is the region's); the kept ones run none.
    assert recomputed["addmm"] == 3 and "addmm" not in saved
    assert recomputed["native_layer_norm"] == saved["native_layer_norm"] == 3  # the rest is recomputed
    assert recomputed["bernoulli_"] == saved["bernoulli_"] == 3  # the dropout masks drawn again


def test_a_random_operator_is_never_kept():
    with pytest.raises(ValueError, match="draws random numbers"):
        sw.checkpoint("0", save=("native_dropout",))
    with pytest.raises(ValueError, match="neither one of 'matmul'"):
        sw.checkpoint("0", save=("matmull",))
    with pytest.raises(ValueError, match="breaks it into other operators"):  # never seen: kept nothing
        sw.checkpoint("0", save=("linear",))
    with pytest.raises(ValueError, match="in place"):  # always failed in backward
        sw.checkpoint("0", save=("relu_",))
    # A fused attention with dropout draws: recomputed even where 'attention' is kept; without it, kept.
    policy = ckpt_mod.save._save_policy
    ops = ckpt_mod.save_ops(("attention",))
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 1, 4, 8)
    kept = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    assert policy(ops, None, sdpa, q, q, q, 0.0) == kept
    assert policy(ops, None, sdpa, q, q, q, 0.1) != kept
    assert policy(ops, None, sdpa, q, q, q, dropout_p=0.1) != kept


def test_save_round_trips_as_text_and_a_chain_takes_it():
    step = sw.checkpoint(r"layer[12]", save="matmul")
    assert str(step) == "checkpoint('layer[12]', save=('matmul',))"
    assert sw.Plan.parse(str(sw.Plan([step]))).steps == (step,)
    from toymodels import resnet64

    ref = resnet64(stem_dropout=0.25).double()
    stem = r"conv1|bn1|relu|drop|maxpool"
    plain = sw.apply(copy.deepcopy(ref), sw.checkpoint(stem, chain=True))
    model = sw.apply(copy.deepcopy(ref), sw.checkpoint(stem, chain=True, save=("conv",)))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for _ in range(2):  # the first training forward checks the chain, the second runs it as one region
        out_r, g_r = run(ref, x, seed=4)
        out_m, g_m = run(model, x, seed=4)
        assert torch.equal(out_r, out_m) and all(torch.equal(g_r[n], g_m[n]) for n in g_r)
        run(plain, x)
    for m in (ref, model, plain):  # BatchNorm counted once per step, the recompute's put back
        assert m.bn1.num_batches_tracked.item() == 2
    assert torch.equal(model.bn1.running_var, ref.bn1.running_var)
    assert _backward_ops(plain, x)["convolution"] == 1 and "convolution" not in _backward_ops(model, x)


def test_a_model_keeping_outputs_pickles_copies_and_keeps_them_after():
    ref = _mlp_blocks()
    model = sw.apply(copy.deepcopy(ref), sw.checkpoint(r"[012]", save=("matmul",)))
    x = torch.randn(8, 16, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(model)), copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    for twin in copies:
        out_r, g_r = run(ref, x, seed=2)
        out_m, g_m = run(twin, x, seed=2)
        assert torch.equal(out_r, out_m) and all(torch.equal(g_r[n], g_m[n]) for n in g_r)
        assert "addmm" not in _backward_ops(twin, x)
    # The module itself takes names too.
    block = ckpt_mod.CheckpointModule(_mlp_blocks()[0], save=("matmul",))
    torch.manual_seed(0)
    block(x).sum().backward()  # warm
    with OpCounter() as ops:
        block(x).sum().backward()
    assert ops.count["addmm"] == 2  # the forward's two; none again in the recompute


def test_a_second_backward_through_a_keeping_region_is_torchs_own_error():
    model = sw.apply(_mlp_blocks(), sw.checkpoint("0", save=("matmul",)))
    loss = model(torch.randn(4, 16, dtype=torch.float64)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        loss.backward()


@pytest.mark.parametrize("chain", [False, True])
def test_a_kept_output_changed_in_place_is_named_in_backward(chain):
    # As timm's squeeze-excite: a convolution whose output an in-place activation overwrites.
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True)), nn.Conv2d(4, 2, 1))
    pattern = "0|1" if chain else "1"
    sw.apply(model.double(), sw.checkpoint(pattern, save=("conv",), chain=chain))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    if chain:
        model(x).sum().backward()  # a chain's first forward runs its members plainly, watching the parent
    with pytest.raises(RuntimeError, match=r"keeps the output .* In-place modules in it: 1\.1 \(ReLU\(inplace=True\)\)"):
        model(x).sum().backward()
