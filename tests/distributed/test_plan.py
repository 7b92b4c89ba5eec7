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
    whole, replicated = rows["DP=2 EP=2, Engram whole"], rows["DP=2 EP=1, Engram whole"]
    assert whole["kv_tokens_per_rank"] == 1000 and whole["kv_tokens_total"] == 2000
    assert not replicated["fits"]  # every expert on every rank: more than the device holds
    assert "kv_tokens_per_rank" not in replicated
    assert replicated["over_bytes_per_rank"] == weights.rank_bytes(0, 1) - memory


def test_sizes_parse_in_both_units_and_bad_ones_are_named():
    assert parse_size("141GB") == 141 * 10**9 and parse_size("80GiB") == 80 * 2**30 and parse_size("512") == 512
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


# the release's Engram tables from the spec (spec-v41.md §5), not from this code: rows of layers 1 and 14,
# each row 256 FP8 channels plus 8 UE8M0 scales
RELEASE_TABLE_ROWS = (384006168, 384016682)
RELEASE_ROW_BYTES = 256 + 256 // 32


@pytest.mark.slow  # builds the release's model on the meta device (~15-50 s); the slow tier, which CI runs
def test_the_release_on_eight_devices(capsys):
    """flash keeps two ~98 GB Engram tables: whole on every rank they do not fit a 141 GB device even with the
    experts split eight ways; with their rows sharded over the eight ranks they do (141 GB), and at 80 GB
    only with the shards in host memory. Every figure is recomputed here from the whole-table layout's bytes
    and the spec's table sizes."""
    assert main(["plan", "--preset", "flash", "--devices", "8", "--device-memory", "141GB", "--json"]) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["layouts"]}
    whole = rows["DP=8 EP=8, Engram whole"]
    assert not rows["DP=8 EP=1, Engram whole"]["fits"] and not whole["fits"]
    assert 250e9 < whole["weight_bytes_per_rank"] < 260e9
    tables = sum(RELEASE_TABLE_ROWS) * RELEASE_ROW_BYTES
    share = sum(-(-n // 8) for n in RELEASE_TABLE_ROWS) * RELEASE_ROW_BYTES  # rank 0 holds the larger share
    kv_token = global_kv_bytes_per_token(preset("flash"))["total"]
    for memory, fits_on_device in ((141 * 10**9, True), (80 * 10**9, False)):
        usable = int(memory * 0.9)
        got = {r["layout"]: r for r in plan(preset("flash"), 8, memory)}
        sharded, host = (
            got["DP=8 EP=8, Engram rows sharded"],
            next(r for name, r in got.items() if name.startswith("DP=8 EP=8, Engram rows sharded in host")),
        )
        assert sharded["built"] and host["built"]
        assert sharded["weight_bytes_per_rank"] == whole["weight_bytes_per_rank"] - tables + share
        assert host["weight_bytes_per_rank"] == whole["weight_bytes_per_rank"] - tables
        assert host["host_bytes_per_rank"] == share and sharded["host_bytes_per_rank"] == 0
        assert sharded["fits"] == fits_on_device and host["fits"]
        assert host["kv_tokens_per_rank"] == (usable - host["weight_bytes_per_rank"]) // kv_token
        assert host["kv_tokens_total"] == 8 * host["kv_tokens_per_rank"]
        if fits_on_device:
            assert sharded["kv_tokens_per_rank"] == (usable - sharded["weight_bytes_per_rank"]) // kv_token
        else:
            assert sharded["over_bytes_per_rank"] == sharded["weight_bytes_per_rank"] - usable
        assert host["serve_flags"] == "--data-parallel-size 8 --expert-parallel-size 8 --engram-memory host"
    assert main(["plan", "--preset", "flash", "--devices", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert (
        "DP=8 EP=8, Engram rows sharded " in out
        and "refused: the weights exceed the 72.0 GB usable per device by" in out
    )
    assert "1 of 11 layouts fit: DP=8 EP=8, Engram rows sharded in host" in out


@pytest.mark.parametrize("world", [2, 3, 7])  # 7: uneven row shares (660 and 864 rows)
def test_sharded_engram_rank_bytes_are_the_split_models(world):
    """A rank's bytes with the Engram rows sharded: counted on a model whose experts and tables were split as
    a serving rank splits them."""
    from dsv41.distributed.engram_parallel import split_engram

    cfg = preset("tiny")
    weights = WeightBytes.of(cfg)
    for rank in range(world):
        with torch.device("meta"):
            model = Transformer(cfg)
        drop_experts(model, rank, world)
        tables = split_engram(model, rank, world)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        on_tables = sum(p.numel() * p.element_size() for t in tables for p in t.parameters())
        assert weights.rank_bytes(rank, world, "sharded") == held
        assert weights.rank_bytes(rank, world, "sharded-host") == held - on_tables
        assert weights.host_bytes(rank, world, "sharded-host") == on_tables
    assert sum(weights.engram_share(r, world) for r in range(world)) == weights.engram_tables


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
    assert "DP=2 EP=2 TP=2, Engram whole" in rows and not any("TP=4" in name for name in rows)
    tp = rows["DP=2 EP=2 TP=2, Engram whole"]
    assert tp["weight_bytes_per_rank"] < rows["DP=4 EP=1, Engram whole"]["weight_bytes_per_rank"]
    # the KV cache is replicated over an engine's TP ranks: counted once per engine
    assert tp["kv_tokens_total"] == 2 * tp["kv_tokens_per_rank"]
