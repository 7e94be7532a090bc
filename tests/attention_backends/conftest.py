import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Attention on these tiny shapes gains nothing from a second thread, which may be busy with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
