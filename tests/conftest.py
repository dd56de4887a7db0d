import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP threads that wait
    for each other make a training step a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
