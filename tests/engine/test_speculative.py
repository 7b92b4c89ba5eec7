"""DSpark speculative decoding in the engine (issue 13): greedy output identical to plain decoding under
continuous batching with sequences accepting different lengths, every cache kind rolled back to exactly
what plain decoding leaves, speculative sampling keeping the target distribution, metrics."""

import os

import pytest
import torch

from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.engine.llm_engine import LLMEngine as Engine
from dsv41.engine.sampling import verify_draft
from dsv41.tokenizer import ByteTokenizer
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR
from tests.engine.helpers import make, prompts

DSPARK = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")  # 10 layers + 3 stages, window 8, ratios 2 and 1


@pytest.fixture(scope="module")
def model():
    return load_model(DSPARK)


def oracle(monkeypatch, truth: dict, wrong: float, seed: int = 0):
    """Replace each draft by the plain run's own continuation (`truth`: prompt tuple -> output ids), with
    each drafted position wrong with probability `wrong`: whole blocks accepted, partial blocks,
    immediate rejections, different lengths for different sequences in the same step."""
    real = Engine._draft
    g = torch.Generator().manual_seed(seed)

    def fake(self, work):
        real(self, work)  # the drafter still runs and writes its rings as usual
        for seq in self.running:
            if not seq.draft_tokens:
                continue
            want = truth[tuple(seq.prompt_ids)][len(seq.output_ids) : len(seq.output_ids) + len(seq.draft_tokens)]
            draft = want + seq.draft_tokens[len(want) :]
            for i in range(len(draft)):
                if float(torch.rand((), generator=g)) < wrong:
                    draft[i] = (draft[i] + 1) % 1000 + 3
            seq.draft_tokens = draft

    monkeypatch.setattr(Engine, "_draft", fake)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(model):
    """(prompts, their plain greedy outputs): decoded once for the three drafters below."""
    batch = prompts([13, 30, 5, 47, 21])
    return batch, [o.token_ids for o in make(model).generate(batch, GREEDY)]


# the random drafter alone (nearly every draft rejected, ~8 s on one core) is in the slow tier: the oracle cases
# below still run it (its rings and drafts) and test_engine_drafts_equal_the_model_drafter checks its drafts
@pytest.mark.parametrize("wrong", [pytest.param(None, marks=pytest.mark.slow), 0.08, 0.5])
def test_greedy_speculative_equals_plain_decoding(model, plain_greedy, monkeypatch, wrong):
    """40 tokens from prompts of 5-47 tokens cross the 8-slot windows and ratio-2 groups many times; the
    drafter itself (random weights: nearly always rejected), an oracle right 92% of the time (mostly
    whole blocks) and one right half the time. Requests arrive together and run batched."""
    batch, plain = plain_greedy
    if wrong is not None:
        oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, wrong)
    engine = make(model, speculative=True)
    spec = [o.token_ids for o in engine.generate(batch, GREEDY)]
    assert spec == plain
    m = engine.metrics()
    assert m["spec_decode_steps_total"] > 0
    if wrong is not None:
        assert m["spec_decode_accepted_tokens_total"] > 0
        # each drafted position wrong with probability `wrong`, independently: a step emits its accepted
        # prefix plus one token, 1 + sum_k (1 - wrong)^k over the k = 1..n drafted positions (4.26 at 0.08,
        # 1.94 at 0.5); blocks cut short by max_tokens pull the measured mean down a little (3.98 and 1.96)
        n_draft = sum(k.startswith("spec_decode_acceptance_rate_position_") for k in m)
        assert n_draft == 4
        expected = 1 + sum((1 - wrong) ** k for k in range(1, n_draft + 1))
        low = {0.08: 3.5, 0.5: 1.75}[wrong]
        assert low < m["spec_decode_mean_emitted_per_step"] <= expected + 0.25, (m, expected)
        # fewer target passes than tokens: decoding really went several tokens at a time
        assert m["steps_total"] < sum(len(t) for t in plain)


def test_mixed_acceptance_in_one_batch_and_late_arrivals(model, monkeypatch):
    """Requests join while others are mid-generation (continuous batching), with stop conditions and
    max_tokens reached inside a draft block; each sequence accepts its own number of drafts."""
    batch = prompts([9, 26, 15, 33], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (23, 31, 7, 40)]
    plain = [o.token_ids for o in make(model).generate(batch, params)]
    oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, 0.25, seed=3)
    engine = make(model, speculative=True)
    accepted_per_step = []
    engine.add_request("a", batch[0], params[0])
    engine.add_request("b", batch[1], params[1])
    done, step = {}, 0
    while engine.has_unfinished() or step < 6:
        if step == 4:
            engine.add_request("c", batch[2], params[2])
        if step == 6:
            engine.add_request("d", batch[3], params[3])
        before = {s.request_id: len(s.output_ids) for s in engine.running}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        grew = {
            s.request_id: len(s.output_ids) - before.get(s.request_id, 0)
            for s in engine.running
            if s.request_id in before
        }
        accepted_per_step.append(set(grew.values()))
        step += 1
    assert [done[k] for k in "abcd"] == plain
    assert [len(t) for t in plain] == [23, 31, 7, 40]  # max_tokens honoured though drafts ran past it
    assert any(len(v) > 1 for v in accepted_per_step)  # some step emitted different counts per sequence


def _readable_state(engine, seq):
    """What the next forward of this sequence reads: the ring slots of the last W computed positions
    (per backbone layer), the pending part of each partial group, the global entries below
    num_computed, as raw bytes."""
    cache, cfg = seq.cache, engine.model_config
    n, w = seq.num_computed, cfg.window_size
    lo = max(0, n - w)
    slots = torch.arange(lo, n) % w
    state = {
        "codes": cache.window_codes[: cfg.n_layers, slots].view(torch.uint8).clone(),
        "scale": cache.window_scale[: cfg.n_layers, slots].clone(),
    }
    for layer, (kv, score) in cache.group.items():
        pending = n % kv.size(1)
        state[f"group{layer}"] = (kv[:, :pending].clone(), score[:, :pending].clone())
    for layer, lay in engine.pool.sources.items():
        entries = torch.arange(n // lay.ratio)
        state[f"kv{layer}"] = engine.pool.read_kv(layer, cache.table, entries).clone()
        state[f"keys{layer}"] = engine.pool.read_key_range(layer, cache.table, 0, n // lay.ratio).clone()
    return state


def _equal(a, b):
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


# 1.0 (every draft rejected at its first position; ~8 s) is in the slow tier: 0.4 rejects at every depth, the
# first included
@pytest.mark.parametrize("wrong", [pytest.param(1.0, marks=pytest.mark.slow), 0.4])
def test_rollback_leaves_every_cache_as_plain_decoding_does(model, monkeypatch, wrong):
    """Plain and speculative engines side by side on one request: whenever both have computed the same
    positions, everything the next forward reads (window rings, partial compression groups, compressed
    KV, index keys) is bit-identical, including right after a rejected draft (wrong=1.0: every draft
    rejected at its first position; 0.4: rejections at every depth). The prefix cache registers the
    same block hashes."""
    (prompt,) = prompts([19], seed=7)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    plain_out = make(model).generate([prompt], params)[0].token_ids
    oracle(monkeypatch, {tuple(prompt): plain_out}, wrong, seed=1)
    plain, spec = make(model, enable_prefix_caching=True), make(model, speculative=True, enable_prefix_caching=True)
    plain.add_request("x", prompt, params)
    spec.add_request("x", prompt, params)
    states, compared, rejected = {}, 0, 0
    while plain.has_unfinished():
        plain.step()
        seq = plain.requests.get("x")
        if seq is not None and seq.cache is not None and not seq.in_prefill:
            states[seq.num_computed] = (_readable_state(plain, seq), list(seq.block_hashes))
    while spec.has_unfinished():
        before = spec.counters.get("spec_decode_draft_tokens_total", 0) - spec.counters.get(
            "spec_decode_accepted_tokens_total", 0
        )
        spec.step()
        seq = spec.requests.get("x")
        after = spec.counters["spec_decode_draft_tokens_total"] - spec.counters["spec_decode_accepted_tokens_total"]
        if seq is not None and seq.cache is not None and not seq.in_prefill and seq.num_computed in states:
            want, hashes = states[seq.num_computed]
            got = _readable_state(spec, seq)
            assert want.keys() == got.keys()
            for key in want:
                assert _equal(want[key], got[key]), (seq.num_computed, key)
            assert seq.block_hashes == hashes
            compared += 1
            rejected += after > before
    assert compared >= 5 and rejected >= 3


def test_verify_draft_keeps_the_target_distribution():
    """Speculative sampling on a 6-token vocabulary with top-k 5 at temperature 0.8: with a draft
    distribution q far from the target p, the first token's frequencies over 20,000 trials match p after
    its top-5 cut (chi-square; the cut-off token never appears), and a second position (reached only
    after an acceptance) matches p there too."""
    p_logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 2.5, 0.0, 1.0, -0.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    )
    q_logits = torch.tensor([[0.0, 2.5, -0.3, 1.5, 0.2, -0.1], [1.5, 0.0, -0.2, 0.1, 2.0, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=5)

    def top5(logits):  # the processed distribution, written out: the lowest of the 6 logits (no ties) is cut
        z = logits / 0.8
        z = z.masked_fill(logits == logits.min(), float("-inf"))
        return torch.softmax(z, -1)

    g = torch.Generator().manual_seed(0)
    first = torch.zeros(6)
    second = torch.zeros(6)
    trials = 20000
    # the drafts are drawn from the top-5 cut of q, as the drafter samples with the same params
    q0, q1 = top5(q_logits[0]), top5(q_logits[1])
    for _ in range(trials):
        d0 = int(torch.multinomial(q0, 1, generator=g))
        d1 = int(torch.multinomial(q1, 1, generator=g))
        a, nxt = verify_draft(p_logits, [d0, d1], q_logits, params, g)
        first[d0 if a >= 1 else nxt] += 1
        if a >= 1:
            second[d1 if a >= 2 else nxt] += 1
    for counts, logits in ((first, p_logits[0]), (second, p_logits[1])):
        probs = top5(logits)
        cut = int(logits.argmin())
        assert counts[cut] == 0, counts  # top-k: the target's sixth token is never emitted
        keep = probs > 0
        expected = probs[keep] * counts.sum()
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < 18.5, (counts, expected)  # 4 degrees of freedom: p < 0.001


def test_sampled_speculative_decoding_keeps_the_target_distribution(model, monkeypatch):
    """End to end on the engine (statistically, a tiny-sized model): top-k 4 sampling, so the first two
    tokens take 16 values. The second is drafted from a distribution q that differs from the target's
    (the target's own logits, shifted) and goes through the engine's verification; over 320 seeded
    requests the (t1, t2) frequencies match the target's exact probabilities p(t1) p(t2 | t1) (chi-square,
    15 degrees of freedom), and drafts were both accepted and rejected."""
    (prompt,) = prompts([6], seed=5)
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    probe = make(model)
    p1 = torch.softmax(probe.prompt_logits(prompt), -1)
    first_choices = p1.topk(4).indices.tolist()
    p1 = p1[first_choices] / p1[first_choices].sum()
    cond = {}
    for t in first_choices:
        logits = probe.prompt_logits(prompt + [t])
        top = logits.topk(4).indices
        q = logits.clone()
        q[top[0]] -= 2.0  # the drafter under-rates the favourite and over-rates the last of the four
        q[top[3]] += 1.0
        cond[t] = (top.tolist(), torch.softmax(logits[top], -1), q)
    real = Engine._draft

    def fake(self, work):  # draft one token from q for the second position, with its own generator
        real(self, work)
        for seq in self.running:
            if seq.draft_tokens and len(seq.output_ids) == 1:
                q = cond[seq.output_ids[0]][2]
                probs = torch.softmax(q, -1)
                keep = probs.topk(4).indices
                masked = torch.zeros_like(probs)
                masked[keep] = probs[keep]
                seq.draft_tokens = [int(torch.multinomial(masked / masked.sum(), 1, generator=seq.generator))]
                seq.draft_logits = q.unsqueeze(0)

    monkeypatch.setattr(Engine, "_draft", fake)
    engine = make(model, speculative=True, num_speculative_tokens=1, max_num_seqs=80, max_num_batched_tokens=512)
    n = 320
    outs = engine.generate([prompt] * n, [SamplingParams(seed=s, **params) for s in range(n)])
    counts = torch.zeros(4, 4)
    for o in outs:
        top, _, _ = cond[o.token_ids[0]]
        counts[first_choices.index(o.token_ids[0]), top.index(o.token_ids[1])] += 1
    expected = torch.stack([p1[i] * cond[t][1] for i, t in enumerate(first_choices)]) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, (counts, expected)  # p < 0.001
    c = engine.counters
    assert 0 < c["spec_decode_accepted_tokens_total"] < c["spec_decode_draft_tokens_total"]


def test_engine_drafts_equal_the_model_drafter(model):
    """The engine's batched draft (two sequences at different positions in one drafter pass, FP8 rings
    in the state pool, rows written from the runner's captured target-layer inputs) proposes what the
    model-level drafter proposes for each alone."""
    batch = prompts([21, 27], seed=9)
    want, firsts = [], []
    for prompt in batch:
        ids = torch.tensor([prompt])
        with model.numerics(16), torch.inference_mode():
            cache = model.new_cache(1, 64)
            inputs = {}
            logits = model(ids, 0, cache, last_only=True, drafter_inputs=inputs)[:, -1]
            model.draft_prefill(inputs["main_hidden"][:, :-1], 0, cache)
            first = logits.argmax(-1)
            want.append(
                model.draft(first, inputs["main_hidden"][:, -1:], len(prompt) - 1, cache).tokens[0, 1:].tolist()
            )
            firsts.append([int(first)])
    engine = make(model, speculative=True, prefill_mode="full")  # bounded replay changes the decoder's rows
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seqs = [engine.requests[str(i)] for i in range(2)]
    while not seqs[0].output_ids:  # two prefill chunks each (16 + 5, 16 + 11): both end in step 2
        engine.step()
    assert [s.output_ids for s in seqs] == firsts
    assert [s.draft_tokens for s in seqs] == want
    assert want[0] != want[1]


def test_drafter_rows_of_several_sequences_in_one_call_equal_each_written_alone(model):
    """`dspark.write_rows` (the `fast` engine's drafter-ring writes after a verify: every sequence's kept rows
    in one call) puts each row where `dspark.prefill` of its sequence alone puts it, with the same bits under
    batch-invariant GEMMs: rows of three sequences at positions that wrap their rings, in one shuffled call."""
    from dsv41.engine.sequence import DraftRings, StatePool
    from dsv41.model import dspark

    cfg, g = model.cfg, torch.Generator().manual_seed(3)
    width = len(cfg.dspark_target_layer_ids) * cfg.dim
    window = min(stage.attn.window for stage in model.mtp)
    starts, counts = [3, window - 2, 5 * window + 1], [4, 5, window]  # the second and third wrap around
    hidden = [torch.randn(n, width, generator=g).bfloat16() for n in counts]
    alone, together = (StatePool(cfg, 3, torch.device("cpu"), drafter=True) for _ in range(2))

    class Alone:  # one sequence's ring in the pool, as `prefill` writes it (SequenceCache.window_write)
        def __init__(self, slot):
            self.rings = DraftRings(alone, [slot])

        def window_write(self, layer, b, ring_slots, values):  # values [1, n, D]
            for i, at in enumerate(ring_slots.tolist()):
                self.rings.window_write_rows(layer, torch.tensor([at]), values[:, i : i + 1])

    with model.numerics(16), torch.inference_mode():
        for slot, (h, start) in enumerate(zip(hidden, starts)):
            dspark.prefill(model.mtp, h.unsqueeze(0), start, Alone(slot))
        rows = torch.cat(hidden)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, counts)])
        slots = [s for s, n in enumerate(counts) for _ in range(n)]
        order = torch.randperm(len(slots), generator=g)
        dspark.write_rows(model.mtp, rows[order], positions[order], DraftRings(together, [slots[i] for i in order]))
    for stage in model.mtp:
        layer = stage.layer_id
        assert torch.equal(
            alone.window_codes[:, layer].view(torch.uint8), together.window_codes[:, layer].view(torch.uint8)
        )
        assert torch.equal(alone.window_scale[:, layer], together.window_scale[:, layer])
    assert alone.window_scale[:, model.mtp[0].layer_id].any()


def test_speculative_needs_a_drafter():
    from dsv41.config import tiny
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    m = init_random_weights(Transformer(tiny()), seed=1)
    with pytest.raises(ValueError, match="DSpark drafter"):
        LLMEngine(m, ByteTokenizer(m.cfg.vocab_size), EngineConfig(speculative=True, numerics="deterministic"))


def _greedy_with_logprobs(engine, batch, params):
    """Tokens and the chosen tokens' logprobs of each request, run together on `engine`."""
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    tokens, logprobs = {}, {f"r{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
            logprobs[o.request_id] += [lp.logprob for lp in o.new_logprobs]
    return [tokens[f"r{i}"] for i in range(len(batch))], [logprobs[f"r{i}"] for i in range(len(batch))]


@pytest.mark.slow  # a `small`-width model at 2 threads (~11 s on a loaded 2-core machine); CI runs -m slow
def test_a_verified_token_gets_the_bits_of_a_decode_step_at_two_threads(monkeypatch):
    """The hole found in the speculative benchmark (issue 30): a verify chunk listed every query's
    compressed entries at the chunk's widest count, a decode step at the query's own, and the attention's
    block sums round by their length. At 2 threads, on a `small`-width model with a random drafter (no
    ties), batched plain decoding and speculative decoding with an oracle (so verify chunks compute most
    tokens) must give the same tokens and bit-identical logprobs, including sequences that are still
    shorter than index_topk compressed entries."""
    import dataclasses

    from dsv41.config import preset
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        base = preset("small")
        cfg = dataclasses.replace(
            base,
            n_mtp_layers=2,
            compress_ratios=base.compress_ratios + (0, 0),
            dspark_block_size=4,
            dspark_noise_token_id=base.vocab_size - 1,
            dspark_target_layer_ids=(4, 8, 10),
            dspark_markov_rank=32,
            dspark_n_routed_experts=4,
            dspark_n_activated_experts=2,
        )
        model = init_random_weights(Transformer(cfg), seed=1).eval()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
        batch = prompts([13, 30, 5, 9, 47, 21, 38, 17])  # batch 8, as in the benchmark
        settings = {"kv_pool_tokens": 8192, "max_num_batched_tokens": 512, "prefill_chunk_size": 64}
        plain, plain_lp = _greedy_with_logprobs(make(model, **settings), batch, params)
        oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, wrong=0.0)
        engine = make(model, speculative=True, **settings)
        spec, spec_lp = _greedy_with_logprobs(engine, batch, params)
    finally:
        torch.set_num_threads(threads)
    assert engine.metrics()["spec_decode_mean_emitted_per_step"] > 2  # verify chunks did the work
    assert spec == plain
    assert spec_lp == plain_lp  # bit for bit


def test_batched_verify_gives_the_bits_of_per_request_verify(model, monkeypatch):
    """Batched verify (issue 30: a draft of n tokens runs as n batched decode steps of the attention,
    every request's i-th token in step i) against each request verified on its own: same tokens as plain
    decoding and bit-identical logprobs, with sequences accepting different lengths in one step (so the
    steps' batches shrink and rejected tails are rolled back from the rows the decode steps kept)."""
    from dsv41.engine.runner import ModelRunner

    batch = prompts([13, 30, 5, 47, 21], seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    plain, plain_lp = _greedy_with_logprobs(make(model), batch, params)
    oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, 0.25, seed=5)
    widest = []
    real = ModelRunner._decode_steps

    def spy(self, chunks, device):
        steps = real(self, chunks, device)
        widest.append(max((len(members) for _, members in steps[1:]), default=0))
        return steps

    monkeypatch.setattr(ModelRunner, "_decode_steps", spy)
    batched, batched_lp = _greedy_with_logprobs(make(model, speculative=True, batched_verify="on"), batch, params)
    assert max(widest) >= 3  # several requests' verify tokens shared a decode step
    widest.clear()
    alone, alone_lp = _greedy_with_logprobs(make(model, speculative=True, batched_verify="off"), batch, params)
    assert max(widest) <= 1  # no decode step held two requests' verify tokens
    assert batched == alone == plain
    assert batched_lp == alone_lp == plain_lp  # bit for bit
