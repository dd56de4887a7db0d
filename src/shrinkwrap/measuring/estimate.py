"""Know before you rent a GPU: a training iteration's CUDA peak, predicted on the CPU.

:func:`estimate` builds the model as its factory does (on the CPU), applies the plan, then puts a
fake tensor (``torch._subclasses.fake_tensor``: shape, dtype and no data) in place of every
parameter, buffer and input, and runs two training iterations on them: the second, with the
optimizer's state made, under torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``),
which counts the bytes alive at every operation, by kind: parameters, buffers, gradients,
optimizer state, activations and temporaries. The estimate says where in the iteration its peak
falls (the phase, the innermost module running) and what each term holds then: a language
model's peak often comes at the start of backward, the loss's gradient over the vocabulary, when
no parameter's gradient exists yet. Seconds for a bench model, no GPU, no weights' memory besides
the model's own construction.

Fake tensors check no index: the first iteration runs under :class:`~.indices.KnownIndices`, which
raises where an embedding is indexed past its rows, as the real run would, rather than answering
for an input the model cannot take.

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
from .indices import KnownIndices
from .profile import LossFn, OptimizerFactory
from .step import _Iteration, default_loss, require_batch

MiB = 2**20


PHASES = ("zero_grad", "forward", "loss", "backward", "step")  # an iteration's, as measure names them


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes at the predicted peak of a steady training iteration, by what holds them then, where
    in the iteration the peak falls, and what the prediction cannot see (``notes``).

    The terms (:meth:`breakdown`, which sum to ``peak``): ``parameters`` (weights and buffers),
    ``gradients``, ``optimizer_state`` (the state kept between steps), ``activations`` (what the
    forward keeps, mostly saved for backward), ``temporaries`` (backward's gradients of
    activations and working tensors, an optimizer step's working tensors), ``output`` (the model's
    output and the loss, held to the iteration's end) and ``batch``. :meth:`holds` says in words
    what each holds at that moment.

    ``phase`` is the iteration's phase at the peak (``"forward"``, ``"loss"``, ``"backward"``,
    ``"step"``); ``module`` the innermost module running then, by dotted name (``""``: the model's
    own forward outside its submodules; None: none, as in the loss or the optimizer step);
    ``stepping`` whether an optimizer step was running (the step, or a step in backward).

    Example::

        >>> est = sw.estimate(make_model, batch)
        >>> est.moment, est.holds()["gradients"]
        ('in the optimizer step', "every trained parameter's, which the step reads")
    """

    peak: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    output: int
    batch: int
    seconds: float
    notes: tuple[str, ...] = ()
    phase: str | None = None
    module: str | None = None
    stepping: bool = False
    steps_in_backward: bool = False  # the plan steps the optimizer inside backward
    backward_begun: bool = True  # in backward: whether a submodule's backward had begun by the peak

    def breakdown(self) -> dict[str, int]:
        """The peak's bytes by term, in the order :meth:`holds` describes them."""
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "activations": self.activations, "temporaries": self.temporaries, "output": self.output,
                "batch": self.batch}

    @property
    def moment(self) -> str:
        """Where in the iteration the peak falls, in words."""
        at = f"at {self.module}" if self.module else "in the model's own forward, outside its submodules"
        if self.phase == "forward":
            return "in forward, " + at if self.module is not None else "in forward"
        if self.phase == "loss":
            return "in the loss, after the forward"
        if self.phase == "step":
            return "in the optimizer step"
        if self.phase != "backward":
            return "unknown"
        if self.module:
            text = f"in backward, at {self.module}"
        elif self.backward_begun:
            text = "in backward, outside the model's submodules"
        else:
            text = "at the start of backward, before any submodule's: the loss's gradient"
        return text + (", during a step in backward" if self.stepping else "")

    def holds(self) -> dict[str, str]:
        """What each term of :meth:`breakdown` holds at the peak's moment, one short line each."""
        phase, bw = self.phase, self.steps_in_backward
        if phase in ("forward", "loss"):
            grads = ("none: zero_grad(set_to_none=True) freed the last iteration's, and backward has not begun"
                     if not self.gradients else "the last iteration's, which zero_grad kept")
        elif phase == "backward":
            grads = ("none yet: backward has reached no parameter, and zero_grad(set_to_none=True) freed the last ones"
                     if not self.gradients else
                     "those not yet stepped: the step in backward frees each once its bucket is stepped" if bw else
                     "those backward has made so far")
        else:
            grads = ("every trained parameter's, which the step reads" if not bw else
                     "those backward left in .grad, which the handle's step steps" if self.gradients else
                     "none: the step in backward freed each")
        acts = {"forward": "what the forward has made and keeps: tensors saved for backward, the running operation's",
                "loss": "what the forward saved for backward, and the loss's tensors",
                "backward": "what the forward saved for backward that backward has not yet freed "
                            "(a checkpointed region's recompute included)"}.get(
            phase, "forward tensors referenced beyond the output's tensors (a cache in it, or what a module keeps)"
            if self.activations else "none: backward freed what the forward saved")
        temps = {"backward": "gradients of activations and the backward's working tensors"
                             + (", and the step in backward's" if self.stepping else ""),
                 "step": "the optimizer step's working tensors (a multi-tensor step's are parameter-sized)"}.get(
            phase, "none: the forward's working tensors count as activations")
        return {
            "parameters": "the weights and buffers",
            "gradients": grads,
            "optimizer_state": "the optimizer's state, made at its first step and kept between iterations",
            "activations": acts,
            "temporaries": temps,
            "output": "none yet: the model has not returned" if phase == "forward" else
                      "the model's output and the loss, held to the iteration's end (a language model's logits)",
            "batch": "the input tensors",
        }

    def __str__(self) -> str:
        holds = self.holds()
        lines = [f"estimated CUDA peak of a training iteration: {self.peak / MiB:.1f} MiB, {self.moment}; "
                 f"predicted on the CPU in {self.seconds:.1f} s, not measured"]
        lines += [f"  {k:<16}{v / MiB:>10.1f} MiB  {holds[k]}" for k, v in self.breakdown().items()]
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


def _fake(model: nn.Module, mode: Any) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every parameter and buffer of ``model`` (shrinkwrap's wrappers share the tables) replaced by a
    fake tensor of its shape and dtype; a tensor held twice (tied weights) stays one. Returns the
    integer ones as :class:`~.indices.KnownIndices` takes them: ``(fake, real, False)``."""
    memo: dict[int, torch.Tensor] = {}
    known = []
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    f = mode.from_tensor(t.detach())
                    memo[id(t)] = nn.Parameter(f, t.requires_grad) if isinstance(t, nn.Parameter) else f
                    if not (t.is_floating_point() or t.is_complex()):
                        known.append((memo[id(t)], t, False))
                table[key] = memo[id(t)]
    return known


def _kinds(tracker: Any, which: str) -> dict[str, int]:
    """The tracker's bytes by kind (``PARAM``, ``GRAD``, ..., ``Total``), over its devices."""
    out: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot(which).values():
        for k, v in snap.items():
            key = str(k).rsplit(".", 1)[-1]
            out[key] = out.get(key, 0) + v
    return out


class _Moments(_compat.dispatch_mode()):
    """Where the tracker's peak falls. Entered above the ``MemTracker``, it reads the peak after
    every operation, and when it rose, notes the iteration's phase (told by the iteration's marks)
    and the innermost module running (torch's ``ModTracker``)."""

    def __init__(self, tracker: Any) -> None:
        super().__init__()
        self.tracker, self.modules = tracker, _compat.mod_tracker()()
        self.phase, self.top = "zero_grad", -1
        self.begun = False  # whether a submodule's backward has begun
        self.at: tuple[str, str | None, bool] = ("zero_grad", None, False)

    def mark(self, phase: str) -> None:
        """The end of ``phase``, as the iteration calls it."""
        self.phase = PHASES[PHASES.index(phase) + 1] if phase != PHASES[-1] else "end"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.begun and self.phase == "backward":
            self.begun = any("." in n for n in self.modules.parents)
        total = _compat.tracked_peak(self.tracker)
        if total > self.top:
            inner = max(self.modules.parents - {"Global"}, key=lambda n: n.count("."), default=None)
            # ModTracker names the model by its class: the dotted name under it is the user's.
            self.top, self.at = total, (self.phase, None if inner is None else inner.partition(".")[2], self.begun)
        return out

    def __enter__(self) -> "_Moments":
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.modules.__exit__(*exc)


def _storages(ts: Any) -> dict[int, int]:
    """``id -> bytes`` of the storages under ``ts``, each once."""
    return {id(st): st.nbytes() for st in (t.untyped_storage() for t in ts)}


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
    module docstring).

    Args:
        model_or_factory: a function returning a fresh model, or a model, which is copied.
        batch, plan, loss_fn, optimizer: as :func:`shrinkwrap.measure` (the default optimizer is
            AdamW in its multi-tensor form, as on CUDA).

    Returns:
        An :class:`Estimate`: the peak's bytes by term, where in the iteration it falls, and what
        each term holds then.

    Raises:
        IndexError: where the batch makes the model index an embedding past its rows (an input
            longer than its positions, a token id past its vocabulary), as the real run would.

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
    require_batch(batch, "estimate()")
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
    known = _fake(model, mode)
    names = {id(p): n.removesuffix(".weight") for n, p in model.named_parameters()}
    held: list[torch.Tensor] = []  # the output's tensors and the loss, which the iteration holds to its end

    def loss(out: Any) -> torch.Tensor:
        held[:] = tensors(out)
        held.append((loss_fn or default_loss)(out))
        return held[-1]

    # MemTracker warns for each module a backward hook outlives (the fake model's hooks), and its
    # module tracker when a checkpointed region runs its modules again in backward: not the user's concern.
    with mode, _cuda_attention(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        fake_batch = tree_map(lambda t: mode.from_tensor(t.cpu()), batch)
        known += [(f, t.cpu(), True) for f, t in zip(tensors(fake_batch), tensors(batch))]
        params = [p for p in model.parameters() if p.requires_grad]
        handle = trained_by(model)
        opt = handle or (optimizer(params) if optimizer else torch.optim.AdamW(params, foreach=True))
        step = _Iteration(model, fake_batch, loss, opt, None)
        with KnownIndices(known, names):  # fake tensors check no index: the first iteration does, where it can
            step()  # the optimizer's state is made in the first
        tracker = MemTracker()
        tracker.track_external(model, opt, *tensors(fake_batch))
        state = _kinds(tracker, "current").get("OPT", 0)
        moments = _Moments(tracker)
        with tracker, moments:
            step(moments.mark)
    peak = _kinds(tracker, "peak")
    phase, module, begun = moments.at
    # The tracker counts all an optimizer step makes as its state: beyond the state kept between
    # steps, it is the step's working tensors.
    scratch = max(peak.get("OPT", 0) - state, 0)
    ours = _storages(tensors((list(model.parameters()), list(model.buffers()), fake_batch)))
    out_bytes = sum(b for k, b in _storages(held).items() if k not in ours) if phase in ("loss", "backward", "step") else 0
    output = min(out_bytes, peak.get("ACT", 0))
    held.clear()
    return Estimate(
        peak=peak.get("Total", 0),
        parameters=peak.get("PARAM", 0) + peak.get("BUFFER", 0),
        gradients=peak.get("GRAD", 0),
        optimizer_state=peak.get("OPT", 0) - scratch,
        activations=peak.get("ACT", 0) - output,
        temporaries=peak.get("TEMP", 0) + scratch,
        output=output,
        batch=peak.get("OTH", 0),
        seconds=time.perf_counter() - start,
        notes=tuple(notes),
        phase=phase,
        module=module,
        stepping=scratch > 0 or phase == "step",
        steps_in_backward=handle is not None,
        backward_begun=begun,
    )
