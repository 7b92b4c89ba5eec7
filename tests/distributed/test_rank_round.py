"""One rank's round (dsv41.distributed.data_parallel.RankEngine) in a one-process gloo group: what it reports
back to the front for bad input, for a failing step and for the metrics the front combines."""

import socket

import pytest
import torch.distributed as dist

from dsv41.distributed.config import ParallelConfig
from dsv41.distributed.data_parallel import RankEngine, combine_metrics
from dsv41.engine import EngineConfig, SamplingParams, build_engine


@pytest.fixture
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _add(rid, prompt, max_tokens=2):
    return ("add", rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), None)


def test_bad_input_is_rejected_and_a_failing_step_fails_its_requests(group, monkeypatch):
    engine = build_engine("tiny", EngineConfig(fused_kernels="off", kv_pool_tokens=4096))
    rank = RankEngine(engine)
    reply = rank.round(
        {
            "commands": [_add("bad", [engine.model_config.vocab_size + 5]), _add("ok", [5, 6, 7])],
            "step": True,
            "stop": False,
        }
    )
    assert [r for r, _ in reply["rejected"]] == ["bad"] and "prompt token ids" in reply["rejected"][0][1]
    assert reply["failed"] == [] and reply["unfinished"] and [o.request_id for o in reply["outputs"]] == ["ok"]

    def broken_step():
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(engine, "step", broken_step)
    reply = rank.round({"commands": [], "step": True, "stop": False})
    # an internal failure is not the client's fault: reported as failed (a 500), not rejected (a 400)
    assert reply["rejected"] == [] and [r for r, _ in reply["failed"]] == ["ok"]
    assert "bookkeeping bug" in reply["failed"][0][1]
    # a round that does not step runs nothing
    monkeypatch.undo()
    reply = rank.round({"commands": [_add("later", [5, 6])], "step": False, "stop": False})
    assert reply["outputs"] == [] and reply["metrics"]["waiting"] == 1


def test_combined_metrics_sum_counts_and_recompute_ratios():
    a = {
        "waiting": 1,
        "running": 2,
        "kv_blocks_used": 1,
        "kv_blocks_total": 4,
        "kv_usage": 0.25,
        "prefix_cache_hit_tokens": 0,
        "prefix_cache_queried_tokens": 10,
        "prefix_cache_hit_rate": 0.0,
        "requests_finished_total": 3,
        "kv_resident_bytes_per_token": 100.0,
    }
    b = dict(
        a,
        waiting=0,
        kv_blocks_used=3,
        kv_usage=0.75,
        prefix_cache_hit_tokens=10,
        prefix_cache_hit_rate=1.0,
        requests_finished_total=1,
        kv_resident_bytes_per_token=300.0,
    )
    m = combine_metrics([a, b])
    assert m["waiting"] == 1 and m["running"] == 4 and m["requests_finished_total"] == 4
    assert m["kv_usage"] == 0.5 and m["prefix_cache_hit_rate"] == 0.5
    assert m["kv_resident_bytes_per_token"] == 200.0
    assert m["dp_rank1_requests_finished_total"] == 1 and m["dp_rank0_waiting"] == 1


def test_layouts_that_do_not_exist_are_refused_by_name():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0).validate()
    ParallelConfig(data_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="must be 1 \\(off\\) or equal to --data-parallel-size"):
        ParallelConfig(data_parallel_size=4, expert_parallel_size=2).validate()
    ParallelConfig(data_parallel_size=2, expert_parallel_size=2).validate()
