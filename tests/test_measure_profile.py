"""What a measured profile counts: saved tensors, the module log, CUDA peaks, graph pools and the optimizer's
state."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.measuring import ModuleLog, SavedTensors
from shrinkwrap.measuring import graphs

from measure_helpers import FAST, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def test_saved_tensors_live_count_falls_to_zero_after_backward():
    model, x = mlp(), torch.randn(16, 32)
    with SavedTensors() as saved:
        loss = model(x).sum()
        held = saved.live
        loss.backward()
    assert held == saved.bytes == saved.peak_live > 0
    assert saved.live == 0


def test_module_log_names_real_modules_and_its_events():
    model = mlp()
    prof = sw.measure(model, torch.randn(16, 32), **FAST)
    names = {n for n, _ in model.named_modules()}
    assert {e.module for e in prof.timeline} <= names
    events = {(e.module, e.event) for e in prof.timeline}
    assert {("0", "forward_start"), ("0", "forward_end"), ("3", "backward_end")} <= events
    assert [e.event for e in prof.timeline if not e.module and e.event in ("zero_grad", "forward", "loss",
            "backward", "step")] == ["zero_grad", "forward", "loss", "backward", "step"]
    top = dict(prof.top_modules)
    assert set(top) <= names and top["1"] > 0  # the BatchNorm keeps its input for backward


def test_module_log_treats_a_checkpointed_region_as_one_contributor():
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.Tanh()), nn.Sequential(nn.Linear(64, 64), nn.Tanh()))
    sw.apply(model, sw.Plan([sw.checkpoint("0")]))
    x = torch.randn(16, 32)
    with SavedTensors() as saved, ModuleLog(model, lambda: saved.live) as log:
        loss = model(x).sum()
        log.mark("loss")  # what follows is backward: forwards run now are recomputes
        loss.backward()
    assert any(e.event == "recompute" for e in log.events)
    names = [n for n, _ in log.contributors()]
    assert "0" in names and not any(n.startswith("0.") for n in names)


# -- CUDA ----------------------------------------------------------------------------------------


_INDEPENDENT = """
import torch
from shrinkwrap.models import tiny_efficientnet
torch.manual_seed(0)
model = tiny_efficientnet().cuda().train()
x = torch.randn(64, *tiny_efficientnet.input_shape, device="cuda")
opt = torch.optim.AdamW(model.parameters())
def step():
    opt.zero_grad(set_to_none=True)
    model(x).float().mean().backward()
    opt.step()
for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
torch.cuda.synchronize()
print(torch.cuda.max_memory_allocated())
"""


def independent_peak() -> int:
    """Peak of one steady AdamW step of tiny_efficientnet at batch 64, measured plainly, as a user
    would, in a fresh process like the harness's rows (a process that ran other CUDA work holds
    cuBLAS workspaces that a fresh one allocates during its first step)."""
    out = subprocess.run([sys.executable, "-c", _INDEPENDENT], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.cuda
def test_cuda_baseline_peak_matches_an_independent_measurement():
    from shrinkwrap.models import tiny_efficientnet

    batch = torch.randn(64, *tiny_efficientnet.input_shape)
    report = sw.plan_report([sw.checkpoint(r"blocks\.\d+")], tiny_efficientnet, batch, iterations=3)
    assert report.metric == "peak_allocated" and report.isolation == "in subprocesses"
    base = report.rows[0].profile
    assert base.peak == pytest.approx(independent_peak(), rel=0.03)
    assert report.rows[1].profile.peak < base.peak
    assert sum(base.breakdown().values()) == base.peak
    assert [p.name for p in base.steady_step] == ["zero_grad", "forward", "loss", "backward", "step"]
    assert base.first_peak >= base.static > 0 and base.timeline_probe == "allocated"


def test_without_cuda_the_module_log_runs_anyway_since_it_counts_the_saved_bytes():
    from shrinkwrap.measuring.profile import Options
    from shrinkwrap.measuring.step import measure_with

    prof = measure_with(mlp(), torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu", module_log=False))
    assert prof.saved == sw.saved_tensor_bytes(lambda: mlp().train()(torch.randn(16, 32)))
    assert prof.timeline


def test_graph_pools_counts_private_pools_and_the_gradients_a_replay_wrote_there(monkeypatch):
    """The CUDA-graph reading of measure(), on a made-up allocator snapshot: only segments of a
    private pool on the measured device count, and a gradient counts as unseen when its storage
    lies in one of them outside every block the allocator counts as allocated (a recording's
    gradient, in such a block, is counted by the allocator already)."""
    inside, recorded, outside = torch.zeros(256), torch.zeros(128), torch.zeros(64)
    at, rec = inside.untyped_storage().data_ptr(), recorded.untyped_storage().data_ptr()
    segments = [
        {"device": 0, "address": at, "total_size": inside.nbytes, "segment_pool_id": (0, 7),
         "blocks": [{"address": at, "size": inside.nbytes, "state": "inactive"}]},  # a graph pool, a replay's gradient
        {"device": 0, "address": rec, "total_size": recorded.nbytes, "segment_pool_id": (0, 7),
         "blocks": [{"address": rec, "size": recorded.nbytes, "state": "active_allocated"}]},  # a recording's
        {"device": 0, "address": outside.untyped_storage().data_ptr(), "total_size": 2048,
         "segment_pool_id": (0, 0)},  # the default pool
        {"device": 1, "address": outside.untyped_storage().data_ptr(), "total_size": 512,
         "segment_pool_id": (0, 7)},  # another GPU's graph pool
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    pool, unseen = graphs.graph_pool_bytes(torch.device("cuda", 0), [inside, None, recorded, outside])
    assert (pool, unseen) == (inside.nbytes + recorded.nbytes, inside.nbytes)


def test_an_optimizer_without_a_state_attribute_has_its_state_counted_from_its_state_dict():
    class PerParameter:
        """torchao's CPUOffloadOptimizer's shape: an optimizer per parameter, no ``state``."""

        def __init__(self, params):
            self.inner = [torch.optim.AdamW([p]) for p in params]
            self.param_groups = [g for o in self.inner for g in o.param_groups]

        def step(self):
            for o in self.inner:
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in self.inner:
                o.zero_grad(set_to_none)

        def state_dict(self):
            return {"offloaded": [o.state_dict() for o in self.inner]}

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    x = torch.randn(8, 16)
    plain = sw.measure(make(), x, optimizer=lambda params: torch.optim.AdamW(params), iterations=1, warmup=1)
    wrapped = sw.measure(make(), x, optimizer=PerParameter, iterations=1, warmup=1)
    assert plain.optimizer_state >= 2 * plain.parameters > 0
    assert wrapped.optimizer_state == plain.optimizer_state
