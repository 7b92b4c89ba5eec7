"""Fixtures shared by the tests of tests/distributed/: fused kernels off, the single-device reference."""

import pytest
import torch


@pytest.fixture(autouse=True)
def eager_reference_ops(monkeypatch):
    """DSV41_FUSED=0 here and in every rank process these tests start (they inherit the environment): each
    process would otherwise compile the fused kernels before its first forward (about 7 s of CPU per rank
    with a warm compiler cache). Those kernels are per-token ops that no layout splits (the indexer stays
    replicated under tensor parallelism), and where used they give the eager ops' bits; that is tested in
    tests/ops/test_fused.py. The served layouts here run with fused_kernels off for the same reason."""
    monkeypatch.setenv("DSV41_FUSED", "0")


@pytest.fixture(scope="session")
def reference():
    """name -> (text, tokens' logprobs) from the single-device engine, each prompt of
    test_data_parallel.PROMPTS run on its own; computed once for every module that compares with it (read
    only)."""
    from tests.distributed.test_data_parallel import _reference

    threads = torch.get_num_threads()
    # one thread, as each served rank uses: with the server's processes on the same cores, more threads
    # oversubscribe them (measured here: 105 s instead of 5 s on a loaded 2-core machine)
    torch.set_num_threads(1)
    try:
        return _reference()
    finally:
        torch.set_num_threads(threads)
