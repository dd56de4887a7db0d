"""Full fine-tuning with the optimizer stepped inside backward, under the Hugging Face Trainer:
train, save checkpoints, resume from one.

The step goes on before the Trainer sees the model, and the model's optimizer-shaped handle goes to
the Trainer (``optimizers=(sw.optimizer(model), None)``), whose learning-rate schedule then drives
it: each gradient is used and dropped as backward produces it, so the gradient term leaves the
peak. ``max_grad_norm=0``: clipping by the global norm needs every gradient at once, and a clip
that would scale them is refused, as is gradient accumulation. Random weights and data; seconds on
a CPU.

    python examples/trainer_step_in_backward.py
"""

import os
import shutil
import tempfile

import torch
import transformers

import shrinkwrap as sw

PLAN = r"checkpoint(r'transformer\.h\.\d+'), step_in_backward(torch.optim.AdamW, options={'lr': 0.001})"


def make() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    return sw.apply(transformers.GPT2LMHeadModel(config), PLAN)


ids = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in ids]


def train(model: transformers.GPT2LMHeadModel, out: str, resume: str | None = None) -> None:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=4, max_grad_norm=0.0, save_strategy="steps",
        save_steps=2, logging_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(sw.optimizer(model), None))
    trainer.train(resume_from_checkpoint=resume)


with tempfile.TemporaryDirectory() as out:
    whole = make()
    train(whole, out)  # four steps, checkpoints after the second and the fourth
    shutil.rmtree(os.path.join(out, "checkpoint-4"))
    resumed = make()
    train(resumed, out, resume=os.path.join(out, "checkpoint-2"))  # the last two steps again, from the checkpoint
    gap = max((a - b).abs().max().item() for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    print(f"plan: {PLAN}")
    print(f"trained 4 steps, and resumed from step 2's checkpoint: largest weight difference {gap:.1e}")
