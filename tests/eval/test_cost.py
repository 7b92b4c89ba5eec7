"""dsv41.eval.cost: zero for a variant against itself and for bounded replay within one window, bounded and
full as the engine computes them, the bf16-KV switch, the metrics by hand, the outputs."""

import json
import math
import os

import numpy as np
import pytest
import torch

from dsv41.config import tiny
from dsv41.engine import EngineConfig, LLMEngine
from dsv41.eval.cost import CostConfig, compare_logits, continuation_logits, kv_cost, kv_storage, run_cost
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops.quant import KV_FP4_BLOCK, fp4_qdq
from dsv41.tokenizer import ByteTokenizer


def random_tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).numpy().astype(np.int64)


@pytest.fixture(scope="module")
def invariant_model():
    """tiny with the engine's batch-invariant GEMMs, so its forward and the engine's agree to rounding."""
    m = init_random_weights(Transformer(tiny()), seed=1).eval()
    m.set_batch_invariant(16)
    return m


def test_a_variant_against_itself_and_bounded_within_one_window_are_exactly_zero(tiny_eval):
    window = tiny_eval.cfg.window_size  # 8
    seqs = {
        window - 2: [random_tokens(window - 2 + 6, seed=s) for s in range(2)],
        45: [random_tokens(45 + 6, seed=s) for s in range(2)],
    }
    result = kv_cost(tiny_eval, seqs, [("full", "full"), ("bounded", "bounded"), ("bounded", "full")], 6, chunk=16)
    for r in result["summary"]:
        zero = r["compare"] != "bounded:full" or r["length"] <= window
        if zero:
            assert (r["dnll"], r["kl"], r["kl_first"], r["max_abs_logit"], r["agree"]) == (0.0, 0.0, 0.0, 0.0, 1.0), r
        else:  # a 45-token prompt: the decoder windows start at 37 instead of 0
            assert r["max_abs_logit"] > 1e-3 and r["kl"] > 0 and r["replay_differs"]


def test_bounded_and_full_variants_match_the_engine(invariant_model):
    """The first continuation position's logits are the prompt's last: the engine's prompt_logits in each
    prefill mode gives them too (to accumulation-order rounding), and the two modes differ by more."""
    model = invariant_model
    tokens = random_tokens(50, seed=4)
    prompt = tokens[:45]
    ours = continuation_logits(model, tokens, 45, ["full", "bounded"], chunk=16)

    def engine(mode):
        config = EngineConfig(
            block_size=8,
            kv_pool_tokens=1024,
            prefill_chunk_size=64,
            max_num_batched_tokens=64,
            prefill_mode=mode,
            enable_prefix_caching=False,
        )
        return LLMEngine(model, ByteTokenizer(1024), config).prompt_logits(prompt.tolist())

    bounded, full = engine("bounded"), engine("full")
    assert (ours["bounded"][0] - bounded).abs().max() < 1e-3 < (ours["bounded"][0] - full).abs().max()
    assert (ours["full"][0] - full).abs().max() < 1e-3 < (ours["full"][0] - bounded).abs().max()


def test_bf16_kv_keeps_unrounded_latents_and_costs_something(tiny_eval):
    model, cfg = tiny_eval.model, tiny_eval.cfg
    ids = torch.from_numpy(random_tokens(40, seed=2))[None]
    stored = {}
    for fp4 in (True, False):
        cache = model.new_cache(1, 40)
        with kv_storage(model, fp4, fp4), torch.inference_mode():
            model(ids, 0, cache, last_only=True)
        stored[fp4] = {k: v[0, : 40 // cfg.compress_ratios[k]].float() for k, v in cache.compressed_kv.items()}
    for kv in stored[True].values():  # as served: every latent is on the E2M1 grid already
        assert torch.equal(fp4_qdq(kv, KV_FP4_BLOCK, "e4m3"), kv)
    assert any(not torch.equal(fp4_qdq(kv, KV_FP4_BLOCK, "e4m3"), kv) for kv in stored[False].values())
    assert all(layer.attn.fp4_kv for layer in model.layers)  # the switch is put back
    assert all(layer.attn.indexer.fp4_keys for layer in model.layers if layer.attn.indexer is not None)
    result = kv_cost(tiny_eval, {40: [random_tokens(48, seed=5)]}, [("full", "bf16kv"), ("full", "bf16cache")], 8, 16)
    assert all(r["max_abs_logit"] > 0 and r["kl"] > 0 for r in result["summary"])


def test_compare_logits_by_hand():
    ref = torch.tensor([[0.0, math.log(3.0)], [1.0, 0.0]])  # p = (1/4, 3/4), then (e, 1)/(e + 1)
    test = torch.tensor([[0.0, 0.5], [0.0, 1.0]])  # same argmax at the first position, not at the second
    m = compare_logits(ref, test, torch.tensor([1, 0]))
    q1 = math.exp(0.5) / (1 + math.exp(0.5))
    kl0 = 0.25 * math.log(0.25 / (1 - q1)) + 0.75 * math.log(0.75 / q1)
    p1 = math.exp(1) / (math.exp(1) + 1)
    kl1 = p1 * math.log(p1 / (1 - p1)) + (1 - p1) * math.log((1 - p1) / p1)
    assert m["kl_first"] == pytest.approx(kl0) and m["kl"] == pytest.approx((kl0 + kl1) / 2)
    assert m["nll_ref"] == pytest.approx((-math.log(0.75) - math.log(p1)) / 2)
    assert m["nll_test"] == pytest.approx((-math.log(q1) - math.log(1 - p1)) / 2)
    assert m["dnll"] == pytest.approx(m["nll_test"] - m["nll_ref"])
    assert m["agree"] == 0.5 and m["agree_first"] == 1.0 and m["max_abs_logit"] == pytest.approx(1.0)


def test_run_cost_writes_table_json_and_plot(tiny_eval, text_file, tmp_path, capsys):
    out = str(tmp_path)
    run_cost(
        CostConfig(
            text=text_file,
            lengths="6,40",
            samples=2,
            continuation=8,
            chunk=16,
            compare="bounded:full,full:bf16kv",
            out=out,
        ),
        tiny_eval,
    )
    saved = json.load(open(os.path.join(out, "cost.json")))
    assert [(r["compare"], r["length"]) for r in saved["summary"]] == [
        ("bounded:full", 6),
        ("full:bf16kv", 6),
        ("bounded:full", 40),
        ("full:bf16kv", 40),
    ]
    assert len(saved["per_sample"]) == 8 and saved["window_size"] == 8
    assert open(os.path.join(out, "cost.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "bounded vs full" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not A:B"):
        run_cost(CostConfig(compare="bounded:fast", out=out), tiny_eval)
    with pytest.raises(ValueError, match="continuation must be a positive integer"):
        run_cost(CostConfig(continuation=0, out=out), tiny_eval)
    with pytest.raises(ValueError, match="--extrapolate"):
        run_cost(CostConfig(lengths="4K", out=out), tiny_eval)  # 4096 + 64 continuation tokens > 4096
