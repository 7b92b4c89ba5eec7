"""DSpark draft-and-verify at the model level (dsv41.generate.generate_speculative): greedy output equal
to plain decoding, rollback leaving the caches as if never drafted, speculative sampling preserving the
target distribution."""

import os

import pytest
import torch

from dsv41.generate import SpeculativeStats, _accept, generate, generate_speculative
from dsv41.model import dspark
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR

DSPARK = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")  # 10 layers + 3 stages, window 8, ratios 2 and 1


@pytest.fixture(scope="module")
def model():
    m = load_model(DSPARK)
    return m


def _prompt(b=2, s=13, seed=0):
    return torch.randint(3, 1000, (b, s), generator=torch.Generator().manual_seed(seed))


def _oracle_drafts(model, monkeypatch, truth: torch.Tensor, wrong_every: int):
    """Make the drafter propose the plain run's own tokens (so whole blocks are accepted), except every
    `wrong_every`-th drafted position, which gets a wrong token (a rejection there)."""
    real = dspark.draft
    calls = {"n": 0}

    def fake(model_, first, hidden, pos, cache, trace=None, choose=None):
        result = real(model_, first, hidden, pos, cache, trace, choose)  # keeps the rings written as usual
        k = result.tokens.size(1) - 1
        start = pos + 2 - truth_offset  # index into `truth` of the first drafted position
        tokens = result.tokens.clone()
        for i in range(k):
            j = start + i
            if 0 <= j < truth.size(1):
                tokens[:, i + 1] = truth[:, j]
            calls["n"] += 1
            if calls["n"] % wrong_every == 0:
                tokens[:, i + 1] = (tokens[:, i + 1] + 1) % 1000 + 3
        result.tokens = tokens
        return result

    truth_offset = _prompt().size(1)
    monkeypatch.setattr(dspark, "draft", fake)


@pytest.fixture(scope="module")
def plain40(model):
    """Plain greedy decoding of 40 tokens from _prompt(), once for the three drafters below."""
    with model.numerics(16):
        return generate(model, _prompt(), 40)


# the random drafter alone (nearly every block rejected, ~6 s on one core) is in the slow tier: the oracle cases
# still run it (its rings) and tests/model/test_golden.py checks its drafts against the reference
@pytest.mark.parametrize(
    "drafts", [pytest.param("drafter", marks=pytest.mark.slow), "oracle-mostly-right", "oracle-every-other-wrong"]
)
def test_greedy_speculative_equals_plain_decoding(model, plain40, monkeypatch, drafts):
    """40 tokens from a 13-token prompt cross the 8-slot windows and the ratio-2 groups many times; the
    drafter (random weights: nearly every block rejected), an oracle drafter that is right except every
    7th position (whole blocks accepted, partial blocks) and one wrong every other position."""
    prompt, plain = _prompt(), plain40
    with model.numerics(16):
        if drafts != "drafter":
            _oracle_drafts(model, monkeypatch, plain, 7 if drafts == "oracle-mostly-right" else 2)
        stats = SpeculativeStats()
        spec = generate_speculative(model, prompt, 40, stats=stats)
    assert torch.equal(spec, plain)
    if drafts == "oracle-mostly-right":
        assert stats.tokens_per_step > 2.5 and stats.accepted > 0  # blocks of 4 were mostly accepted
    assert stats.steps < 40


def test_rollback_leaves_the_caches_as_plain_decoding_does(model, monkeypatch):
    """After a speculative run with rejections, every cache entry a later step can read (window rings,
    partial compression groups, compressed KV and index keys up to the position, Engram history) equals the
    cache of a plain token-by-token run that reached the same position."""
    prompt = _prompt(b=1, seed=3)
    n = 23
    with model.numerics(16):
        plain = generate(model, prompt, n)
        _oracle_drafts(model, monkeypatch, plain, 3)
        cfg = model.cfg
        k = cfg.dspark_block_size
        spec_cache = model.new_cache(1, prompt.size(1) + n + k + 1)
        spec = generate_speculative(model, prompt, n, cache=spec_cache)
        assert torch.equal(spec, plain)
        # the plain run fed every generated token but the last one
        ref = model.new_cache(1, prompt.size(1) + n + k + 1)
        with torch.inference_mode():
            model(prompt, 0, ref)
            for i in range(n - 1):
                model(plain[:, i : i + 1], prompt.size(1) + i, ref)
    # both processed the prompt and the first n - 1 generated tokens: every cache must agree
    end = prompt.size(1) + n - 1
    for layer in range(cfg.n_layers):
        assert torch.equal(spec_cache.window_kv[layer], ref.window_kv[layer]), layer
    for layer in cfg.kv_source_layers:
        rows = end // cfg.compress_ratios[layer]
        assert torch.equal(spec_cache.compressed_kv[layer][:, :rows], ref.compressed_kv[layer][:, :rows]), layer
        assert torch.equal(spec_cache.index_k[layer][:, :rows], ref.index_k[layer][:, :rows]), layer
    for layer in spec_cache.group_kv:
        assert torch.equal(spec_cache.group_kv[layer], ref.group_kv[layer]), layer
        assert torch.equal(spec_cache.group_score[layer], ref.group_score[layer]), layer
    assert torch.equal(spec_cache.engram_ids[:, :end], ref.engram_ids[:, :end])


def test_confidence_threshold_keeps_greedy_output(model):
    prompt = _prompt(seed=5)
    with model.numerics(16):
        plain = generate(model, prompt, 20)
        stats = SpeculativeStats()
        spec = generate_speculative(model, prompt, 20, confidence_threshold=0.5, stats=stats)
    assert torch.equal(spec, plain)


@pytest.mark.parametrize("n", [1, 3])
def test_speculative_sampling_keeps_the_target_distribution(n):
    """Drafts drawn from q and accepted with min(1, p/q), else replaced from norm(max(p - q, 0)): the first
    emitted token is distributed as p (20,000 trials, a 6-token vocabulary, q far from p)."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    q_logits = torch.tensor([-1.0, 0.0, 2.0, 1.0, -2.0, 0.0])
    p = torch.softmax(p_logits, -1)
    q = torch.softmax(q_logits, -1)
    trials = 20000
    target = p_logits.expand(trials, n + 1, 6)
    draft_logits = q_logits.expand(trials, n, 6)
    proposed = torch.multinomial(q, trials * n, replacement=True, generator=gen).view(trials, n)
    accepted, nxt = _accept(target, draft_logits, proposed, 1.0, 1.0, gen, greedy=False)
    first = torch.where(accepted > 0, proposed[:, 0], nxt)
    freq = torch.bincount(first, minlength=6).float() / trials
    assert (freq - p).abs().max() < 0.015, (freq, p)
    # acceptance of the first draft happens with probability sum_x min(p, q)
    assert abs((accepted > 0).float().mean() - torch.minimum(p, q).sum()) < 0.015


def test_greedy_speculative_stops_at_eos_like_plain_decoding(model):
    """eos repeats after a row's first one and generation stops once every row has one, as in `generate`."""
    prompt = _prompt(seed=7)
    with model.numerics(16):
        free = generate(model, prompt, 16)
        eos = int(free[0, 9])  # a token row 0 produces: it finishes there, row 1 maybe later or never
        plain = generate(model, prompt, 16, eos_id=eos)
        spec = generate_speculative(model, prompt, 16, eos_id=eos)
    assert torch.equal(spec, plain)
