"""The sampler's logit processing (dsv41.engine.sampling.process_logits, min-p) against a plain-Python
formulation written from vLLM's and OpenAI's descriptions, element by element, and its use in the
speculative verify path."""

import dataclasses
import math
import random

import pytest
import torch

from dsv41.engine.sampling import (
    GREEDY_TEMPERATURE,
    TokenHistory,
    process_logits,
    sample,
    sampling_probs,
    sampling_support,
    token_logprobs,
    verify_draft,
)
from dsv41.engine.types import SamplingParams


def reference(logits, params, prompt, output, stop_ids):
    """One token at a time, as the documentation states it."""
    out = []
    for t, x in enumerate(logits):
        if len(output) < params.min_tokens and t in stop_ids:
            x = -math.inf
        x += params.logit_bias.get(t, 0.0)
        if params.repetition_penalty != 1.0 and (t in prompt or t in output):
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * output.count(t)
        x -= params.presence_penalty * (1.0 if t in output else 0.0)
        out.append(x)
    return out


@pytest.mark.parametrize("case", range(12))
def test_process_logits_matches_the_elementwise_definition(case):
    rng = random.Random(case)
    vocab = 40
    logits = [rng.uniform(-4, 4) for _ in range(vocab)]
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
    params = SamplingParams(
        presence_penalty=rng.choice([0.0, 0.7, -1.5]),
        frequency_penalty=rng.choice([0.0, 0.4, -0.3, 2.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.6]),
        min_tokens=rng.choice([0, 5, 30]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 4))},
        max_tokens=64,
    )
    stop_ids = [3, 7]
    got = process_logits(torch.tensor(logits), params, TokenHistory(prompt, output, stop_ids)).tolist()
    want = reference(logits, params, prompt, output, stop_ids)
    for g, w in zip(got, want):
        assert (g == w == -math.inf) or abs(g - w) <= 1e-4 * max(1.0, abs(w))


def test_min_p_keeps_exactly_the_tokens_above_the_scaled_top_probability():
    logits = torch.tensor([2.0, 1.9, 0.5, -1.0, 1.0, -3.0])
    for min_p in (0.05, 0.3, 0.9):
        params = SamplingParams(temperature=0.7, min_p=min_p)
        probs = torch.softmax(logits / 0.7, -1)
        want = [i for i, p in enumerate(probs.tolist()) if p >= min_p * max(probs.tolist())]
        assert sampling_support(logits, params).tolist() == want
        p = sampling_probs(logits, params)
        assert sorted((p > 0).nonzero().flatten().tolist()) == want
        assert abs(float(p.sum()) - 1.0) < 1e-5


def test_penalised_greedy_and_processed_logprobs_follow_the_processing():
    logits = torch.tensor([1.0, 3.0, 2.5, 0.0])
    hist = TokenHistory([0], [1, 1], [3])
    # frequency 0.5 x 2 repeats takes token 1 from 3.0 to 2.0: token 2 wins
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert sample(logits, params, None, hist) == 2
    assert sample(logits, SamplingParams(temperature=0), None, hist) == 1
    # min_tokens: the stop id is never drawn before min_tokens tokens, even when biased up
    params = SamplingParams(temperature=1.0, min_tokens=4, max_tokens=8, logit_bias={3: 50.0})
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, params, g, hist) != 3 for _ in range(50))
    assert sample(logits, params, g, TokenHistory([0], [1, 1, 2, 2], [3])) == 3  # reached: the bias wins
    tl = token_logprobs(logits, 2, 2, _Tok(), SamplingParams(temperature=1.0, min_tokens=4, max_tokens=8), hist)
    assert tl.support.tolist() == [0, 1, 2] and tl.logprob == pytest.approx(
        float(torch.log_softmax(torch.tensor([1.0, 3.0, 2.5]), -1)[2]), abs=1e-6
    )


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_greedy_verify_uses_the_history_each_draft_position_would_have():
    # without processing the argmax is 1 everywhere; with a presence penalty, a second 1 loses to 2
    target = torch.tensor([[0.0, 3.0, 2.5, 0.0]] * 3)
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    hist = TokenHistory([], [], [])
    a, nxt = verify_draft(target, [1, 2], None, params, None, hist)
    assert (a, nxt) == (2, 1)  # 1, then 2 (1 present: 2.0 < 2.5), then 1 (both present: 2.0 > 1.5)
    a, nxt = verify_draft(target, [1, 1], None, params, None, hist)
    assert (a, nxt) == (1, 2)
    a, _ = verify_draft(target, [1, 1], None, SamplingParams(temperature=0), None, None)
    assert a == 2


def test_sampled_verify_is_lossless_with_penalties():
    """With a drafter distribution q unlike p, the verified token at position 1 follows the penalised
    target distribution given the history plain decoding would have (Monte Carlo, 3 sigma)."""
    torch.manual_seed(0)
    vocab = 5
    target = torch.randn(2, vocab)
    draft_logits = torch.randn(1, vocab)
    params = SamplingParams(temperature=1.0, frequency_penalty=1.5, repetition_penalty=1.4)
    hist = TokenHistory([0, 4], [2], [])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    trials = 4000
    for _ in range(trials):
        d = sample(draft_logits[0], params, g, hist)
        a, nxt = verify_draft(target, [d], draft_logits, params, g, hist)
        first = d if a == 1 else nxt
        counts[first] += 1
    p = sampling_probs(target[0], params, hist)
    sigma = (p * (1 - p) / trials).sqrt()
    assert ((counts / trials - p).abs() <= 3 * sigma + 1e-3).all(), (counts / trials, p)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={1000: 1.0}), "logit_bias"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
    ],
)
def test_ranges_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw).validate(1000)


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30])
def test_a_tiny_repetition_penalty_still_samples(penalty):
    """A penalty that divides logits past fp32's range (5e-324 is 0 there) caps them instead: the request
    samples (among the penalised tokens) rather than failing on infinite logits (found by schemathesis)."""
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, repetition_penalty=penalty, max_tokens=4)
    params.validate(40)
    logits = torch.linspace(-3, 3, 40)
    history = TokenHistory([38, 39], [], [])
    processed = process_logits(logits, params, history)
    assert bool(torch.isfinite(processed).all())
    assert sample(logits, params, torch.Generator().manual_seed(0), history) in (38, 39)
    untouched = process_logits(logits, dataclasses.replace(params, repetition_penalty=1.3), history)
    assert untouched[39] == logits[39] / 1.3  # an ordinary penalty: the cap changes nothing
