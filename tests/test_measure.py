"""The measuring harness: shrinkwrap.measure (one configuration) and plan_report (baseline -> steps)."""

import json
import multiprocessing
import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.measuring import ModuleLog, SavedTensors
from shrinkwrap.measuring import first_use, graphs
from shrinkwrap.measuring.step import default_loss

FAST = dict(iterations=1, warmup=1, device="cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_measure_function_and_the_measuring_package_are_apart():
    import importlib
    import types

    import shrinkwrap.measuring.saved  # noqa: F401

    assert callable(sw.measure) and sw.measure.__module__ == "shrinkwrap.measuring.step"
    assert isinstance(sw.measuring, types.ModuleType) and sw.measuring is importlib.import_module("shrinkwrap.measuring")
    assert sw.measuring.saved.saved_tensor_bytes is sw.saved_tensor_bytes
    assert not hasattr(sw.measure, "saved")  # the function, not the package under its name


def test_cpu_profile_counts_what_it_labels():
    model, x = mlp(), torch.randn(16, 32)
    prof = sw.measure(model, x, iterations=3, warmup=1, device="cpu")
    params = list(model.parameters())
    assert prof.peak is None and prof.static is None and prof.breakdown() == {}  # no GPU peak passed off
    assert prof.device == "cpu" and prof.torch_version == torch.__version__
    assert prof.saved == sw.saved_tensor_bytes(lambda: model(x))
    assert prof.parameters == nbytes(params) + nbytes(model.buffers())
    assert prof.gradients == nbytes(params)
    assert prof.optimizer_state >= 2 * nbytes(params)  # AdamW: exp_avg and exp_avg_sq (and step counters)
    assert prof.batch == x.nbytes
    assert len(prof.step_times_ms) == 3 and prof.step_ms > 0
    assert "no GPU peak" in str(prof)


def test_measure_leaves_the_model_as_it_was():
    model = mlp().eval()
    model(torch.randn(4, 32)).sum().backward()  # the user's own gradients, to be kept
    modules = list(model.modules())
    params = {n: p for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in params.items()}
    sw.measure(model, torch.randn(16, 32), **FAST)
    assert list(model.modules()) == modules
    assert {n: p for n, p in model.named_parameters()} == params  # same objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights, running stats, num_batches_tracked
    assert all(torch.equal(p.grad, grads[n]) for n, p in params.items())
    assert not model.training and not any(m.training for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class HFLike(nn.Module):
    """Keyword inputs and an output object, as Hugging Face models take and give."""

    def __init__(self, loss: bool) -> None:
        super().__init__()
        self.emb, self.loss = nn.Embedding(50, 16), loss

    def forward(self, input_ids, labels=None):
        logits = self.emb(input_ids)
        loss = logits.pow(2).mean() if self.loss else None
        return types.SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("with_loss", [True, False])
def test_dict_batch_and_output_objects(with_loss):
    prof = sw.measure(HFLike(with_loss), {"input_ids": torch.randint(0, 50, (4, 8))}, **FAST)
    assert prof.gradients > 0


def test_default_loss():
    t = torch.tensor([1.0, 3.0])
    assert default_loss(t) == 2
    assert default_loss(types.SimpleNamespace(loss=torch.tensor(5.0), logits=t)) == 5
    assert default_loss(types.SimpleNamespace(loss=None, logits=t)) == 2
    assert default_loss((t, "aux")) == 2
    with pytest.raises(TypeError, match="loss_fn"):
        default_loss("text")


def test_grad_scaler_is_used_for_float16_autocast(monkeypatch):
    made = []

    class Recording(torch.amp.GradScaler):
        def __init__(self, *a, **k):
            made.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    model = mlp()
    sw.measure(model, torch.randn(8, 32), **FAST)
    assert not made
    sw.apply(model, sw.Plan([sw.autocast(torch.float16)]))
    sw.measure(model, torch.randn(8, 32), **FAST)
    assert made == [("cpu",)]


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


# -- plan_report ------------------------------------------------------------------------------


def blocks() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])


def test_plan_report_rows_and_deltas_follow_baseline_then_steps():
    plan = sw.Plan([sw.checkpoint(["0", "1"]), sw.checkpoint("2")])
    report = sw.plan_report(plan, blocks, torch.randn(64, 32), **FAST)
    assert [r.label for r in report.rows] == ["baseline", str(plan.steps[0]), "checkpoint('2')"]
    assert [r.plan for r in report.rows] == [sw.Plan(plan.steps[:i]) for i in range(3)]
    assert [r.role for r in report.rows] == ["baseline", "step", "step"]
    assert report.rows[1].matched == ("0", "1") and report.rows[2].matched == ("2",)
    assert report.metric == "saved_for_backward" and report.isolation == "in this process"
    values = [r.profile.saved for r in report.rows]
    assert values[0] > values[1] > values[2]  # each checkpoint keeps less for backward
    rows = report.to_dict()["rows"]
    mib = 2**20
    for i, row in enumerate(rows):
        assert row["value_mib"] == pytest.approx(values[i] / mib, abs=1e-3)
        assert row["delta_base_mib"] == pytest.approx((values[i] - values[0]) / mib, abs=2e-3)
        assert row["ratio_base"] == pytest.approx(values[i] / values[0], abs=1e-4)
        if i:
            assert row["delta_prev_mib"] == pytest.approx((values[i] - values[i - 1]) / mib, abs=2e-3)
    assert rows[0]["delta_prev_mib"] is None and rows[0]["step_ratio"] == 1


def test_plan_report_leaves_a_model_instance_untouched():
    model = mlp()
    modules = list(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = sw.plan_report([sw.checkpoint("0")], model, torch.randn(16, 32), **FAST)
    assert report.rows[1].matched == ("0",)
    assert list(model.named_modules()) == modules  # same names, same objects, nothing wrapped
    assert sw.records(model) == [] and not isinstance(model[0], sw.CheckpointModule)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_rows_can_run_in_fresh_subprocesses():
    model = mlp()  # an instance travels to the subprocess as torch.save bytes; the user's stays here
    report = sw.plan_report([], model, torch.randn(16, 32), isolate=True, **FAST)
    assert report.isolation == "in subprocesses" and not report.notes
    assert report.rows[0].profile.saved == sw.saved_tensor_bytes(lambda: model.train()(torch.randn(16, 32)))


def test_an_unpicklable_row_runs_in_process_with_a_note():
    report = sw.plan_report([], lambda: nn.Linear(4, 4), torch.randn(2, 4), isolate=True, **FAST)
    assert report.isolation == "in this process" and "does not pickle" in report.notes[0]
    assert "use module-level functions for the factory and the loss" in report.notes[0]


SCRIPT = """
import json, sys
import torch, torch.nn as nn
import shrinkwrap as sw

with open(sys.argv[1], "a") as runs:  # each run of the script's top level
    runs.write("x")

class Net(nn.Sequential):
    pass

def make():
    return Net(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

def main(model):
    report = sw.plan_report([sw.checkpoint("0")], model, torch.randn(16, 32), isolate=True, iterations=1, warmup=1,
                            device="cpu")
    print(json.dumps([report.isolation, report.notes]))
"""
GUARD = 'if __name__ == "__main__":\n'
ENDINGS = {  # how the script ends, whether it runs from a file, and what the note says (None: rows in subprocesses)
    "guarded": (GUARD + "    main(make)\n", True, None),
    "unguarded": ("main(make)\n", True, "train.py calls shrinkwrap at its top level (line {line}), outside `if __name__ == "
                  '"__main__":`, and a spawned process would run the script again: put the script\'s work under that line'),
    "defined under the guard": (GUARD + "    def make_here():\n        return make()\n    main(make_here)\n", True,
                                "make_here is defined under `if __name__ == \"__main__\":`, which a spawned process does "
                                "not run, so it cannot find it there: define it above that line"),
    "python -c": (GUARD + "    main(make)\n", False, "make is defined in __main__ here (an interactive session, python "
                  "-c or a notebook), which a spawned process cannot import: define it in a module and import it"),
    "python -c, an instance": (GUARD + "    main(make())\n", False, "Net is defined in __main__ here"),
}


@pytest.mark.parametrize("how", list(ENDINGS))
def test_rows_start_fresh_processes_only_where_the_main_script_lets_them(tmp_path, how):
    # A spawned process runs the main script again to find its functions: at its top level, the
    # call would run again there (and fail to start processes of its own); what python -c or the
    # guarded block defines, it cannot find. Each measures here, with a note that says the fix.
    ending, from_file, said = ENDINGS[how]
    if how == "unguarded":
        said = said.replace("{line}", str((SCRIPT + ending).splitlines().index("main(make)") + 1))
    runs, script = tmp_path / "runs", tmp_path / "train.py"
    script.write_text(SCRIPT + ending, encoding="utf-8-sig")  # a BOM, as some editors write: read as Python reads it
    command = [sys.executable, *([str(script)] if from_file else ["-c", SCRIPT + ending]), str(runs)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    isolation, notes = json.loads(out.stdout.strip().splitlines()[-1])
    if said is None:
        assert isolation == "in subprocesses" and not notes
        assert runs.read_text() == "xxx"  # this process's, and each row's process ran its top level, not main()
        return
    assert isolation == "in this process" and runs.read_text() == "x" and "Traceback" not in out.stderr
    assert len(notes) == 1 and notes[0].startswith(f"rows measured in this process, not in subprocesses: {said}")


def test_a_main_guard_is_read_in_the_forms_scripts_write_it():
    import ast

    from shrinkwrap.processes.sendable import _defined_unguarded, _in_guard

    source = """
import torch as t
A = 1
def make(): pass
try:
    class Net: pass
except ImportError:
    pass
if __name__ == '__main__':
    def hidden(): pass
    run(make)
if "__main__" == __name__ and t:
    run(make)
elif True:
    B = 2
if __name__ != "__main__":
    run(make)
    C = 3
else:
    run(make)
    def hidden_too(): pass
if not __name__ == "__main__":
    pass
else:
    run(make)
if __name__ != "__main__" and t:
    pass
else:
    run(make)
run(make)
"""
    tree = ast.parse(source)
    lines = source.splitlines()
    calls = [i for i, text in enumerate(lines, 1) if text.strip() == "run(make)"]
    # Under the guard, in either form; not where the script is run as a module too (an else of a
    # negated guard within an ``and`` runs in a spawned process where ``t`` is false).
    assert [bool(list(_in_guard(tree, line))) for line in calls] == [True, True, False, True, True, False, False]
    assert _defined_unguarded(tree) == {"t", "A", "make", "Net", "B", "C"}  # not hidden, bound under the guard


def test_bad_plan_raises_before_any_row_is_measured():
    with pytest.raises(sw.SelectionError, match="nope"):
        sw.plan_report([sw.checkpoint("nope")], mlp, torch.randn(4, 32), **FAST)


class OOMWhenOneRegion(nn.Module):
    """Simulates a configuration that runs out of CUDA memory: exactly one checkpointed region."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        if sum(isinstance(m, sw.CheckpointModule) for m in self.modules()) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.b(self.a(x))


def test_a_row_that_runs_out_of_memory_says_so_and_the_rest_comes():
    report = sw.plan_report([sw.checkpoint("a"), sw.checkpoint("b")], OOMWhenOneRegion, torch.randn(4, 8), **FAST)
    assert [r.status for r in report.rows] == ["ok", "oom", "ok"]
    assert "out of memory" in report.rows[1].error and report.rows[1].profile is None
    rows = report.to_dict()["rows"]
    assert rows[1]["value_mib"] is None and rows[1]["peak_mib"] is None
    assert rows[2]["delta_prev_mib"] is None and rows[2]["delta_base_mib"] is not None
    assert "OOM" in str(report) and "out of memory" in str(report)


def test_snapshot_needs_cuda():
    with pytest.raises(ValueError, match="cuda"):
        sw.measure(mlp(), torch.randn(4, 32), snapshot="snap.pickle", **FAST)


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


@pytest.mark.cuda
def test_cuda_measure_in_place_restores_a_gpu_model(tmp_path):
    model = torch.nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prof = sw.measure(model, torch.randn(64, 256), snapshot=str(tmp_path / "snap.pickle"))
    assert prof.peak >= prof.static > 0 and (tmp_path / "snap.pickle").stat().st_size > 0
    assert all(torch.equal(v, state[k]) and v.is_cuda for k, v in model.state_dict().items())


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
    timings = sw.time_interleaved(models, torch.randn(2, 4), opts, rounds=2, per_round=1, until=until, max_rounds=9)
    assert seen == [2, 3, 4, 5] and all(len(t.rounds_ms) == 5 for t in timings.values())
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


def test_fresh_processes_start_the_next_rows_process_ahead_and_stop_it_when_closed():
    from shrinkwrap.compare import measure_plans
    from shrinkwrap.processes import FreshProcesses
    from shrinkwrap.measuring.profile import Options

    before = {c.pid for c in multiprocessing.active_children()}
    with FreshProcesses(mlp) as fresh:
        report = measure_plans(mlp, [sw.Plan(), sw.Plan([sw.checkpoint("0")])], torch.randn(16, 32),
                               Options(iterations=1, warmup=1, device="cpu"), isolate=True, processes=fresh)
        fresh.start_next()
        (waiting,) = fresh._waiting
        assert len(waiting._processes) == 1  # started ahead, unused
        process = next(iter(waiting._processes.values()))
    assert not fresh._waiting
    process.join(timeout=30)
    assert not process.is_alive()
    # Processes that measured a row were not waited for after it, and are gone once closed.
    assert not [c for c in multiprocessing.active_children() if c.pid not in before]
    assert report.isolation == "in subprocesses" and [r.status for r in report.rows] == ["ok", "ok"]
    assert report.rows[1].matched == ("0",)  # what the plan matched came back from its process


def test_fresh_processes_ahead_start_the_next_rows_process_as_each_row_starts():
    from shrinkwrap.processes import fresh as processes
    from shrinkwrap.processes import FreshProcesses

    for ahead in (False, True):
        with FreshProcesses(mlp, ahead=ahead) as fresh:
            pids = [fresh.run(os.getpid) for _ in range(2)]
            # Ahead, two wait: started as the rows started (the second row found its own ready).
            assert len(fresh._waiting) == (processes.AHEAD if ahead else 0)
        assert len(set(pids)) == 2 and os.getpid() not in pids
    # Stopped at once where asked (before the GPU's free memory is read), and started again by a row.
    with FreshProcesses(mlp, ahead=True) as fresh:
        fresh.start_next()
        assert len(fresh._waiting) == processes.AHEAD
        started = [p for pool in fresh._waiting for p in (pool._processes or {}).values()]
        fresh.stop_next()
        assert not fresh._waiting and not any(p.is_alive() for p in started)
        fresh.run(os.getpid)
        assert len(fresh._waiting) == processes.AHEAD
    assert not fresh._waiting  # closed: none left waiting


def test_a_progress_bar_is_redrawn_in_place_on_a_terminal_and_a_line_a_row_in_a_log(capsys, monkeypatch):
    sw.plan_report(sw.Plan([sw.checkpoint("0")]), mlp, torch.randn(16, 32), iterations=1, warmup=1, device="cpu",
                   progress=True)
    assert capsys.readouterr().err.splitlines() == ["shrinkwrap: 0/2 baseline", "shrinkwrap: 1/2 checkpoint('0')",
                                                    "shrinkwrap: 2/2 done"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = sw.ProgressBar()
    bar(1, 4, "baseline")
    bar(4, 4, "done")
    drawn = capsys.readouterr().err
    assert drawn == ("\rmeasuring [#####...............] 1/4 baseline".ljust(90)
                     + "\rmeasuring [####################] 4/4 done".ljust(90) + "\n")  # a new line once done
    sw.ProgressBar(quiet=True)(1, 4, "baseline")
    assert capsys.readouterr().err == ""

class _Recording:
    """A loss that appends its process id, float32 matmul precision and the time to a file each time it
    runs (picklable: a spawned process gets it)."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, out):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {torch.get_float32_matmul_precision()} {time.time()}\n")
        return out.float().mean()


def test_plans_compiled_ahead_run_their_first_iterations_in_processes_side_by_side(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    log = tmp_path / "steps"
    options = Options(loss_fn=_Recording(log), iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("compile(backend='no_such_backend')")]
    torch.set_float32_matmul_precision("high")  # a setting the compiler's caches key on: the processes take it
    try:
        at_once, errors = compile_ahead(mlp, plans, torch.randn(16, 32), options)
    finally:
        torch.set_float32_matmul_precision("highest")
    assert at_once == 3 and errors[:2] == [None, None] and "no_such_backend" in errors[2]
    lines = [line.split() for line in log.read_text().splitlines()]
    pids = [pid for pid, *_ in lines]
    # The warm-up and one more iteration, each plan that ran, in a process of its own.
    assert len(pids) == 4 and len(set(pids)) == 2 and str(os.getpid()) not in pids
    assert {precision for _, precision, _ in lines} == {"high"}
    # One plan alone, or one that cannot be sent to a process: nothing runs ahead (this process compiles it).
    log.unlink()
    assert compile_ahead(mlp, plans[:1], torch.randn(16, 32), options) == (0, [])
    assert compile_ahead(lambda: mlp(), plans, torch.randn(16, 32), options) == (0, [])
    assert not log.exists()


def _measured(make, plan, batch, options):
    """What a process ahead does once all have compiled, here: the time its turn began and ended."""
    began = time.time()
    time.sleep(0.5)
    return os.getpid(), began, time.time(), str(plan)


class _DiesInTurn:
    """``then`` of compile_ahead whose first caller dies during its turn (holding the lock)."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, make, plan, batch, options):
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return "measured"
        os._exit(3)


class _DiesSecond:
    """A factory whose second caller (a process of its own) dies."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self):
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            os._exit(3)
        return mlp()


def test_plans_compiled_ahead_are_then_measured_there_one_at_a_time_once_all_have_compiled(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    log = tmp_path / "steps"
    options = Options(loss_fn=_Recording(log), iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("compile(backend='no_such_backend')")]
    seen: list[tuple[float, list[float]]] = []
    started = time.time()
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options, then=_measured,
                                 compiled=lambda seconds: seen.append((time.time(), seconds)))
    assert at_once == 3 and [text for *_, text in out] == [str(p) for p in plans]  # the one that failed too
    steps = [(int(pid), float(t)) for pid, _, t in (line.split() for line in log.read_text().splitlines())]
    turns = sorted((began, ended) for _, began, ended, _ in out)
    # Each in the process that compiled it, after every plan's first iterations, and no two at once.
    assert {pid for pid, *_ in out} == {pid for pid, _ in steps} | {out[2][0]} and len({pid for pid, *_ in out}) == 3
    assert max(t for _, t in steps) < turns[0][0]
    assert all(ended <= began for (_, ended), (began, _) in zip(turns, turns[1:]))
    # Told once, after the last compiled, with the seconds each plan's first iterations took.
    ((told, seconds),) = seen
    assert max(t for _, t in steps) < told and len(seconds) == 3 and all(0 < s < told - started for s in seconds)
    # One that dies: the other's turn never comes, and it ends with its first iterations' result.
    at_once, out = compile_ahead(_DiesSecond(tmp_path / "ticket"), plans[:2], torch.randn(16, 32), options, then=_measured,
                                 compiled=lambda seconds: seen.append((time.time(), seconds)))
    (died,) = [o for o in out if o is not None]
    assert len(seen) == 1  # never all compiled
    assert at_once == 2 and out.count(None) == 1 and "BrokenProcessPool" in died
    # One that dies in its turn, holding the lock: the other's turn never comes, and it ends too.
    started = time.time()
    at_once, out = compile_ahead(mlp, plans[:2], torch.randn(16, 32), options, then=_DiesInTurn(tmp_path / "turn"))
    (died,) = [o for o in out if o is not None]
    assert out.count(None) == 1 and "BrokenProcessPool" in died and time.time() - started < 120


def _keyed(make, plan, batch, options, keys):
    """``then`` with a second turn: when its first turn ended, and the plan's key."""
    return time.time(), keys[str(plan)]


def _second(make, plan, batch, options, ended, before):
    """``after``: the plan, when its first turn ended and its second began, what the earlier
    second turns left, and for the later ones, how many came before it."""
    began = time.time()
    time.sleep(0.2)
    return (str(plan), ended, began, before), float(len(before))


def test_the_second_turns_of_plans_compiled_ahead_go_least_key_first_each_told_what_the_earlier_left():
    import functools

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): float("nan"), str(plans[1]): 2.0, str(plans[2]): 1.0}  # no figure: last
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                 then=functools.partial(_keyed, keys=keys), after=_second)
    assert at_once == 3 and [text for text, *_ in out] == [str(p) for p in plans]
    turns = sorted(out, key=lambda o: o[2])
    assert [text for text, *_ in turns] == [str(plans[2]), str(plans[1]), str(plans[0])]
    assert [before for *_, before in turns] == [[], [0.0], [0.0, 1.0]]
    # Every second turn after every first turn, and no two at once.
    assert max(ended for _, ended, _, _ in out) < turns[0][2]
    assert all(b - a >= 0.2 for a, b in zip([t[2] for t in turns], [t[2] for t in turns[1:]]))


def _keyed_raising(make, plan, batch, options, keys, bad):
    """``then`` that raises for the plan ``bad``."""
    if str(plan) == bad:
        raise RuntimeError("no row (a stand-in)")
    return _keyed(make, plan, batch, options, keys)


def _second_raising(make, plan, batch, options, ended, before, bad):
    """``after`` that raises for the plan ``bad``."""
    if str(plan) == bad:
        raise RuntimeError("CUDA out of memory (a stand-in)")
    return _second(make, plan, batch, options, ended, before)


def test_a_turn_that_raises_is_its_plans_entry_and_the_others_turns_go_on():
    import functools

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): 3.0, str(plans[1]): 1.0, str(plans[2]): 2.0}
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options, then=functools.partial(_keyed, keys=keys),
                                 after=functools.partial(_second_raising, bad=str(plans[2])))
    assert at_once == 3 and out[2] == "RuntimeError: CUDA out of memory (a stand-in)"
    # The one after it still had its turn, told what the one before it left and that the failed one left nothing.
    assert out[1][3] == [] and out[0][3] == [0.0, float("inf")]
    # One that raises in its first turn: its second passes, and the others' go on.
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                 then=functools.partial(_keyed_raising, keys=keys, bad=str(plans[1])), after=_second)
    assert out[1].startswith("RuntimeError") and out[2][3] == [] and out[0][3] == [0.0]


def test_plans_compiled_ahead_where_not_all_run_at_once_go_in_waves_each_taking_its_turns(monkeypatch):
    import functools

    from shrinkwrap.processes import ahead as processes
    from shrinkwrap.measuring.profile import Options

    monkeypatch.setattr(processes, "_processes_fitting", lambda device, room: 2)  # the GPU's memory holds two
    options = Options(iterations=1, warmup=1, device="cpu")
    plans = [sw.Plan.parse("compile(backend='aot_eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='aot_eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='aot_eager')")]
    keys = {str(plans[0]): 2.0, str(plans[1]): 1.0, str(plans[2]): 0.5}
    told = []
    at_once, out = processes.compile_ahead(mlp, plans, torch.randn(16, 32), options,
                                           then=functools.partial(_keyed, keys=keys), after=_second,
                                           compiled=lambda seconds: told.append((time.time(), seconds)))
    assert at_once == 2 and [text for text, *_ in out] == [str(p) for p in plans]
    first, second, last = out[1], out[0], out[2]  # the first wave by key, then the second wave
    assert [before for *_, before in (first, second, last)] == [[], [0.0], [0.0, 1.0]]
    assert second[2] < last[1]  # the second wave's turns after the first wave's
    # Told once, when the last wave had compiled, with every plan's first iterations.
    ((when, seconds),) = told
    assert second[2] < when and len(seconds) == 3 and all(s > 0 for s in seconds)


def _meet_on_exit(folder: str, count: int) -> None:
    """A process's last act (a finalizer, as a compiler's worker pool shutting down): say it is
    exiting, then wait until ``count`` processes are, and say whether they all met."""
    mine = os.path.join(folder, str(os.getpid()))
    open(mine + ".exiting", "w").close()
    deadline = time.monotonic() + 60  # past compile_ahead's grace: a process left alone is terminated
    while time.monotonic() < deadline:
        if len([f for f in os.listdir(folder) if f.endswith(".exiting")]) == count:
            open(mine + ".met", "w").close()
            return
        time.sleep(0.05)


class _MeetOnExit:
    """``then`` of a process that, once told to exit, exits only beside the others."""

    def __init__(self, folder: str, count: int) -> None:
        self.folder, self.count = folder, count

    def __call__(self, make, plan, batch, options):
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _meet_on_exit, args=(self.folder, self.count), exitpriority=0)
        return os.getpid()


def test_processes_ahead_whose_turns_end_together_exit_side_by_side(tmp_path):
    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    plans = [sw.Plan.parse("compile(backend='eager')"), sw.Plan.parse("checkpoint('0'), compile(backend='eager')"),
             sw.Plan.parse("checkpoint('2'), compile(backend='eager')")]
    at_once, out = compile_ahead(mlp, plans, torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu"),
                                 then=_MeetOnExit(str(tmp_path), len(plans)))
    # Told to exit one after another, the first would wait alone until it was terminated, and
    # only the last would see all three exiting.
    met = sorted(int(f.name.split(".")[0]) for f in tmp_path.glob("*.met"))
    assert at_once == 3
    assert met == sorted(out), "the processes exited one after another, not side by side"


def test_a_process_ahead_given_settings_equal_to_its_own_leaves_what_the_caches_key_on_as_it_was():
    """Setting float32 matmul precision to the "highest" it already was turns torch's cache key
    (``fp32_precision``) from "none" to "ieee": every graph a process ahead compiled then missed
    the caches of the process that sent it (H100, torch 2.11). Run in a fresh interpreter, whose
    settings no other test has touched; a setting that differs is still taken."""
    code = """if True:
        import torch, torch.nn as nn
        from shrinkwrap.processes.ahead import compile_settings, _first_steps
        from shrinkwrap.measuring.profile import Options
        from shrinkwrap.plan import Plan
        settings = compile_settings()
        before = torch.backends.cuda.matmul.fp32_precision
        assert _first_steps(lambda: nn.Linear(4, 2), Plan(), torch.randn(3, 4), Options(device="cpu", warmup=1), settings) is None
        print(before, torch.backends.cuda.matmul.fp32_precision, end=" ")
        settings["matmul"].update(legacy="high", fp32_precision="tf32", allow_bf16_reduced_precision_reduction=False)
        _first_steps(lambda: nn.Linear(4, 2), Plan(), torch.randn(3, 4), Options(device="cpu", warmup=1), settings)
        matmul = torch.backends.cuda.matmul
        print(torch.get_float32_matmul_precision(), matmul.fp32_precision, matmul.allow_bf16_reduced_precision_reduction)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["none", "none", "high", "tf32", "False"]
    # A process that set the precision through torch's newer API (reading it the legacy way then
    # raises): it is sent, and taken, as that API's setting.
    code = """if True:
        import torch
        from shrinkwrap.processes.settings import compile_settings, _take_matmul_settings
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        print(compile_settings()["matmul"])
    """
    sent = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "legacy" not in sent and sent["fp32_precision"] == "tf32"
    code = f"""if True:
        import torch
        from shrinkwrap.processes.settings import _take_matmul_settings
        _take_matmul_settings({sent!r})
        print(torch.backends.cuda.matmul.fp32_precision)
    """
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["tf32"]


@pytest.mark.parametrize("first", ["torch", "multiprocessing"])
def test_a_main_script_that_imports_torch_compiles_here_what_its_processes_compiled_ahead(tmp_path, first):
    # The caches key on tensors' metadata pickled, which names torch's memory formats after a
    # module found in sys.modules, where the main script sits (as __mp_main__) at another place in
    # a spawned process than in its parent: without the fix the parent found none of its keys.
    # A script of its own, whose main module has torch (pytest's has not). Imported after torch,
    # multiprocessing puts __mp_main__ after torch's modules in the parent only: the keys differed
    # (0 of 2 hits without the fix). Imported first, it puts it first in both, and the fix must keep
    # the keys alike.
    script = tmp_path / "main.py"
    script.write_text(f"""if True:
        import {first}
        import torch, torch.nn as nn
        import shrinkwrap as sw
        from shrinkwrap.processes import compile_ahead
        from shrinkwrap.measuring.profile import Options
        from shrinkwrap.measuring.step import setup_iteration

        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

        if __name__ == "__main__":
            from torch._dynamo.utils import counters
            plans = [sw.Plan.parse("checkpoint('0'), compile()"), sw.Plan.parse("checkpoint('2'), compile()")]
            x = torch.randn(4, 8)
            assert compile_ahead(make, plans, x, Options(device="cpu", warmup=1, iterations=1)) == (2, [None, None])
            for plan in plans:  # the training step the measuring harness runs (on a CPU measure()'s
                # reading of saved bytes compiles other graphs)
                torch._dynamo.reset()  # each plan compiled as a fresh process would
                step, _ = setup_iteration(sw.apply(make(), plan), x, Options(device="cpu"), torch.device("cpu"))
                step()
            print(dict(counters["aot_autograd"]))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = eval(out.stdout.strip().splitlines()[-1])
    assert counts.get("autograd_cache_hit") == 2 and not counts.get("autograd_cache_miss"), counts


@pytest.mark.cuda
def test_processes_ahead_count_what_this_process_keeps_cached_and_unused_as_free():
    from shrinkwrap.processes.ahead import PROCESS_MARGIN, _processes_fitting

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0]
    room = free // 4 - PROCESS_MARGIN  # four such rows fill what is free
    block = torch.empty(free * 3 // 4, dtype=torch.uint8, device=device)
    del block  # kept by the allocator, unused: as after a row measured here
    assert torch.cuda.mem_get_info(device)[0] < free // 3  # what the card reports free now
    assert _processes_fitting(device, room) >= 3 and torch.cuda.memory_reserved(device) < free // 4


@pytest.mark.cuda
def test_a_plan_compiled_ahead_compiles_here_from_the_on_disk_cache(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    from shrinkwrap.processes import compile_ahead
    from shrinkwrap.measuring.profile import Options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold for this test; the processes inherit it
    plans = [sw.Plan.parse("compile()"), sw.Plan.parse("autocast(torch.bfloat16), compile()")]
    options = Options(iterations=1, warmup=2, device="cuda")
    x = torch.randn(64, 32)
    free = torch.cuda.mem_get_info()[0]
    assert compile_ahead(mlp, plans, x, options, room=free) == (0, [])  # memory for one process only
    assert compile_ahead(mlp, plans, x, options, room=2**20) == (2, [None, None])
    torch._dynamo.reset()
    counters.clear()
    sw.measure(sw.apply(mlp(), plans[1]), x, device="cuda", warmup=2, iterations=1)
    # Forward and backward from the caches: AOTAutograd's where its key matches (inductor's is then
    # not asked), else inductor's; neither compiles anything anew.
    aot, fx = dict(counters["aot_autograd"]), dict(counters["inductor"])
    hits = max(aot.get("autograd_cache_hit", 0), fx.get("fxgraph_cache_hit", 0))
    assert hits >= 2 and not fx.get("fxgraph_cache_miss"), (aot, fx)


def test_a_process_started_ahead_imports_the_modules_of_the_models_classes_and_never_calls_the_factory(
        tmp_path, monkeypatch):
    import sys

    from shrinkwrap.processes.fresh import _ready

    (tmp_path / "shrinkwrap_test_models_xyz.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    built = []
    assert "shrinkwrap_test_models_xyz" not in sys.modules
    try:
        _ready(lambda: built.append(1), ["shrinkwrap_test_models_xyz", "no_such_module_xyz"])
        assert sys.modules["shrinkwrap_test_models_xyz"].LOADED  # imported; the missing one is passed over
    finally:
        sys.modules.pop("shrinkwrap_test_models_xyz", None)
    assert built == []  # a factory may cache what it builds, or act: only the row calls it


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie their head
        self.norm = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.embed.weight.note = "kept"  # an attribute set on a parameter (transformers sets some)

    def forward(self, x):
        return self.head(self.frozen(self.norm(self.embed(x))))


def test_a_copy_made_on_the_device_is_the_model_new_tied_where_it_was_tied():
    from shrinkwrap.processes.copies import ModelCopies

    original = _Tied()
    original.norm.running_mean.add_(1.0)
    copy_ = ModelCopies(original)(torch.device("cpu"))
    assert copy_.head.weight is copy_.embed.weight  # still one parameter
    assert copy_.embed.weight is not original.embed.weight and copy_.embed.weight.note == "kept"
    assert not copy_.frozen.weight.requires_grad and isinstance(copy_.frozen.weight, nn.Parameter)
    for (name, a), b in zip(original.state_dict().items(), copy_.state_dict().values()):
        assert torch.equal(a, b), name
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), name  # its own memory
    copy_.norm.running_mean.zero_()
    assert original.norm.running_mean.eq(1.0).all()


def test_a_copy_of_tensors_that_share_memory_keeps_them_shared():
    from shrinkwrap.processes.copies import ModelCopies

    original = nn.Linear(4, 4)
    original.register_buffer("table", torch.zeros(3, 4))
    original.register_buffer("row", original.table[1])  # a buffer into another buffer's memory
    copy_ = ModelCopies(original)(torch.device("cpu"))
    copy_.table[1, 0] = 5.0
    assert copy_.row[0] == 5.0 and original.row[0] == 0.0  # as deepcopy keeps them


def test_without_cuda_the_module_log_runs_anyway_since_it_counts_the_saved_bytes():
    from shrinkwrap.measuring.profile import Options
    from shrinkwrap.measuring.step import measure_with

    prof = measure_with(mlp(), torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu", module_log=False))
    assert prof.saved == sw.saved_tensor_bytes(lambda: mlp().train()(torch.randn(16, 32)))
    assert prof.timeline


def test_a_row_built_to_be_thrown_away_is_not_restored():
    from shrinkwrap.measuring.profile import Options
    from shrinkwrap.measuring.step import measure_with

    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    measure_with(model, torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu"), restore=False)
    assert all(p.grad is not None for p in model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # AdamW's steps stay


@pytest.mark.cuda
def test_cuda_one_warm_up_iteration_reaches_an_eager_models_steady_peak():
    # autoplan measures eager rows after one warm-up iteration (see autoplan.rows.Rows.options_for): the peak
    # must be the one that more warm-up reaches, to the byte.
    from shrinkwrap.models import tiny_efficientnet

    batch = torch.randn(64, *tiny_efficientnet.input_shape)
    peaks = [sw.measure(tiny_efficientnet(), batch, iterations=1, warmup=w).peak for w in (1, 2, 3)]
    assert peaks[0] == peaks[1] == peaks[2]


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


def _depthwise() -> nn.Module:
    """Two blocks alike (their convolutions are the same calls) and a stem."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 3, padding=1, groups=8))


needs_recording = pytest.mark.skipif(not first_use.SUPPORTED,
                                     reason="this torch's dispatch modes cannot leave torch.compile alone")


@needs_recording
def test_first_use_records_each_library_call_once_with_the_metadata_that_ran():
    import collections

    from shrinkwrap.measuring.first_use import PLANNED, _Tensor, recorded

    model = _depthwise().to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 16, 16).to(memory_format=torch.channels_last)[:, 1:]  # a view, at an offset
    with recorded() as calls, torch.autocast("cpu", torch.bfloat16):
        model(x).float().sum().backward()
    names = collections.Counter(c[1] for c in calls.calls)
    # The two depthwise convolutions are one call forward; backward, the last one's output
    # gradient comes in the default layout, and the stem computes no input gradient: three calls.
    # Nothing else: relu, the loss, the adds are not planned.
    assert names == {"convolution": 2, "convolution_backward": 3, "native_batch_norm": 1,
                     "native_batch_norm_backward": 1} and set(names) <= PLANNED
    assert len(calls) == 7 and not any(c[0] for c in calls.calls)  # on a CPU, backward runs on this thread
    stem = next(c for c in calls.calls if c[1] == "convolution")
    first = stem[3][0]
    # Autocast's dtype, and the layout: the bf16 copy of the view is a tensor of its own.
    assert first == _Tensor((2, 3, 16, 16), x.contiguous(memory_format=torch.channels_last).stride(), 0,
                            torch.bfloat16, "cpu")
    with recorded() as calls:
        model(x).sum().backward()
    stem = next(c for c in calls.calls if c[1] == "convolution")
    assert stem[3][0] == _Tensor((2, 3, 16, 16), x.stride(), 1, torch.float32, "cpu")  # in float32, the view


@needs_recording
def test_replay_makes_the_calls_on_new_tensors_with_memory_to_spare_in_the_thread_they_were_made_in(monkeypatch):
    import pickle

    model, x = _depthwise(), torch.randn(2, 4, 16, 16)[:, 1:]
    recorder = first_use._Recorder({})
    recorder.thread = None  # as if recording began on another thread: every call is backward's
    with recorder:
        model(x).sum().backward()
    calls = pickle.loads(pickle.dumps(first_use.Calls(recorder.calls)))  # it travels to another process
    assert len(calls) == 7 and all(c[0] for c in calls.calls)
    seen = []
    real = first_use._made

    def made(spec):
        out = real(spec)
        if isinstance(spec, first_use._Tensor):
            seen.append((torch._C._current_graph_task_id() >= 0, out.storage_offset(), out.dtype))
        return out

    monkeypatch.setattr(first_use, "_made", made)
    assert first_use.replay(calls) == 7
    assert all(backward for backward, _, _ in seen)  # made inside autograd's backward, as recorded
    assert (True, x.storage_offset(), torch.float32) in seen  # the input view at its offset
    sizes = sorted(first_use._bytes((c[3], c[4])) for c in calls.calls)
    # A call runs where its arguments take at most a third of what its device has free beyond keep.
    monkeypatch.setattr(first_use, "_free", lambda device: 3 * sizes[1] + 1000)
    assert first_use.replay(calls, keep=1000) == 2
    monkeypatch.undo()
    calls.calls[(False, "not_an_operator", "default", (), ())] = None
    assert first_use.replay(calls) == 7  # an operator this torch lacks is skipped
    # Floating tensors are made as they come; others (a reserve, offsets) zero, so that no value
    # out of range can fault the device.
    index = real(first_use._Tensor((2, 3), (1, 2), 2, torch.int64, "cpu"))
    assert index.stride() == (1, 2) and index.storage_offset() == 2 and not index.any()


def test_fresh_processes_make_the_primed_calls_before_each_row(monkeypatch):
    import concurrent.futures

    from shrinkwrap.processes import fresh as processes
    from shrinkwrap.measuring.first_use import Calls

    submitted, started = [], []

    class Row(concurrent.futures.Future):
        def result(self, timeout=None):
            started.append(len(fresh._waiting))  # the next rows' processes, started before this row is over
            return super().result(timeout)

    class Pool:
        """A process pool that runs nothing and says what it was given, in order."""

        def __init__(self, *args, **kwargs):
            self._processes, self._executor_manager_thread = {}, None

        broken = False

        def submit(self, fn, *args):
            if self.broken:
                raise concurrent.futures.process.BrokenProcessPool("died waiting")
            submitted.append((self, fn.__name__, sorted(k[1] for k in args[0].calls) if fn is processes.replay else None))
            future = Row() if fn is os.getpid else concurrent.futures.Future()
            future.set_result(None)
            return future

        def shutdown(self, **kwargs):
            pass

    def calls(*names):
        return Calls({(False, name, "default", (), ()): None for name in names})

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    with processes.FreshProcesses(mlp, ahead=True) as fresh:
        fresh.start_next()
        fresh.prime(calls("a"), keep=1024)  # the processes waiting now replay before their rows
        fresh.prime(calls("a", "b"), keep=1024)  # primed again: only the call they were not given
        fresh.prime(calls("b"), keep=1024)  # nothing new: nothing to make
        fresh.run(os.getpid)  # and those started ahead as each row starts, first thing: every call
        fresh.run(os.getpid)
    pools = list(dict.fromkeys(p for p, _, _ in submitted))
    assert [[(fn, given) for p, fn, given in submitted if p is pool] for pool in pools] == [
        [("_ready", None), ("replay", ["a"]), ("replay", ["b"]), ("getpid", None)],
        [("_ready", None), ("replay", ["a"]), ("replay", ["b"]), ("getpid", None)],
        [("_ready", None), ("replay", ["a", "b"])], [("_ready", None), ("replay", ["a", "b"])]]
    assert started == [processes.AHEAD, processes.AHEAD]
    # With none waiting (the first row, or after stop_next), the row's own process starts first,
    # the others as it starts; one that died waiting is dropped, not a failure.
    submitted.clear()
    with processes.FreshProcesses(mlp, ahead=True) as fresh:
        fresh.run(os.getpid)
        order = [fn for _, fn, _ in submitted]
        assert order == ["_ready", "getpid"] + ["_ready"] * processes.AHEAD
        dead, alive = fresh._waiting
        dead.broken = True
        fresh.prime(calls("c"), keep=0)
        assert fresh._waiting == [alive] and submitted[-1] == (alive, "replay", ["c"])
