"""The streaming indexer (key blocks scored one at a time, running top-k; Reindex layers scoring only their
candidate blocks) against the materialised reference path: same selections, same logits, bit for bit."""

import pytest
import torch

from dsv41 import ops
from dsv41.config import small, tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops import index_cpu


def _tied_scores(shape, seed):
    """bf16 scores from a handful of values, with -inf holes: many exact ties."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=g).bfloat16() / 2
    return scores.masked_fill(torch.rand(shape, generator=g) < 0.2, -torch.inf)


@pytest.mark.parametrize("width,k,step", [(50, 6, 7), (64, 64, 16), (300, 17, 32), (9, 6, 3)])
def test_merge_topk_streams_to_the_canonical_topk(width, k, step):
    scores = _tied_scores((2, 5, width), seed=width)
    kept_s, kept_p = scores[..., :0], torch.empty(2, 5, 0, dtype=torch.int64)
    for start in range(0, width, step):
        pos = torch.arange(start, min(width, start + step))
        kept_s, kept_p = ops.merge_topk(kept_s, kept_p, scores[..., start : start + step], pos, k)
    want = ops.topk_canonical(scores, k).sort(dim=-1).values
    assert torch.equal(kept_p, want)
    assert torch.equal(kept_s, scores.gather(-1, want))


def test_canonical_topk_takes_the_lowest_positions_among_ties():
    """A row of equal scores (and one of -inf, as invisible entries are) keeps positions 0..k-1, in
    order: the tie rule the streaming merge relies on."""
    for value in (0.0, -torch.inf):
        scores = torch.full((1, 1, 40), value, dtype=torch.bfloat16)
        assert torch.equal(ops.topk_canonical(scores, 5), torch.arange(5).view(1, 1, 5))


def _model(cfg, seed=1):
    return init_random_weights(Transformer(cfg), seed=seed).eval()


def _run(model, ids, chunks, streaming: bool, budget: int, kernel: bool = False):
    for layer in model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.streaming = streaming
            layer.attn.indexer.score_budget = budget
            layer.attn.indexer.cpu_kernel_min_pairs = 0 if kernel else 1 << 62
    cache = model.new_cache(ids.size(0), ids.size(1))
    logits, traces, start = [], [], 0
    with torch.inference_mode():
        for end in chunks:
            trace = {}
            logits.append(model(ids[:, start:end], start, cache, trace=trace))
            traces.append({n: v for n, v in trace.items() if n.endswith(("topk_idxs", "candidates"))})
            start = end
    return torch.cat(logits, dim=1), traces


@pytest.mark.parametrize(
    "preset,length,chunks,budget",
    [
        ("tiny", 120, (37, 80, 81, 120), 8 * 8),  # blocks of one candidate block: many merges
        ("small", 700, (300, 640, 641, 700), 1 << 14),
    ],
)
def test_streaming_selection_equals_materialised(preset, length, chunks, budget):
    cfg = {"tiny": tiny, "small": small}[preset]()
    model = _model(cfg)
    ids = torch.randint(3, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(3))
    want_logits, want = _run(model, ids, chunks, streaming=False, budget=budget)
    got_logits, got = _run(model, ids, chunks, streaming=True, budget=budget)
    assert [sorted(t) for t in got] == [sorted(t) for t in want]
    names = [n for t in want for n in t]
    assert any("candidates" in n for n in names) and sum("topk_idxs" in n for n in names) > 3
    for g, w in zip(got, want):
        for name in w:
            assert torch.equal(g[name], w[name]), name
    assert torch.equal(got_logits, want_logits)


@pytest.mark.skipif(index_cpu.library() is None, reason="no C++ compiler to build the kernel")
@pytest.mark.parametrize("preset,length,chunks", [("tiny", 120, (37, 80, 81, 120)), ("small", 700, (300, 640, 700))])
def test_kernel_selection_equals_materialised(preset, length, chunks, monkeypatch):
    """The Full layers' selection by the C++ kernel (dsv41.ops.index_cpu; the portable build too, where the CPU
    has no AVX512-VNNI and the model would not use it) gives the materialised path's picks and logits, bit for
    bit, chunk after chunk: the kernel's offsets, visibility and unusable picks are wired as the reference's."""
    monkeypatch.setattr(index_cpu, "available", lambda: True)
    calls = []
    real = index_cpu.index_topk_cpu
    monkeypatch.setattr(index_cpu, "index_topk_cpu", lambda *a: calls.append(1) or real(*a))
    cfg = {"tiny": tiny, "small": small}[preset]()
    model = _model(cfg, seed=2)
    ids = torch.randint(3, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(5))
    want_logits, want = _run(model, ids, chunks, streaming=False, budget=1 << 14)
    got_logits, got = _run(model, ids, chunks, streaming=True, budget=1 << 14, kernel=True)
    assert calls  # the kernel served
    for g, w in zip(got, want):
        for name in w:
            assert torch.equal(g[name], w[name]), name
    assert torch.equal(got_logits, want_logits)


def test_reindex_layers_read_only_candidate_blocks():
    """Past the candidate pool's size, a Reindex layer's picks all lie in its source's candidate blocks,
    and the pool is smaller than the visible cache (so the check means something)."""
    cfg = small()
    model = _model(cfg)
    ids = torch.randint(3, cfg.vocab_size, (1, 600), generator=torch.Generator().manual_seed(4))
    _, (trace,) = _run(model, ids, (600,), streaming=True, budget=1 << 14)
    pool = trace[f"debug.layers.{cfg.candidate_source_layer}.candidates"][0, -1]  # last query's mask
    assert pool.sum() < pool.numel()
    for layer in range(cfg.candidate_source_layer + 1, cfg.n_layers):
        name = f"debug.layers.{layer}.topk_idxs"
        if name in trace and layer in cfg.index_source_layers:
            picks = trace[name][0, -1]
            picks = picks[picks >= 0]
            assert picks.numel() and pool[picks].all()


@pytest.mark.parametrize("mode", ["full", "bounded"])
def test_engine_prefill_and_decode_same_with_streaming(mode):
    """Through the engine (packed pool: key blocks dequantised one at a time, candidate keys gathered by
    row), chunked prefill then decode give the same logits streamed and materialised."""
    from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
    from dsv41.tokenizer import ByteTokenizer

    cfg = tiny()
    model = _model(cfg)
    prompt = torch.randint(3, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    results = []
    for streaming in (False, True):
        for layer in model.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.streaming, layer.attn.indexer.score_budget = streaming, 64
        engine = LLMEngine(
            model,
            ByteTokenizer(cfg.vocab_size),
            EngineConfig(
                block_size=16,
                kv_pool_tokens=1024,
                prefill_chunk_size=48,
                prefill_mode=mode,
                enable_prefix_caching=False,
            ),
        )
        first = engine.prompt_logits(prompt)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        results.append((first, out.token_ids))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


@pytest.mark.parametrize(
    "b,s,h,d,t",
    [(1, 1, 8, 64, 5000), (3, 1, 8, 64, 300), (48, 1, 8, 64, 256), (1, 64, 4, 64, 777), (2, 5, 16, 128, 40)],
)
def test_index_scores_mm_equals_the_einsum_reference(b, s, h, d, t):
    """On FP4-rounded q and k (what the indexer scores), the 2-D GEMM formulation gives the einsum's bits,
    including keys whose scales differ by 2^8 from each other."""
    from dsv41.ops.quant import FP4_BLOCK

    g = torch.Generator().manual_seed(t)
    q = ops.fp4_qdq(torch.randn(b, s, h, d, generator=g), FP4_BLOCK, "ue8m0").bfloat16()
    spread = 2.0 ** torch.randint(-4, 5, (b, t, 1), generator=g)
    k = ops.fp4_qdq(torch.randn(b, t, d, generator=g) * spread, FP4_BLOCK, "ue8m0").bfloat16()
    w = torch.randn(b, s, h, generator=g).bfloat16()
    assert torch.equal(ops.index_scores_mm(q, k, w), ops.index_scores(q, k, w))


def test_fp4_dequant_bf16_equals_the_fp32_dequant():
    from dsv41.ops.quant import KV_FP4_BLOCK, fp4_dequant, fp4_dequant_bf16, fp4_quant

    x = torch.randn(3, 50, 128, generator=torch.Generator().manual_seed(0)) * 10
    for block, fmt in ((32, "ue8m0"), (KV_FP4_BLOCK, "e4m3")):
        codes, scale = fp4_quant(x, block, fmt)
        assert torch.equal(fp4_dequant_bf16(codes, scale, block), fp4_dequant(codes, scale, block).bfloat16())
