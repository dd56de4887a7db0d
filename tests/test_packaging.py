"""What a fresh machine installs: pyproject's dependencies and extras, and .ci/run building its own
environment to run the README's install lines and test command as written. (The real check is
`bash .ci/run` in a fresh clone; these keep its rules.)"""

import pathlib
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {r.name.lower().replace("-", "_"): r for r in map(Requirement, names)}


def readme_lines(which: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_lines.py"), which],
                          capture_output=True, text=True, check=True)
    return done.stdout


def test_the_dependencies_hold_numpy_and_the_test_extra_the_third_party_models():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in requirements(project["dependencies"])  # torch warns at every import without it
    test = requirements(project["optional-dependencies"]["test"])
    assert {"pytest", "transformers", "efficientnet_pytorch", "accelerate", "peft"} <= set(test)  # accelerate: the Trainer
    # 4.50 is the oldest checked to pass; 5.24 is what pip resolves today.
    assert all(test["transformers"].specifier.contains(v) for v in ("4.50.0", "5.24.0"))
    assert not test["transformers"].specifier.contains("4.49.0")
    # PyPI's torchvision is built for PyPI's CUDA torch: an extra would pull it beside a CPU one.
    assert "vision" not in project["optional-dependencies"]


def test_ci_runs_the_readmes_install_lines_and_test_command_as_written():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert 'python3 -m venv "$venv"' in commands and 'venv="${SHRINKWRAP_CI_VENV:-' in script
    assert any(c.startswith('export PATH="$venv/bin:$PATH"') for c in commands)
    assert not [c for c in commands if "pip install" in c]  # every install is the README's, run below
    assert 'install="$(python3 .ci/readme_lines.py install)"' in commands
    assert 'bash -euo pipefail -c "$install"' in commands
    assert commands[-2:] == ['echo "ci: $test_command"', 'bash -euo pipefail -c "$test_command"']


def test_the_install_lines_are_the_readmes_cpu_block():
    install = readme_lines("install")
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", README, re.S).group(1)
    assert install == block
    lines = install.splitlines()
    # torch first, by the exact pin this machine has a CPU wheel for, from torch's CPU index.
    assert lines[0].startswith("pip install torch==2.13.0 ") and "download.pytorch.org/whl/cpu" in lines[0]
    assert "> constraints.txt" in lines[1]
    assert lines[2] == 'pip install -c constraints.txt -e ".[test,plot]"'


def test_the_constraint_line_names_the_installed_torch(tmp_path):
    line = readme_lines("install").splitlines()[1]
    code = re.fullmatch(r'python -c "(.*)" > constraints.txt', line).group(1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import torch
    assert Requirement(done.stdout.strip()).specifier.contains(torch.__version__)


def test_the_test_command_is_the_readmes():
    assert readme_lines("test") == "python3 -m pytest -q\n"
    assert "The tests (" in README
