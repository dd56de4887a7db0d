"""The shrinkwrap command: demo, profile, and one clear line for bad input."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from shrinkwrap.cli import main, matching_torchvision

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--iterations", "1", "--device", "cpu"]


def small_model() -> nn.Module:
    """A factory for `profile test_cli:small_model`."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Tanh()), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, 4))


def factory_that_raises() -> nn.Module:
    """A factory for `profile test_cli:factory_that_raises`: the user's model code fails."""
    raise RuntimeError("no weights on this machine")


def factory_of_text() -> str:
    return "a model, I promise"


def error_line(stderr: str) -> str:
    """The command's error line: the last line of stderr. Lines before it are not the command's:
    torch warns on import where numpy is missing ("UserWarning: Failed to initialize NumPy")."""
    assert stderr.endswith("\n") and "Traceback" not in stderr, stderr
    return stderr.splitlines()[-1]


def one_error_line(capsys, argv, expected: str) -> None:
    """The command ends in one error line, exit 2: before it, progress lines at most (stderr is no
    terminal here: a line as each stage starts and as each of its items ends)."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and error_line(err).startswith("shrinkwrap: error: ")
    assert all(re.fullmatch(r"shrinkwrap: \d+/\d+ .*", line) for line in lines[:-1]), err
    assert expected in lines[-1], err


def test_demo_runs_and_prints_the_report(capsys, tmp_path):
    assert main(["demo", "--batch", "2", *FAST, "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    # stderr is no terminal here: a line as the rows start and as each ends, no bar redrawn in place
    lines = err.splitlines()
    assert lines[0] == "shrinkwrap: 0/5 rows" and lines[1].startswith("shrinkwrap: 1/5 rows") and "\r" not in err
    assert lines[1].endswith(": baseline") and len(lines) == 6
    assert "baseline" in out and "checkpoint(" in out and torch.__version__ in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rows"][0]["step"] == "baseline" and len(data["rows"]) >= 2
    assert data["model"].startswith("shrinkwrap.models:tiny_efficientnet")
    assert main(["demo", "--batch", "2", *FAST, "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # no progress with --quiet


def test_profile_a_package_module_factory(capsys):
    argv = ["profile", f"{__name__}:small_model", "--batch", "2", "--input", "3,8,8",
            "--plan", "checkpoint('3')", "--json", "-", *FAST]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in data["rows"]] == ["baseline", "checkpoint('3')"]
    assert data["rows"][1]["matched"] == ["3"] and data["batch"] == "2x3x8x8 float32"


def test_profile_reads_the_input_shape_a_factory_declares(capsys):
    argv = ["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--plan", "checkpoint('head')", "--markdown", *FAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| `baseline` |" in out and "1x3x32x32" in out


@pytest.mark.parametrize("argv, expected", [
    (["profile", "nocolon", "--batch", "1", "--plan", ""], "cannot read model 'nocolon'"),
    (["profile", "shrinkwrap.models:nosuch", "--batch", "1", "--plan", ""], "no callable 'nosuch'"),
    (["profile", "no_such_package_xyz:f", "--batch", "1", "--plan", ""], "cannot import 'no_such_package_xyz'"),
    (["profile", f"{__name__}:small_model", "--batch", "1", "--plan", ""], "--input"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--plan", "frobnicate()"], "unknown step 'frobnicate'"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--plan", "checkpoint("], "cannot read plan"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--plan", "checkpoint('nope')"], "matches no module"),
    (["demo", "--snapshot", "s.pickle", "--device", "cpu"], "--snapshot"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--fsdp", "--device", "cpu"], "add --nproc N"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--nproc", "2", "--device", "cpu"],
     "--nproc needs --fsdp or --ddp"),
])
def test_bad_input_gets_one_clear_line(capsys, argv, expected):
    one_error_line(capsys, argv, expected)


@pytest.mark.parametrize("command", [["profile", "--plan", "swish()"], ["profile"], ["fit", "--budget", "0.5"]])
@pytest.mark.parametrize("factory, expected", [
    ("factory_that_raises", "raised RuntimeError: no weights on this machine"),
    ("factory_of_text", "returned str 'a model, I promise', not an nn.Module"),
])
def test_a_failing_model_factory_is_one_line_naming_the_model(capsys, command, factory, expected):
    argv = [command[0], f"{__name__}:{factory}", "--batch", "2", "--input", "3,8,8", *command[1:], *FAST]
    one_error_line(capsys, argv, f"shrinkwrap: error: model {__name__}:{factory} {expected}")


def test_profile_without_a_plan_profiles_the_model_as_it_is(capsys, tmp_path):
    argv = ["profile", f"{__name__}:small_model", "--batch", "2", "--input", "3,8,8", "--json", str(tmp_path / "r.json"), *FAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "largest contributors, baseline" in out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["step"] for r in rows] == ["baseline"] and rows[0]["top_modules"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_without_cuda(capsys):
    one_error_line(capsys, ["demo", "--device", "cuda"], "--device cuda asked")


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has four GPUs")
def test_more_ranks_than_gpus(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve_device would refuse first
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    one_error_line(capsys, ["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "1", "--nproc", "4", "--ddp",
                            "--device", "cuda"], "--nproc 4 needs a GPU per rank")


@pytest.mark.parametrize("argv, expected", [
    (["--nproc", "2", "--fsdp"], ["--fsdp"]),
    (["--fsdp", "--nproc=2", "--plan", "x"], ["--fsdp", "--plan", "x"]),
    (["--np", "2", "--ddp"], ["--ddp"]),  # argparse reads an abbreviation as --nproc
])
def test_a_rank_is_started_without_nproc(argv, expected):
    from shrinkwrap.cli import _without_nproc

    assert _without_nproc(["profile", "m:f", *argv]) == ["profile", "m:f", *expected]


@pytest.mark.parametrize("package", ["torchvision", "timm", "transformers"])
def test_missing_optional_package_names_the_pip_command(capsys, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    # torchvision pinned to this torch's (an unpinned one may not import beside it); timm brings one
    vision = f"pip install '{matching_torchvision()}'"
    expected = {"torchvision": vision, "timm": vision, "transformers": "pip install transformers"}[package]
    one_error_line(capsys, ["profile", f"{package}:x", "--batch", "1", "--plan", ""], expected)
    if package == "timm":
        one_error_line(capsys, ["profile", "timm:x", "--batch", "1"], "&& pip install timm")


@pytest.mark.parametrize("torch_version, requirement", [
    ("2.4.1+cu121", "torchvision==0.19.*"), ("2.11.0", "torchvision==0.26.*"), ("2.13.0+cpu", "torchvision==0.28.*"),
    ("2.13.0.dev20260101+cpu", "torchvision==0.28.*"), ("1.13.1", "torchvision"),
])
def test_matching_torchvision_pairs_torch_2_x_with_0_x_plus_15(torch_version, requirement):
    assert matching_torchvision(torch_version) == requirement


def test_the_torchvision_advice_names_the_index_this_torch_came_from(monkeypatch):
    import shrinkwrap.cli_models as cli_models

    for version, index in (("2.13.0+cpu", " --index-url https://download.pytorch.org/whl/cpu"),
                           ("2.13.0+cu126", " --index-url https://download.pytorch.org/whl/cu126"), ("2.13.0", "")):
        monkeypatch.setattr(torch, "__version__", version)
        assert cli_models._install("torchvision").endswith(f"pip install 'torchvision==0.28.*'{index}")


def test_unknown_torchvision_model(capsys):
    pytest.importorskip("torchvision")
    one_error_line(capsys, ["profile", "torchvision:resnet1888", "--batch", "1", "--plan", ""], "resnet18")


def test_torchvision_model_runs(capsys):
    pytest.importorskip("torchvision")
    argv = ["profile", "torchvision:resnet18", "--batch", "2", "--input", "3,32,32", "--plan", "checkpoint('layer1')", *FAST]
    assert main(argv) == 0 and "layer1" in capsys.readouterr().out


@pytest.mark.parametrize("config, head, labels", [("GPT2Config", "GPT2LMHeadModel", "1x16"),
                                                   ("BertConfig", "BertForSequenceClassification", "1 ")])
def test_transformers_config_class_runs(capsys, monkeypatch, config, head, labels):
    transformers = pytest.importorskip("transformers")
    import shrinkwrap.cli_models as cli_models

    small = dict(GPT2Config=dict(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64),
                 BertConfig=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=128, max_position_embeddings=64))
    # The default configs build 100M-parameter models; the path under test is the same for a small one.
    monkeypatch.setattr(cli_models, "_hf_config", lambda name: getattr(transformers, name)(**small[name]))
    argv = ["profile", f"transformers:{config}", "--batch", "1", "--input", "16", "--plan", "", "--json", "-", *FAST]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == f"transformers:{config}" and f"input_ids 1x16 int64, labels {labels}" in data["batch"]
    assert any(e["module"].startswith(("transformer.", "bert.")) for e in data["rows"][0]["top_modules"])
    assert type(cli_models._transformers(config)).__name__ == head


def test_python_dash_m_runs_the_command():
    run = subprocess.run([sys.executable, "-m", "shrinkwrap", "profile", "x:y", "--batch", "1", "--plan", "bogus("],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and error_line(run.stderr).startswith("shrinkwrap: error: cannot read plan")


def test_fit_prints_the_report_and_a_plan_profile_accepts(capsys):
    model = "shrinkwrap.models:tiny_efficientnet"
    assert main(["fit", model, "--batch", "4", "--budget", "0.6", *FAST]) == 0
    out, _ = capsys.readouterr()
    plan = out.strip().splitlines()[-1].removeprefix("plan: ")
    assert "baseline" in out and "chosen" in out and plan and not plan.startswith("(none")
    assert max(len(line) for line in out.splitlines()) <= 120, out
    assert main(["profile", model, "--batch", "4", "--plan", plan, *FAST]) == 0


def test_fit_compile_tries_the_plans_compiled(capsys):
    step = "compile(backend='aot_eager')"
    assert main(["fit", "test_cli:small_model", "--input", "3,8,8", "--batch", "4", "--max-slowdown", "100",
                 "--compile", step, *FAST]) == 0
    out, _ = capsys.readouterr()
    assert "compiled: " in out and step in out


def test_fit_needs_a_readable_budget(capsys):
    one_error_line(capsys, ["fit", "test_cli:small_model", "--input", "3,8,8", "--batch", "4", "--budget", "lots", *FAST],
                   "cannot read budget 'lots'")


def test_torchrun_variables_inherited_without_fsdp_or_ddp_profile_this_process(capsys, monkeypatch):
    # A process that inherited a torchrun job's environment is not a rank this command started:
    # joining a group of two would wait for a second rank that never comes.
    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29999").items():
        monkeypatch.setenv(key, value)
    assert main(["profile", f"{__name__}:small_model", "--batch", "2", "--input", "3,8,8", *FAST]) == 0
    assert not torch.distributed.is_initialized()


# -- the edges: each one line and exit 2, before anything is measured -------------------------


def model_that_fails_on_the_batch() -> nn.Module:
    """A model whose forward raises on an input of the wrong shape (the user's --input)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(10, 2))


@pytest.mark.parametrize("argv, expected", [
    (["fit", "shrinkwrap.models:tiny_efficientnet", "--batch", "2", "--budget", "1.5"],
     "budget 1.5 has no unit: a fraction of the baseline's memory is at most 1, and bytes need a unit"),
    (["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "2", "--plan", "checkpoint('blocks'"],
     "cannot read plan \"checkpoint('blocks'\": '(' was never closed"),
    (["profile", "shrinkwrap.models:tiny_efficientnet"], "the following arguments are required: --batch (see: "),
    (["profile", f"{__name__}:model_that_fails_on_the_batch", "--batch", "2", "--input", "3,8,8"],
     "RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    (["profile", "no/such/file.py:make", "--batch", "2"], "no file 'no/such/file.py' for model"),
])
def test_an_edge_of_the_command_is_one_error_line(capsys, argv, expected):
    one_error_line(capsys, [*argv, *FAST], expected)


@pytest.mark.parametrize("option", ["--json", "--plot", "--snapshot"])
def test_an_output_into_a_missing_folder_is_refused_before_measuring(capsys, option, tmp_path, monkeypatch):
    import shrinkwrap.cli as cli

    monkeypatch.setattr(cli, "plan_report", lambda *a, **k: pytest.fail("measured before checking the output"))
    path = str(tmp_path / "nowhere" / "out.png")
    expected = "needs a GPU" if option == "--snapshot" else f"{option} {path}: the folder {tmp_path / 'nowhere'} does not"
    if option == "--plot":
        pytest.importorskip("matplotlib")
    one_error_line(capsys, ["profile", "shrinkwrap.models:tiny_efficientnet", "--batch", "2", option, path, *FAST],
                   expected)


def test_a_torchvision_that_cannot_be_imported_is_one_line(capsys, monkeypatch):
    import shrinkwrap.cli_models as cli_models

    real = cli_models.importlib.import_module

    def broken(name, *a, **k):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *a, **k)

    monkeypatch.setattr(cli_models.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(cli_models.importlib, "import_module", broken)
    one_error_line(capsys, ["profile", "torchvision:resnet18", "--batch", "2", *FAST],
                   "torchvision is installed but cannot be imported (RuntimeError: operator torchvision::nms does "
                   f"not exist); built for another torch than {torch.__version__}? install the torchvision built for "
                   f"torch {torch.__version__}: pip install '{matching_torchvision()}'")
    # transformers imports an installed torchvision: a broken one is named before a model's import fails
    monkeypatch.undo()
    find_spec = cli_models.importlib.util.find_spec
    monkeypatch.setattr(cli_models.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torchvision" else find_spec(name, *a))
    monkeypatch.setattr(cli_models.importlib, "import_module", broken)
    one_error_line(capsys, ["estimate", "transformers:GPT2Config", "--batch", "2", "--input", "8"],
                   "(transformers models import it where it is installed and fail with it; or: pip uninstall torchvision)")


def test_a_model_file_by_path_and_a_module_in_the_current_folder_load(tmp_path, capsys, monkeypatch):
    (tmp_path / "mymodel.py").write_text(
        "import torch.nn as nn\n\ndef make():\n    return nn.Sequential(nn.Flatten(), nn.Linear(12, 2))\n")
    assert main(["profile", str(tmp_path / "mymodel.py") + ":make", "--batch", "2", "--input", "3,2,2", *FAST]) == 0
    capsys.readouterr()
    script = shutil.which("shrinkwrap", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the shrinkwrap script is not installed beside this python")
    run = subprocess.run([script, "profile", "mymodel:make", "--batch", "2", "--input", "3,2,2", *FAST],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "baseline" in run.stdout


def test_version_and_a_wrong_option_are_one_line_each(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("shrinkwrap 0.")
    one_error_line(capsys, ["demo", "--bogus"], "unrecognized arguments: --bogus (see: shrinkwrap --help)")


def test_the_fit_table_fits_120_columns_with_long_plans(capsys):
    from shrinkwrap import Plan, Report, Row
    from shrinkwrap.measuring.profile import Profile

    def prof(ms):
        return Profile("cuda:0", "GPU", "2", None, 10, 0, 0, 0, ms, [ms], peak=100 * 2**20, first_peak=110 * 2**20,
                       static=10 * 2**20)

    long = Plan.parse(r"checkpoint(r'features\.[1-7]\.\d+'), swish(), bn_act(), channels_last(), autocast(torch.bfloat16)")
    report = Report([Row(Plan(), prof(10.0), role="baseline"), Row(long, prof(12.0), tuple(f"features.{i}.{j}"
                     for i in range(7) for j in range(3)))], "cuda:0", "GPU", "2", model="m", batch="b",
                    notes=[f"note {i}" for i in range(10)])
    text = report.to_text(notes=3)
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert f"[1] {long}" in text and "note 2" in text and "note 3" not in text and "(7 more notes" in text
