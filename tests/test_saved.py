import torch
import torch.nn as nn

import shrinkwrap as sw


def test_counts_unique_storages_and_skips_parameters():
    x = torch.randn(64, 512)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU())
    # Linear saves its input (and its weight, a parameter: not counted); ReLU saves its output.
    assert sw.saved_tensor_bytes(model, x) == 2 * 64 * 512 * 4


def test_a_tensor_saved_twice_counts_once():
    x = torch.randn(1000, requires_grad=True)

    def f():
        return (x * x).sum() + (x * 2).sum()   # mul saves x (twice over); x is not a Parameter

    with sw.SavedTensors() as saved:
        f()
    assert saved.bytes == 1000 * 4 and saved.count == 1


def test_nothing_is_saved_under_no_grad():
    with torch.no_grad():
        assert sw.saved_tensor_bytes(nn.Linear(8, 8), torch.randn(4, 8)) == 0
