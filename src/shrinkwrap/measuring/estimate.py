"""Know before you rent a GPU: a training iteration's CUDA peak, predicted on the CPU.

:func:`estimate` builds the model as its factory does (on the CPU), applies the plan, then puts a
fake tensor (``torch._subclasses.fake_tensor``: shape, dtype and no data) in place of every
parameter, buffer and input, and runs two training iterations on them: the second, with the
optimizer's state made, under torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``),
which counts the bytes alive at every operation, by kind: parameters, buffers, gradients,
optimizer state, activations and temporaries. Seconds for a bench model, no GPU, no weights'
memory besides the model's own construction.

What the CPU would do otherwise than the GPU is made the GPU's where it matters to memory:
attention runs as a fused kernel keeps it (output and log-sum-exp, not the probabilities: what
``scaled_dot_product_attention`` does on CUDA), and AdamW takes its multi-tensor form (CUDA's
default, with parameter-sized temporaries). What it cannot see is said in ``notes``: the
compiler's partitioner (``compile()``: estimated as eager), CUDA graphs' private pools, offload's
copies (counted as kept on the device), cuDNN and cuBLAS workspaces, the allocator's rounding.
The measured figure (``shrinkwrap.measure``) and the cap a card must hold (``shrinkwrap.fit``)
are the GPU's answer.

Example::

    >>> est = sw.estimate(torchvision.models.resnet152, torch.randn(64, 3, 224, 224), "checkpoint(r'layer[1-4]')")
    >>> est.peak / 2**30, est.breakdown()
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _compat
from .._rewrite import records
from .._tree import tensors, tree_map
from ..plan import PlanLike, as_plan
from ..select import require_module, wrong
from ..transforms.optimizer.interface import trained_by
from .profile import LossFn, OptimizerFactory
from .step import _Iteration, default_loss

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes at the predicted peak of a steady training iteration, by kind, and what the
    prediction cannot see (``notes``)."""

    peak: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # what the forward keeps for backward, and temporaries
    other: int  # the batch, and what no kind claims
    seconds: float
    notes: tuple[str, ...] = ()

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "activations": self.activations, "other": self.other}

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in self.breakdown().items())
        lines = [f"estimated CUDA peak of a training iteration: {self.peak / MiB:.1f} MiB ({parts}); "
                 f"predicted on the CPU in {self.seconds:.1f} s, not measured"]
        lines += [f"  not seen: {n}" for n in self.notes]
        return "\n".join(lines)


@contextlib.contextmanager
def _cuda_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` as CUDA's fused kernels keep memory: the CPU's own choice
    (the math path with dropout) would keep the probabilities, batch x heads x length x length.
    The estimate's numbers are never read: only shapes and lifetimes matter."""
    real = F.scaled_dot_product_attention

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)  # the kernels take a float bias
        return _compat.flash_attention_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def _fake(model: nn.Module, mode: Any) -> None:
    """Every parameter and buffer of ``model`` (shrinkwrap's wrappers share the tables) replaced by a
    fake tensor of its shape and dtype; a tensor held twice (tied weights) stays one."""
    memo: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    f = mode.from_tensor(t.detach())
                    memo[id(t)] = nn.Parameter(f, t.requires_grad) if isinstance(t, nn.Parameter) else f
                table[key] = memo[id(t)]


def _notes(model: nn.Module) -> list[str]:
    notes = []
    for rec in records(model):
        name = getattr(rec.step, "name", str(rec.step))
        if name == "compile":
            mode = getattr(rec.step, "mode", None)
            notes.append("compile() is estimated as eager: the compiler's partitioner may keep less"
                         + ("; CUDA graphs (mode='reduce-overhead') reserve private pools on top" if mode else ""))
        elif name == "offload":
            notes.append("offload() is estimated as kept on the device: its copies to the CPU are not modelled")
    notes.append("cuDNN and cuBLAS workspaces and the caching allocator's rounding are not counted")
    return notes


def estimate(model_or_factory: nn.Module | Callable[[], nn.Module], batch: Any, plan: PlanLike = (),
             loss_fn: LossFn | None = None, optimizer: OptimizerFactory | None = None) -> Estimate:
    """Predict the CUDA peak of a training iteration of ``plan`` on the model, on the CPU (see the
    module docstring). ``model_or_factory``: a function returning a fresh model, or a model, which
    is copied; ``batch``, ``loss_fn``, ``optimizer`` as :func:`shrinkwrap.measure` (the default is
    AdamW in its multi-tensor form, as on CUDA).

    Example::

        >>> print(sw.estimate(make_model, batch, "checkpoint(r'layers\\\\.\\\\d+'), autocast(torch.bfloat16)"))
    """
    import copy

    FakeTensorMode = _compat.fake_tensor()[1]
    try:
        MemTracker = _compat.mem_tracker()
    except ImportError as exc:
        raise RuntimeError(f"shrinkwrap: estimate() needs torch's MemTracker (torch >= 2.5), which torch "
                           f"{torch.__version__} lacks: {exc}") from None
    plan = as_plan(plan, "estimate()")
    if any(getattr(s, "name", None) == "step_in_backward" and getattr(s, "state", None) == "cpu" for s in plan.steps):
        # Under fake tensors the CPU copies and the worker thread's steps cannot run, and the device
        # would have to be told from the host: refused rather than estimated wrong.
        raise ValueError("shrinkwrap: estimate() cannot model step_in_backward(state='cpu'): estimate the plan with "
                         "state='device' and leave out its optimizer_state term, which the CPU holds instead "
                         "(the parameters' gradients go down one at a time)")
    start = time.perf_counter()
    if isinstance(model_or_factory, nn.Module):
        model = copy.deepcopy(model_or_factory)
    elif callable(model_or_factory):
        model = require_module(model_or_factory(), "estimate()'s factory")
    else:
        raise TypeError(wrong("estimate()", "a model or a function returning one", model_or_factory))
    model = plan.apply(model.cpu().train())
    notes = _notes(model)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    _fake(model, mode)
    # MemTracker warns for each module a backward hook outlives (the fake model's hooks): not the user's concern.
    with mode, _cuda_attention(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")
        fake_batch = tree_map(lambda t: mode.from_tensor(t.cpu()), batch)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = trained_by(model) or (optimizer(params) if optimizer else torch.optim.AdamW(params, foreach=True))
        step = _Iteration(model, fake_batch, loss_fn or default_loss, opt, None)
        step()  # the optimizer's state is made in the first
        tracker = MemTracker()
        tracker.track_external(model, opt, *tensors(fake_batch))
        with tracker:
            step()
    peak = {str(k).rsplit(".", 1)[-1]: v for snap in tracker.get_tracker_snapshot("peak").values()
            for k, v in snap.items()}
    return Estimate(
        peak=peak.get("Total", 0),
        parameters=peak.get("PARAM", 0) + peak.get("BUFFER", 0),
        gradients=peak.get("GRAD", 0),
        optimizer_state=peak.get("OPT", 0),
        activations=peak.get("ACT", 0) + peak.get("TEMP", 0),
        other=peak.get("OTH", 0),
        seconds=time.perf_counter() - start,
        notes=tuple(notes),
    )
