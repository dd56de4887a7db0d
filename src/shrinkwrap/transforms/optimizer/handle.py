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
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch.optim.optimizer import required

from .backward import _HOW, BackwardSteps, _Backward
from .binding import Binding
from .checks import LoopChecks
from .cpu import CpuSteps, _OnCpu
from .refusals import _LIVE, guard_grad_scaler, per_parameter_options
from .standin import is_stand_in


class InBackward(LoopChecks, Binding, BackwardSteps, CpuSteps, torch.optim.Optimizer):
    """The optimizer-shaped handle of a model whose optimizer steps inside backward (see the module
    docstring). A ``torch.optim.Optimizer``: schedulers, step hooks and ``state_dict`` see the plain
    optimizer ``cls(model.parameters(), **options)``, whatever steps each parameter."""

    def __init__(self, cls: type, options: dict, on_cpu: bool, spec: tuple = (), delayed: bool = False,
                 rounding: str = "nearest", delay_after: int = 0) -> None:
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
        self.delay, self.delay_after, self.rounding = delayed, delay_after, rounding
        self.steps_taken = 0  # step() calls that stepped: the delayed update starts after delay_after of them
        # The stochastic rounding's offsets: a generator of the handle's own, so that the user's
        # random stream is not drawn from (on the worker thread, at times of its own).
        self.rounding_generator = (torch.Generator().manual_seed(torch.initial_seed() % 2**63)
                                   if rounding == "stochastic" else None)
        self.deferred: list = []  # delayed: the last backward's steps, submitted at step()
        self.worker_s = 0.0  # seconds the worker spent stepping
        self.waited_s = 0.0  # seconds the loop waited for the worker
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
        # Gradients waiting to be stepped together (see _wait_in_bucket), and the optimizers that step a
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
                "delayed": self.delay, "rounding": self.rounding, "delay_after": self.delay_after,
                "steps_taken": self.steps_taken,
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "group_of": dict(self.group_of)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["cls"], state["options"], state["on_cpu"], state["spec"], state.get("delayed", False),
                      state.get("rounding", "nearest"), state.get("delay_after", 0))
        self.steps_taken = state.get("steps_taken", 0)
        self.param_groups = [{"params": [], **g} for g in state["groups"]]
        self.group_of = dict(state["group_of"])

    @property
    def spec_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k != "foreach"}

    def __repr__(self) -> str:
        return (f"InBackward({self.cls.__module__}.{self.cls.__qualname__}, {len(self.optimizers)} parameters "
                f"trained, state on the {'CPU' if self.on_cpu else 'device'})")

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Runs ``closure`` (its backward steps the parameters), waits for updates on the CPU
        (delayed: hands them to the CPU, to be written up in the next backward), and steps, as a
        plain optimizer would, each parameter whose gradient is still in ``.grad``: a backward that
        kept its graph left it there, or FSDP2 held the parameter unsharded when the hooks were
        placed. Raises where the last backward stopped at a non-finite gradient."""
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
        if self.delayed:
            self._submit_delayed()
            self._done()
        else:
            self.wait()
        self.unconfirmed = []
        self._raise_skipped()
        self.steps_taken += 1
        return loss

    @property
    def delayed(self) -> bool:
        """Whether this iteration's update is delayed: with ``delayed=True``, once ``delay_after``
        steps were taken exact (the warm-up)."""
        return self.delay and self.steps_taken >= self.delay_after

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
        # A resumed run's warm-up goes on from the steps its optimizer took, where its state counts them.
        taken = [int(own["step"]) for own in state_dict["state"].values() if isinstance(own, dict) and "step" in own]
        if taken:
            self.steps_taken = max(taken)
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

