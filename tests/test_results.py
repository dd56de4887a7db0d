"""benchmarks/RESULTS.md is what the JSON rows beside it make (benchmarks/results.py): a figure in it
comes from a row with its GPU, torch version and date, and a row's newest figures replace its old.
And benchmarks/ keeps its house rules: one harness every script imports, at most eleven scripts, no
import circles, every JSON file rendered, no plot nothing links to, no paragraph over 150 words."""

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
MODULES = {p.stem: p for p in BENCH.glob("*.py")}


def _imported(path: pathlib.Path) -> set[str]:
    """The benchmarks modules ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & set(MODULES)


def _is_script(path: pathlib.Path) -> bool:
    return path.suffix == ".sh" or "if __name__ == \"__main__\":" in path.read_text()


def test_results_md_is_what_the_rows_make():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_zoo_table_names_what_dominates_an_answer_and_answers_over_the_time_targets():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from results import latest_runs, zoo_lines
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def row(config, act, ms, **extra):
        return {"model": "m", "config": config, "activation_mib": act, "step_ms": ms, **extra}

    rows = [row("base_fp32", 1000.0, 20.0), row("compile+bf16", 500.0, 10.0),
            row("ckpt_every_block+bf16", 200.0, 15.0),
            row("auto_fast", 300.0, 12.0, dominated_by=[], autoplan_s=40.0),
            row("auto_small", 400.0, 18.0, dominated_by=["ckpt_every_block+bf16"], autoplan_s=75.0, gpu="NVIDIA H200"),
            {"model": "broken", "config": "all", "error": "timed out after 900 s"}]
    lines = zoo_lines(rows)
    m = next(line for line in lines if line.startswith("| m |"))
    cells = [c.strip() for c in m.strip("|").split("|")]
    # Each answer: its cell, what dominates it, what beats it by autoplan's rule (10% less memory
    # within the time limit: every block at 0.2 in 15 ms against 20 ms and 30 ms; within 10% of
    # the memory and 10% faster: the 1.0x answer beside the 1.5x one; compiled rows not read
    # against eager answers).
    assert cells[1:7] == ["0.30 @ 1.20", "none", "ckpt_every_block+bf16", "0.40 @ 1.80", "ckpt_every_block+bf16",
                          "ckpt_every_block+bf16, auto_fast"]
    assert cells[7:10] == ["not run", "-", "-"] and cells[10] == "0.20 @ 1.50"
    assert cells[-3:] == ["40.0 / 75.0 / -", "-", "H200"]
    assert any("| broken | error: timed out after 900 s" in line for line in lines)
    assert lines[-3] == "Dominated: 1 of 2 answers (m auto_small)."
    assert lines[-2] == "Beaten by autoplan's rule: 2 of 2 answers (m auto_fast, m auto_small)."
    # Two answers of one plan, timed apart: the same plan, not a plan that beats it.
    same = [dict(r, plan="p") if r["config"].startswith("auto") else r for r in rows]
    cells = [c.strip() for c in next(x for x in zoo_lines(same) if x.startswith("| m |")).strip("|").split("|")]
    assert cells[6] == "ckpt_every_block+bf16"
    # An eager answer that only a compiled row dominates is counted apart.
    rows[3] = row("auto_fast", 300.0, 12.0, dominated_by=["compile+bf16"], autoplan_s=40.0)
    assert "; of the eager answers, 1 only by a compiled row (m auto_fast)." in zoo_lines(rows)[-3]
    # compile=True: beaten by compiled rows too; its compile stage's seconds beside the cold compile.
    rows[1]["first_ms"] = 30000.0
    rows.insert(5, row("auto_compile", 520.0, 12.0, compile_stage_s=95.0, again_s=50.0, again_stage_s=20.0))
    cells = [c.strip() for c in next(x for x in zoo_lines(rows) if x.startswith("| m |")).strip("|").split("|")]
    assert cells[7:10] == ["0.52 @ 1.20", "none", "compile+bf16, ckpt_every_block+bf16, auto_fast, auto_small"]
    assert cells[-2] == "95.0 / 30.0 (again: 50.0, its stage 20.0)"
    rows[5] = row("auto_compile", 520.0, 12.0, compile_stage_s=95.0, again_error="timed out after 600 s")
    cells = [c.strip() for c in next(x for x in zoo_lines(rows) if x.startswith("| m |")).strip("|").split("|")]
    assert cells[-2] == "95.0 / 30.0 (again: timed out after 600 s)"
    # A model's later run replaces its earlier one whole, an error row of the earlier one too.
    again = [{"model": "broken", "config": "base_fp32", "activation_mib": 10.0, "step_ms": 1.0, "run": "later"}]
    assert latest_runs(rows + again) == (rows[:-1] + again, [])
    # A run that ended without rows does not (the deadline cut it, or it timed out): the model's
    # earlier figures stand, and the latest such run comes second, but one the deadline never started.
    cut = [{"model": "broken", "config": "all", "error": "stopped at the run's deadline after 50 s", "run": "last",
            "cut": True}]
    late = [{"model": "broken", "config": "all", "error": "timed out after 900 s; it had answered ...", "run": "before last"}]
    unstarted = [{"model": "broken", "config": "all", "error": "not started: the run's deadline passed", "run": "last",
                  "cut": True}]
    assert latest_runs(rows + again + cut) == (rows[:-1] + again, cut)
    assert latest_runs(rows + again + late + unstarted) == (rows[:-1] + again, late)
    assert latest_runs(rows + again + late + cut) == (rows[:-1] + again, cut)  # the latest such run
    assert latest_runs(rows + cut + again) == (rows[:-1] + again, [])  # one before the run kept: not listed
    assert latest_runs(rows[-1:] + cut) == (rows[-1:], cut)
    # An error run after an error run is the model's latest: nothing earlier has rows.
    assert latest_runs(rows[-1:] + late) == (late, [])
    # A run that failed replaces the earlier one: the table shows the error.
    failed = [{"model": "broken", "config": "all", "error": "exit 1: RuntimeError: ...", "run": "last"}]
    assert latest_runs(rows + again + failed) == (rows[:-1] + failed, [])


def test_the_benchmarks_import_no_circle():
    graph = {name: _imported(path) - {name} for name, path in MODULES.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join(path + (name,))}"
        if name not in done:
            for other in graph[name]:
                visit(other, path + (name,))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_at_most_eleven_scripts_each_on_the_harness():
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and _is_script(p))
    assert len(scripts) <= 11, scripts
    assert "harness.py" not in scripts
    for name in scripts:
        if name.endswith(".py"):
            assert "harness" in _imported(BENCH / name), f"{name} does not import the harness"


def test_every_json_file_is_rendered_and_every_plot_linked():
    sys.path.insert(0, str(BENCH))
    try:
        from results import RENDERED
    finally:
        sys.path.remove(str(BENCH))
    assert sorted(p.name for p in BENCH.glob("*.json")) == sorted(RENDERED)
    results_source = (BENCH / "results.py").read_text()
    assert all(f'load("{name}")' in results_source for name in RENDERED)
    linked = "".join(p.read_text() for p in [BENCH / "RESULTS.md", ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
    for image in [*BENCH.glob("*.png"), *BENCH.glob("*.svg")]:
        assert image.name in linked, f"{image.name} is linked from nowhere"


def test_no_results_paragraph_over_150_words():
    text = (BENCH / "RESULTS.md").read_text()
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.lstrip().startswith(("|", "#")):
            assert len(paragraph.split()) <= 150, paragraph[:80]


def test_a_json_file_holds_one_row_a_configuration():
    sys.path.insert(0, str(BENCH))
    try:
        from harness import ROW_KEYS, load_rows
    finally:
        sys.path.remove(str(BENCH))
    assert sorted(ROW_KEYS) == sorted(p.name for p in BENCH.glob("*.json"))
    for name, key in ROW_KEYS.items():
        keys = [key(r) for r in load_rows(BENCH / name)]
        assert len(keys) == len(set(keys)), f"{name} holds more than one row of a configuration"


def test_a_new_row_replaces_the_row_of_its_configuration(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from harness import load_rows, save_rows
    finally:
        sys.path.remove(str(BENCH))
    path = tmp_path / "rows.json"
    save_rows(path, [{"model": "m", "config": "a", "ms": 1.0}, {"model": "m", "config": "b", "ms": 1.0}])
    save_rows(path, [{"model": "m", "config": "a", "ms": 2.0}])
    assert load_rows(path) == [{"model": "m", "config": "b", "ms": 1.0}, {"model": "m", "config": "a", "ms": 2.0}]


def test_every_results_anchor_linked_from_the_docs_exists():
    def anchor(heading: str) -> str:  # GitHub's: lower case, punctuation dropped, spaces to hyphens
        return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")

    text = (BENCH / "RESULTS.md").read_text()
    anchors = {anchor(line.lstrip("#").strip()) for line in text.splitlines() if line.startswith("#")}
    for page in [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("src/**/*.py")]:
        for link in re.findall(r"RESULTS\.md#([a-z0-9_-]+)", page.read_text()):
            assert link in anchors, f"{page.relative_to(ROOT)} links RESULTS.md#{link}, which is no heading"


def test_the_host_section_renders_its_rows_and_nothing_without_them(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import results
        from harness import ROW_KEYS, save_rows
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(results, "HERE", tmp_path)
    assert results.bandwidth_section() == []
    stamp = {"host_cores": 16, "torch_threads": 16, "gpu": "NVIDIA H200", "torch": "2.13.0", "date": "2026-01-01"}

    def figures(ms, nbytes):
        return {"ms": ms, "ms_low": ms * 0.9, "ms_high": ms * 1.1, "bytes": nbytes, "gb_s": nbytes / ms / 1e6,
                "gb_s_low": nbytes / ms / 1.1e6, "gb_s_high": nbytes / ms / 0.9e6}

    rows = [{"measure": "link", "config": "h2d_pinned", "threads": None, **figures(20.0, 2**30), "array_gib": 1.0,
             **stamp},
            {"measure": "adamw", "config": "worker", "threads": None, **figures(500.0, 28 * 494_000_000),
             "elements": 494_000_000, "tensors": 290, "worker_threads": 1, "worker_threads_found": 1, **stamp}]
    save_rows(tmp_path / "bandwidth.json", rows, key=ROW_KEYS["bandwidth.json"])
    lines = results.bandwidth_section()
    assert lines[0] == "## The host: link, memory and the CPU optimizer"
    assert "| link | h2d_pinned | - | 20.00 (18.00-22.00) | 53.69 (48.81-59.65) | 1.0 GiB an array |" in lines[4 + 2]
    assert "| adamw | worker | 1 (found) | 500.00 (450.00-550.00) | 27.66 (25.15-30.74) | 494M parameters (290 " \
        "tensors) | 16 / 16 | NVIDIA H200 |" in lines[4 + 3]
