"""Reports: table, markdown, JSON schema (stable field names) and the plot, from known numbers."""

import dataclasses
import json
import sys

import pytest
import torch

from shrinkwrap.measuring import Event, Phase, Profile
from shrinkwrap.plan import Plan
from shrinkwrap.report import SCHEMA, Report, Row

MiB = 2**20

TOP_KEYS = {
    "schema", "device", "device_name", "torch_version", "model", "batch", "isolation", "notes",
    "world_size", "metric", "metric_label", "rows",
}
ROW_KEYS = {
    "step", "plan", "status", "error", "value_mib", "delta_prev_mib", "delta_base_mib", "ratio_base",
    "step_ms", "step_ratio", "matched", "skipped", "peak_mib", "first_peak_mib", "static_mib", "saved_mib",
    "parameters_mib", "gradients_mib", "optimizer_state_mib", "batch_mib", "breakdown", "phases",
    "top_modules", "timeline_probe", "timeline", "snapshot", "role", "round", "batch_size", "fits",
    "compiled", "first_ms", "recompiles", "graph_breaks", "transfers_mib", "cpu_step", "rank", "ranks",
    "fit_mib", "fit_below_mib", "fit_resolution_mib", "fit_iterations", "trained_under_mib", "frontier",
}


def prof(saved_mib: float, step_ms: float, peak_mib: float | None = None, first_mib: float | None = None) -> Profile:
    cuda = peak_mib is not None
    first = peak_mib - 10 if first_mib is None and cuda else first_mib
    p = dict(peak=int(peak_mib * MiB), first_peak=int(first * MiB), static=40 * MiB) if cuda else {}
    phases = [Phase("zero_grad", 40 * MiB, 40 * MiB), Phase("forward", 90 * MiB, int(peak_mib * MiB)),
              Phase("loss", 90 * MiB, 90 * MiB), Phase("backward", 50 * MiB, 60 * MiB),
              Phase("step", 40 * MiB, 50 * MiB)] if cuda else []
    return Profile(
        device="cuda:0" if cuda else "cpu", device_name="Test GPU" if cuda else "test-cpu",
        torch_version=torch.__version__, saved=int(saved_mib * MiB), parameters=10 * MiB,
        gradients=10 * MiB, optimizer_state=20 * MiB, batch=2 * MiB, step_ms=step_ms,
        step_times_ms=[step_ms], first_step=phases, steady_step=phases,
        timeline=[Event("", "zero_grad", 0), Event("layer1", "forward_start", 0),
                  Event("layer1", "forward_end", int(saved_mib * MiB)), Event("", "forward", int(saved_mib * MiB)),
                  Event("", "backward", 0)],
        top_modules=[("layer1", int(saved_mib * MiB))], **p,
    )


def report(cuda: bool = False) -> Report:
    peaks = (200.0, 150.0, None, 100.0) if cuda else (None,) * 4
    rows = [
        Row(Plan.parse(""), prof(100, 10, peaks[0]), role="baseline"),
        Row(Plan.parse("checkpoint('layer1')"), prof(60, 15, peaks[1]), ("layer1",), role="step"),
        Row(Plan.parse("checkpoint('layer1'), swish()"), None, ("act",), status="oom", error="CUDA out of memory",
            role="step"),
        Row(Plan.parse("checkpoint('layer1'), swish(), autocast(torch.bfloat16)"),
            prof(30, 12, peaks[3]), ("",), (("head", "kept in float32"),), role="step"),
    ]
    return Report(rows, device="cuda:0" if cuda else "cpu", device_name="Test GPU" if cuda else "test-cpu",
                  torch_version=torch.__version__, model="toy", batch="8x3x32x32 float32",
                  isolation="in this process", notes=["a note"])


@pytest.mark.parametrize("cuda", [False, True])
def test_json_schema_field_names_are_stable(cuda):
    data = json.loads(report(cuda).to_json())
    assert set(data) == TOP_KEYS and data["schema"] == SCHEMA
    assert data["metric"] == ("peak_allocated" if cuda else "saved_for_backward")
    for row in data["rows"]:
        assert set(row) == ROW_KEYS  # an OOM row has every key too, null-valued
    ok = data["rows"][0]
    assert {e["module"] for e in ok["top_modules"]} == {"layer1"} and set(ok["timeline"][0]) == {"module", "event", "mib"}
    assert data["rows"][3]["skipped"] == [{"module": "head", "reason": "kept in float32"}]
    if cuda:
        assert set(ok["breakdown"]) == {"parameters_mib", "gradients_mib", "optimizer_state_mib", "batch_mib",
                                        "activations_other_mib"}
        assert set(ok["phases"]) == {"first", "steady"} and set(ok["phases"]["steady"][0]) == {"phase", "allocated_mib", "peak_mib"}
    else:
        assert ok["breakdown"] == {} and ok["peak_mib"] is None and ok["phases"] == {"first": [], "steady": []}


def test_on_cuda_a_row_s_figure_is_its_first_step_s_peak_where_that_is_the_larger():
    report = Report([Row(Plan(), prof(100, 10.0, 200)), Row(Plan(), prof(50, 10.0, 150, first_mib=180))],
                    "cuda:0", "Test GPU", torch.__version__)
    assert [report.value(r) / MiB for r in report.rows] == [200, 180]


@pytest.mark.parametrize("cuda", [False, True])
def test_deltas_against_previous_row_and_baseline(cuda):
    rows = report(cuda).to_dict()["rows"]
    values = [200.0, 150.0, None, 100.0] if cuda else [100.0, 60.0, None, 30.0]
    assert [r["value_mib"] for r in rows] == values
    assert [r["delta_prev_mib"] for r in rows] == [None, values[1] - values[0], None, None]  # after an OOM row: none
    assert [r["delta_base_mib"] for r in rows] == [0, values[1] - values[0], None, values[3] - values[0]]
    assert [r["ratio_base"] for r in rows] == [1, round(values[1] / values[0], 4), None, round(values[3] / values[0], 4)]
    assert [r["step_ratio"] for r in rows] == [1, 1.5, None, 1.2]
    assert [r["status"] for r in rows] == ["ok", "ok", "oom", "ok"]


def test_cuda_breakdown_adds_up_to_the_peak():
    p = prof(100, 10, 200)
    assert p.peak_phase == "forward" and p.breakdown()["gradients"] == 0  # set_to_none: no gradients in forward
    assert sum(p.breakdown().values()) == p.peak


@pytest.mark.parametrize("cuda", [False, True])
def test_text_and_markdown_name_device_torch_and_units(cuda):
    r = report(cuda)
    text, md = r.to_text(), r.to_markdown()
    for out in (text, md, r.to_json()):
        assert torch.__version__ in out and ("Test GPU" if cuda else "test-cpu") in out
    assert ("peak MiB" if cuda else "saved MiB") in text
    assert ("no GPU" in text) is not cuda  # a CPU report says it is not a GPU peak
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step "))
    table = lines[header:header + 2 + len(r.rows)]
    assert set(table[1]) <= {"-", " "}
    # Aligned: every column starts where its header starts.
    starts = [i for i, c in enumerate(table[1]) if c == "-" and (i == 0 or table[1][i - 1] == " ")]
    for line in table[2:]:
        assert all(line[s - 1] == " " for s in starts[1:] if s < len(line))
    assert "OOM" in text and "CUDA out of memory" in text and "note: a note" in text
    cells = [line.count(" | ") for line in md.splitlines() if line.startswith("| ")]
    assert len(set(cells)) == 1 and len(cells) == 1 + len(r.rows)


def ranked(*per_rank: Profile) -> Profile:
    """Rank 0's profile of a row measured on ``len(per_rank)`` ranks, as measure gives it."""
    for r, p in enumerate(per_rank):
        p.rank = r
    return dataclasses.replace(per_rank[0], ranks=list(per_rank))


@pytest.mark.parametrize("cuda", [False, True])
def test_a_report_of_several_ranks_shows_each_rank_and_heads_with_the_largest(cuda):
    peak = (lambda mib: mib) if cuda else (lambda mib: None)
    rows = [Row(Plan.parse(""), ranked(prof(100, 10, peak(200)), prof(120, 11, peak(260))), role="baseline"),
            Row(Plan.parse("checkpoint('layer1')"), ranked(prof(60, 15, peak(150)), prof(50, 14, peak(140))),
                ("layer1",), role="step")]
    r = Report(rows, device="cuda:0" if cuda else "cpu", device_name="x", torch_version=torch.__version__)
    data = r.to_dict()
    assert r.world_size == data["world_size"] == 2
    heads = [260.0, 150.0] if cuda else [120.0, 60.0]
    assert [row["value_mib"] for row in data["rows"]] == heads  # the rank that runs out of memory first
    assert data["rows"][1]["ratio_base"] == round(heads[1] / heads[0], 4)
    assert [q["rank"] for q in data["rows"][0]["ranks"]] == [0, 1] and data["rows"][0]["rank"] == 0
    assert [q["value_mib"] for q in data["rows"][1]["ranks"]] == ([150.0, 140.0] if cuda else [60.0, 50.0])
    text = r.to_text()
    header = next(line for line in text.splitlines() if line.startswith("step "))
    assert "max of 2 ranks" in header and "rank 0" in header and "rank 1" in header
    baseline = next(line for line in text.splitlines() if line.startswith("baseline"))
    assert baseline.split()[1:4] == (["260.0", "200.0", "260.0"] if cuda else ["120.0", "100.0", "120.0"])
    assert "each of 2 ranks" in text
    assert "rank 1: " in str(rows[0].profile)
    single = report(cuda).to_dict()
    assert single["world_size"] == 1 and single["rows"][0]["ranks"] == [] and single["rows"][0]["rank"] is None


def test_save_by_suffix(tmp_path):
    r = report()
    r.save(str(tmp_path / "r.json"))
    r.save(str(tmp_path / "r.md"))
    r.save(str(tmp_path / "r.txt"))
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["step"] == "baseline"
    assert (tmp_path / "r.md").read_text().count("| `baseline` |") == 1
    assert (tmp_path / "r.txt").read_text().startswith("shrinkwrap report")


def test_plot_without_matplotlib_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"shrinkwrap: plotting needs matplotlib; install it with: pip install matplotlib$"):
        report().plot(str(tmp_path / "m.png"))


@pytest.mark.parametrize("cuda", [False, True])
def test_plot_writes_a_png(tmp_path, cuda):
    pytest.importorskip("matplotlib")
    report(cuda).plot(str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_frontier_is_the_rows_no_other_row_beats_on_both_memory_and_time():
    rows = [Row(Plan(), prof(100, 10.0, peak_mib=500), role="baseline")] + [
        Row(Plan.parse(f"checkpoint('{name}')"), prof(100, ms, peak_mib=mib))
        for name, mib, ms in [("a", 300, 12.0), ("b", 400, 15.0), ("c", 300, 11.0), ("d", 200, 20.0), ("e", 500, 10.0)]]
    report = Report(rows, "cuda:0", "Test GPU", torch.__version__)
    # b is beaten by a and c, a by c; e ties the baseline (the same figures beat neither).
    assert [str(r.plan) for r in report.frontier()] == ["checkpoint('d')", "checkpoint('c')", "", "checkpoint('e')"]
    flags = {r["plan"]: r["frontier"] for r in report.to_dict()["rows"]}
    assert flags == {"": True, "checkpoint('a')": False, "checkpoint('b')": False, "checkpoint('c')": True,
                     "checkpoint('d')": True, "checkpoint('e')": True}
