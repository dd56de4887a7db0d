"""On a GPU: a configuration read at R trains under a cap a little above R and not under one well
below it, for an eager, a compiled, a CUDA-graphed and an offloaded plan; the graphed plan's
reading is replaced by its fit figure; autoplan's budgeted answer trained under the budget's cap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw

pytestmark = pytest.mark.cuda
MiB = 2**20


def resnet() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def batch() -> torch.Tensor:
    return torch.randn(64, 3, 112, 112, generator=torch.Generator().manual_seed(0))


BLOCKS = r"layer[1-4]"
PLANS = {
    "eager": "",
    "compiled": "compile()",
    "graphed": "compile(mode='reduce-overhead')",
    "offloaded": f"checkpoint(r'{BLOCKS}'), offload(r'{BLOCKS}')",
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_a_reading_agrees_with_the_cap_it_trains_under(kind):
    report = sw.compare.measure_plans(resnet, [sw.Plan.parse(PLANS[kind])], batch(), sw.Options(device="cuda"), fit=True)
    row = report.rows[0]
    p, fit = row.profile, row.fit
    assert fit is not None and fit.below is not None and fit.cap - fit.below <= fit.resolution
    # It trained under its cap, and under none well below its reading: the cap bites.
    assert fit.cap > p.static + 0.6 * (p.peak - p.static)
    if kind == "graphed":
        assert p.cuda_graphs and report.value(row) == fit.cap  # the fit figure stands for the reading
    else:
        assert fit.cap <= 1.10 * p.peak + 64 * MiB, (fit.cap / MiB, p.peak / MiB)
    assert sw.trains_under(resnet, batch(), fit.cap + fit.resolution, PLANS[kind]).ok


def test_autoplan_s_budgeted_answer_trained_under_the_budget_s_cap():
    # A budget bf16 plans reach with room: on an H100 (torch 2.11) exact steps read 0.79x of the
    # baseline's peak at most and that plan did not train under a cap of 0.85x; with bf16 one read
    # 0.64x and did not train under 0.65x (a reading is 1-9% under what training needs).
    plan, report = sw.autoplan(resnet, batch(), budget=0.8, max_slowdown=2.0, rounds=2, allow_lossy=True)
    assert any(n.startswith("fits in ") and "trained 8 iterations under a" in n for n in report.notes), \
        "\n".join(report.notes)
    chosen = next(r for r in report.rows if r.trained_under is not None)
    assert str(chosen.plan) == str(plan)
