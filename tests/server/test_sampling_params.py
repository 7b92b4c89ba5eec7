"""n, best_of, the penalties, logit_bias, min_tokens and min_p through the official `openai` client against
the real engine (`tiny` preset, random weights). Each effect is measured against the same request without
the parameter; token ids come back with vLLM's `return_token_ids`. Budgets are a few tokens: the tiny
model decodes slowly on a shared CPU."""

import httpx
import openai
import pytest

from tests.server.test_server import _wait_idle

EOS = 1  # the tiny preset's eos_token_id
PROMPT = "Count repeats please"  # greedy continuation repeats tokens (random weights)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ids(client, engine, prompt=PROMPT, **kw):
    extra = {"return_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})}
    r = client.completions.create(model=engine.model_name, prompt=prompt, extra_body=extra, **kw)
    return r, [c.token_ids for c in r.choices]


def test_logit_bias_forces_and_bans_tokens(served, client):
    engine = served[1]
    _, (greedy,) = _ids(client, engine, max_tokens=2, temperature=0)
    _, (forced,) = _ids(client, engine, max_tokens=3, temperature=1.0, seed=3, logit_bias={"777": 100})
    assert forced == [777, 777, 777] and greedy[0] != 777
    _, (banned,) = _ids(client, engine, max_tokens=1, temperature=0, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]


def test_penalties_reduce_repeats(served, client):
    engine = served[1]
    _, (base,) = _ids(client, engine, max_tokens=10, temperature=0)
    repeats = len(base) - len(set(base))
    assert repeats >= 3, base  # the precondition the comparison needs
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        kw = {name: 2.0} if name != "repetition_penalty" else {"extra": {name: 2.0}}
        _, (pen,) = _ids(client, engine, max_tokens=10, temperature=0, **kw)
        assert len(pen) - len(set(pen)) < repeats, (name, pen, base)
        if name != "repetition_penalty":  # nothing generated yet: the first token cannot change
            assert pen[0] == base[0]


def test_min_tokens_holds_back_eos_and_stop_ids(served, client):
    engine = served[1]
    # EOS pushed to the top: without min_tokens the request ends at once
    r, (ids,) = _ids(
        client, engine, max_tokens=8, temperature=0, logit_bias={str(EOS): 100}, extra={"ignore_eos": False}
    )
    assert ids == [EOS] and r.choices[0].finish_reason == "stop"
    r, (ids,) = _ids(
        client,
        engine,
        max_tokens=8,
        temperature=0,
        logit_bias={str(EOS): 100},
        extra={"ignore_eos": False, "min_tokens": 4},
    )
    assert len(ids) == 5 and ids[-1] == EOS and EOS not in ids[:4] and r.choices[0].finish_reason == "stop"
    # a stop id likewise, at temperature 1
    r, (ids,) = _ids(
        client,
        engine,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        logit_bias={"500": 100},
        extra={"stop_token_ids": [500], "min_tokens": 3},
    )
    assert len(ids) == 4 and ids[-1] == 500 and 500 not in ids[:3]


def test_n_choices_share_the_prompt_and_are_seeded(served, client):
    _, engine, async_engine = served
    prompt = "n choices share one prefill of this prompt, " * 3  # > 2 KV blocks, not seen before
    before = async_engine.metrics()
    r, ids = _ids(client, engine, prompt, max_tokens=3, temperature=1.0, seed=11, n=3)
    after = async_engine.metrics()
    assert [c.index for c in r.choices] == [0, 1, 2] and all(len(x) == 3 for x in ids)
    assert r.usage.completion_tokens == 9 and r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
    assert len({tuple(x) for x in ids}) > 1  # different seeds, different samples
    # choices 1 and 2 computed no prompt token: all of the prompt came from choice 0's cache
    n_prompt = r.usage.prompt_tokens
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 2 * n_prompt
    assert after["prefix_cache_snapshot_hits"] - before["prefix_cache_snapshot_hits"] >= 2
    # reproducible, and choice i is the request with seed + i on its own
    _, again = _ids(client, engine, prompt, max_tokens=3, temperature=1.0, seed=11, n=3)
    _, (alone,) = _ids(client, engine, prompt, max_tokens=3, temperature=1.0, seed=12)
    assert again == ids and alone == ids[1]


def test_n_streamed_chat_equals_non_streamed(served, client):
    engine = served[1]
    kw = dict(
        model=engine.model_name,
        messages=[{"role": "user", "content": "two please"}],
        max_tokens=3,
        temperature=1.0,
        seed=4,
        n=2,
    )
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.chat.completions.create(**kw, extra_body=extra)
    assert [c.index for c in r.choices] == [0, 1]
    streamed = {0: [], 1: []}
    finishes = {}
    for chunk in client.chat.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == {i: c.token_ids for i, c in enumerate(r.choices)}
    assert finishes == {0: "length", 1: "length"}
    # the legacy endpoint likewise, usage over both choices in the last chunk
    _, ids = _ids(client, engine, max_tokens=3, temperature=1.0, seed=4, n=2)
    streamed, usage = {0: [], 1: []}, None
    for chunk in client.completions.create(
        model=engine.model_name,
        prompt=PROMPT,
        max_tokens=3,
        temperature=1.0,
        seed=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
        usage = chunk.usage or usage
    assert [streamed[0], streamed[1]] == ids and usage.completion_tokens == 6


def test_disconnect_mid_stream_aborts_every_choice(served):
    srv, _, async_engine = served
    _wait_idle(async_engine)
    before = async_engine.metrics()
    with httpx.stream(
        "POST",
        srv.base_url + "/v1/completions",
        timeout=60,
        json={"prompt": "three long stories", "max_tokens": 1000, "ignore_eos": True, "n": 3, "stream": True},
    ) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    m = _wait_idle(async_engine)  # all three stopped long before their 1000 tokens
    assert m["requests_finished_total"] == before["requests_finished_total"] + 3
    assert m["generation_tokens_total"] - before["generation_tokens_total"] < 300
    assert m["kv_blocks_used"] == before["kv_blocks_used"]


def test_best_of_returns_the_choices_with_the_best_mean_logprob(served, client):
    engine = served[1]
    kw = dict(max_tokens=3, temperature=1.5, seed=21)
    r, all_ids = _ids(client, engine, n=3, logprobs=0, **kw)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in r.choices]
    best = max(range(3), key=lambda i: means[i])
    b, (picked,) = _ids(client, engine, n=1, extra={"best_of": 3}, **kw)
    assert picked == all_ids[best] and b.choices[0].logprobs is None
    assert b.usage.completion_tokens == 9  # every generated sequence counts


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"logit_bias": {"1024": 5}}, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_input_is_a_400_in_openai_shape(served, body, param):
    r = httpx.post(served[0].base_url + "/v1/completions", json={"prompt": "x", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_serve_option_sets_the_cap_on_choices(monkeypatch):
    import dsv41.cli as cli
    import dsv41.server.run as run

    got = {}
    monkeypatch.setattr(run, "serve", lambda model, **kw: got.update(kw))
    assert cli.cmd_serve(cli.build_parser().parse_args(["serve", "tiny", "--max-choices", "4"])) == 0
    assert got["max_choices"] == 4
    assert cli.build_parser().parse_args(["serve", "tiny"]).max_choices == 16


def test_parameters_reach_the_engine_once_per_choice():
    """The scripted engine records each engine request: one per choice, seeds seed + i, the processing
    parameters as sent; a 429 for a later choice aborts the choices already started."""
    from dsv41.engine import EngineBusy
    from dsv41.server import create_app
    from dsv41.server.run import ServerThread
    from tests.server.fake_engine import FakeAsyncEngine, FakeEngine

    fake = FakeAsyncEngine("abc")
    with ServerThread(create_app(FakeEngine(), fake)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "x"}],
            n=3,
            seed=2**63 - 2,
            max_tokens=3,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            logit_bias={"7": -3, "9": 100},
            extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 2},
        )
        assert [c.message.content for c in r.choices] == ["abc"] * 3 and r.usage.completion_tokens == 9
        params = [p for _, _, p in fake.requests]
        assert [p.seed for p in params] == [2**63 - 2, 2**63 - 1, 0]  # seed + i, wrapped into [0, 2**63)
        p = params[0]
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (
            0.5,
            -0.25,
            1.5,
            0.1,
            2,
        )
        assert p.logit_bias == {7: -3.0, 9: 100.0}
        assert len({rid for rid, _, _ in fake.requests}) == 3
    busy = FakeAsyncEngine("abc", delay=0.2)
    calls = []
    real = busy.generate

    def generate(request_id, prompt, params, images=None):  # the third choice finds the queue full
        calls.append(request_id)
        if len(calls) < 3:
            return real(request_id, prompt, params, images)

        async def refused():
            raise EngineBusy("full")
            yield  # an async generator, as AsyncEngine.generate is

        return refused()

    busy.generate = generate
    with ServerThread(create_app(FakeEngine(), busy)) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 3}, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert sorted(busy.aborted) == sorted(calls[:2]) and not busy.running
