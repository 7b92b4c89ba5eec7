"""Logit processing (penalties, logit_bias, min_tokens, min_p) inside the engine: DSpark speculative decoding
keeps plain decoding's output with it on (the verify path processes each drafted position with the
history plain decoding would have there), a request's tokens do not depend on its batch, and processed
logprobs are those of the processed distribution."""

import os

import pytest

from dsv41.engine import SamplingParams
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR
from tests.engine.helpers import make, prompts
from tests.engine.test_speculative import oracle

DSPARK = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")


@pytest.fixture(scope="module")
def dspark():
    return load_model(DSPARK)


PROCESSED = dict(
    temperature=0,
    max_tokens=16,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    repetition_penalty=1.3,
    logit_bias={40: 3.0, 41: -50.0},
    min_tokens=6,
    stop_token_ids=[7],
)


@pytest.fixture(scope="module")
def plain_runs(dspark):
    """(prompts, processed plain greedy outputs, unprocessed ones): decoded once for both drafters below."""
    batch = prompts([9, 23, 14])
    plain = [o.token_ids for o in make(dspark).generate(batch, SamplingParams(**PROCESSED))]
    unprocessed = [o.token_ids for o in make(dspark).generate(batch, SamplingParams(temperature=0, max_tokens=16))]
    return batch, plain, unprocessed


# the random drafter alone (nearly every draft rejected) is in the slow tier: 0.2 still runs it and rejects a
# fifth of the drafts beside the accepted ones
@pytest.mark.parametrize("wrong", [pytest.param(None, marks=pytest.mark.slow), 0.2])
def test_greedy_speculative_with_penalties_equals_plain_decoding(dspark, plain_runs, monkeypatch, wrong):
    batch, plain, unprocessed = plain_runs
    params = SamplingParams(**PROCESSED)
    assert plain != unprocessed  # the processing changes what greedy decoding picks
    if wrong is not None:  # drafts right 80% of the time: verification sees accepted drafts in its history
        oracle(monkeypatch, {tuple(p): t for p, t in zip(batch, plain)}, wrong)
    engine = make(dspark, speculative=True)
    assert [o.token_ids for o in engine.generate(batch, params)] == plain
    if wrong is not None:
        assert engine.metrics()["spec_decode_accepted_tokens_total"] > 0


def test_penalised_sampling_does_not_depend_on_the_batch(tiny_model):
    params = SamplingParams(
        temperature=1.0,
        top_p=0.95,
        min_p=0.02,
        seed=5,
        max_tokens=8,
        ignore_eos=True,
        frequency_penalty=0.8,
        repetition_penalty=1.2,
        logit_bias={100: 2.0},
        min_tokens=3,
    )
    target = prompts([11])[0]
    alone = make(tiny_model).generate([target], params)[0].token_ids
    others = prompts([5, 17, 30], seed=1)
    batch = make(tiny_model).generate(
        [others[0], target, others[1], others[2]],
        [SamplingParams(temperature=0.7, seed=k, max_tokens=8) for k in range(1)]
        + [params]
        + [SamplingParams(temperature=0.9, max_tokens=8)] * 2,
    )
    assert batch[1].token_ids == alone


def test_processed_logprobs_follow_the_logit_bias(tiny_model):
    prompt = prompts([7])[0]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True, logprobs=1, logit_bias={500: 100.0})
    raw = make(tiny_model).generate([prompt], params)[0]
    processed = make(tiny_model, logprobs_mode="processed").generate([prompt], params)[0]
    assert raw.token_ids == processed.token_ids == [500, 500, 500]
    assert all(lp.logprob > -1e-3 for lp in processed.new_logprobs)  # the biased distribution: ~certain
    assert all(lp.logprob < -1.0 for lp in raw.new_logprobs)  # the model's own: an arbitrary token
