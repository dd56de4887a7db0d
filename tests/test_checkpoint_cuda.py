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
