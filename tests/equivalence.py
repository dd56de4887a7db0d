"""Train a model and its transformed twin the same way and compare them: the machinery of the
compatibility suites (test_compat.py on the CPU, test_compat_cuda.py on a GPU).

A :class:`Case` says how to build a model, feed it and checkpoint every block; :func:`train` runs
SGD steps with a fixed seed before each (dropout draws the same masks) and returns a :class:`Trace`
of the losses, every parameter's gradient and, at the end, every parameter and buffer;
:func:`assert_same` compares two traces bit for bit, or to a stated tolerance. The ``check_*``
functions are the checks both suites run on each model.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import logging
import pickle
from typing import Callable

import torch
import torch.nn as nn

import shrinkwrap as sw

F64 = torch.float64
STEPS = (0, 1)  # two SGD steps; the seed before step i is 100 + i
# Equal up to float64 rounding, where an exact comparison cannot hold (each use says why): a
# compiled model against eager, as dynamo may reorder a sum; the same math by another route.
ROUNDING = dict(rtol=1e-9, atol=1e-12)


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[..., nn.Module]  # build(seed=0): the plain model, float64, train mode
    batch: Callable[[], dict]  # the fixed batch, as keyword arguments of the model
    loss: Callable[..., torch.Tensor]  # the model's output to a scalar
    blocks: str  # the checkpoint pattern: every block
    n_blocks: int
    dropout: bool = True  # the model draws random numbers in training (dropout, drop path)


@dataclasses.dataclass
class Trace:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]  # per step, by parameter name
    state: dict[str, torch.Tensor]  # parameters and buffers after the last step

    def __add__(self, later: "Trace") -> "Trace":
        return Trace(self.losses + later.losses, self.grads + later.grads, later.state)


def train(model: nn.Module, case: Case, steps: tuple[int, ...] = STEPS) -> Trace:
    """SGD steps, each after ``torch.manual_seed(100 + step)`` so that dropout draws the same masks."""
    plain = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes the names
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)  # no optimizer state: steps may resume in a new one
    trace = Trace([], [], {})
    for step in steps:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss = case.loss(model(**case.batch()))
        loss.backward()
        trace.losses.append(loss.detach())
        trace.grads.append({n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None})
        opt.step()
    trace.state = {n: t.detach().clone() for n, t in (*plain.named_parameters(), *plain.named_buffers())}
    return trace


@functools.cache
def reference(case: Case, steps: tuple[int, ...] = STEPS) -> Trace:
    """The untransformed model's training (computed once per model)."""
    return train(case.build(), case, steps)


def assert_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str, **tol) -> None:
    """Same names in the same order; values bit-equal, or close to ``tol`` where given."""
    assert list(got) == list(ref), what
    for n in ref:
        if tol:
            torch.testing.assert_close(got[n], ref[n], **tol, msg=lambda m: f"{what} {n}: {m}")
        else:
            assert got[n].dtype == ref[n].dtype and torch.equal(got[n], ref[n]), f"{what} {n}"


def assert_same(ref: Trace, got: Trace, **tol) -> None:
    assert len(got.losses) == len(ref.losses)
    for step, (l_ref, l_got, g_ref, g_got) in enumerate(zip(ref.losses, got.losses, ref.grads, got.grads)):
        assert_equal({"loss": l_ref}, {"loss": l_got}, f"step {step}", **tol)
        assert_equal(g_ref, g_got, f"step {step} gradient", **tol)
    assert_equal(ref.state, got.state, "after training:", **tol)


def checkpointed(case: Case, seed: int = 0) -> nn.Module:
    model = case.build(seed=seed)
    sw.apply(model, sw.Plan([sw.checkpoint(case.blocks)]))
    assert len(sw.records(model)[-1].matched) == case.n_blocks
    return model


def wrappers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, sw.CheckpointModule)}


# -- the checks ---------------------------------------------------------------------------------


def check_checkpoint(case: Case, expected: Trace) -> Trace:
    """Every parameter gets a gradient, dropout is on, and training the checkpointed model equals
    ``expected`` bit for bit, BatchNorm counting each step once. Returns the trace."""
    n_params = len(list(case.build().parameters()))
    assert all(len(g) == n_params for g in expected.grads)
    if case.dropout:  # so equal traces mean equal masks in forward and recompute
        assert not torch.equal(*(train(case.build(), case, (s,)).losses[0] for s in (0, 5)))
    got = train(checkpointed(case), case)
    assert_same(expected, got)
    counts = {n: int(t) for n, t in got.state.items() if n.endswith("num_batches_tracked")}
    assert all(c == len(STEPS) for c in counts.values()), counts  # not once more in the recompute
    return got


def check_state_dict(case: Case) -> None:
    """The transformed model's state_dict is the plain model's (keys, values, metadata), and a
    state_dict loads from either into the other."""
    plain, model = case.build(), checkpointed(case)
    assert_equal(plain.state_dict(), model.state_dict(), "state_dict")
    assert model.state_dict()._metadata == plain.state_dict()._metadata
    other = case.build(seed=1)
    model.load_state_dict(other.state_dict())  # saved before the transform, loaded after
    assert_equal(other.state_dict(), model.state_dict(), "plain -> transformed")
    fresh = case.build(seed=2)
    fresh.load_state_dict(model.state_dict())  # saved after, loaded into a plain model
    assert_equal(other.state_dict(), fresh.state_dict(), "transformed -> plain")


def check_revert(case: Case, first: Trace, **tol) -> tuple[nn.Module, Callable[[], None]]:
    """Checkpoint, train a step (equal to ``first``), revert: the original module objects are back.
    Returns the model and ``go_on()``, which trains the other steps and compares the whole to the
    plain model's training (to ``tol``)."""
    model = case.build()
    before = dict(model.named_modules())
    sw.apply(model, sw.Plan([sw.checkpoint(case.blocks)]))
    done = train(model, case, STEPS[:1])
    assert_same(first, done)
    sw.revert(model)
    assert sw.records(model) == [] and not wrappers(model)
    after = dict(model.named_modules())
    assert list(after) == list(before) and all(after[n] is m for n, m in before.items())
    return model, lambda: assert_same(reference(case), done + train(model, case, STEPS[1:]), **tol)


def _torch_save_load(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save_load,
}


def check_copy(case: Case, how: str, expected: Trace) -> None:
    """A copy of the checkpointed model keeps its regions, shares nothing with it, trains equal to
    ``expected`` bit for bit, and reverts to its own originals."""
    model = checkpointed(case)
    clone = COPIES[how](model)
    regions = wrappers(clone)
    assert list(regions) == list(wrappers(model))
    for w in regions.values():  # the wrapper still shares the wrapped module's tree
        assert w._parameters is w.wrapped._parameters and w._modules is w.wrapped._modules
    assert not any(p is q for p, q in zip(clone.parameters(), model.parameters()))
    assert_same(expected, train(clone, case))
    sw.revert(clone)
    assert not wrappers(clone)
    assert [type(m) for m in clone.modules()] == [type(m) for m in case.build().modules()]
    assert not {id(m) for m in clone.modules()} & {id(m) for m in model.modules()}


@functools.cache
def compiled_step(case: Case, plan: sw.Plan | None = None) -> tuple[Trace, str | None]:
    """One training step of the model with ``plan`` (None: every block checkpointed) under
    ``torch.compile(backend="aot_eager")``, and the graph break that ``fullgraph=True`` refused
    (None if it traced as one graph)."""
    graph_break = None
    for fullgraph in (True, False):
        torch._dynamo.reset()
        model = checkpointed(case) if plan is None else sw.apply(case.build(), plan)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        # Logging is no computation: dynamo may pass over it. (HF's loss_function warns once in
        # GPT-2's forward, which would break the untransformed model's graph too. Read after the
        # build: importing transformers adds Logger.warning_once.)
        logs = {getattr(logging.Logger, n) for n in ("debug", "info", "warning", "warning_once")
                if hasattr(logging.Logger, n)}
        try:
            with torch._dynamo.config.patch(ignore_logging_functions=logs):
                return train(compiled, case, STEPS[:1]), graph_break
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            if not fullgraph:
                raise
            graph_break = f"{type(exc).__name__}: {exc}"[:3000]
    raise AssertionError("unreachable")


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten operators dispatched while it is on, by name (``count``): what a region
    recomputes in backward, say."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func._overloadpacket.__name__
        self.count[name] = self.count.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
