"""SamplingParams.prompt_logprobs: every prompt token's log-probability given the tokens before it, from the
logits the prefill chunks compute (what an lm-eval loglikelihood needs)."""

import pytest
import torch

from dsv41.engine import SamplingParams
from tests.engine.helpers import make, prompts

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)


def plain_logprobs(model, prompt):
    """log_softmax of one plain forward over the prompt: row p scores token p + 1 ([len - 1, vocab])."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]))[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_plain_forward(model, prompt, entries, top_n):
    assert len(entries) == len(prompt) and entries[0] is None
    reference = plain_logprobs(model, prompt)
    for i in range(1, len(prompt)):
        entry, row = entries[i], reference[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - float(row[prompt[i]])) < 1e-4, i
        assert len(entry.top) == top_n
        assert entry.top[0][0] == int(row.argmax()) and abs(entry.top[0][2] - float(row.max())) < 1e-4
        assert entry.top[0][2] >= entry.top[1][2]


@pytest.mark.parametrize("mode", ["bounded", "full"])
def test_prompt_logprobs_equal_the_plain_forward(model, mode):
    """Prompts shorter than a chunk, spanning several 16-token chunks and longer than the window, all in
    one batch; in bounded mode too (such a request runs the decoder over every position)."""
    batch = prompts([2, 15, 37, 70])
    engine = make(model, prefill_mode=mode)
    outs = engine.generate(batch, PARAMS)
    for prompt, out in zip(batch, outs):
        check_against_plain_forward(model, prompt, out.prompt_logprobs, 2)
    # the tokens it generates are those of a full prefill without prompt logprobs
    plain = make(model, prefill_mode="full").generate(
        batch, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # requests without the option get none
    assert make(model).generate(batch[:1], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_prompt_logprobs_read_nothing_from_the_prefix_cache(model):
    """A repeat of a cached prompt is recomputed when it wants prompt logprobs (a hit would skip the
    positions to score) and still hits the cache when it does not (full prefill: a bounded one would not
    resume from a snapshot whose decoder started elsewhere)."""
    (prompt,) = prompts([50], seed=2)
    engine = make(model, enable_prefix_caching=True, prefill_mode="full")
    first = engine.generate([prompt], PARAMS)[0]
    again = engine.generate([prompt], PARAMS)[0]
    assert again.num_cached_tokens == 0
    assert [e.logprob for e in again.prompt_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs[1:]]
    plain = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert plain.num_cached_tokens > 0


def test_prompt_logprobs_survive_preemption_mid_prefill(model):
    """A pool too small for the batch preempts requests during their prefill; the recompute fills in the
    rest and every entry still equals the plain forward, each position scored once."""
    batch = prompts([60, 52, 44], seed=3)
    engine = make(model, kv_pool_tokens=96)
    outs = engine.generate(batch, PARAMS)
    assert engine.counters["preemptions_total"] > 0
    for prompt, out in zip(batch, outs):
        check_against_plain_forward(model, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_are_validated(model):
    engine = make(model)
    for bad in (-1, SamplingParams.MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request("bad", [5, 6, 7], SamplingParams(prompt_logprobs=bad))
