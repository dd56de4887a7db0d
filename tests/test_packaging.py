"""What a fresh machine installs: pyproject's extras, and .ci/run building its own environment to run
the README's test command. (The real check is `bash .ci/run` in a fresh clone; these keep its rules.)"""

import pathlib
import re

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {r.name.lower().replace("-", "_"): r for r in map(Requirement, names)}


def test_the_test_extra_has_the_third_party_models_and_numpy_stays_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test = requirements(project["optional-dependencies"]["test"])
    assert {"pytest", "transformers", "efficientnet_pytorch", "accelerate", "peft"} <= set(test)  # accelerate: the Trainer
    # 4.50 is the oldest checked to pass; 5.23 is what pip resolves today.
    assert all(test["transformers"].specifier.contains(v) for v in ("4.50.0", "5.23.0"))
    assert not test["transformers"].specifier.contains("4.49.0")
    assert "numpy" not in requirements(project["dependencies"])  # torch only warns without it


def test_ci_installs_into_its_own_venv_and_runs_the_readmes_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert any(re.fullmatch(r'python3 -m venv "\$venv"', c) for c in commands)
    assert 'venv="${SHRINKWRAP_CI_VENV:-' in script
    pips = [c for c in commands if "pip install" in c]
    assert pips and all(c.startswith('"$python" -m pip install') for c in pips)  # never python3's own pip
    # torch first, by its exact pin (the CPU wheel on disk), then the rest under a constraint keeping it.
    assert pips[0].endswith('"torch==2.13.0"')
    assert pips[-1].endswith('-e ".[test]"') and all(' -c "$scratch/constraints.txt" ' in c for c in pips[1:])
    assert 'echo "torch==2.13.0" > "$scratch/constraints.txt"' in commands
    readme = (ROOT / "README.md").read_text()
    test_command = re.search(r"The tests, after `pip install -e \"\.\[test\]\"`.*?\n\n    (python3 -m pytest[^\n]*)",
                             readme, re.S).group(1)
    assert commands[-1] == test_command.replace("python3", '"$python"', 1)
