"""shrinkwrap.estimate: a training iteration's CUDA peak predicted on the CPU with fake tensors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.cli import main

MiB = 2**20
WIDTH, BATCH, DEPTH = 256, 512, 6


def mlp() -> nn.Module:
    """``DEPTH`` blocks of three Linear + Tanh layers, then a head."""
    def block():
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    return nn.Sequential(nn.Sequential(*[block() for _ in range(DEPTH)]), nn.Linear(WIDTH, 1))


def test_the_static_terms_are_the_model_s_own_bytes():
    est = sw.estimate(mlp, torch.randn(BATCH, WIDTH))
    params = sum(p.numel() * 4 for p in mlp().parameters())
    assert est.parameters == params
    assert est.optimizer_state >= 2 * params  # AdamW's two moments (and its step counts)
    assert est.peak == sum(est.breakdown().values())
    # Each Tanh keeps its output (the next Linear's input): 3 x depth activations of batch x width.
    assert est.activations >= 3 * DEPTH * BATCH * WIDTH * 4


def test_a_plan_s_saving_shows_in_the_estimate_and_what_it_cannot_see_is_said():
    batch = torch.randn(BATCH, WIDTH)
    # Each block recomputed from its input: one tensor kept a block, and one block's recompute.
    plain, checkpointed = sw.estimate(mlp, batch), sw.estimate(mlp, batch, r"checkpoint(r'0\.\d')")
    assert checkpointed.activations < 0.6 * plain.activations
    assert checkpointed.parameters == plain.parameters
    compiled = sw.estimate(mlp, batch, "compile(backend='eager')")
    assert any("compile() is estimated as eager" in n for n in compiled.notes)


def test_attention_is_estimated_as_a_fused_kernel_keeps_it():
    class Attention(nn.Module):
        def forward(self, x):
            q = x.view(4, 8, 256, 32)
            return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True).sum()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.attn = nn.Linear(256, 256), Attention()

        def forward(self, x):
            return self.attn(self.proj(x))

    est = sw.estimate(Model, torch.randn(4, 256, 256))
    probabilities = 4 * 8 * 256 * 256 * 4  # batch x heads x length x length floats
    assert est.activations < probabilities, est


def test_the_command_prints_and_writes_json(capsys, tmp_path):
    assert main(["estimate", "shrinkwrap.models:tiny_efficientnet", "--batch", "4", "--plan", "swish()",
                 "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "estimated CUDA peak of a training iteration" in out and "plan: swish()" in out
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["schema"] == "shrinkwrap.estimate/1" and data["peak_mib"] > data["parameters_mib"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("plan", ["", "checkpoint(r'layer[1-4]'), autocast(torch.bfloat16)"])
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(plan):
    torchvision = pytest.importorskip("torchvision")
    batch = torch.randn(64, 3, 224, 224)
    est = sw.estimate(torchvision.models.resnet18, batch, plan)
    model = sw.apply(torchvision.models.resnet18(), plan)
    held = torch.cuda.memory_allocated()  # not this model's: what the process held before
    peak = sw.measure(model, batch, device="cuda").peak - held
    assert abs(est.peak - peak) <= 0.10 * peak, (est.peak / MiB, peak / MiB, held / MiB)


def test_the_step_in_backward_is_estimated_with_its_handle_and_no_gradient_term():
    # A wide model at a batch of 8: parameters, gradients and state are the bill, and the plain
    # loop's peak is its optimizer step with every gradient held.
    def wide():
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    batch = torch.randn(8, 1024)
    plain = sw.estimate(wide, batch)
    stepped = sw.estimate(wide, batch, "step_in_backward(torch.optim.AdamW)")
    grads = sum(p.numel() * 4 for p in wide().parameters())
    assert plain.gradients == grads
    # Each gradient is dropped once its bucket is stepped: at most a bucket and one parameter's are
    # alive (a bucket: a sixteenth of the gradients here, 2 MiB).
    from shrinkwrap.transforms.optimizer.backward import _SHARE

    assert stepped.gradients <= grads // _SHARE + max(p.numel() * 4 for p in wide().parameters())
    assert stepped.peak <= plain.peak - 0.9 * grads, (stepped, plain)
    with pytest.raises(ValueError, match="shrinkwrap: estimate\\(\\) cannot model step_in_backward\\(state='cpu'\\)"):
        sw.estimate(wide, batch, "step_in_backward(torch.optim.AdamW, state='cpu')")
