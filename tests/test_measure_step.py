"""shrinkwrap.measure on one configuration: its inputs and losses, the model left as it was, and the copies it
measures on."""

import types

import pytest
import torch
import torch.nn as nn

import shrinkwrap as sw
from shrinkwrap.measuring.step import default_loss

from measure_helpers import FAST, mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_measure_function_and_the_measuring_package_are_apart():
    import importlib
    import types

    import shrinkwrap.measuring.saved  # noqa: F401

    assert callable(sw.measure) and sw.measure.__module__ == "shrinkwrap.measuring.step"
    assert isinstance(sw.measuring, types.ModuleType) and sw.measuring is importlib.import_module("shrinkwrap.measuring")
    assert sw.measuring.saved.saved_tensor_bytes is sw.saved_tensor_bytes
    assert not hasattr(sw.measure, "saved")  # the function, not the package under its name


def test_cpu_profile_counts_what_it_labels():
    model, x = mlp(), torch.randn(16, 32)
    prof = sw.measure(model, x, iterations=3, warmup=1, device="cpu")
    params = list(model.parameters())
    assert prof.peak is None and prof.static is None and prof.breakdown() == {}  # no GPU peak passed off
    assert prof.device == "cpu" and prof.torch_version == torch.__version__
    assert prof.saved == sw.saved_tensor_bytes(lambda: model(x))
    assert prof.parameters == nbytes(params) + nbytes(model.buffers())
    assert prof.gradients == nbytes(params)
    assert prof.optimizer_state >= 2 * nbytes(params)  # AdamW: exp_avg and exp_avg_sq (and step counters)
    assert prof.batch == x.nbytes
    assert len(prof.step_times_ms) == 3 and prof.step_ms > 0
    assert "no GPU peak" in str(prof)


def test_measure_leaves_the_model_as_it_was():
    model = mlp().eval()
    model(torch.randn(4, 32)).sum().backward()  # the user's own gradients, to be kept
    modules = list(model.modules())
    params = {n: p for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in params.items()}
    sw.measure(model, torch.randn(16, 32), **FAST)
    assert list(model.modules()) == modules
    assert {n: p for n, p in model.named_parameters()} == params  # same objects
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights, running stats, num_batches_tracked
    assert all(torch.equal(p.grad, grads[n]) for n, p in params.items())
    assert not model.training and not any(m.training for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class HFLike(nn.Module):
    """Keyword inputs and an output object, as Hugging Face models take and give."""

    def __init__(self, loss: bool) -> None:
        super().__init__()
        self.emb, self.loss = nn.Embedding(50, 16), loss

    def forward(self, input_ids, labels=None):
        logits = self.emb(input_ids)
        loss = logits.pow(2).mean() if self.loss else None
        return types.SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("with_loss", [True, False])
def test_dict_batch_and_output_objects(with_loss):
    prof = sw.measure(HFLike(with_loss), {"input_ids": torch.randint(0, 50, (4, 8))}, **FAST)
    assert prof.gradients > 0


def test_default_loss():
    t = torch.tensor([1.0, 3.0])
    assert default_loss(t) == 2
    assert default_loss(types.SimpleNamespace(loss=torch.tensor(5.0), logits=t)) == 5
    assert default_loss(types.SimpleNamespace(loss=None, logits=t)) == 2
    assert default_loss((t, "aux")) == 2
    with pytest.raises(TypeError, match="loss_fn"):
        default_loss("text")


def test_grad_scaler_is_used_for_float16_autocast(monkeypatch):
    made = []

    class Recording(torch.amp.GradScaler):
        def __init__(self, *a, **k):
            made.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    model = mlp()
    sw.measure(model, torch.randn(8, 32), **FAST)
    assert not made
    sw.apply(model, sw.Plan([sw.autocast(torch.float16)]))
    sw.measure(model, torch.randn(8, 32), **FAST)
    assert made == [("cpu",)]


def test_snapshot_needs_cuda():
    with pytest.raises(ValueError, match="cuda"):
        sw.measure(mlp(), torch.randn(4, 32), snapshot="snap.pickle", **FAST)


@pytest.mark.cuda
def test_cuda_measure_in_place_restores_a_gpu_model(tmp_path):
    model = torch.nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prof = sw.measure(model, torch.randn(64, 256), snapshot=str(tmp_path / "snap.pickle"))
    assert prof.peak >= prof.static > 0 and (tmp_path / "snap.pickle").stat().st_size > 0
    assert all(torch.equal(v, state[k]) and v.is_cuda for k, v in model.state_dict().items())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie their head
        self.norm = nn.BatchNorm1d(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.embed.weight.note = "kept"  # an attribute set on a parameter (transformers sets some)

    def forward(self, x):
        return self.head(self.frozen(self.norm(self.embed(x))))


def test_a_copy_made_on_the_device_is_the_model_new_tied_where_it_was_tied():
    from shrinkwrap.processes.copies import ModelCopies

    original = _Tied()
    original.norm.running_mean.add_(1.0)
    copy_ = ModelCopies(original)(torch.device("cpu"))
    assert copy_.head.weight is copy_.embed.weight  # still one parameter
    assert copy_.embed.weight is not original.embed.weight and copy_.embed.weight.note == "kept"
    assert not copy_.frozen.weight.requires_grad and isinstance(copy_.frozen.weight, nn.Parameter)
    for (name, a), b in zip(original.state_dict().items(), copy_.state_dict().values()):
        assert torch.equal(a, b), name
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), name  # its own memory
    copy_.norm.running_mean.zero_()
    assert original.norm.running_mean.eq(1.0).all()


def test_a_copy_of_tensors_that_share_memory_keeps_them_shared():
    from shrinkwrap.processes.copies import ModelCopies

    original = nn.Linear(4, 4)
    original.register_buffer("table", torch.zeros(3, 4))
    original.register_buffer("row", original.table[1])  # a buffer into another buffer's memory
    copy_ = ModelCopies(original)(torch.device("cpu"))
    copy_.table[1, 0] = 5.0
    assert copy_.row[0] == 5.0 and original.row[0] == 0.0  # as deepcopy keeps them


def test_a_row_built_to_be_thrown_away_is_not_restored():
    from shrinkwrap.measuring.profile import Options
    from shrinkwrap.measuring.step import measure_with

    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    measure_with(model, torch.randn(16, 32), Options(iterations=1, warmup=1, device="cpu"), restore=False)
    assert all(p.grad is not None for p in model.parameters())
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # AdamW's steps stay


@pytest.mark.cuda
def test_cuda_one_warm_up_iteration_reaches_an_eager_models_steady_peak():
    # autoplan measures eager rows after one warm-up iteration (see autoplan.rows.Rows.options_for): the peak
    # must be the one that more warm-up reaches, to the byte.
    from shrinkwrap.models import tiny_efficientnet

    batch = torch.randn(64, *tiny_efficientnet.input_shape)
    peaks = [sw.measure(tiny_efficientnet(), batch, iterations=1, warmup=w).peak for w in (1, 2, 3)]
    assert peaks[0] == peaks[1] == peaks[2]
