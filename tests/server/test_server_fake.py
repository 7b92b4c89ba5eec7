"""Server behaviour that needs known model output: a scripted engine (tests/server/fake_engine.py) behind
the real app and a real uvicorn server. Tool calls, reasoning, prompt rendering, parameter mapping,
logprob shapes, queue-full answers and disconnects."""

import json
import time

import httpx
import openai
import pytest

from dsv41.chat.dsml import render_tool_calls
from dsv41.engine import EngineBusy
from dsv41.server import create_app
from dsv41.server.run import ServerThread
from tests.conftest import optional_import
from tests.server.fake_engine import FakeAsyncEngine, FakeEngine

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
SCRIPT = "The user wants weather.</think>Let me check.\n\n" + render_tool_calls([CALL])
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def server(request):
    """(ServerThread, FakeAsyncEngine); parametrize indirectly with FakeAsyncEngine kwargs."""
    fake = FakeAsyncEngine(**getattr(request, "param", {"script": SCRIPT}))
    with ServerThread(create_app(FakeEngine(), fake)) as srv:
        yield srv, fake


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _prompt_text(fake, k=-1):
    return FakeEngine().tokenizer.decode(fake.requests[k][1])


def test_tool_calls_and_reasoning_non_streamed(server):
    srv, fake = server
    r = _client(srv).chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, reasoning_effort="low", max_tokens=1000
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # the prompt the engine got: tools rendered, thinking mode with effort 50, BOS not doubled
    prompt = _prompt_text(fake)
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert "Reasoning Effort: 50" in prompt
    assert prompt.endswith("<｜Assistant｜><think>")
    assert fake.requests[-1][1][0] == 0 and fake.requests[-1][1][1] != 0
    assert r.usage.prompt_tokens == len(fake.requests[-1][1])
    assert r.usage.completion_tokens == len(FakeEngine().tokenizer.encode(SCRIPT, add_bos=False))
    assert r.usage.prompt_tokens_details.cached_tokens == 2


def test_tool_calls_streamed_match_non_streamed(server):
    srv, fake = server
    chunks = list(
        _client(srv).chat.completions.create(
            model="fake-model",
            messages=USER,
            tools=TOOLS,
            reasoning_effort=60,
            max_tokens=1000,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    deltas = [c.choices[0].delta for c in chunks[:-1]]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert content == "Let me check." and reasoning == "The user wants weather."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


@pytest.mark.parametrize("server", [{"script": "Plain answer.\n\n" + render_tool_calls([CALL])}], indirect=True)
def test_tool_choice_none_and_non_thinking_default(server):
    srv, fake = server
    client = _client(srv)
    r = client.chat.completions.create(
        model="fake-model", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=1000
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.startswith("Plain answer.\n\n<｜DSML｜ calls>")
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    prompt = _prompt_text(fake)
    assert "get_weather" not in prompt and "Reasoning Effort" not in prompt
    assert prompt.endswith("<｜Assistant｜></think>")
    # explicit thinking switch, vLLM style
    client.chat.completions.create(
        model="fake-model", messages=USER, max_tokens=3, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    assert _prompt_text(fake).endswith("<｜Assistant｜><think>")
    assert "Reasoning Effort: 75" in _prompt_text(fake)  # the default effort


@pytest.mark.parametrize("server", [{"script": "Plain answer.\n\n" + render_tool_calls([CALL])}], indirect=True)
def test_named_tool_choice_renders_only_that_tool_and_is_enforced(server):
    optional_import("llguidance")  # a named function is enforced by constrained decoding
    srv, fake = server
    client = _client(srv)
    r = client.chat.completions.create(
        model="fake-model",
        messages=USER,
        tools=TOOLS,
        max_tokens=1000,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Plain answer."
    assert "get_time" not in _prompt_text(fake) and "get_weather" in _prompt_text(fake)
    spec = fake.requests[-1][2].structured  # the engine got the DSML grammar, starting at once (no thinking)
    assert spec is not None and spec.kind == "tool_call" and spec.start_after is None


def test_parameters_reach_the_engine(server):
    srv, fake = server
    _client(srv).chat.completions.create(
        model="fake-model",
        messages=USER,
        temperature=0.3,
        top_p=0.9,
        seed=7,
        stop="xyz",
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=2,
        extra_body={"top_k": 5, "stop_token_ids": [5, 6], "ignore_eos": True},
    )
    p = fake.requests[-1][2]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (0.3, 0.9, 5, 7, 9)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (["xyz"], [5, 6], True, 2)
    _client(srv).completions.create(model="fake-model", prompt=[3, 4, 5], stop=["a", "b"])
    p = fake.requests[-1][2]
    assert fake.requests[-1][1] == [3, 4, 5]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.logprobs) == (1.0, 1.0, 0, 16, ["a", "b"], None)
    # chat without max_tokens gets the rest of the context
    _client(srv).chat.completions.create(model="fake-model", messages=USER)
    assert fake.requests[-1][2].max_tokens == 4096 - len(fake.requests[-1][1])


@pytest.mark.parametrize("server", [{"script": "abcdef"}], indirect=True)
def test_logprob_shapes(server):
    srv, _ = server
    client = _client(srv)
    r = client.chat.completions.create(model="fake-model", messages=USER, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == list("abcdef")
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    r = client.chat.completions.create(model="fake-model", messages=USER, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model="fake-model", messages=USER).choices[0].logprobs is None
    r = client.completions.create(model="fake-model", prompt="x", logprobs=1, max_tokens=4)
    lp = r.choices[0].logprobs
    assert lp.tokens == list("abcd") and lp.text_offset == [0, 1, 2, 3]
    assert all(len(t) == 1 for t in lp.top_logprobs) and len(lp.token_logprobs) == 4
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(model="fake-model", prompt="x", logprobs=0, max_tokens=4, stream=True)
    ]
    assert [t for lp in streamed for t in lp.tokens] == list("abcd")
    assert [o for lp in streamed for o in lp.text_offset] == [0, 1, 2, 3]


@pytest.mark.parametrize("server", [{"busy_exc": EngineBusy("64 requests waiting")}], indirect=True)
def test_queue_full_is_429_with_retry_after(server):
    srv, _ = server
    for stream in (False, True):
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": USER, "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        _client(srv).completions.create(model="fake-model", prompt="hi")
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert "dsv41_requests_rejected_queue_full_total 3" in metrics
    assert 'dsv41_http_responses_total{endpoint="/v1/chat/completions",status="429"} 2' in metrics


@pytest.mark.parametrize("server", [{"script": "x" * 400, "delay": 0.02}], indirect=True)
def test_disconnect_aborts_the_request(server):
    srv, fake = server

    def wait_aborted(n):
        deadline = time.monotonic() + 10
        while len(fake.aborted) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(fake.aborted) == n and not fake.running

    with httpx.Client(base_url=srv.base_url) as client:
        with client.stream("POST", "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert next(line for line in lines if line).startswith("data: ")
        wait_aborted(1)  # mid-stream
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 400}, timeout=0.3)
        wait_aborted(2)  # while a non-streamed request was generating
    assert "dsv41_client_disconnects_total 2" in httpx.get(srv.base_url + "/metrics").text
