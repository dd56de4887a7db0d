"""On the GPU: checkpointing resnet152's layer1 and layer2 cuts the training peak (foundation issue)."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

import shrinkwrap as sw

pytestmark = pytest.mark.cuda


def _resnet152():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return tv.models.resnet152().cuda()


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(1)
    return torch.randn(64, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (64,), device="cuda")


def test_resnet152_layer12_peak(batch):
    # Measured first, on fresh models, before anything else in this module holds GPU memory.
    loss = lambda out: F.cross_entropy(out, batch[1])  # noqa: E731
    base = sw.measure(_resnet152(), batch[0], loss_fn=loss, optimizer=torch.optim.Adam)
    gc.collect()
    torch.cuda.empty_cache()
    ckpt = sw.measure(sw.apply(_resnet152(), "checkpoint('layer[12]')"), batch[0], loss_fn=loss,
                      optimizer=torch.optim.Adam)
    ratio = ckpt.peak / base.peak
    print(
        f"\nresnet152 @64 on {torch.cuda.get_device_name()} torch {torch.__version__}: "
        f"peak {base.peak / 2**20:.0f} MiB -> {ckpt.peak / 2**20:.0f} MiB ({ratio:.3f}x); "
        f"step {base.step_ms:.1f} ms -> {ckpt.step_ms:.1f} ms"
    )
    assert ratio <= 0.70


def test_resnet152_layer12_batchnorm_statistics(batch):
    ref = _resnet152()
    model = sw.apply(copy.deepcopy(ref), sw.Plan([sw.checkpoint(r"layer[12]")]))
    # Three identical training steps on each; the statistics must agree. cuDNN's weight gradients
    # are not bit-deterministic, so later steps' inputs differ in the last bits: rtol 1e-4.
    for m in (ref, model):
        opt = torch.optim.Adam(m.parameters(), lr=1e-4)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(batch[0]), batch[1]).backward()
            opt.step()
    for (name, b_ref), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
        if name.endswith("num_batches_tracked"):
            assert b.item() == b_ref.item() == 3, name
        else:
            torch.testing.assert_close(b, b_ref, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("keep_random", [False, True], ids=["as-built", "if-random-calls-were-kept"])
def test_a_fused_attention_with_dropout_is_recomputed_not_kept(monkeypatch, keep_random):
    """checkpoint(save=('attention',)) on a GPU, where attention is a fused kernel drawing its
    dropout: the region recomputes it, so the dropout after it draws the forward's mask and the
    gradients are the plain regions'. Keeping it (the rule switched off) shifts the random stream
    and changes them: the comparison has teeth."""
    from shrinkwrap.transforms import checkpoint as ckpt_mod

    transformers = pytest.importorskip("transformers")
    from equivalence import OpCounter

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128,
                                     attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).cuda().train()
    if keep_random:
        monkeypatch.setattr(ckpt_mod.save, "_draws", lambda *args: False)
    blocks = r"transformer\.h\.\d+"
    models = {"plain": sw.apply(copy.deepcopy(ref), sw.checkpoint(blocks)),
              "kept": sw.apply(copy.deepcopy(ref), sw.checkpoint(blocks, save=("matmul", "attention")))}
    ids = torch.randint(0, 128, (4, 64), device="cuda")
    grads = {}
    for name, model in models.items():
        torch.manual_seed(5)
        with OpCounter() as ops:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads[name] = [p.grad for p in model.parameters()]
    fused = sum(n for op, n in ops.count.items() if op.startswith("_scaled_dot_product_") and "cpu" not in op)
    assert fused == 2  # one fused, dropout-drawing attention call per block
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads["plain"], grads["kept"]))
    assert same is not keep_random
