"""dsv41.model.replay: the engine's chunked computation as one differentiable forward."""

import pytest
import torch

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.replay import check_spans, decode_spans, prefill_spans, replay_forward
from dsv41.model.transformer import Transformer

WIDE = tiny().replace(
    window_size=64, index_topk=64, candidate_topk_blocks=20, n_routed_experts=16, n_activated_experts=2
)


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 1000, (batch, n), generator=torch.Generator().manual_seed(seed))


def _incremental(model, ids, spans):
    """The model's own chunked forward over a ModelCache, span by span (what the engine is tested equal to)."""
    cache = model.new_cache(ids.size(0), ids.size(1))
    return torch.cat([model(ids[:, a:e], a, cache) for a, e in spans], dim=1)


@pytest.mark.parametrize("cfg", [tiny(), WIDE], ids=["tiny", "wide"])
def test_replay_equals_the_chunked_forward_bit_for_bit(cfg):
    model = init_random_weights(Transformer(cfg), seed=2).eval()
    ids = _ids(90, batch=2)
    schedules = [[(0, 90)], prefill_spans(90, 32), decode_spans(prefill_spans(57, 16), 90)]
    with model.numerics(16), torch.no_grad():
        for spans in schedules:
            want = _incremental(model, ids, spans)
            assert torch.equal(replay_forward(model, ids, spans), want), spans[:3]
            assert torch.equal(replay_forward(model, ids, spans, logits_from=40), want[:, 40:])
        # different schedules are different computations (at these widths: tiny's happen to agree), and
        # replay follows the one it is given
        if cfg is WIDE:
            assert not torch.equal(replay_forward(model, ids, schedules[0]), replay_forward(model, ids, schedules[2]))


def test_replay_under_autograd_has_the_same_values_and_trains_the_attention():
    model = init_random_weights(Transformer(tiny()), seed=3).eval()
    ids = _ids(40)
    spans = decode_spans(prefill_spans(30, 16), 40)
    with model.numerics(16):
        with torch.no_grad():
            want = replay_forward(model, ids, spans)
        got = replay_forward(model, ids, spans)
        assert got.requires_grad and torch.equal(got.detach(), want)
        got.logsumexp(-1).sum().backward()
    params = dict(model.named_parameters())
    for name in (
        "layers.2.attn.compressor.wkv.weight",
        "layers.6.attn.compressor.wkv.weight",  # FP4 entries
        "layers.0.attn.wkv.weight",  # FP8 window ring
        "layers.3.attn.wq_b.weight",
        "layers.5.ffn.gate.weight",
        "layers.1.engram.wkv.weight",
    ):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    assert params["layers.2.attn.indexer.wq_b.weight"].grad is None  # the selection is discrete


def test_routing_is_recorded_and_replayed():
    from dsv41.model.moe import RoutingRecord

    cfg = tiny()
    model = init_random_weights(Transformer(cfg), seed=4).eval()
    ids = _ids(20, batch=2)
    spans = prefill_spans(20, 8)
    record = RoutingRecord(ids_only=True)
    with model.numerics(16), torch.no_grad():
        natural = replay_forward(model, ids, spans, record=record)
        routing = torch.stack([c[1] for c in record.calls], dim=1).view(2, 20, cfg.n_layers, -1)
        assert torch.equal(replay_forward(model, ids, spans, routing=routing), natural)
        other = (routing + 1) % cfg.n_routed_experts
        assert not torch.equal(replay_forward(model, ids, spans, routing=other), natural)
        with pytest.raises(ValueError, match="routing must be"):
            replay_forward(model, ids, spans, routing=routing[:, :5])
        with pytest.raises(ValueError, match="expert ids must lie"):
            replay_forward(model, ids, spans, routing=routing + cfg.n_routed_experts)


def test_span_checks():
    with pytest.raises(ValueError, match="tile"):
        check_spans([(0, 4), (5, 8)], 8)
    with pytest.raises(ValueError, match="cover"):
        check_spans([(0, 4)], 8)
    assert decode_spans([(0, 3)], 6) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert prefill_spans(70, 32) == [(0, 32), (32, 64), (64, 70)]


def test_token_wise_functions_follow_the_chunks_of_a_shared_call():
    """Router scores and mHC mixes of several chunks computed in one call, told the chunks' sizes, equal
    each chunk's own call bit for bit (the engine's batch invariance, ops.lanes)."""
    model = init_random_weights(Transformer(WIDE), seed=5).eval()
    gate, block = model.layers[3].ffn.gate, model.layers[3]
    calls = [1, 7, 1, 13, 3]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(calls), WIDE.dim, generator=g).bfloat16()
    h = torch.randn(1, sum(calls), WIDE.hc_mult, WIDE.dim, generator=g).bfloat16()
    with model.numerics(16), torch.no_grad():
        parts = torch.split(x, calls)
        alone = torch.cat([gate.scores(p) for p in parts])
        assert torch.equal(gate.scores(x, calls), alone)
        mixes = block.hc_mixes(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, calls)
        hs = torch.split(h, calls, dim=1)
        for k, name in enumerate(("pre", "post", "comb")):
            want = torch.cat(
                [block.hc_mixes(p, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)[k] for p in hs], 1
            )
            assert torch.equal(mixes[k], want), name
