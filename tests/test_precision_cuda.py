"""On the GPU: autocast and half on torchvision resnet18 at batch 128, Adam."""

import gc

import pytest
import torch
import torch.nn.functional as F

import shrinkwrap as sw
from shrinkwrap.measuring import measure

pytestmark = pytest.mark.cuda


def _resnet18():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return tv.models.resnet18().cuda()


def _batch(n=128):
    torch.manual_seed(1)
    return torch.randn(n, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (n,), device="cuda")


PLANS = {
    "fp32": "",
    "autocast(bf16)": "autocast(torch.bfloat16)",
    "checkpoint(layer[1-4]) + autocast(bf16)": "checkpoint('layer[1-4]'), autocast(torch.bfloat16)",
}


@pytest.fixture(scope="module")
def peaks():
    # Tests before these in the process may hold CUDA memory (compiled graphs keep their models'
    # weights; 7.5 GiB in a full `-m cuda` run): each peak is counted from what was allocated
    # before its model was built, so it is the model's own (its weights, optimizer, activations).
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    x, y = _batch()
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    peaks = {}
    # A first measurement allocates cuBLAS and cuDNN workspaces that stay: made here, they count
    # in no row's peak rather than in the first row's only.
    measure(_resnet18(), x, loss_fn=loss, optimizer=torch.optim.Adam, warmup=1, iterations=1)
    gc.collect()
    torch.cuda.empty_cache()
    for label, plan in PLANS.items():
        held = torch.cuda.memory_allocated()  # what the process holds besides this model
        model = sw.apply(_resnet18(), plan) if plan else _resnet18()  # each on a fresh model
        # measure: warm-up steps, then gc, empty_cache, reset_peak_memory_stats, synchronise, one step
        peaks[label] = measure(model, x, loss_fn=loss, optimizer=torch.optim.Adam, warmup=3).peak - held
        del model
        gc.collect()
        torch.cuda.empty_cache()
    base = peaks["fp32"]
    print(f"\nresnet18 @128, one Adam step, on {torch.cuda.get_device_name()} torch {torch.__version__}:")
    for label, peak in peaks.items():
        print(f"  {label:42s} peak {peak / 2**20:7.0f} MiB  {peak / base:.3f}x")
    return peaks


def test_resnet18_autocast_peak(peaks):
    assert peaks["autocast(bf16)"] / peaks["fp32"] <= 0.65


# Each peak is the model's own (weights, optimizer, activations), counted from what the process
# held after a first measurement made cuBLAS's and cuDNN's workspaces. Measured on an H100
# (2026-11-23): 1399 / 2835 MiB = 0.494x. Whole-process peaks of a fresh process, which count those
# workspaces (about 139 MiB) in every row, read 1538 / 2974 MiB = 0.517x.
def test_resnet18_checkpoint_and_autocast_peak(peaks):
    assert peaks["checkpoint(layer[1-4]) + autocast(bf16)"] / peaks["fp32"] <= 0.50


def test_resnet18_half_float16_trains_20_steps_without_nan():
    model = sw.apply_half(_resnet18(), torch.float16)
    assert model.conv1.weight.dtype == torch.float16 and model.bn1.weight.dtype == torch.float32
    # Adam's default eps=1e-8 rounds to 0 in float16 (the smallest subnormal is 6e-8): wherever a
    # squared gradient underflows to 0, the update divides by zero and the weights turn inf/NaN on
    # the first step (seen on CPU). 1e-4 is representable. No GradScaler: it refuses float16 grads.
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    x, y = _batch()  # float32 images: the half model casts them on the way in
    losses = []
    for _ in range(20):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"\nresnet18 half(float16) @128 on {torch.cuda.get_device_name()}: losses {[round(v, 3) for v in losses]}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]
