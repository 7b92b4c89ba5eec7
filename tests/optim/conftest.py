import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    """The optimizer tests use many small matmuls; on a loaded 2-core machine intra-op threading makes
    them 10-100x slower, so run them on one thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
