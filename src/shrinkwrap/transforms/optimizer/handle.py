"""The optimizer-shaped handle of a model whose optimizer steps inside backward: :class:`InBackward`.

Each parameter that requires grad gets an optimizer of its own (the class and options given), and a
hook that steps it as soon as its gradient is accumulated, then leaves a stand-in
(:class:`~.standin.Consumed`) in ``.grad``. To the loop the handle is the plain optimizer the user
would have built over ``model.parameters()``: one param group of every parameter (``add_param_group``
takes some out into groups of their own), whose options the steps in backward read, so that LR
schedulers, step hooks and ``state_dict`` round trips with a plain optimizer of the same class work.

What a plain loop does that a step in backward cannot follow is refused, at the earliest point
where it can be known (see docs/steps/step_in_backward.md): a backward that discards or adds to
gradients the step used, a non-finite gradient (never stepped), a backward that raised halfway.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import required

from ... import _rewrite
from .cpu import _OnCpu, _differs, _one_optimizer, fingerprint
from .lowbit import LowBitAdamW, _is_fake
from .refusals import _LIVE, guard_grad_scaler, per_parameter_options
from .standin import Consumed, is_stand_in, local, norms, stand_in

# Gradients that wait in backward to be stepped together (see InBackward._later): at most 128 MiB,
# and a sixteenth of the model's gradient bytes, so that the gradient term stays out of the peak.
_BUCKET = 128 << 20
_SHARE = 16
_TOGETHER = 64  # bucket optimizers kept (buckets differ where a forward leaves parameters unused)
_HOW = ("foreach", "fused")  # the group options that say how an optimizer steps, not what it computes

# The classes whose fused step skips itself where ``found_inf`` is set (as GradScaler has it).
_FOUND_INF = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)


def _count_change(p: torch.Tensor) -> None:
    """Count the CPU step's coming write in ``p``'s version now, before the worker makes it: a node
    later in this backward that needs the weight as it was raises torch's error, as it does where
    the step runs on the device (whose in-place update counts)."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(p)
        return
    set_version = torch._C._autograd._unsafe_set_version_counter
    try:
        set_version((p,), (p._version + 1,))
    except TypeError:  # torch 2.4-2.5 take one tensor
        set_version(p, p._version + 1)


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
    ca = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported: not running
    region = getattr(ca, "in_compiled_autograd_region", False)  # a flag in some versions, a function in others
    return bool(region() if callable(region) else region)


def _keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``, ``create_graph=True``)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(keep()) if keep is not None and not _compiled_autograd() else False


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


def _equal(a: Any, b: Any) -> bool:
    """Option values equal: tensors the same object, anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return bool(a == b)


def _signature(p: torch.Tensor) -> tuple:
    return p.device, p.dtype, tuple(p.shape)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    rest = len(names) - 3
    return shown + (f" and {rest} more" if rest > 0 else "")


class InBackward(torch.optim.Optimizer):
    """The optimizer-shaped handle of a model whose optimizer steps inside backward (see the module
    docstring). A ``torch.optim.Optimizer``: schedulers, step hooks and ``state_dict`` see the plain
    optimizer ``cls(model.parameters(), **options)``, whatever steps each parameter."""

    def __init__(self, cls: type, options: dict, on_cpu: bool, spec: tuple = ()) -> None:
        # Not Optimizer.__init__, which wants the parameters: the model's come at bind().
        template = cls([torch.zeros(1, requires_grad=True)], **options)
        self.defaults = dict(template.defaults)
        self.param_groups = [{"params": [], **{k: v for k, v in template.param_groups[0].items() if k != "params"}}]
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()  # step() runs the step hooks
        self.cls, self.spec, self.on_cpu = cls, spec, on_cpu
        self.options = per_parameter_options(cls, options)
        self.names: list[str] = []  # every parameter of the model, in its order
        self.params: dict[str, torch.Tensor] = {}
        self.group_of: dict[str, int] = {}  # the parameters add_param_group put in groups 1...
        self.optimizers: dict[str, torch.optim.Optimizer] = {}  # the parameters that require grad
        self.bound: dict[str, tuple] = {}  # the object and signature each optimizer was built for
        self.pending: dict[str, dict] = {}  # loaded state of parameters without an optimizer yet
        self.hooks: dict[str, Any] = {}
        self.cpu: dict[str, _OnCpu] = {}
        self.futures: list[concurrent.futures.Future] = []
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.streams: dict = {}  # a device's streams for the CPU steps (see _streams)
        self.lock = threading.Lock()
        self.model: Any = lambda: None  # a weak reference to the model, set by the step
        # Gradients waiting to be stepped together (see _later), and the optimizers that step a
        # bucket of parameters at once, by the bucket's names.
        self.waiting: dict[str, torch.Tensor] = {}
        self.waiting_bytes = 0
        self.grad_bytes = 0
        self.together: OrderedDict[tuple[str, ...], torch.optim.Optimizer] = OrderedDict()
        self.backward: _Backward | None = None  # the backward running, or one that raised
        self.unconfirmed: list[_Backward] = []  # the backwards that stepped since the last step()
        self.skipped: str | None = None  # the non-finite gradient that stopped the last backward's steps
        self.retained = False  # warned that a backward keeping its graph keeps its gradients
        self.fetched = 0  # weights the CPU steps took from the GPU, changed since their last step
        _LIVE.add(self)
        guard_grad_scaler()

    # -- what torch's Optimizer API reads ----------------------------------------------------------
    @property
    def state(self) -> dict:  # type: ignore[override]
        """Each parameter's state, keyed by the model's parameter, as a plain optimizer's."""
        out: dict = {}
        for n in self.names:
            opt = self.optimizers.get(n)
            own = next(iter(opt.state.values()), None) if opt is not None else self.pending.get(n)
            if own:
                out[self.params[n]] = own
        return out

    @state.setter
    def state(self, value: Any) -> None:
        pass  # the per-parameter optimizers' own

    def __getstate__(self) -> dict:
        """A copy (``deepcopy``, pickle, ``AveragedModel``) steps with the same class, options and
        groups from fresh state: the state is saved through ``state_dict()``, as a plain optimizer's."""
        self.wait()
        return {"cls": self.cls, "options": self.spec_options, "on_cpu": self.on_cpu, "spec": self.spec,
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "group_of": dict(self.group_of)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["cls"], state["options"], state["on_cpu"], state["spec"])
        self.param_groups = [{"params": [], **g} for g in state["groups"]]
        self.group_of = dict(state["group_of"])

    @property
    def spec_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k != "foreach"}

    def __repr__(self) -> str:
        return (f"InBackward({self.cls.__module__}.{self.cls.__qualname__}, {len(self.optimizers)} parameters "
                f"trained, state on the {'CPU' if self.on_cpu else 'device'})")

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Runs ``closure`` (its backward steps the parameters), waits for updates on the CPU, and
        steps, as a plain optimizer would, each parameter whose gradient is still in ``.grad``: a
        backward that kept its graph left it there, or FSDP2 held the parameter unsharded when
        the hooks were placed. Raises where the last backward stopped at a non-finite gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle()
        self._raise_skipped()
        self._check_options()
        self._rebind()
        late = _Backward(tracked=True)
        for n, p in self.params.items():
            if n in self.optimizers and p.grad is not None and not is_stand_in(p.grad):
                if self.on_cpu:
                    self._to_cpu(n, p, late)
                else:
                    self._step([n], [p], late)
        self._read_checks(late)
        self.wait()
        self.unconfirmed = []
        self._raise_skipped()
        return loss

    def _raise_skipped(self) -> None:
        if self.skipped is None:
            return
        name, self.skipped = self.skipped, None
        raise RuntimeError(
            f"shrinkwrap: step() after a backward whose gradient of {name!r} was not finite: this model's "
            "optimizer steps inside backward (step_in_backward()), and stepped none of that backward's "
            "gradients (a plain optimizer would write NaN into the weights). Skip such a batch with "
            "zero_grad() instead of step() (a guard on the loss, or on what clip_grad_norm_ returns).")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the stand-ins backward left in ``.grad`` (``set_to_none=False``: zero gradients'
        stand-ins, which the next forward drops). Raises after a backward that no ``step()``
        followed: its gradients were applied already, and a loop that discards them cannot be
        followed."""
        self._settle()
        self._confirmed("zero_grad()")
        self.skipped = None
        self._rebind()
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: the group's parameters step with its options. Parameters of the first
        group (every parameter no other group names) move to the new one; a parameter of another
        added group raises, as torch's does."""
        self._rebind()
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("shrinkwrap: add_param_group() takes the parameters as a list or a tensor, not a set, "
                            "whose order changes between runs")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        by_id = {id(p): n for n, p in self.params.items()}
        names = []
        for p in params:
            if id(p) not in by_id:
                raise ValueError(f"shrinkwrap: add_param_group() takes the model's own parameters; a tensor of shape "
                                 f"{tuple(p.shape)} is not one of them (add a new module to the model first)")
            names.append(by_id[id(p)])
        if any(self.group_of.get(n, 0) for n in names) or len(set(names)) != len(names):
            raise ValueError("some parameters appear in more than one parameter group")
        group = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in self.defaults.items():
            if v is required and k not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {k}")
            group.setdefault(k, v)
        self.param_groups.append({"params": [], **group})
        for n in names:
            self.group_of[n] = len(self.param_groups) - 1
        self._regroup()

    def state_dict(self) -> dict:  # type: ignore[override]
        """As a plain optimizer's over the same groups: parameters numbered group by group."""
        self.wait()
        self._rebind()
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state, groups, i = {}, [], 0
        for g, group in enumerate(self.param_groups):
            members = self._members(g)
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(i, i + len(members)))})
            for n in members:
                own = self._own_state(n)
                if own:
                    state[i] = own
                i += 1
        out = {"state": state, "param_groups": groups}
        for post in self._optimizer_state_dict_post_hooks.values():
            out = post(self, out) or out
        return out

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """As a plain optimizer's: the saved groups' options, each parameter's state onto the
        parameter at its place (on the CPU with ``state='cpu'``)."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        self.wait()
        self._rebind()
        saved_groups = state_dict["param_groups"]
        sizes = [len(self._members(g)) for g in range(len(self.param_groups))]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if len(sizes) == 1 and len(saved_sizes) > 1 and sum(saved_sizes) == sizes[0]:
            # A plain optimizer of several groups over model.parameters() in order (one a
            # parameter, say): the handle takes its groups.
            self.param_groups[1:] = [{"params": [], **self.param_groups[0]} for _ in saved_sizes[1:]]
            owners = [g for g, size in enumerate(saved_sizes) for _ in range(size)]
            self.group_of = {n: g for n, g in zip(self.names, owners) if g}
            self._regroup()
            sizes = saved_sizes
        if [len(g["params"]) for g in saved_groups] != sizes:
            raise ValueError(
                f"shrinkwrap: a state_dict of groups of {[len(g['params']) for g in saved_groups]} parameters cannot "
                f"load into this handle's groups of {sizes} (every parameter of the model, in model.parameters() "
                f"order, then the groups add_param_group() made): save it from a handle, or from "
                f"{self.cls.__name__}(model.parameters())")
        for g, saved in enumerate(saved_groups):
            self.param_groups[g].update({k: v for k, v in saved.items() if k != "params"})
            for i, n in zip(saved["params"], self._members(g)):
                own = state_dict["state"].get(i)
                if n in self.optimizers:
                    self._load_one(n, own)
                elif own:
                    self.pending[n] = own
                else:
                    self.pending.pop(n, None)
        self.together.clear()  # their state dicts are new ones
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _own_state(self, n: str) -> dict | None:
        opt = self.optimizers.get(n)
        if opt is None:
            return self.pending.get(n)
        return opt.state_dict()["state"].get(0)

    def _load_one(self, n: str, own: dict | None) -> None:
        opt = self.optimizers[n]
        # How each optimizer steps (fused, foreach) stays its own: a plain optimizer's state_dict
        # would otherwise turn a per-parameter step into its multi-tensor path.
        group = {**opt.param_groups[0], **self._options(n)}
        group.pop("params")
        opt.load_state_dict({"state": {0: own} if own else {}, "param_groups": [{**group, "params": [0]}]})

    # -- groups --------------------------------------------------------------------------------------
    def _members(self, g: int) -> list[str]:
        return [n for n in self.names if self.group_of.get(n, 0) == g]

    def _regroup(self) -> None:
        for g, group in enumerate(self.param_groups):
            group["params"] = [self.params[n] for n in self._members(g)]

    def _options(self, n: str, record: _Backward | None = None) -> dict:
        """What ``n`` steps with: its group's options (a scheduler's learning rate), and how its
        own optimizer steps (``_HOW``); kept in ``record`` as the backward read them."""
        g = self.group_of.get(n, 0)
        options = {k: v for k, v in self.param_groups[g].items() if k != "params" and k not in _HOW}
        if record is not None and g not in record.used:
            record.used[g] = (options, {k: v._version for k, v in options.items() if isinstance(v, torch.Tensor)})
        own = self.optimizers[n].param_groups[0]
        return {**options, **{k: own[k] for k in _HOW if k in own}}

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

    # -- binding parameters ------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Take the model's parameters as they are now: every parameter joins the first group, and
        each that requires grad gets an optimizer and the hook, where it has none or the model
        holds another object under its name, or the same one on another device or dtype, than
        when it got one (at apply; after FSDP2's fully_shard swapped them; after a parameter was
        unfrozen, an adapter added, the model moved)."""
        named = dict(model.named_parameters())
        # Under FSDP2 the model holds its sharded parameters between forwards and the unsharded ones
        # while a module runs: the step takes the sharded one, whose reduced gradient FSDP2 hands to
        # the hooks.
        sharded = bool(_rewrite.sharded(model))
        changed = list(named) != self.names and not sharded
        for n, p in named.items():
            if sharded and getattr(p, "_local_tensor", None) is None:
                continue
            if self.params.get(n) is not p:
                self.params[n], changed = p, True
            then = self.bound.get(n)
            if p.requires_grad and (then is None or then[0] is not p or then[1] != _signature(p)):
                self._bind_one(n, p)
                changed = True
        if not changed:
            return
        if not sharded:
            for n in [n for n in self.params if n not in named]:
                self._unbind(n)
            self.names = list(named)
        else:
            self.names = [n for n in named if n in self.params]
        self._regroup()
        self.together.clear()
        self.grad_bytes = sum(p.numel() * p.element_size() for n, p in self.params.items() if n in self.optimizers)

    def _bind_one(self, n: str, p: torch.Tensor) -> None:
        old = self.optimizers.get(n)
        if old is not None and any(old.state.values()):
            then = self.bound[n]
            what = ("was replaced (by sharding?)" if then[0] is not p else
                    f"moved from {then[1][0]} {then[1][1]} to {p.device} {p.dtype}")
            raise RuntimeError(f"shrinkwrap: parameter {n!r} {what} after training began; its optimizer state "
                               "cannot follow it. Shard, move or cast the model before its first step, or load the "
                               "handle's state_dict() again after.")
        if n in self.hooks:
            self.hooks.pop(n).remove()
        if self.on_cpu and getattr(p, "_local_tensor", None) is not None:
            raise RuntimeError(f"shrinkwrap: step_in_backward(state='cpu') does not take FSDP2's sharded parameters "
                               f"({n!r}); use state='device', whose step takes each rank's shard")
        on = _OnCpu(p, self.cls, self.options) if self.on_cpu else None
        # A DTensor (FSDP2's shard) keeps the single-tensor step: torch's fused kernels are
        # not among the operations DTensor shards in every version.
        new = on.optimizer if on else _one_optimizer(
            self.cls, p, self.options, fused=p.is_cuda and getattr(p, "_local_tensor", None) is None)
        if old is not None:
            group = old.param_groups[0]
            # The dict the optimizer held, stepping as the new optimizer does (fused where the new
            # one took a GPU tensor, a shard's single-tensor step otherwise).
            group.update({k: v for k, v in new.param_groups[0].items() if k in ("params", *_HOW)})
            new.param_groups[0] = group
        if on is not None:
            self.cpu[n] = on
        self.optimizers[n], self.bound[n] = new, (p, _signature(p))
        if n in self.pending:
            self._load_one(n, self.pending.pop(n))
        self.hooks[n] = p.register_post_accumulate_grad_hook(self._hook(n))

    def _unbind(self, n: str) -> None:
        if n in self.hooks:
            self.hooks.pop(n).remove()
        for table in (self.params, self.optimizers, self.bound, self.cpu, self.pending, self.group_of):
            table.pop(n, None)

    def _rebind(self) -> None:
        model = self.model()
        if model is not None:
            self.bind(model)

    def _hook(self, name: str) -> Any:
        # The hook reaches the handle through a weak reference: a tensor's hooks are held from C++,
        # where the garbage collector cannot see them, so a handle -> parameter -> hook -> handle
        # cycle would never be collected, and a model dropped without revert() would keep its
        # parameters and optimizer state on the GPU.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            handle = ref()
            if handle is not None:  # else the model and its handle are gone
                handle._arrived(name, p)
        return hook

    # -- in backward ---------------------------------------------------------------------------------
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
            self._later(name, p)
        else:
            self._step([name], [p], record)

    def _begin(self) -> _Backward:
        """The record of the running backward, begun with its first gradient: the engine's
        end-of-backward callback ends it (compiled autograd has none: each parameter steps alone)."""
        with self.lock:
            if self.backward is None:
                self.backward = _Backward(tracked=not _compiled_autograd())
                if self.backward.tracked:
                    torch.autograd.Variable._execution_engine.queue_callback(self._end)
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

    def _later(self, name: str, p: torch.Tensor) -> None:
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

    def _to_cpu(self, name: str, p: torch.Tensor, record: _Backward) -> None:
        """The gradient, its norms and the weight down (a side stream), the step on the worker
        thread, the weight back up (another stream); a non-finite gradient stops the steps as on
        the device, raised at the next ``wait()`` where some were stepped."""
        on = self.cpu[name]
        grad = p.grad
        two, peak = norms([local(grad)])
        weight = on.master.detach() if on.seen is None else on.seen  # where the weight comes down
        if p.is_cuda:
            down, up, _ = self._streams(p.device)
            # A half weight: whether it changed since its step wrote it, taken on the compute
            # stream now, after whatever the forward did to it.
            changed = _differs(fingerprint(p), on.written, p.device).to(two[0].dtype) if on.seen is not None else two[0]
            told = torch.stack([two[0], peak[0], changed])
            down.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(down):
                on.grad.copy_(grad, non_blocking=True)
                if on.seen is None:  # a float32 weight comes down with its gradient, into the master
                    weight.copy_(p.detach(), non_blocking=True)
                on.norms.copy_(told, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(down)
            grad.record_stream(down)  # their memory is reused only once the copies are done
            told.record_stream(down)
        else:
            on.grad.copy_(grad)
            on.norms.copy_(torch.stack([two[0], peak[0], two[0]]))
            copied = up = None
        p.grad = stand_in(p, name, two[0], peak[0])
        _count_change(p)
        # The step holds the parameter, its state and the handle weakly: a finished step's closure
        # can outlive wait() for a moment in the worker, and must not keep a dropped model alive.
        refs = weakref.ref(p), weakref.ref(on), weakref.ref(self)
        options, lock = self._options(name, record), self.lock

        def step() -> None:
            p, on, handle = (r() for r in refs)
            if p is None or on is None or handle is None:
                return
            if copied is not None:
                copied.synchronize()
            finite = math.isfinite(float(on.norms[1]))
            with lock:
                skip = record.skipping
            if skip or not finite:
                _unstepped(p.grad)
                if not skip:
                    handle._stop(record, name, worker=True)
                return
            if up is None:
                on.take(p.detach())  # a CPU model's own weight
            elif on.seen is not None and bool(on.norms[2]):  # a half weight changed since its step
                with torch.cuda.stream(handle._streams(p.device)[2]):  # waits for no copy up
                    weight.copy_(p.detach(), non_blocking=True)
                    torch.cuda.current_stream().synchronize()
                handle.fetched += 1
                on.take(weight)
            on.master.grad = on.grad
            on.optimizer.param_groups[0].update(options)
            on.optimizer.step()
            on.master.grad = None
            with lock:
                record.stepped.append(name)
            with torch.no_grad():
                if up is not None:
                    with torch.cuda.stream(up):
                        p.data.copy_(on.master, non_blocking=True)
                        if on.seen is not None:
                            on.written = fingerprint(p)
                else:
                    p.data.copy_(on.master)

        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shrinkwrap-step")
        with self.lock:
            self.futures.append(self.worker.submit(step))

    def _streams(self, device: torch.device) -> tuple:
        """A device's streams for the CPU steps: the copies down, the copies up, the fetches."""
        if device not in self.streams:
            self.streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return self.streams[device]

    # -- between backwards -----------------------------------------------------------------------------
    def wait(self) -> None:
        """Every CPU step done and its weight back (the compute stream waits for the copies); the
        first error a CPU step raised is raised here."""
        with self.lock:
            futures, self.futures = self.futures, []
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
        return [n for record in self.unconfirmed for n in record.stepped]

    def before_forward(self, module: nn.Module) -> None:
        """The root's forward pre-hook: CPU updates back, zero gradients' stand-ins dropped, and,
        for a training forward, the parameters bound (see :meth:`bind`)."""
        self._settle()
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
