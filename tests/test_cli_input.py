"""The shrinkwrap command's input read before anything is measured: each misread a one-line error,
and a language model of the user's own given token ids."""

import os
import sys

import pytest
import torch
import torch.nn as nn

import shrinkwrap.cli as cli
from shrinkwrap.cli import load_model, main
from test_cli import FAST, one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "shrinkwrap.models:tiny_efficientnet"
LM = f"{__name__}:small_lm"


def small_lm() -> nn.Module:
    """A factory for `--tokens`: a Hugging Face language model, its vocabulary in its config."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=97, n_positions=32,
                                         bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def plain_lm() -> nn.Module:
    """A language model with no config: the vocabulary must be given."""
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))


def declared_lm() -> nn.Module:
    return plain_lm()


declared_lm.vocab_size = 50
declared_lm.input_shape = (12,)

BUILT: list[str] = []


def recorded_lm() -> nn.Module:
    """Records the device each build of it lands on; refuses the meta device when asked to."""
    BUILT.append(str(torch.empty(0).device))
    if os.environ.get("REFUSE_META") and BUILT[-1] == "meta":
        raise RuntimeError("weights cannot load on meta")
    return small_lm()


@pytest.fixture
def nothing_measured(monkeypatch):
    """Every check here comes before measuring: the measuring entries fail the test if called."""
    def fail(*a, **k):
        pytest.fail("measured before the input was checked")

    monkeypatch.setattr(cli, "plan_report", fail)
    monkeypatch.setattr(sys.modules["shrinkwrap.autoplan"], "autoplan", fail)
    monkeypatch.setattr(sys.modules["shrinkwrap.measuring.estimate"], "estimate", fail)


FIT = ["fit", MODEL, "--batch", "2"]
PROFILE = ["profile", MODEL, "--batch", "2"]
ESTIMATE = ["estimate", MODEL, "--batch", "2"]
SLOWDOWN = "expected the step time allowed as a multiple of the baseline's, a number above 0"
FOLDER = "{tmp} is a folder; name a file in it, e.g. "
PLOT = "end the name in a format matplotlib writes (png, pdf, svg"
GPT2 = ["transformers:GPT2Config", "--batch", "2"]


@pytest.mark.parametrize("argv, expected", [
    ([*FIT, "--max-slowdown", "0"], f"argument --max-slowdown: {SLOWDOWN}"),
    ([*FIT, "--max-slowdown", "-1"], f"{SLOWDOWN} such as 1.2 (at most 20% slower), got '-1'"),
    ([*FIT, "--max-slowdown", "-1e3"], f"{SLOWDOWN}"),
    ([*FIT, "--max-slowdown", "nan"], f"{SLOWDOWN}"),
    ([*FIT, "--max-slowdown", "inf"], f"{SLOWDOWN}"),
    ([*FIT, "--max-slowdown", "-inf"], f"{SLOWDOWN}"),
    ([*FIT, "--max-slowdown", "1.2x"], f"{SLOWDOWN}"),
    ([*FIT, "--budget", "-2GiB"], "a budget must be positive, got '-2GiB'"),
    ([*FIT, "--maximize", "batch", "--max-slowdown", "1.5"], "--maximize batch finds the largest batch within a budget"),
    ([*FIT, "--budget", "0.5", "--compile", "swish()"], "argument --compile: expected a compile step such as"),
    ([*FIT, "--budget", "0.5", "--compile", "compile("], "argument --compile: cannot read plan 'compile('"),
    ([*FIT, "--budget", "0.5", "--json", "-", "--markdown"], "--json - prints JSON in place of the table"),
    ([*PROFILE, "--json", "-", "--markdown"], "--json - prints JSON in place of the table, and --markdown"),
    (["demo", "--json", "-", "--markdown"], "give one (--json FILE --markdown writes the JSON and prints markdown)"),
    ([*PROFILE, "--json", "{tmp}"], f"--json {FOLDER}--json {{tmp}}/report.json"),
    ([*FIT, "--budget", "0.5", "--json", "{tmp}"], f"--json {FOLDER}"),
    ([*ESTIMATE, "--json", "{tmp}"], f"--json {FOLDER}--json {{tmp}}/estimate.json"),
    ([*PROFILE, "--plot", "{tmp}"], f"--plot {FOLDER}--plot {{tmp}}/memory.png"),
    ([*PROFILE, "--plot", "memory.txt"], f"--plot memory.txt: {PLOT}"),
    ([*PROFILE, "--plot", "memory"], f"--plot memory: {PLOT}"),
    ([*FIT, "--budget", "0.5", "--plot", "m.html"], f"--plot m.html: {PLOT}"),
    ([*PROFILE, "--plot", "-"], "--plot needs a file name, e.g. --plot memory.png"),
    ([*PROFILE, "--json", ""], "--json needs a file name, e.g. --json report.json ('-': print it)"),
    ([*ESTIMATE, "--json", ""], "--json needs a file name"),
    ([*PROFILE, "--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"], "--json and --plot both name {tmp}/r.png"),
    ([*PROFILE, "--input", "-3,32,32"], "argument --input: sizes must be positive, got '-3,32,32'"),
    ([*PROFILE, "--input=-3,32,32"], "argument --input: sizes must be positive, got '-3,32,32'"),
    ([*ESTIMATE, "--input", "-3,32,32"], "argument --input: sizes must be positive"),
    ([*PROFILE, "--input", "-.5"], "argument --input: expected comma-separated sizes"),
    ([*PROFILE, "--batch", "-1,2"], "argument --batch: expected a positive whole number, got '-1,2'"),
    (["demo", "--device", "mps"], "--device mps: shrinkwrap measures on cpu or cuda"),
    (["demo", "--device", "meta"], "--device meta: shrinkwrap measures on cpu or cuda"),
    (["profile", "transformers:PretrainedConfig", "--batch", "2"], "is the base of every config"),
    (["profile", "transformers:ViTConfig", "--batch", "2"], "transformers:ViTConfig has no vocab_size"),
    (["profile", *GPT2, "--input", "4096"], "GPT2Config holds 1024 positions, and --input 4096 is longer"),
    (["estimate", *GPT2, "--input", "4096"], "give --input 1024 or less"),
    (["profile", *GPT2, "--input", "3,32,32"], "--input is the sequence length, one number (e.g. --input 128), not 3,32,32"),
    (["profile", *GPT2, "--tokens", "100"], "transformers:GPT2Config reads its vocabulary from the config"),
    (["profile", "torchvision:resnet18", "--batch", "2", "--tokens"], "torchvision:resnet18 takes images"),
    (["profile", ":make", "--batch", "2"], "cannot read model ':make'"),
    (["profile", LM, "--batch", "2", "--tokens", "0"], "argument --tokens: expected the vocabulary size"),
    (["profile", LM, "--batch", "2", "--tokens", "-5"], "argument --tokens: expected the vocabulary size"),
    (["profile", "--tokens", LM, "--batch", "2"], "a model named after --tokens is read as its value"),
    (["profile", LM, "--batch", "2", "--tokens", "--input", "3,16"], "--input is the sequence length, one number"),
    (["profile", LM, "--batch", "2", "--tokens", "--input", "33"], f"{LM} holds 32 positions, and --input 33"),
    (["profile", f"{__name__}:plain_lm", "--batch", "2", "--tokens"], "plain_lm's model has none: give the vocab"),
    (["profile", f"{__name__}:plain_lm", "--batch", "2", "--tokens", "50"], "give the sequence length for"),
    (["profile", f"{__name__}:plain_lm", "--batch", "2"], "(a language model: --tokens, and --input the sequence"),
])
def test_a_misread_is_one_error_line_before_measuring(capsys, tmp_path, nothing_measured, argv, expected):
    if any("transformers" in a or "_lm" in a for a in argv):
        pytest.importorskip("transformers")
    tmp = str(tmp_path)
    if argv[0] != "estimate":  # estimate measures nothing: no device, no iterations
        argv = [*argv, *(FAST if "--device" not in argv else FAST[:2])]
    one_error_line(capsys, [a.replace("{tmp}", tmp) for a in argv], expected.replace("{tmp}", tmp))


def test_a_gpu_index_this_machine_lacks(capsys, monkeypatch, nothing_measured):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_error_line(capsys, ["demo", "--device", "cuda:3"], "--device cuda:3: this machine has 1 GPU(s), cuda:0 to cuda:0")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes a read-only file")
def test_a_read_only_output_is_refused_before_measuring(capsys, tmp_path, nothing_measured):
    path = tmp_path / "r.json"
    path.write_text("{}")
    path.chmod(0o444)
    one_error_line(capsys, [*PROFILE, "--json", str(path), *FAST], f"--json {path}: the file is not writable")


@pytest.mark.parametrize("argv, expected", [
    (["--input", "-3,32,32"], ["--input=-3,32,32"]),
    (["--max-slowdown", "-inf", "--budget", "-.5"], ["--max-slowdown=-inf", "--budget=-.5"]),
    (["--input=-3", "-4"], ["--input=-3", "-4"]),   # the option has its value already
    (["--", "-3"], ["--", "-3"]),
    (["--plan", "swish()", "--quiet"], ["--plan", "swish()", "--quiet"]),
])
def test_a_value_that_starts_with_a_dash_reaches_its_option(argv, expected):
    assert cli._joined(["profile", "m:f", *argv]) == ["profile", "m:f", *expected]


# -- a language model of the user's own: token ids ---------------------------------------------


def test_tokens_alone_reads_the_vocabulary_from_the_models_config(capsys):
    pytest.importorskip("transformers")
    import json

    argv = ["profile", LM, "--batch", "2", "--tokens", "--input", "8", "--plan", "checkpoint('transformer.h.0')",
            "--json", "-", *FAST]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == "input_ids 2x8 int64, labels 2x8 int64"
    assert [r["step"] for r in data["rows"]] == ["baseline", "checkpoint('transformer.h.0')"]
    _, batch = load_model(LM, (8,), 64, tokens=True)
    assert batch["input_ids"].max() < 97 and batch["input_ids"].max() > 50 and batch["labels"] is batch["input_ids"]
    _, batch = load_model(LM, (8,), 64, tokens=5)  # a number given is the vocabulary
    assert batch["input_ids"].max() < 5


def test_tokens_without_a_length_takes_the_configs_positions():
    pytest.importorskip("transformers")
    _, batch = load_model(LM, None, 2, tokens=True)
    assert batch["input_ids"].shape == (2, 32)


def test_the_model_read_for_its_config_is_built_on_the_meta_device(monkeypatch):
    pytest.importorskip("transformers")
    BUILT.clear()
    make, _ = load_model(f"{__name__}:recorded_lm", (8,), 2, tokens=True)
    assert BUILT == ["meta"]  # no memory, no initialisation: each row builds its own
    monkeypatch.setenv("REFUSE_META", "1")
    BUILT.clear()
    load_model(f"{__name__}:recorded_lm", (8,), 2, tokens=True)
    assert BUILT == ["meta", "cpu"]  # a factory that cannot build on meta is built as it is
    BUILT.clear()
    load_model(f"{__name__}:recorded_lm", (8,), 2, tokens=7)
    assert BUILT == []  # vocabulary and length given: nothing to read
    assert make().lm_head.weight.device.type == "cpu"


def test_a_factory_that_declares_its_vocabulary_gets_tokens_without_the_option():
    _, batch = load_model(f"{__name__}:declared_lm", None, 3)
    assert batch["input_ids"].shape == (3, 12) and batch["input_ids"].max() < 50


def test_a_model_file_whose_module_name_is_taken_is_refused(capsys, tmp_path, monkeypatch, nothing_measured):
    # json.py beside the user's code: `import json` finds the standard library's, not the file
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "json.py").write_text("import torch.nn as nn\n\ndef make():\n    return nn.Linear(3, 2)\n")
    one_error_line(capsys, ["profile", f"{tmp_path}/json.py:make", "--batch", "2", "--input", "3", *FAST],
                   f"the module name 'json' is taken by {sys.modules['json'].__file__}")
