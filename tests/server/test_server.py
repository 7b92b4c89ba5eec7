"""The OpenAI-compatible server on the real engine (`tiny` preset, random weights, so the text is noise):
driven with the official `openai` client and raw httpx against uvicorn on a free port. Checks structure,
token counts, streaming, the prefix cache through `cached_tokens`, concurrency, errors, metrics and
abort on disconnect. Token budgets are small: the tiny model decodes a few tokens/s per request on CPU."""

import json
import threading
import time

import httpx
import openai
import pytest

from dsv41.engine import AsyncEngine, EngineConfig, build_engine
from dsv41.server import create_app
from dsv41.server.run import ServerThread

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(srv, path, body, **kw):
    if isinstance(body, (dict, list)):
        return httpx.post(srv.base_url + path, json=body, timeout=60, **kw)
    return httpx.post(srv.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def _wait_idle(async_engine, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = async_engine.metrics()
        if m["running"] == 0 and m["waiting"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {async_engine.metrics()}")


def test_models_and_health(served, client):
    srv, engine, _ = served
    (model,) = client.models.list().data
    assert model.id == engine.model_name and model.object == "model"
    assert client.models.retrieve(engine.model_name).id == engine.model_name
    assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}
    r = httpx.get(srv.base_url + "/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_server_reports_its_numerics_mode(served):
    """Which guarantee a reply's bits come with: the model card and a Prometheus info metric say the mode."""
    srv, engine, _ = served
    assert engine.config.numerics == "fast"
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["numerics"] == "fast"
    assert 'dsv41_numerics_info{mode="fast"} 1.0' in httpx.get(srv.base_url + "/metrics").text


def test_a_deterministic_server_says_so():
    engine = build_engine(
        "tiny", EngineConfig(kv_pool_tokens=2048, max_model_len=256, numerics="deterministic", fused_kernels="off")
    )
    app = create_app(engine)
    with ServerThread(app) as srv:
        assert httpx.get(srv.base_url + f"/v1/models/{engine.model_name}").json()["numerics"] == "deterministic"
        assert 'dsv41_numerics_info{mode="deterministic"} 1.0' in httpx.get(srv.base_url + "/metrics").text


def test_completion_counts_logprobs_and_token_prompts(served, client):
    srv, engine, _ = served
    prompt = "The capital of France is"
    r = client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt)) and r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert all(max(t.values()) >= v - 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))

    ids = engine.tokenizer.encode(prompt)
    r = client.completions.create(
        model=engine.model_name, prompt=ids, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2


def test_streaming_equals_non_streaming_and_prefix_cache_hits(served, client):
    _, engine, _ = served
    # > one KV block (64 tokens) of identical prompt, so the repeat can be served from the prefix cache
    prompt = "A long shared preamble that fills more than one KV block. " * 3
    kw = dict(model=engine.model_name, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 3
    assert usage.prompt_tokens_details.cached_tokens > 0  # the second run reused the first one's KV
    assert "".join(c.choices[0].text for c in chunks[:-1]) == first.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_non_streamed_and_streamed(served, client):
    _, engine, _ = served
    r = client.chat.completions.create(
        model=engine.model_name, messages=USER, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    msg = r.choices[0].message
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and msg.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert isinstance(msg.content, str) and getattr(msg, "reasoning_content", None) is None

    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_raw_sse_framing(served):
    srv, _, _ = served
    with httpx.stream(
        "POST",
        srv.base_url + "/v1/chat/completions",
        timeout=60,
        json={"messages": USER, "max_tokens": 2, "stream": True, "ignore_eos": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert "usage" not in payloads[0]  # only with stream_options.include_usage
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b'{"messages": [', 400, None),
        ({"messages": USER, "temperature": "hot"}, 400, "temperature"),
        ({"messages": "hello"}, 400, "messages"),
        ({"prompt": "x"}, 400, "messages"),
        ({"model": "gpt-4", "messages": USER}, 404, "model"),
        ({"messages": USER, "n": 17}, 400, "n"),
        ({"messages": USER, "max_tokens": 100_000}, 400, "messages"),
        ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": USER, "top_p": 0}, 400, "top_p"),
        ({"messages": USER, "temperature": -0.5}, 400, "temperature"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
        ({"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"messages": USER, "seed": -1}, 400, "seed"),
        ({"messages": USER, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ({"messages": USER, "reasoning_effort": 0}, 400, "reasoning_effort"),
        ({"messages": USER, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ({"messages": USER, "tool_choice": "auto"}, 400, "tool_choice"),
        ({"messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"messages": USER, "logit_bias": {"1": -100.5}}, 400, "logit_bias"),
        ({"messages": USER, "logit_bias": {"100000000": 1}}, 400, "logit_bias"),
    ],
)
def test_chat_errors_have_openai_shape(served, body, status, param):
    r = _post(served[0], "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": [1] * 2000, "max_tokens": 1}, "prompt", "context_length_exceeded"),
        ({"prompt": "hi", "max_tokens": 1024}, "prompt", "context_length_exceeded"),
        ({"prompt": [5, 99999]}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": ["a", "b"]}, "prompt", None),
        ({"prompt": "hi", "logprobs": 30}, "logprobs", None),
        ({"prompt": "hi", "echo": True}, "echo", None),
    ],
)
def test_completion_errors(served, body, param, code):
    r = _post(served[0], "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == code


def test_unknown_route_and_method(served):
    srv = served[0]
    r = httpx.get(srv.base_url + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(srv.base_url + "/v1/chat/completions").status_code == 405


def test_concurrent_clients_and_bad_requests_do_not_interfere(served, client):
    _, engine, async_engine = served
    results, errors, bad_statuses = {}, [], []

    def good(k):
        try:
            r = client.chat.completions.create(
                model=engine.model_name,
                max_tokens=3 + k % 2,
                seed=k,
                messages=[{"role": "user", "content": f"question {k}"}],
                extra_body={"ignore_eos": True},
            )
            results[k] = r
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def bad():
        try:  # statuses are asserted in the main thread: an assert in a worker thread only warns
            for body in ({"messages": USER, "temperature": -1}, b"{oops", {"messages": USER, "n": 99}):
                r = _post(served[0], "/v1/chat/completions", body)
                bad_statuses.append((r.status_code, r.json()["error"]["type"]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=good, args=(k,)) for k in range(4)] + [threading.Thread(target=bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors and sorted(results) == [0, 1, 2, 3]
    assert bad_statuses == [(400, "invalid_request_error")] * 3
    for k, r in results.items():
        assert r.usage.completion_tokens == 3 + k % 2 and r.choices[0].finish_reason == "length"
    assert len({r.id for r in results.values()}) == 4
    _wait_idle(async_engine)


def test_client_disconnect_mid_stream_frees_the_slot(served):
    srv, _, async_engine = served
    _wait_idle(async_engine)
    before = async_engine.metrics()
    with httpx.stream(
        "POST",
        srv.base_url + "/v1/completions",
        timeout=60,
        json={"prompt": "tell me a long story", "max_tokens": 1000, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert async_engine.metrics()["running"] == 1
    m = _wait_idle(async_engine)  # the engine stopped the request long before its 1000 tokens
    assert m["requests_finished_total"] == before["requests_finished_total"] + 1
    assert m["generation_tokens_total"] - before["generation_tokens_total"] < 500
    assert m["kv_blocks_used"] == before["kv_blocks_used"]
    assert "dsv41_client_disconnects_total 1" in httpx.get(srv.base_url + "/metrics").text


def test_metrics_after_traffic(served):
    text = httpx.get(served[0].base_url + "/metrics").text
    assert text.startswith("# HELP ")
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["dsv41_generation_tokens_total"]) > 0
    assert float(values["dsv41_prompt_tokens_total"]) > 0
    assert 0 <= float(values["dsv41_kv_cache_usage_ratio"]) <= 1
    assert float(values["dsv41_prefix_cache_hit_tokens_total"]) > 0
    assert 0 < float(values["dsv41_prefix_cache_hit_rate"]) <= 1
    assert float(values['dsv41_http_responses_total{endpoint="/v1/chat/completions",status="400"}']) >= 3
    assert float(values["dsv41_time_to_first_token_seconds_count"]) > 0


def test_full_queue_answers_429():
    """A separate engine that runs one sequence and queues at most one more: with one request running
    and one waiting, a third is refused with 429 + Retry-After; the others are unaffected."""
    engine = build_engine("tiny", EngineConfig(kv_pool_tokens=4096, max_num_seqs=1), seed=0)
    async_engine = AsyncEngine(engine, max_waiting=1)
    app = create_app(engine, async_engine)
    async_engine.start()
    try:
        with ServerThread(app) as srv:
            queued = {}

            def second():
                queued["r"] = httpx.post(
                    srv.base_url + "/v1/completions",
                    timeout=60,
                    json={"prompt": "y", "max_tokens": 2, "ignore_eos": True},
                )

            body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r1:
                assert r1.status_code == 200
                t = threading.Thread(target=second)
                t.start()
                # wait until the engine itself reports the second request as waiting (a refreshed
                # count: two more steps with it queued), not only the submission counter
                deadline = time.monotonic() + 10
                steps = None
                while time.monotonic() < deadline:
                    m = async_engine.metrics()
                    if m["waiting"] < 1:
                        steps = None
                    elif steps is None:
                        steps = m["steps_total"]
                    elif m["steps_total"] >= steps + 2:
                        break
                    time.sleep(0.01)
                r3 = httpx.post(srv.base_url + "/v1/completions", json=dict(body, max_tokens=2), timeout=60)
                assert r3.status_code == 429, r3.text
                assert int(r3.headers["retry-after"]) >= 1
                assert r3.json()["error"] == {
                    "message": "The server's request queue is full; retry later (1 requests are already waiting).",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "queue_full",
                }
            # closing the first stream aborts it, so the queued request runs
            t.join(60)
            assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 2
            _wait_idle(async_engine)
    finally:
        async_engine.shutdown()
