"""`dsv41 plan` (dsv41.distributed.plan): a rank's weight bytes are those of the model a rank really builds,
KV capacity follows from the pool's bytes per token, layouts that cannot hold the weights are refused, and
the release on 8 x 141 GB and 8 x 80 GB devices is reported."""

import json

import pytest
import torch

from dsv41.cli import main
from dsv41.config import preset
from dsv41.distributed.expert_parallel import drop_experts
from dsv41.distributed.plan import WeightBytes, parse_size, plan
from dsv41.model.cache import global_kv_bytes_per_token
from dsv41.model.transformer import Transformer


def _held_bytes(cfg, rank: int, world: int) -> int:
    """Bytes of the parameters a rank keeps after dropping the others' experts, counted on the model itself."""
    with torch.device("meta"):
        model = Transformer(cfg)
    drop_experts(model, rank, world)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_bytes_are_the_sharded_models(world):
    cfg = preset("tiny")
    weights = WeightBytes.of(cfg)
    for rank in range(world):
        assert weights.rank_bytes(rank, world) == _held_bytes(cfg, rank, world)
    assert weights.rank_bytes(0, 1) == weights.total


def test_kv_capacity_and_refusals_follow_the_bytes():
    cfg = preset("tiny")
    weights, per_token = WeightBytes.of(cfg), global_kv_bytes_per_token(cfg)["total"]
    memory = weights.rank_bytes(0, 2) + 1000 * per_token  # room for 1000 tokens beside rank 0's share, at 100%
    rows = {r["layout"]: r for r in plan(cfg, 2, memory, utilization=1.0)}
    assert rows["DP=2 EP=2"]["kv_tokens_per_rank"] == 1000 and rows["DP=2 EP=2"]["kv_tokens_total"] == 2000
    assert not rows["DP=2 EP=1"]["fits"]  # every expert on every rank: more than the device holds
    assert "kv_tokens_per_rank" not in rows["DP=2 EP=1"]


def test_sizes_parse_in_both_units_and_bad_ones_are_named():
    assert parse_size("141GB") == 141 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("512") == 512
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_the_release_on_eight_devices(capsys):
    """flash keeps two ~98 GB Engram tables; whole on every rank (what this engine does) they do not fit a
    141 GB device even with the experts split eight ways; sharded or in host memory they would."""
    assert main(["plan", "--preset", "flash", "--devices", "8", "--device-memory", "141GB", "--json"]) == 1
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["layouts"]}
    assert not rows["DP=8 EP=1"]["fits"] and not rows["DP=8 EP=8"]["fits"]
    sharded = rows["DP=8 EP=8, Engram rows sharded (not built)"]
    assert sharded["fits"] and sharded["sequences_1m_total"] > 0
    assert 250e9 < rows["DP=8 EP=8"]["weight_bytes_per_rank"] < 260e9
    assert main(["plan", "--preset", "flash", "--devices", "8", "--device-memory", "80GB"]) == 1
    out = capsys.readouterr().out
    assert "refused: the weights exceed the 72.0 GB usable per device" in out
    assert "no layout this engine has built fits these devices" in out


@pytest.mark.parametrize("name,tp,ep", [("tiny", 2, 1), ("tiny", 2, 2), ("small", 2, 2)])
def test_tensor_parallel_rank_bytes_are_the_sliced_models(name, tp, ep):
    from dsv41.distributed.tensor_parallel import slice_attention_heads

    cfg = preset(name)
    weights = WeightBytes.of(cfg)
    for rank in range(ep):
        with torch.device("meta"):
            model = Transformer(cfg)
        drop_experts(model, rank, ep)
        slice_attention_heads(model, 0, tp)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weights.rank_bytes(rank, ep, tp=tp) == held
    assert weights.rank_bytes(0, ep, tp=tp) < weights.rank_bytes(0, ep)


def test_tensor_parallel_layouts_are_planned_where_the_heads_split():
    cfg = preset("tiny")  # 2 output groups: TP=2 splits them, TP=4 would not
    rows = {r["layout"]: r for r in plan(cfg, 4, 10**9)}
    assert "DP=2 EP=2 TP=2" in rows and not any("TP=4" in name for name in rows)
    tp = rows["DP=2 EP=2 TP=2"]
    assert tp["weight_bytes_per_rank"] < rows["DP=4 EP=1"]["weight_bytes_per_rank"]
    # the KV cache is replicated over an engine's TP ranks: counted once per engine
    assert tp["kv_tokens_total"] == 2 * tp["kv_tokens_per_rank"]
