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
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA GPUs; this machine has {gpus}"))
        elif "cuda" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
