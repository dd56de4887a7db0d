"""The output head of causal language models: ``chunked_loss`` computes the head and the loss
chunk by chunk over tokens, never materialising the full batch x sequence x vocabulary logits.

:class:`ChunkedLoss` (``chunked_loss(chunk_size=1024)``) acts on a Hugging Face ``*ForCausalLM``
(any model whose forward is ``hidden = base_model(...).last_hidden_state; logits =
lm_head(hidden); loss = loss_function(logits, labels, ...)``, ``lm_head`` an ``nn.Linear``). In
training, called with ``labels``, the model's forward runs its base model as its own forward
would, then computes the loss over ``chunk_size`` tokens at a time: each chunk's logits
(``hidden_chunk @ W.T + b``, soft-capped where the config has ``final_logit_softcapping``) give
the chunk's loss and, at once, its gradients (softmax minus one-hot), which go straight into the
gradients of the hidden states and of the head's weight. Autograd keeps those two (the weight's
gradient is what backward would make anyway; a frozen head gets none) and no tensor of
``tokens x vocab``: what the forward leaves for backward loses the logits and their log-softmax
(``2 x tokens x vocab`` floats, and more under autocast), and the head costs the same three
matmuls as the model's own, with no recompute.

Exact, not bit for bit: the same label shift (or ``shift_labels``), ``ignore_index=-100``, mean
over the counted tokens or the sum over ``num_items_in_batch`` (HF's gradient accumulation),
tied embeddings (the gradient of the shared weight gets both uses), and soft-capping, as the
model's own loss; sums run in another order, so float64 agrees to ``rtol=1e-12``. One deliberate
difference: HF computes its loss in float32 (``logits.float()``) even in a float64 model; the
chunked loss is computed in the wider of float32 and the logits' dtype, so a float64 model gets
a float64 loss (the tests compare against the model's float64 logits and ``cross_entropy``).
Under autocast the chunk matmuls run in the autocast dtype and the loss in float32, as HF's.

In chunked training the output's ``logits`` is None (they were never whole): a user who needs
them turns the step off (``sw.revert``) or calls in ``eval()``. Without labels, in ``eval()``,
or with ``logits_to_keep`` set, the model's own forward runs, unchanged.

The step's forward is set on the root (``_rewrite.RootForward``) and goes under every other
root forward (autocast, whatever the order of the plan), so autocast covers the base model and
the chunks, and torch.compile traces it into the model's graph.

The files, one concern each:

- ``kernel.py``: ``chunked_cross_entropy``, the loss and its gradients a chunk at a time.
- ``read_forward.py``: reading the model's forward for what the chunked loss must reproduce.
- ``forward.py``: the root's forward that calls the base model and the chunked loss.
- ``step.py``: the ``chunked_loss`` step.
"""

from .kernel import IGNORE_INDEX, chunked_cross_entropy  # noqa: F401 - importable from here, as before
from .read_forward import head_problem  # noqa: F401 - importable from here, as before
from .step import ChunkedLoss, apply_chunked_loss

__all__ = ['ChunkedLoss', 'apply_chunked_loss']
