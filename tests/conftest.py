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


@pytest.fixture(autouse=True)
def _earlier_cuda_tests_let_go(request):
    """A CUDA test's memory figures are its own: what earlier tests compiled (dynamo's caches keep
    their models and graph pools alive) or left to the collector is let go first. In one run of
    the CUDA tests on an H100, about 6.5 GiB of theirs was still allocated when the estimate's and
    the optimizer's peaks were read."""
    if "cuda" in request.keywords and torch.cuda.is_available():
        import gc

        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    yield


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA GPUs; this machine has {gpus}"))
        elif "cuda" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
