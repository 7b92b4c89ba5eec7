"""Fixtures shared by the serve-launching tests of tests/distributed/."""

import pytest
import torch


@pytest.fixture(scope="module")
def reference():
    """name -> (text, tokens' logprobs) from the single-device engine, each prompt of
    test_data_parallel.PROMPTS run on its own."""
    from tests.distributed.test_data_parallel import _reference

    threads = torch.get_num_threads()
    # one thread, as each served rank uses: with the server's processes on the same cores, more threads
    # oversubscribe them (measured here: 105 s instead of 5 s on a loaded 2-core machine)
    torch.set_num_threads(1)
    try:
        return _reference()
    finally:
        torch.set_num_threads(threads)
