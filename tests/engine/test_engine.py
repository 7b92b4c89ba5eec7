"""The engine against the plain model loop, and its scheduling, caching and request handling."""

import pytest
import torch

from dsv41.config import tiny
from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.engine.kv_pool import PagedKVPool
from dsv41.engine.runner import Chunk, ModelRunner
from dsv41.engine.sequence import SequenceCache, StatePool
from dsv41.generate import generate
from dsv41.model.cache import global_kv_bytes_per_token
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.tokenizer import ByteTokenizer
from tests.conftest import pin_routing

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pinned_model():
    """For comparisons across numerically different paths (a recomputed or restored state against the
    decode that built it): MoE selection pinned so that bf16 noise cannot flip an expert choice."""
    m = pin_routing(init_random_weights(Transformer(tiny()), seed=1).eval())
    m.set_batch_invariant(16)
    return m


def make(model, **overrides) -> LLMEngine:
    # deterministic numerics: these tests compare engines and the plain loop bit for bit (tests/engine/helpers.py)
    settings = dict(
        block_size=8, kv_pool_tokens=2048, prefill_chunk_size=16, max_num_batched_tokens=64, numerics="deterministic"
    )
    settings.update(overrides)
    return LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(**settings))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 0.1) -> bool:
    return bool((a - b).abs().max() < tol and a.argmax() == b.argmax())


def test_runner_matches_the_model_forward(model):
    """The packed paged cache and the ragged runner reproduce Transformer.forward bit for bit."""
    cfg = model.cfg
    (tokens,) = prompts([29])
    ids = torch.tensor([tokens])
    ref_cache = model.new_cache(1, 40)
    ref_prefill = model(ids[:, :26], 0, ref_cache)[0, -1]
    ref_decode = [model(ids[:, p : p + 1], p, ref_cache)[0, -1] for p in range(26, 29)]

    cache = SequenceCache(cfg, PagedKVPool(cfg, 8, 8), StatePool(cfg, 1), 0)
    cache.set_blocks([5, 2, 7, 0])
    runner = ModelRunner(model)
    out = runner.forward([Chunk(cache, tokens[:26], 0, [])])
    assert torch.equal(out[0], ref_prefill)
    for p in range(26, 29):
        out = runner.forward([Chunk(cache, tokens[p : p + 1], p, tokens[p - 3 : p])])
        assert torch.equal(out[0], ref_decode[p - 26])


def test_full_prefill_engine_matches_the_reference_loop(model):
    for tokens in prompts([5, 30]):
        ref = generate(model, torch.tensor([tokens]), 8)[0].tolist()
        assert make(model, prefill_mode="full").generate([tokens], GREEDY)[0].token_ids == ref


@pytest.mark.parametrize("mode", ["full", "bounded"])
def test_chunked_prefill_matches_one_shot(model, mode):
    (tokens,) = prompts([37], seed=3)
    one_shot = make(model, prefill_mode=mode, prefill_chunk_size=64).prompt_logits(tokens)
    for chunk in (1, 5, 8, 13):  # odd sizes split ratio-2 groups; 13 also crosses windows unevenly
        logits = make(model, prefill_mode=mode, prefill_chunk_size=chunk).prompt_logits(tokens)
        assert close(logits, one_shot), chunk


def test_bounded_replay_runs_the_decoder_on_the_last_window_only(model):
    cfg = model.cfg
    boundary = max(cfg.kv_source_layers)
    seen = {"enc": 0, "dec": 0}
    hooks = [
        model.layers[0].ffn.register_forward_hook(lambda m, i, o: seen.__setitem__("enc", seen["enc"] + o.shape[1])),
        model.layers[boundary + 1].ffn.register_forward_hook(
            lambda m, i, o: seen.__setitem__("dec", seen["dec"] + o.shape[1])
        ),
    ]
    try:
        (tokens,) = prompts([45], seed=4)
        bounded = make(model, prefill_mode="bounded", prefill_chunk_size=64).prompt_logits(tokens)
        assert seen == {"enc": 45, "dec": cfg.window_size}
        seen.update(enc=0, dec=0)
        full = make(model, prefill_mode="full", prefill_chunk_size=64).prompt_logits(tokens)
        assert seen == {"enc": 45, "dec": 45}
    finally:
        for h in hooks:
            h.remove()
    gap = (bounded - full).abs().max()
    assert 0 < gap < 1.0  # an approximation (spec §2.1), not a different model
    # with no more tokens than the window the replay is the full prefill
    (short,) = prompts([cfg.window_size], seed=5)
    assert torch.equal(
        make(model, prefill_mode="bounded").prompt_logits(short), make(model, prefill_mode="full").prompt_logits(short)
    )


def test_preemption_loses_nothing(pinned_model):
    """A pool too small for the batch forces preemption by recompute. Every request must still finish,
    and every generated token must be the greedy choice of the plain model run over prompt + output
    (teacher-forced, up to bf16 noise: the random tiny model has logit near-ties of ~0.005 that the
    recompute, a prefill instead of decode steps, may resolve either way; a lost or misplaced block
    would miss by far more)."""
    model = pinned_model
    batch = prompts([30, 5, 47, 12, 64, 9])
    engine = make(model, kv_pool_tokens=96, enable_prefix_caching=False)
    outs = [o.token_ids for o in engine.generate(batch, GREEDY)]
    assert engine.counters["preemptions_total"] > 0
    assert engine.allocator.num_used() == 0
    for prompt, out in zip(batch, outs):
        assert len(out) == GREEDY.max_tokens
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1]  # [steps, vocab]
        gaps = logits.max(-1).values - logits.gather(-1, torch.tensor(out)[:, None])[:, 0]
        assert gaps.max() < 0.05, gaps


def test_prefix_cache_follow_up_turn(model):
    """Exact reuse (the default): a follow-up resumes from the newest snapshot whose state a miss would
    also compute, and its logits equal the miss path's bit for bit. Approximate reuse
    (--no-exact-prefix-reuse) resumes from the reply's end and rebuilds expired windows by replay."""
    first, suffix, long_suffix = prompts([61, 6, 20], seed=6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    w = model.cfg.window_size

    def follow_up(engine, tail):
        out = engine.generate([first], params)[0]
        return first + out.token_ids + tail

    # short follow-up: its decoder window starts inside the reply, where the reply's snapshot has other
    # decoder states, so the end-of-prompt snapshot serves (the reply is recomputed)
    engine = make(model)
    turn2 = follow_up(engine, suffix)
    cached = engine.prompt_logits(turn2)
    miss = make(model, enable_prefix_caching=False).prompt_logits(turn2)
    assert engine.stats.snapshot_hits == 1 and engine.stats.hit_tokens == len(first)
    assert torch.equal(cached, miss)

    # a follow-up longer than the window: the reply's end (all but its last token) is reused, exactly
    assert len(long_suffix) >= w
    engine = make(model)
    turn2 = follow_up(engine, long_suffix)
    cached = engine.prompt_logits(turn2)
    assert engine.stats.hit_tokens == len(first) + 5
    assert torch.equal(cached, make(model, enable_prefix_caching=False).prompt_logits(turn2))

    # approximate reuse: the reply's snapshot with its decoder states from the decode steps
    engine = make(model, exact_prefix_reuse=False)
    turn2 = follow_up(engine, suffix)
    cached = engine.prompt_logits(turn2)
    # the reference is a full prefill (measured max |dlogit| 0.003)
    fresh = make(model, enable_prefix_caching=False, prefill_mode="full").prompt_logits(turn2)
    assert engine.stats.snapshot_hits == 1 and engine.stats.window_rebuilds == 0
    assert engine.stats.hit_tokens == len(first) + 5
    assert close(cached, fresh, tol=0.02)
    fresh = make(model, enable_prefix_caching=False).prompt_logits(turn2)  # bounded, as the rebuild below

    # window rings expired: exact reuse has nothing to resume from; approximate reuse restores the global
    # KV and rebuilds the rings by bounded replay
    engine = make(model, window_ttl_s=0.0)
    engine.prompt_logits(follow_up(engine, suffix))
    assert engine.stats.hit_tokens == 0 and engine.stats.window_rebuilds == 0
    engine = make(model, window_ttl_s=0.0, exact_prefix_reuse=False)
    turn2 = follow_up(engine, suffix)
    rebuilt = engine.prompt_logits(turn2)
    assert engine.stats.window_rebuilds == 1 and engine.stats.hit_tokens == len(first) + 5
    assert (rebuilt - fresh).abs().max() < 1.0

    # no snapshots: approximate reuse shares whole blocks only
    engine = make(model, max_snapshots=0, exact_prefix_reuse=False)
    turn2 = follow_up(engine, suffix)
    engine.prompt_logits(turn2)
    assert engine.stats.hit_tokens == (len(first) + 5) // 8 * 8


def test_a_repeated_prompt_is_served_from_its_snapshot(model):
    """The same prompt again: the end-of-prompt snapshot kept its last logits, so nothing is computed and
    the tokens are the first run's."""
    (prompt,) = prompts([37], seed=9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = make(model)
    first = engine.generate([prompt], params)[0]
    steps = engine.counters["steps_total"]
    again = engine.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == len(prompt)
    assert engine.counters["steps_total"] - steps == len(first.token_ids) - 1  # decode steps only


def test_abort_and_finish_reasons(model):
    engine = make(model)
    a, b = prompts([20, 9])
    engine.add_request("a", a, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.add_request("b", b, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("nope")
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["a"].finish_reason == "abort" and finals["b"].finish_reason == "length"
    assert len(finals["b"].token_ids) == 3
    assert engine.allocator.num_used() == 0


def test_stop_ids_strings_logprobs_and_seeds(model):
    engine = make(model)
    (tokens,) = prompts([15])
    free = engine.generate([tokens], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    stop_id = free.token_ids[3]
    first_hit = free.token_ids.index(stop_id)
    out = engine.generate([tokens], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first_hit + 1]
    # logprobs: one entry per token (streamed in the deltas), greedy picks the best, top-3 sorted
    engine.add_request("lp", tokens, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))
    entries = []
    while engine.has_unfinished():
        for o in engine.step():
            entries += o.new_logprobs
    assert [e.token_id for e in entries] == free.token_ids[:4]
    for e in entries:
        assert len(e.top) == 3 and e.top[0][0] == e.token_id  # greedy picks the best
        assert e.top[0][2] >= e.top[1][2] >= e.top[2][2] and e.logprob <= 0
    text_engine = make(model, enable_prefix_caching=False)  # a cache hit changes the numerics a little
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    s1 = text_engine.generate([tokens], seeded)[0]
    s2 = text_engine.generate([tokens], seeded)[0]
    assert s1.token_ids == s2.token_ids  # per-request seed reproduces


def test_stop_string_is_cut_from_the_text():
    class Letters:
        vocab_size = 1024

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    m = init_random_weights(Transformer(tiny()), seed=1).eval()
    engine = LLMEngine(
        m, Letters(), EngineConfig(block_size=8, kv_pool_tokens=512, prefill_chunk_size=16, max_num_batched_tokens=64)
    )
    (tokens,) = prompts([10])
    free = engine.generate([tokens], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    stop = free.text[3:5]
    out = engine.generate([tokens], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]


def test_bad_requests_are_refused(model):
    engine = make(model, max_model_len=64)
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request("long", [5] * 64)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [5, 99999])
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("p", [5], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [])
    engine.add_request("ok", [5, 6])
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("ok", [5, 6])
    with pytest.raises(ValueError, match="prefill_mode"):
        make(model, prefill_mode="lazy")


def test_measured_kv_bytes_per_token_match_the_analytic_figure(model):
    engine = make(model, kv_pool_tokens=4096, prefill_chunk_size=64)
    (tokens,) = prompts([800], seed=9)
    engine.add_request("r", tokens, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.requests["r"].in_prefill or engine.requests["r"].num_computed == 0:
        engine.step()
    measured = engine.resident_kv_bytes()
    analytic = global_kv_bytes_per_token(model.cfg)["total"]
    assert abs(measured["global_kv_bytes_per_token"] / analytic - 1) < 0.02
    assert abs(measured["allocated_block_bytes"] / measured["tokens"] / analytic - 1) < 0.02
    assert measured["fixed_state_bytes"] > 0


def test_bounded_replay_equals_masked_decoder_windows(model):
    """Independent formulation of spec §2.1: the plain full forward, with the decoder layers' windows
    starting at s = N - window, gives the bounded-replay logits (decoder outputs before s cannot reach
    the last position: the decoder's global KV comes from the encoder output only)."""
    from dsv41.model.cache import ModelCache

    cfg = model.cfg
    (tokens,) = prompts([45], seed=4)
    n, s = len(tokens), len(tokens) - cfg.window_size
    boundary = model.cfg.decoder_boundary

    class DecoderWindowsFrom(ModelCache):
        def window_first(self, layer):
            return s if layer >= boundary else 0

    plain = ModelCache.create(cfg, 1, n)
    masked = DecoderWindowsFrom(**{k: getattr(plain, k) for k in plain.__dataclass_fields__})
    with torch.inference_mode():
        expected = model(torch.tensor([tokens]), 0, masked, last_only=True)[0, -1]
    bounded = make(model, prefill_mode="bounded", prefill_chunk_size=64).prompt_logits(tokens)
    full = make(model, prefill_mode="full", prefill_chunk_size=64).prompt_logits(tokens)
    assert (bounded - expected).abs().max() < 1e-3 < (full - expected).abs().max()


def test_batched_decode_matches_the_model_per_sequence(model):
    """Decode tokens of sequences at different positions (window wrap, odd/even ratio-2 groups), run as one
    batch through dsv41.engine.batched, equal each sequence's own Transformer.forward decode bit for bit."""
    cfg = model.cfg
    lengths = [29, 12, 40]
    seqs = prompts([n + 4 for n in lengths], seed=11)
    pool, states, runner = PagedKVPool(cfg, 8, 64), StatePool(cfg, 4), ModelRunner(model)
    caches = []
    for i, (n, tokens) in enumerate(zip(lengths, seqs)):
        cache = SequenceCache(cfg, pool, states, i)
        cache.set_blocks(list(range(i * 8, i * 8 + 8)))
        runner.forward([Chunk(cache, tokens[:n], 0, [])])
        caches.append(cache)
    expected = []
    for n, tokens in zip(lengths, seqs):
        ref = model.new_cache(1, n + 4)
        model(torch.tensor([tokens[:n]]), 0, ref)
        expected.append([model(torch.tensor([[tokens[p]]]), p, ref)[0, -1] for p in range(n, n + 4)])
    for step in range(4):
        chunks = [
            Chunk(c, [t[n + step]], n + step, t[n + step - 3 : n + step], decode=True)
            for c, n, t in zip(caches, lengths, seqs)
        ]
        out = runner.forward(chunks)
        for i in range(3):
            assert torch.equal(out[i], expected[i][step]), (step, i)


def test_snapshot_restore_is_lossless(model):
    """A follow-up turn restored from the reply's snapshot (tail block, partial groups, rings; the
    approximate-reuse mode, whose decoder continues the first turn's windows) gives exactly the logits of
    one sequence that never stopped: prefill, decode the reply, prefill the
    next user message, with the same chunk boundaries."""

    cfg = model.cfg
    first, suffix, other = prompts([61, 6, 40], seed=12)
    # prefill_chunk_size 16, block_size 8, bounded replay; approximate reuse resumes at the reply's end
    engine = make(model, exact_prefix_reuse=False)
    # 7 tokens: the snapshot is at an odd length (a ratio-2 partial group) inside a block (a tail)
    reply = engine.generate([first], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].token_ids
    engine.generate([other], SamplingParams(temperature=0, max_tokens=2))  # reuses (scribbles on) freed blocks
    turn2 = first + reply + suffix
    restored = engine.prompt_logits(turn2)
    assert engine.stats.snapshot_hits == 1 and engine.stats.hit_tokens == len(first) + 6

    cache = SequenceCache(cfg, PagedKVPool(cfg, 8, 16), StatePool(cfg, 1), 0)
    cache.set_blocks(list(range(16)))
    replay_from = len(first) - cfg.window_size
    for layer in range(cfg.decoder_boundary, cfg.n_layers):
        cache.first[layer] = replay_from
    runner = ModelRunner(model)
    for start in range(0, len(first), 16):
        end = min(start + 16, len(first))
        runner.forward([Chunk(cache, first[start:end], start, first[max(0, start - 3) : start], replay_from)])
    for p in range(len(first), len(first) + 6):
        runner.forward([Chunk(cache, [turn2[p]], p, turn2[p - 3 : p], decode=True)])
    p = len(first) + 6
    continued = runner.forward([Chunk(cache, turn2[p:], p, turn2[p - 3 : p], p)])[0]
    assert torch.equal(restored, continued)


def test_small_latents_survive_the_packed_cache():
    """Compressed entries whose 16-value blocks have small maxima (E4M3 scales in the subnormal range,
    where re-quantising fp4_qdq output is not the identity) read back from the packed pool exactly as the
    model's bf16 cache holds them: prefill writes and batched decode writes alike."""
    m = init_random_weights(Transformer(tiny()), seed=1).eval()
    m.set_batch_invariant(16)
    cfg = m.cfg
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # compressor norm weights of 0.004-0.012: block maxima around 0.01-0.03
        for s in cfg.kv_source_layers:
            weight = m.layers[s].attn.compressor.norm.weight
            weight.copy_(torch.rand(weight.shape, generator=g) * 0.008 + 0.004)
    tokens = torch.randint(3, 1000, (60,), generator=g).tolist()
    ids = torch.tensor([tokens])
    ref_cache = m.new_cache(1, 64)
    expected = [m(ids[:, :30], 0, ref_cache)[0, -1]] + [
        m(ids[:, p : p + 1], p, ref_cache)[0, -1] for p in range(30, 60)
    ]
    cache = SequenceCache(cfg, PagedKVPool(cfg, 8, 10), StatePool(cfg, 1), 0)
    cache.set_blocks(list(range(9, -1, -1)))
    runner = ModelRunner(m)
    got = [runner.forward([Chunk(cache, tokens[:30], 0, [])])[0]]
    got += [
        runner.forward([Chunk(cache, tokens[p : p + 1], p, tokens[p - 3 : p], decode=True)])[0] for p in range(30, 60)
    ]
    subnormal = [
        (s.float() < 2**-6).float().mean().item()
        for s in (cache.pool.kv_scale[layer] for layer in cfg.kv_source_layers)
    ]
    assert max(subnormal) > 0.01  # the weights did put blocks in the band this test is about
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), step
