"""shrinkwrap.estimate: a training iteration's CUDA peak predicted on the CPU with fake tensors."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.cli import main

MiB = 2**20
WIDTH, BATCH, DEPTH = 256, 512, 6


def mlp() -> nn.Module:
    """``DEPTH`` blocks of three Linear + Tanh layers, then a head."""
    def block():
        return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    return nn.Sequential(nn.Sequential(*[block() for _ in range(DEPTH)]), nn.Linear(WIDTH, 1))


def test_the_static_terms_are_the_model_s_own_bytes():
    est = sw.estimate(mlp, torch.randn(BATCH, WIDTH))
    params = sum(p.numel() * 4 for p in mlp().parameters())
    assert est.parameters == params
    assert est.optimizer_state >= 2 * params  # AdamW's two moments (and its step counts)
    assert est.peak == sum(est.breakdown().values())
    # Each Tanh keeps its output (the next Linear's input): 3 x depth activations of batch x width.
    assert est.activations >= 3 * DEPTH * BATCH * WIDTH * 4


def test_a_plan_s_saving_shows_in_the_estimate_and_what_it_cannot_see_is_said():
    batch = torch.randn(BATCH, WIDTH)
    # Each block recomputed from its input: one tensor kept a block, and one block's recompute.
    plain, checkpointed = sw.estimate(mlp, batch), sw.estimate(mlp, batch, r"checkpoint(r'0\.\d')")
    assert checkpointed.activations < 0.6 * plain.activations
    assert checkpointed.parameters == plain.parameters
    compiled = sw.estimate(mlp, batch, "compile(backend='eager')")
    assert any("compile() is estimated as eager" in n for n in compiled.notes)


def test_attention_is_estimated_as_a_fused_kernel_keeps_it():
    class Attention(nn.Module):
        def forward(self, x):
            q = x.view(4, 8, 256, 32)
            return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True).sum()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.attn = nn.Linear(256, 256), Attention()

        def forward(self, x):
            return self.attn(self.proj(x))

    est = sw.estimate(Model, torch.randn(4, 256, 256))
    probabilities = 4 * 8 * 256 * 256 * 4  # batch x heads x length x length floats
    assert est.activations < probabilities, est


def test_the_command_prints_and_writes_json(capsys, tmp_path):
    assert main(["estimate", "shrinkwrap.models:tiny_efficientnet", "--batch", "4", "--plan", "swish()",
                 "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "estimated CUDA peak of a training iteration" in out and "plan: swish()" in out
    for term in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "output", "batch"):
        assert f"\n  {term} " in out
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["schema"] == "shrinkwrap.estimate/2" and data["peak_mib"] > data["parameters_mib"] > 0
    assert data["peak_phase"] in ("forward", "loss", "backward", "step") and data["peak_at"] in out
    assert set(data["holds"]) == {k.removesuffix("_mib") for k in data if k.endswith("_mib") and k != "peak_mib"}


W, LAYERS = 256, 4


def stack() -> nn.Module:
    """Linear layers without bias: ``LAYERS`` weights of ``W`` x ``W`` floats, nothing else."""
    return nn.Sequential(*[nn.Linear(W, W, bias=False) for _ in range(LAYERS)])


WEIGHTS = LAYERS * W * W * 4
STATE = 2 * WEIGHTS + LAYERS * 4  # AdamW's two moments, and a float step count a parameter


def test_a_peak_at_the_optimizer_step_holds_every_gradient_and_the_state_apart_from_the_step_s_scratch():
    # Weights dominate a batch of 8: the peak is the step, every gradient alive, the activations gone.
    est = sw.estimate(stack, torch.randn(8, W))
    assert (est.phase, est.module, est.moment) == ("step", None, "in the optimizer step")
    assert est.parameters == WEIGHTS and est.gradients == WEIGHTS
    # The multi-tensor step's parameter-sized working tensors are its temporaries, not its state.
    assert est.optimizer_state == STATE
    assert WEIGHTS // 2 <= est.temporaries <= 2 * WEIGHTS
    assert est.activations == 0 and est.output == 8 * W * 4 + 4  # the output and the scalar loss, held to the end
    assert est.batch == 8 * W * 4 and est.peak == sum(est.breakdown().values())
    assert "every trained parameter's" in est.holds()["gradients"]
    assert "in the optimizer step" in str(est) and "optimizer step's working tensors" in str(est)


def test_a_peak_in_backward_names_the_module_and_holds_what_backward_has_made():
    # Activations dominate a batch of 8192: the peak is at the last layer's backward, where its weight's
    # gradient is being computed (a temporary until it is stored) and none is stored yet.
    batch = 8192
    est = sw.estimate(stack, torch.randn(batch, W))
    assert (est.phase, est.module, est.moment) == ("backward", str(LAYERS - 1), f"in backward, at {LAYERS - 1}")
    assert est.gradients == 0 and est.holds()["gradients"].startswith("none yet")
    assert est.optimizer_state == STATE
    # Saved for backward: the inputs of layers 1..3 (layer 0's is the batch), and backward's seed, a float.
    assert est.activations == (LAYERS - 1) * batch * W * 4 + 4
    assert est.output == batch * W * 4 + 4 and est.batch == batch * W * 4
    # The gradient of the output and of the last layer's input, and the last layer's weight gradient.
    assert est.temporaries == 2 * batch * W * 4 + W * W * 4
    # A deeper model's peak at the start of backward: the gradients made so far are its head's.
    head = 256 * 1 * 4 + 4
    deep = sw.estimate(mlp, torch.randn(BATCH, WIDTH))
    assert deep.phase == "backward" and deep.module.startswith(f"0.{DEPTH - 1}.")
    assert deep.gradients == head and deep.holds()["gradients"] == "those backward has made so far"


def test_with_the_step_in_backward_the_peak_holds_only_the_gradient_being_stepped():
    est = sw.estimate(stack, torch.randn(8, W), "step_in_backward(torch.optim.AdamW)")
    assert est.phase == "backward" and est.stepping and est.moment.endswith("during a step in backward")
    # Each gradient is freed once stepped: what is alive is the one parameter's being stepped.
    assert 0 < est.gradients <= W * W * 4 and "the step in backward frees each" in est.holds()["gradients"]
    assert est.optimizer_state == STATE and est.temporaries > 0


def test_a_language_model_s_peak_at_the_loss_s_gradient_holds_no_gradient_yet():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000)
    ids = torch.randint(0, 1000, (4, 128))
    est = sw.estimate(lambda: transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids})
    # The logits' gradient and the loss's over the vocabulary, before backward reaches a parameter.
    assert est.phase == "backward" and "the loss's gradient" in est.moment
    assert est.gradients == 0 and est.temporaries >= 2 * 4 * 128 * 1000 * 4
    assert est.output >= 4 * 128 * 1000 * 4  # the logits, which the output holds


def gpt2(positions: int = 64) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=positions, vocab_size=1000)
    return transformers.GPT2LMHeadModel(config)


def test_an_input_longer_than_the_model_s_positions_fails_as_the_real_run_does():
    ids = torch.randint(0, 1000, (2, 128))
    with pytest.raises(IndexError, match="index out of range"):
        gpt2()(input_ids=ids)  # the real run
    with pytest.raises(IndexError, match=r"^shrinkwrap: the model's embedding 'transformer\.wpe' has 64 rows, "
                                         r"and an index the model computes .* reaches row 127: .*shorter input"):
        sw.estimate(gpt2, {"input_ids": ids, "labels": ids})
    short = torch.randint(0, 1000, (2, 64))
    assert sw.estimate(gpt2, {"input_ids": short, "labels": short}).peak > 0
    ids[0, 5] = 1000  # a token id past the vocabulary
    with pytest.raises(IndexError, match=r"'transformer\.wte' has 1000 rows, and a value of the batch reaches row 1000"):
        sw.estimate(functools.partial(gpt2, 128), {"input_ids": ids, "labels": ids})


def test_any_embedding_s_range_is_checked_where_the_model_computes_its_indices():
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(100, 8), nn.Embedding(16, 8)

        def forward(self, ids):
            where = torch.arange(ids.shape[1]).expand_as(ids) + 2  # two rows kept for marks
            ids.clamp_(max=99)  # in place on the batch, as some tokenizer-side code does
            return self.tokens(ids) + self.positions(where)

    ids = torch.full((2, 14), 150)
    assert sw.estimate(Positions, ids).peak > 0  # positions 2..15 of 16
    assert (ids == 150).all()  # the batch comes back as it was given
    with pytest.raises(IndexError, match=r"'positions' has 16 rows, and an index the model computes .* reaches row 16"):
        sw.estimate(Positions, torch.full((2, 15), 150))


def test_the_command_refuses_an_input_the_model_cannot_take(capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    # A model file with the vocabulary given: nothing is built to read its config, so the estimate's
    # own index check is what refuses (transformers: specs are refused earlier, from the config).
    (tmp_path / "small_lm.py").write_text(
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "def make():\n    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "small_lm.py:make", "--tokens", "1000", "--batch", "1", "--input", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shrinkwrap: error: the model's embedding 'transformer.wpe' has 64 rows") and "\n" not in err


@pytest.mark.cuda
@pytest.mark.parametrize("plan", ["", "checkpoint(r'layer[1-4]'), autocast(torch.bfloat16)"])
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(plan):
    torchvision = pytest.importorskip("torchvision")
    batch = torch.randn(64, 3, 224, 224)
    est = sw.estimate(torchvision.models.resnet18, batch, plan)
    model = sw.apply(torchvision.models.resnet18(), plan)
    held = torch.cuda.memory_allocated()  # not this model's: what the process held before
    peak = sw.measure(model, batch, device="cuda").peak - held
    assert abs(est.peak - peak) <= 0.10 * peak, (est.peak / MiB, peak / MiB, held / MiB)


def test_the_step_in_backward_is_estimated_with_its_handle_and_no_gradient_term():
    # A wide model at a batch of 8: parameters, gradients and state are the bill, and the plain
    # loop's peak is its optimizer step with every gradient held.
    def wide():
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    batch = torch.randn(8, 1024)
    plain = sw.estimate(wide, batch)
    stepped = sw.estimate(wide, batch, "step_in_backward(torch.optim.AdamW)")
    grads = sum(p.numel() * 4 for p in wide().parameters())
    assert plain.gradients == grads
    # Each gradient is dropped once its bucket is stepped: at most a bucket and one parameter's are
    # alive (a bucket: a sixteenth of the gradients here, 2 MiB).
    from shrinkwrap.transforms.optimizer.backward import _SHARE

    assert stepped.gradients <= grads // _SHARE + max(p.numel() * 4 for p in wide().parameters())
    assert stepped.peak <= plain.peak - 0.9 * grads, (stepped, plain)
    with pytest.raises(ValueError, match="shrinkwrap: estimate\\(\\) cannot model step_in_backward\\(state='cpu'\\)"):
        sw.estimate(wide, batch, "step_in_backward(torch.optim.AdamW, state='cpu')")
