"""A plan under the Hugging Face Trainer: trains, saves, and loads into a model without the plan."""

import pytest
import torch

import shrinkwrap as sw

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement

pytestmark = pytest.mark.usefixtures("one_thread")

PLAN = [sw.checkpoint(r"transformer\.h\.\d+"), sw.autocast(torch.bfloat16)]


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def dataset(n=8, length=16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def train(model, tmp_path, **args):
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", seed=0, **args)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=dataset())
    result = trainer.train()
    return trainer, result


def test_a_model_with_a_plan_trains_saves_and_loads_into_a_plain_model(tmp_path):
    model = sw.apply(tiny_gpt2(), PLAN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer, result = train(model, tmp_path)
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it learned
    trainer.save_model(str(tmp_path / "saved"))
    plain = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert list(plain.state_dict()) == list(tiny_gpt2().state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("hf_checkpointing", [False, True])
def test_each_layer_is_checkpointed_once_with_or_without_the_trainer_s_gradient_checkpointing(
        tmp_path, monkeypatch, hf_checkpointing):
    import sys

    mlp = transformers.models.gpt2.modeling_gpt2.GPT2MLP
    forward, calls = mlp.forward, []
    # Counted in forward itself: torch's checkpoint does not run module hooks in its recompute.
    monkeypatch.setattr(mlp, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    ours = sys.modules["shrinkwrap.transforms.checkpoint.region"]
    regions, checkpoint = [], ours._torch_checkpoint
    monkeypatch.setattr(ours, "_torch_checkpoint", lambda *a, **k: regions.append(1) or checkpoint(*a, **k))
    model = sw.apply(tiny_gpt2(), PLAN)
    train(model, tmp_path, gradient_checkpointing=hf_checkpointing,
          gradient_checkpointing_kwargs={"use_reentrant": False} if hf_checkpointing else None)
    # 2 steps x 2 layers x (the forward + one recompute), checkpointed by shrinkwrap's regions or,
    # when the Trainer turns Hugging Face's on, by Hugging Face's alone: the regions step aside.
    assert len(calls) == 8
    assert len(regions) == (0 if hf_checkpointing else 4)
