"""The loop checks between backwards: what a plain loop does that a step in backward cannot
follow is refused at the next ``zero_grad()``, ``step()`` or training forward (a backward no
``step()`` followed, options changed after backward, a backward that raised halfway), and the CPU
steps are waited for. Mixed into :class:`~.handle.InBackward`.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import torch.nn as nn

from .backward import _names
from .refusals import _LIVE
from .standin import Consumed, local


def _equal(a: Any, b: Any) -> bool:
    """Option values equal: tensors the same object, anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return bool(a == b)


class LoopChecks:
    """What the handle checks between backwards, and the CPU steps it waits for."""

    def _raise_skipped(self) -> None:
        if self.skipped is None:
            return
        name, self.skipped = self.skipped, None
        raise RuntimeError(
            f"shrinkwrap: step() after a backward whose gradient of {name!r} was not finite: this model's "
            "optimizer steps inside backward (step_in_backward()), and stepped none of that backward's "
            "gradients (a plain optimizer would write NaN into the weights). Skip such a batch with "
            "zero_grad() instead of step() (a guard on the loss, or on what clip_grad_norm_ returns).")

    def _check_options(self) -> None:
        """Raise where a group's options changed between the backward that read them and
        ``step()`` (a step pre-hook, a learning rate set after backward): a plain optimizer would
        step this batch with the new ones."""
        for record in self.unconfirmed:
            for g, (used, versions) in record.used.items():
                now = self.param_groups[g] if g < len(self.param_groups) else {}
                changed = [k for k, v in used.items() if not (now.get(k) is v or _equal(now.get(k), v))
                           or k in versions and v._version != versions[k]]  # a tensor lr set in place
                if changed:
                    self.unconfirmed = []
                    raise RuntimeError(
                        f"shrinkwrap: {', '.join(changed)} of param group {g} changed after backward and before "
                        "step() (a step pre-hook, or set between them): this model's optimizer steps inside "
                        "backward (step_in_backward()), which stepped with the values before. Set them before "
                        "backward (a scheduler's step() after the optimizer's does), or leave step_in_backward() "
                        "out of the plan (shrinkwrap.revert(model)).")

    def wait(self) -> None:
        """Every CPU step done and its weight back (the compute stream waits for the copies; with
        ``delayed=True`` the model holds the latest weights after it); the first error a CPU step
        raised is raised here."""
        began = time.perf_counter()
        if self.delayed:
            self._flush()
        self._done(everything=True)
        self.waited_s += time.perf_counter() - began

    def _done(self, everything: bool = False) -> None:
        """The CPU steps' errors raised, of every step (waited for) or of those done; the compute
        stream after the copies up issued so far."""
        with self.lock:
            futures = self.futures if everything else [f for f in self.futures if f.done()]
            self.futures = [] if everything else [f for f in self.futures if not f.done()]
        errors = [f.exception() for f in futures]
        for device, (_, up, _) in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(up)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            with self.lock:
                self.backward, self.unconfirmed = None, []  # the error names what was stepped
            raise first

    def _settle(self) -> None:
        """After a backward that raised before its end: its waiting gradients are left in ``.grad``
        (not stepped behind the caller's back), and where it had stepped some, that is raised."""
        if self.delayed:
            self._done()
        else:
            self.wait()
        with self.lock:
            record = self.backward
            if record is None:
                return
            self.backward, self.waiting, self.waiting_bytes = None, {}, 0
        self._read_checks(record)
        if record.tracked and record.stepped:
            stepped, self.unconfirmed = self._stepped() + record.stepped, []
            raise RuntimeError(
                f"shrinkwrap: the last backward raised after the optimizer had stepped {_names(stepped)} in it "
                "(step_in_backward()); the rest were not stepped, and the model holds part of an update. Reload "
                "the last checkpoint (the model and sw.optimizer(model).state_dict()), or go on from here.")

    def _confirmed(self, what: str) -> None:
        """Raise where a backward stepped parameters and no ``step()`` followed before ``what``."""
        stepped = self._stepped()
        self._drop_delayed()  # delayed: a backward whose gradients were not finite, or one refused here
        if not stepped:
            return
        self.unconfirmed = []
        raise RuntimeError(
            f"shrinkwrap: {what} after a backward that no step() followed: this model's optimizer steps inside "
            f"backward (step_in_backward()), and that backward already applied its gradients to {_names(stepped)}. "
            "A loop that discards a backward's gradients (a GAN's generator loss through the discriminator, a "
            "backward for analysis) or accumulates them over several cannot step in backward: call step() after "
            "each backward, freeze parameters that must not learn from one (requires_grad_(False)), or leave "
            "step_in_backward() out of the plan (shrinkwrap.revert(model)).")

    def _stepped(self) -> list[str]:
        """What the backwards since the last ``step()`` stepped; delayed, what they will step
        (their gradients came down finite: a non-finite one drops them all, a skipped batch)."""
        stepped = [n for record in self.unconfirmed for n in record.stepped]
        if self.deferred and self._verdict() is None:
            stepped += [n for n, *_ in self.deferred]
        return stepped

    def before_forward(self, module: nn.Module) -> None:
        """The root's forward pre-hook: CPU updates back, zero gradients' stand-ins dropped, and,
        for a training forward, the parameters bound (see :meth:`bind`)."""
        self._settle()
        if self.delayed and not (torch.is_grad_enabled() and module.training):
            self.wait()  # an evaluation sees the latest weights
        if torch.is_grad_enabled() and module.training:
            if self.model() is None:
                self.model = weakref.ref(module)
            self._confirmed("a training forward")
            self.bind(module)
            for p in self.params.values():
                if p.grad is not None and isinstance(local(p.grad), Consumed) and local(p.grad).zeroed:
                    p.grad = None

    def close(self) -> None:
        self.wait()
        for handle in self.hooks.values():
            handle.remove()
        self.hooks.clear()
        _LIVE.discard(self)
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
