"""TransparentWrapper: the state_dict hooks of a wrapped module keep running, with the module itself."""

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw

# Each wrapper, with the name of the module it wraps in `model()`.
WRAPPERS = {
    "checkpoint": (sw.checkpoint("1"), "1"),
    "autocast": (sw.autocast(torch.bfloat16, "1"), "1"),
    "bn_act": (sw.bn_act(), "1.1"),
}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()))


def hook_kinds(calls):
    """Register each kind of state_dict hook on a module; each records (kind, module) when it runs."""
    return {
        "private_post": lambda m: m._register_state_dict_hook(lambda mod, sd, prefix, meta: calls.append(("private_post", mod))),
        "post": lambda m: m.register_state_dict_post_hook(lambda mod, sd, prefix, meta: calls.append(("post", mod))),
        "pre": lambda m: m.register_state_dict_pre_hook(lambda mod, prefix, keep: calls.append(("pre", mod))),
        "load_pre": lambda m: m.register_load_state_dict_pre_hook(lambda mod, *a: calls.append(("load_pre", mod))),
        "load_post": lambda m: m.register_load_state_dict_post_hook(lambda mod, keys: calls.append(("load_post", mod))),
    }


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("kind", ["private_post", "post", "pre", "load_pre", "load_post"])
def test_state_dict_hooks_of_a_wrapped_module_run_with_the_module(wrapper, kind):
    step, name = WRAPPERS[wrapper]
    net = model()
    inner = net.get_submodule(name)
    calls = []
    hook_kinds(calls)[kind](inner)
    sw.apply(net, step)
    assert isinstance(net.get_submodule(name), sw._wrapper.TransparentWrapper)
    sd = net.state_dict()
    net.load_state_dict(sd)
    assert calls == [(kind, inner)]
    sw.revert(net)
    calls.clear()
    net.load_state_dict(net.state_dict())
    assert calls == [(kind, inner)]


@pytest.mark.parametrize("kind", ["post", "pre", "load_pre"])
def test_a_hook_registered_on_the_wrapper_runs_once_and_stays_after_revert(kind):
    net = model()
    inner = net[1]
    sw.apply(net, sw.checkpoint("1"))
    calls = []
    hook_kinds(calls)[kind](net[1])  # a library that finds the wrapper in the tree
    net.load_state_dict(net.state_dict())
    assert [k for k, _ in calls] == [kind]
    sw.revert(net)
    assert net[1] is inner
    net.load_state_dict(net.state_dict())
    assert [k for k, _ in calls] == [kind, kind]


def test_a_hook_returning_a_new_state_dict_is_honoured():
    net = model()

    def rename(mod, sd, prefix, meta):  # what a tied-weights or sharding hook does: edit the dict
        sd[prefix + "extra"] = torch.zeros(1)

    net[1]._register_state_dict_hook(rename)
    sw.apply(net, sw.checkpoint("1"))
    assert "1.extra" in net.state_dict()


def test_attributes_a_library_sets_through_the_wrapper_reach_the_wrapped_module():
    class Layer(nn.Module):  # Hugging Face's GradientCheckpointingLayer, reduced to what matters
        gradient_checkpointing = False

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(self.lin, x, use_reentrant=False)
            return self.lin(x)

    net = nn.Sequential(Layer())
    layer = net[0]
    sw.apply(net, sw.checkpoint("0"))
    for module in net.modules():  # what gradient_checkpointing_enable() does
        if hasattr(module, "gradient_checkpointing"):
            module._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint
            module.gradient_checkpointing = True
    net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert layer.gradient_checkpointing and "_gradient_checkpointing_func" in layer.__dict__
    assert "_gradient_checkpointing_func" not in net[0].__dict__


def test_forward_and_class_set_on_a_wrapper_stay_on_the_wrapper():
    net = model()
    inner = net[1]
    sw.apply(net, sw.checkpoint("1"))
    wrapper = net[1]
    calls = []
    original = wrapper.forward
    wrapper.forward = lambda *a, **k: calls.append(1) or original(*a, **k)  # a library patching what it finds
    net(torch.randn(2, 3, 4, 4))
    assert calls == [1] and "forward" not in inner.__dict__

    class Sub(type(wrapper)):  # what FSDP2's fully_shard does to the module it is given
        pass

    wrapper.__class__ = Sub
    assert type(wrapper) is Sub and type(inner) is nn.Sequential
