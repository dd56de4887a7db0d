"""First use of library calls: recorded once with their metadata, replayed on new tensors, and primed in fresh
processes."""

import os

import pytest
import torch
import torch.nn as nn

from shrinkwrap.measuring import first_use

from measure_helpers import mlp


pytestmark = pytest.mark.usefixtures("one_thread")


def _depthwise() -> nn.Module:
    """Two blocks alike (their convolutions are the same calls) and a stem."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 3, padding=1, groups=8))


needs_recording = pytest.mark.skipif(not first_use.SUPPORTED,
                                     reason="this torch's dispatch modes cannot leave torch.compile alone")


@needs_recording
def test_first_use_records_each_library_call_once_with_the_metadata_that_ran():
    import collections

    from shrinkwrap.measuring.first_use import PLANNED, _Tensor, recorded

    model = _depthwise().to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 16, 16).to(memory_format=torch.channels_last)[:, 1:]  # a view, at an offset
    with recorded() as calls, torch.autocast("cpu", torch.bfloat16):
        model(x).float().sum().backward()
    names = collections.Counter(c[1] for c in calls.calls)
    # The two depthwise convolutions are one call forward; backward, the last one's output
    # gradient comes in the default layout, and the stem computes no input gradient: three calls.
    # Nothing else: relu, the loss, the adds are not planned.
    assert names == {"convolution": 2, "convolution_backward": 3, "native_batch_norm": 1,
                     "native_batch_norm_backward": 1} and set(names) <= PLANNED
    assert len(calls) == 7 and not any(c[0] for c in calls.calls)  # on a CPU, backward runs on this thread
    stem = next(c for c in calls.calls if c[1] == "convolution")
    first = stem[3][0]
    # Autocast's dtype, and the layout: the bf16 copy of the view is a tensor of its own.
    assert first == _Tensor((2, 3, 16, 16), x.contiguous(memory_format=torch.channels_last).stride(), 0,
                            torch.bfloat16, "cpu")
    with recorded() as calls:
        model(x).sum().backward()
    stem = next(c for c in calls.calls if c[1] == "convolution")
    assert stem[3][0] == _Tensor((2, 3, 16, 16), x.stride(), 1, torch.float32, "cpu")  # in float32, the view


@needs_recording
def test_replay_makes_the_calls_on_new_tensors_with_memory_to_spare_in_the_thread_they_were_made_in(monkeypatch):
    import pickle

    model, x = _depthwise(), torch.randn(2, 4, 16, 16)[:, 1:]
    recorder = first_use._Recorder({})
    recorder.thread = None  # as if recording began on another thread: every call is backward's
    with recorder:
        model(x).sum().backward()
    calls = pickle.loads(pickle.dumps(first_use.Calls(recorder.calls)))  # it travels to another process
    assert len(calls) == 7 and all(c[0] for c in calls.calls)
    seen = []
    real = first_use._made

    def made(spec):
        out = real(spec)
        if isinstance(spec, first_use._Tensor):
            seen.append((torch._C._current_graph_task_id() >= 0, out.storage_offset(), out.dtype))
        return out

    monkeypatch.setattr(first_use, "_made", made)
    assert first_use.replay(calls) == 7
    assert all(backward for backward, _, _ in seen)  # made inside autograd's backward, as recorded
    assert (True, x.storage_offset(), torch.float32) in seen  # the input view at its offset
    sizes = sorted(first_use._bytes((c[3], c[4])) for c in calls.calls)
    # A call runs where its arguments take at most a third of what its device has free beyond keep.
    monkeypatch.setattr(first_use, "_free", lambda device: 3 * sizes[1] + 1000)
    assert first_use.replay(calls, keep=1000) == 2
    monkeypatch.undo()
    calls.calls[(False, "not_an_operator", "default", (), ())] = None
    assert first_use.replay(calls) == 7  # an operator this torch lacks is skipped
    # Floating tensors are made as they come; others (a reserve, offsets) zero, so that no value
    # out of range can fault the device.
    index = real(first_use._Tensor((2, 3), (1, 2), 2, torch.int64, "cpu"))
    assert index.stride() == (1, 2) and index.storage_offset() == 2 and not index.any()


def test_fresh_processes_make_the_primed_calls_before_each_row(monkeypatch):
    import concurrent.futures

    from shrinkwrap.processes import fresh as processes
    from shrinkwrap.measuring.first_use import Calls

    submitted, started = [], []

    class Row(concurrent.futures.Future):
        def result(self, timeout=None):
            started.append(len(fresh._waiting))  # the next rows' processes, started before this row is over
            return super().result(timeout)

    class Pool:
        """A process pool that runs nothing and says what it was given, in order."""

        def __init__(self, *args, **kwargs):
            self._processes, self._executor_manager_thread = {}, None

        broken = False

        def submit(self, fn, *args):
            if self.broken:
                raise concurrent.futures.process.BrokenProcessPool("died waiting")
            submitted.append((self, fn.__name__, sorted(k[1] for k in args[0].calls) if fn is processes.replay else None))
            future = Row() if fn is os.getpid else concurrent.futures.Future()
            future.set_result(None)
            return future

        def shutdown(self, **kwargs):
            pass

    def calls(*names):
        return Calls({(False, name, "default", (), ()): None for name in names})

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    with processes.FreshProcesses(mlp, ahead=True) as fresh:
        fresh.start_next()
        fresh.prime(calls("a"), keep=1024)  # the processes waiting now replay before their rows
        fresh.prime(calls("a", "b"), keep=1024)  # primed again: only the call they were not given
        fresh.prime(calls("b"), keep=1024)  # nothing new: nothing to make
        fresh.run(os.getpid)  # and those started ahead as each row starts, first thing: every call
        fresh.run(os.getpid)
    pools = list(dict.fromkeys(p for p, _, _ in submitted))
    assert [[(fn, given) for p, fn, given in submitted if p is pool] for pool in pools] == [
        [("_ready", None), ("replay", ["a"]), ("replay", ["b"]), ("getpid", None)],
        [("_ready", None), ("replay", ["a"]), ("replay", ["b"]), ("getpid", None)],
        [("_ready", None), ("replay", ["a", "b"])], [("_ready", None), ("replay", ["a", "b"])]]
    assert started == [processes.AHEAD, processes.AHEAD]
    # With none waiting (the first row, or after stop_next), the row's own process starts first,
    # the others as it starts; one that died waiting is dropped, not a failure.
    submitted.clear()
    with processes.FreshProcesses(mlp, ahead=True) as fresh:
        fresh.run(os.getpid)
        order = [fn for _, fn, _ in submitted]
        assert order == ["_ready", "getpid"] + ["_ready"] * processes.AHEAD
        dead, alive = fresh._waiting
        dead.broken = True
        fresh.prime(calls("c"), keep=0)
        assert fresh._waiting == [alive] and submitted[-1] == (alive, "replay", ["c"])
