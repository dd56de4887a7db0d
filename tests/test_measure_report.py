"""plan_report (baseline -> steps): its rows and deltas, rows in fresh processes where the main script lets them, and
rows that fail."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw

from measure_helpers import FAST, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


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
