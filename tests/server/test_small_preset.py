"""The issue-34 endpoints and sampling parameters on `dsv41 serve small` (8,192-id byte vocabulary, random
weights) through the official `openai` client: `/v1/responses` (plain, streamed, continued with
`previous_response_id`), `n` with a seed, the penalties and `logit_bias`. The `tiny` versions of these
checks (tests/server/test_responses.py, test_sampling_params.py) cover the details; these show the same
behaviour on the larger preset. Slow tier: a few tokens per request, each step of `small` takes seconds on
a shared 2-core CPU."""

import openai
import pytest

pytestmark = pytest.mark.slow

NOISE = {"ignore_eos": True}  # random weights: a fixed length, whatever is sampled


@pytest.fixture(scope="module")
def client(served_small):
    return openai.OpenAI(base_url=served_small[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _ids(client, engine, prompt, **kw):
    extra = {"return_token_ids": True, **NOISE, **kw.pop("extra", {})}
    r = client.completions.create(model=engine.model_name, prompt=prompt, extra_body=extra, **kw)
    return r, [c.token_ids for c in r.choices]


def test_responses_plain_streamed_and_continued(served_small, client):
    _, engine, async_engine = served_small
    kw = dict(model=engine.model_name, input="Hi", max_output_tokens=3, temperature=0, extra_body=NOISE)
    plain = client.responses.create(**kw)
    assert plain.object == "response" and plain.status == "incomplete" and plain.usage.output_tokens == 3
    (msg,) = plain.output
    assert msg.type == "message" and msg.content[0].type == "output_text"
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == plain.output_text  # greedy: the same text
    assert client.responses.retrieve(events[-1].response.id).output_text == plain.output_text

    # a continuation: the earlier prompt and reply come from the prefix cache, and the result is the
    # explicit conversation's (the reply is forced to "aaa", which re-tokenizes to the generated ids)
    a = engine.tokenizer.encode("a", add_bos=False)[0]
    first = client.responses.create(
        input="Say a", max_output_tokens=3, temperature=0, extra_body={**NOISE, "logit_bias": {str(a): 100}}
    )
    assert first.output_text == "aaa"
    before = async_engine.metrics()
    second = client.responses.create(
        input="And b?", previous_response_id=first.id, max_output_tokens=2, temperature=0, extra_body=NOISE
    )
    after = async_engine.metrics()
    assert second.previous_response_id == first.id
    computed = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= computed
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= computed
    explicit = [
        {"role": "user", "content": "Say a"},
        {"role": "assistant", "content": "aaa"},
        {"role": "user", "content": "And b?"},
    ]
    third = client.responses.create(input=explicit, max_output_tokens=2, temperature=0, extra_body=NOISE)
    assert third.usage.input_tokens == second.usage.input_tokens and third.output_text == second.output_text


def test_n_two_seeded_choices(served_small, client):
    engine = served_small[1]
    prompt = "two samples of this prompt"
    r, ids = _ids(client, engine, prompt, max_tokens=2, temperature=1.0, seed=11, n=2)
    assert [c.index for c in r.choices] == [0, 1] and all(len(x) == 2 for x in ids)
    assert r.usage.completion_tokens == 4 and ids[0] != ids[1]
    _, again = _ids(client, engine, prompt, max_tokens=2, temperature=1.0, seed=11, n=2)
    _, (alone,) = _ids(client, engine, prompt, max_tokens=2, temperature=1.0, seed=12)
    assert again == ids and alone == ids[1]  # reproducible; choice i is the request with seed + i


def test_penalties_reduce_repeats(served_small, client):
    engine = served_small[1]
    prompt = "Count repeats please"  # its greedy continuation repeats tokens (random weights)
    _, (base,) = _ids(client, engine, prompt, max_tokens=9, temperature=0)
    repeats = len(base) - len(set(base))
    assert repeats >= 2, base  # the precondition the comparison needs
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        kw = {name: 2.0} if name != "repetition_penalty" else {"extra": {name: 2.0}}
        _, (pen,) = _ids(client, engine, prompt, max_tokens=9, temperature=0, **kw)
        assert len(pen) - len(set(pen)) < repeats, (name, pen, base)


def test_logit_bias_forces_and_bans_a_token(served_small, client):
    engine = served_small[1]
    z = engine.tokenizer.encode("z", add_bos=False)[0]
    _, (greedy,) = _ids(client, engine, "Bias", max_tokens=1, temperature=0)
    assert greedy[0] != z
    r, (forced,) = _ids(client, engine, "Bias", max_tokens=3, temperature=1.0, seed=3, logit_bias={str(z): 100})
    assert forced == [z, z, z] and r.choices[0].text == "zzz"
    _, (banned,) = _ids(client, engine, "Bias", max_tokens=1, temperature=0, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]
