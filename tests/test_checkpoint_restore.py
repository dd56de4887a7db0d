"""What a region's recompute puts back: buffers it changes in forward match the plain model, or are named."""

import copy

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw


class _RunningVar(nn.Module):
    """As timm's EvoNorm2dB0: a running variance updated in forward that the output does not read
    in training."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_var", torch.ones(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.var(dim=(0, 2, 3), keepdim=True)
        with torch.no_grad():
            self.running_var.mul_(0.9).add_(0.1 * var)
        return x / (var + 1e-5).sqrt()


class _DataEMA(nn.Module):
    """As an EMA codebook: a buffer written through ``.data`` (no version bump) and read by the output."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.data = 0.9 * self.ema.data + 0.1 * x.detach().mean(dim=(0, 2, 3), keepdim=True)
        self.ema.data.mul_(1.5)
        return x * self.ema


def _buffer_models() -> dict:
    def net(last: nn.Module) -> nn.Module:  # a block to checkpoint, and a head
        return nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.SiLU(), last), nn.Conv2d(4, 2, 1))
    return {
        "running_var": lambda: net(_RunningVar(4)),
        "data_ema": lambda: net(_DataEMA(4)),
        "spectral_norm": lambda: net(nn.utils.spectral_norm(nn.Conv2d(4, 4, 3))),
        "parametrizations.spectral_norm": lambda: net(nn.utils.parametrizations.spectral_norm(nn.Conv2d(4, 4, 3))),
    }


@pytest.mark.parametrize("kind", list(_buffer_models()))
@pytest.mark.parametrize("region", [dict(pattern="0"), dict(pattern=r"0\.\d", chain=True),
                                    dict(pattern="0", save=("conv",))])
def test_buffers_a_region_changes_in_forward_match_the_plain_model(kind, region):
    # A spectral norm's power iteration reads and advances its vectors in every training forward: the
    # recompute must start from the forward's vectors (else another weight, other gradients) and
    # not advance them again; a running variance must be counted once.
    torch.manual_seed(0)
    ref = _buffer_models()[kind]().double()
    model = sw.apply(copy.deepcopy(ref), sw.checkpoint(**region))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for step in range(3):  # a chain's first forward runs plainly; then checkpointed
        for m in (ref, model):
            m.zero_grad()
            m(x).square().sum().backward()
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a.grad, b.grad), (step, n)
        for (n, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):
            assert torch.equal(a, b), (step, n)


def test_a_buffer_changed_at_some_forwards_only_is_exact():
    class EveryOther(_RunningVar):  # updates its running variance at every other forward
        def __init__(self, channels):
            super().__init__(channels)
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.calls += 1
            return super().forward(x) if int(self.calls) % 2 else x / 2

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), EveryOther(4)), nn.Conv2d(4, 2, 1)).double()
    model = sw.apply(copy.deepcopy(ref), sw.checkpoint("0"))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for step in range(4):
        for m in (ref, model):
            m.zero_grad()
            m(x).square().sum().backward()
        assert torch.equal(ref[0][1].running_var, model[0][1].running_var), step
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters())), step


def test_a_buffer_first_changed_in_a_later_forward_is_named():
    class Sometimes(_RunningVar):
        on = False

        def forward(self, x):
            return super().forward(x) if self.on else x

    model = sw.apply(nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), Sometimes(4)), nn.Conv2d(4, 2, 1)).double(),
                     sw.checkpoint("0"))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    model(x).sum().backward()
    model[0][1].on = True
    with pytest.raises(RuntimeError, match=r"module '0' changed '0\.1\.running_var' in this forward"):
        model(x)
    fresh = copy.deepcopy(model)  # a copy learns again: its first forward copies every buffer
    fresh(x).sum().backward()
