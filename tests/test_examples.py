"""The examples run as written and print what their docstrings promise."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_trainer_example_reloads_the_weights_into_a_plain_model():
    pytest.importorskip("transformers")
    assert "same weights: True" in run("trainer.py")


def test_the_step_in_backward_example_resumes_from_a_checkpoint_to_the_same_weights():
    pytest.importorskip("transformers")
    assert "largest weight difference 0.0e+00" in run("trainer_step_in_backward.py")


def test_the_quickstart_shows_what_the_plan_saved():
    assert "saved for backward:" in run("quickstart.py")
