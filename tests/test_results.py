"""benchmarks/RESULTS.md is what the JSON rows beside it make (benchmarks/results.py): a figure in it
comes from a row with its GPU, torch version and date, and a row's newest figures replace its old."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_results_md_is_what_the_rows_make():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
