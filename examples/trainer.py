"""Fine-tune a small causal language model with the Hugging Face Trainer and a shrinkwrap plan.

The plan goes on before the Trainer sees the model; save_model writes the plain model's weights
(the plan changes no names), which from_pretrained loads into a model without the plan. With
TrainingArguments(gradient_checkpointing=True) too, each layer is checkpointed once: shrinkwrap's
regions step aside for Hugging Face's own. Random weights and data; seconds on a CPU.

    python examples/trainer.py
"""

import tempfile

import torch
import transformers

import shrinkwrap as sw

config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
model = transformers.GPT2LMHeadModel(config)
plan = sw.Plan([sw.checkpoint(r"transformer\.h\.\d+"), sw.autocast(torch.bfloat16)])
sw.apply(model, plan)

ids = torch.randint(0, config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in ids]
with tempfile.TemporaryDirectory() as out:
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4,
                                          report_to=[], use_cpu=not torch.cuda.is_available(), save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    print(f"plan: {plan}; training loss {trainer.train().training_loss:.3f}")
    trainer.save_model(out + "/model")
    plain = transformers.GPT2LMHeadModel.from_pretrained(out + "/model")
    same = all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    print(f"reloaded without the plan: {type(plain).__name__}, same weights: {same}")
