import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors run faster on one thread, and CI's two cores are shared with other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
