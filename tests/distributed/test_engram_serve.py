"""`dsv41 serve` with the Engram tables' rows sharded over the ranks (dsv41.distributed.engram_parallel), driven
through its HTTP front with the `openai` client: greedy text and chosen-token logprobs equal the
single-device engine's bit for bit. (`--data-parallel-size 2 --expert-parallel-size 2` shards them by default,
so tests/distributed/test_data_parallel.py runs that layout; here: sharded without expert parallelism and in
host memory, and four data+expert-parallel ranks, slow tier.)"""

import pytest

from tests.distributed.test_data_parallel import _client, _complete, _metric, serve_layout
from tests.distributed.test_tensor_parallel_serve import _check_concurrent

openai = pytest.importorskip("openai")


def test_engram_sharded_in_host_memory_without_expert_parallelism(reference):
    layout = ("--data-parallel-size", "2", "--engram-sharding", "sharded", "--engram-memory", "host")
    with serve_layout(layout) as (_, base):
        # one request first, alone: the idle rank must serve the busy rank's lookups of the rows it owns (with
        # the concurrent requests only, both ranks could run as many forwards as each other at every step and
        # serve nothing for the other, depending on how the requests happened to arrive)
        assert _complete(_client(base), "alone") == reference["alone"]
        assert _metric(base, "dp_served_engram_rounds_total") > 0
        _check_concurrent(base, reference, ["b", "c", "d", "e"])
        # no MoE rounds: every rank holds every expert
        assert _metric(base, "dp_served_moe_rounds_total") == 0


@pytest.mark.slow  # four processes on the shared 2-core machine
def test_four_data_and_expert_parallel_ranks_equal_single_device(reference):
    layout = ("--data-parallel-size", "4", "--expert-parallel-size", "4")
    with serve_layout(layout) as (_, base):
        _check_concurrent(base, reference, ["alone", "a", "b", "c", "d", "e"])
        for rank in range(4):
            assert _metric(base, f"dp_rank{rank}_requests_assigned_total") >= 1
        assert _metric(base, "dp_served_engram_rounds_total") > 0
