"""The steps inside backward: each parameter's post-accumulate-grad hook steps its gradient at once,
or in a bucket with the gradients that came before it, and leaves its stand-in in ``.grad``; a
non-finite gradient stops the backward's steps. Mixed into :class:`~.handle.InBackward`, whose
tables (``optimizers``, ``params``, ``waiting``...) it reads.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from ... import _compat
from .lowbit import LowBitAdamW, _is_fake
from .standin import Consumed, local, norms, stand_in

# Gradients that wait in backward to be stepped together (see BackwardSteps._wait_in_bucket): at
# most 128 MiB, and a sixteenth of the model's gradient bytes, so that the gradient term stays out
# of the peak.
_BUCKET = 128 << 20
_SHARE = 16
_TOGETHER = 64  # bucket optimizers kept (buckets differ where a forward leaves parameters unused)
_HOW = ("foreach", "fused")  # the group options that say how an optimizer steps, not what it computes

# The classes whose fused step skips itself where ``found_inf`` is set (as GradScaler has it).
_FOUND_INF = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)


def _unstepped(grad: Any) -> None:
    """Mark a stand-in as a gradient the step did not apply (a backward stopped at a non-finite one)."""
    grad = local(grad) if grad is not None else None
    if isinstance(grad, Consumed):
        grad._sw_stepped = False


def _not_finite(grad: Any) -> bool:
    """Whether a stand-in's gradient was not finite (its largest magnitude); False for none."""
    grad = local(grad) if grad is not None else None
    return isinstance(grad, Consumed) and not math.isfinite(float(grad._sw_max))


def _compiled_autograd() -> bool:
    """Whether backward runs under compiled autograd, whose engine takes no end-of-backward
    callback but from a full graph: there each parameter steps in its hook."""
    return _compat.in_compiled_autograd()


def _keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``, ``create_graph=True``)."""
    return not _compiled_autograd() and _compat.backward_keeps_graph()


@dataclasses.dataclass
class _Backward:
    """What one backward did: the parameters it stepped, whether a non-finite gradient stopped
    its steps, and whether the end-of-backward callback will tell that it ended (``tracked``)."""

    tracked: bool
    stepped: list = dataclasses.field(default_factory=list)
    skipping: bool = False
    # Fused steps check on the device (their found_inf skips the update) and are read at the end
    # of backward in one synchronisation: (where in ``stepped`` the step began, its names, a flag).
    checks: list = dataclasses.field(default_factory=list)
    found: torch.Tensor | None = None  # a fused step's gradient not finite: the later ones skip
    used: dict = dataclasses.field(default_factory=dict)  # each group's options as its steps read them


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    rest = len(names) - 3
    return shown + (f" and {rest} more" if rest > 0 else "")


class BackwardSteps:
    """What the hooks do in backward: step a gradient (now, in a bucket, or on the CPU through
    :class:`~.cpu.CpuSteps`), check that it is finite, and record what each backward stepped."""

    @property
    def batched(self) -> bool:
        """Whether gradients may wait to be stepped in buckets: for torch's optimizers and
        :class:`LowBitAdamW`, which keep everything of a parameter in its group and ``state[p]``
        (another class may keep more on the optimizer object, which a bucket's would not share)."""
        torch_own = self.cls.__module__.startswith("torch.optim") and self.cls is not torch.optim.LBFGS
        return torch_own or self.cls is LowBitAdamW

    def _arrived(self, name: str, p: torch.Tensor) -> None:
        """``p``'s gradient is accumulated: step it (now, in a bucket, or on the CPU) and leave the
        stand-in, or leave the gradient for ``step()`` where the backward keeps its graph."""
        if (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1 and getattr(p, "_local_tensor", None) is None):
            raise RuntimeError(
                f"shrinkwrap: step_in_backward() steps {name!r} as its gradient is accumulated, before DDP "
                "averages it across ranks: each rank would train on its own gradient. Use FSDP2 "
                "(fully_shard), whose reduced gradient the step takes, or leave the step out.")
        if _keeps_graph():
            # A second backward through this graph would need the weights as they are, and a plain
            # loop steps the sum: the gradient stays, for that backward's hook or for step().
            if not self.retained:
                self.retained = True
                warnings.warn("shrinkwrap: a backward that keeps its graph (retain_graph=True) keeps its "
                              "gradients until the next backward or step(), as a plain optimizer's: their memory "
                              "is back while it does", stacklevel=2)
            return
        record = self._begin()
        grad = local(p.grad)
        if self.on_cpu:
            if grad.is_sparse:
                raise RuntimeError(f"shrinkwrap: {name!r} has a sparse gradient, which step_in_backward(state='cpu') "
                                   "does not take: use state='device'")
            self._to_cpu(name, p, record)
        elif (self.batched and getattr(p, "_local_tensor", None) is None and not grad.is_sparse
              and record.tracked and not record.skipping):
            self._wait_in_bucket(name, p)
        else:
            self._step([name], [p], record)

    def _begin(self) -> _Backward:
        """The record of the running backward, begun with its first gradient: the engine's
        end-of-backward callback ends it (compiled autograd has none: each parameter steps alone)."""
        with self.lock:
            if self.backward is None:
                self.backward = _Backward(tracked=not _compiled_autograd())
                if self.backward.tracked:
                    _compat.at_end_of_backward(self._end)
            return self.backward

    def _end(self) -> None:
        self._step_waiting()
        with self.lock:
            record = self.backward
        if record is not None:
            self._read_checks(record)
        with self.lock:
            self.backward = None
        if record is not None:
            self.unconfirmed.append(record)

    def _read_checks(self, record: _Backward) -> None:
        """The fused steps' checks, read at once: from the first whose gradients were not finite
        on, nothing was stepped (their found_inf skipped them, and the state a first step made for
        them is dropped: fused SGD leaves its momentum buffers unset); raise if some were before."""
        if not record.checks:
            return
        checks, record.checks, record.found = record.checks, [], None
        first = next((i for i, (_, _, _, flag) in enumerate(checks) if bool(flag)), None)
        if first is None:
            return
        for _, members, fresh, _ in checks[first:]:
            for n in fresh:
                self.optimizers[n].state[self.params[n]].clear()
            for n in members:
                _unstepped(self.params[n].grad)
        start, names, _, _ = checks[first]
        del record.stepped[start:]
        self._stop(record, next((n for n in names if _not_finite(self.params[n].grad)), names[0]))

    def _step(self, names: list[str], params: list[torch.Tensor], record: _Backward) -> None:
        """Step ``params`` (a bucket, or one), unless a gradient is not finite, and leave their
        stand-ins. A non-finite gradient is never stepped: where nothing of this backward was
        stepped yet, nothing is (the loop may skip the batch with zero_grad()); else it raises now,
        naming what was. A gradient is finite where its largest magnitude is (no norm to overflow)."""
        two, peak = norms([local(p.grad) for p in params])
        kinds = self._kinds(names)
        # torch's fused steps check on the device, no synchronisation (see _read_checks); another, here.
        on_device = (record.tracked and not _is_fake(two[0]) and self.cls in _FOUND_INF
                     and all(how[1] for _, how, _ in kinds))
        if not on_device:
            self._read_checks(record)
        if record.skipping or not (on_device or self._finite(names, params, peak, record)):
            for n, p, a, b in zip(names, params, two, peak):
                p.grad = stand_in(p, n, a, b, stepped=False)
            return
        at = {n: i for i, n in enumerate(names)}
        for (group, _, device), members in kinds.items():
            opt = self._together(tuple(members)) if len(members) > 1 else self.optimizers[members[0]]
            opt.param_groups[0].update(self._options(members[0], record))
            if on_device:
                bad = torch.isfinite(torch.stack([peak[at[n]] for n in members])).all().logical_not()
                fresh = [n for n in members if not self.optimizers[n].state.get(self.params[n])]
                record.checks.append((len(record.stepped), members, fresh, bad))
                # One flag for the whole backward, on the device it began on: after a bad bucket on
                # one device, the buckets on every device skip.
                found = bad.float() if record.found is None else torch.maximum(record.found, bad.float().to(
                    record.found.device))
                record.found = found
            opt.found_inf = found.to(device) if on_device else None  # read by torch's fused step
            opt.step()
            record.stepped += members
        for n, p, a, b in zip(names, params, two, peak):
            p.grad = stand_in(p, n, a, b)

    def _finite(self, names: list[str], params: list[torch.Tensor], peak: list[torch.Tensor],
                record: _Backward) -> bool:
        """Whether every gradient is finite, agreed by every rank of a sharded parameter (each
        holds its own shard's); else stop this backward's steps, and raise where some were stepped."""
        if not record.tracked or _is_fake(peak[0]):  # compiled autograd, estimate()
            return True
        flags = [torch.isfinite(t).logical_not().to(torch.int32) for t in peak]
        for p, flag in zip(params, flags):
            if getattr(p, "_local_tensor", None) is not None and torch.distributed.is_initialized():
                torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MAX)  # every rank steps its shard
        by_device: dict = {}
        for flag in flags:
            by_device.setdefault(flag.device, []).append(flag)
        if not any(bool(torch.stack(group).any()) for group in by_device.values()):
            return True
        bad = [n for n, flag in zip(names, flags) if bool(flag)]
        self._stop(record, bad[0])
        return False

    def _stop(self, record: _Backward, bad: str, worker: bool = False) -> None:
        """A non-finite gradient of ``bad``: this backward steps nothing more; raise if it stepped some
        (in backward; from the CPU worker, at the next :meth:`wait`)."""
        record.skipping = True
        if not record.stepped:
            self.skipped = bad
            return
        stepped = self._stepped() + record.stepped
        if not worker:
            with self.lock:
                self.backward, self.unconfirmed, self.waiting, self.waiting_bytes = None, [], {}, 0
        raise RuntimeError(
            f"shrinkwrap: a non-finite gradient of {bad!r} in backward, after the optimizer had stepped "
            f"{_names(stepped)} in it (step_in_backward()); nothing after was stepped, and the model holds part "
            "of an update. Reload the last checkpoint (the model and sw.optimizer(model).state_dict()); to skip "
            "bad batches, check the loss before backward.")

    def _kinds(self, names: list[str]) -> dict:
        """``names`` by what they step with: their group, how their optimizers step and their
        device (``(group, (foreach, fused), device)``): a model may span devices."""
        kinds: dict = {}
        for n in names:
            own = self.optimizers[n].param_groups[0]
            key = (self.group_of.get(n, 0), tuple(own.get(k) for k in _HOW), self.params[n].device)
            kinds.setdefault(key, []).append(n)
        return kinds

    def _wait_in_bucket(self, name: str, p: torch.Tensor) -> None:
        """Step ``p`` with the gradients that came before it, once they hold ``_BUCKET`` bytes (or a
        ``_SHARE``-th of the model's gradients, the less), and at the end of this backward at the
        latest. One optimizer step a bucket, not a parameter: each step costs the CPU time besides
        its arithmetic (torch's Optimizer.step, its groups' bookkeeping), which a backward that
        keeps the GPU waiting on the CPU pays in full (RESULTS.md, the whole memory bill)."""
        with self.lock:  # hooks run on one autograd thread a device
            if name in self.waiting:
                # A second gradient into one still waiting (a reentrant checkpoint around a parameter
                # used outside it too): stepped once, it would leave one of them unused.
                raise RuntimeError(f"shrinkwrap: a second gradient accumulated into {name!r} in one backward (a "
                                   "reentrant checkpoint around a parameter used outside it too): this model's "
                                   "optimizer steps inside backward (step_in_backward()) and would step it twice. "
                                   "Checkpoint with use_reentrant=False (shrinkwrap's checkpoint() does).")
            self.waiting[name] = p
            self.waiting_bytes += p.grad.numel() * p.grad.element_size()
            full = self.waiting_bytes >= min(_BUCKET, self.grad_bytes // _SHARE)
        if full:
            self._step_waiting()

    def _step_waiting(self) -> None:
        with self.lock:
            waiting, self.waiting, self.waiting_bytes = self.waiting, {}, 0
            record = self.backward
        if waiting:
            self._step(list(waiting), list(waiting.values()), record)

    def _together(self, names: tuple[str, ...]) -> torch.optim.Optimizer:
        """One optimizer over the parameters ``names`` (of one kind, see :meth:`_kinds`), sharing
        their optimizers' state (the same ``state[p]`` dicts): it computes what their own steps
        compute, the same kernels over a list (bit for bit: CPU tests)."""
        opt = self.together.pop(names, None)
        if opt is None:
            opt = self.cls([self.params[n] for n in names], **self.options)
        self.together[names] = opt  # the most recent last
        while len(self.together) > _TOGETHER:
            self.together.popitem(last=False)
        for n in names:
            p = self.params[n]
            opt.state[p] = self.optimizers[n].state[p]
        return opt
