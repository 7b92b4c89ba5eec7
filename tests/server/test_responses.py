"""The Responses API (`/v1/responses`) through the official `openai` client: on the real engine (`tiny`,
random weights: text is noise, so text is compared with what chat completions gives for the same
conversation), and on the scripted engine (tests/server/fake_engine.py) where reasoning and tool calls
need known output. Continuations with `previous_response_id` are checked against the explicit
conversation and the engine's prefix-cache counters."""

import json
import threading

import httpx
import openai
import pytest

from dsv41.chat.dsml import render_tool_calls
from dsv41.engine import EngineBusy
from dsv41.server import create_app
from dsv41.server.responses import ResponseStore, StoredResponse, input_messages
from dsv41.server.run import ServerThread
from tests.conftest import optional_import
from tests.server.fake_engine import FakeAsyncEngine, FakeEngine

NOISE = {"ignore_eos": True}  # random weights: a fixed length, whatever is sampled


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def recorded(served, monkeypatch):
    """Every engine request's prompt ids and final output ids, as the server submitted them."""
    async_engine = served[2]
    calls = []
    original = async_engine.generate

    async def generate(request_id, prompt_ids, params, images=None):
        entry = {"prompt": list(prompt_ids), "output": None}
        calls.append(entry)
        async for out in original(request_id, prompt_ids, params, images):
            entry["output"] = list(out.token_ids)
            yield out

    monkeypatch.setattr(async_engine, "generate", generate)
    return calls


def _tokenize(srv, messages, **kw) -> list[int]:
    r = httpx.post(srv.base_url + "/tokenize", json={"messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _shape(output) -> list:
    """Output items without their random ids."""
    items = []
    for item in output:
        d = item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else dict(item)
        d.pop("id", None)
        d.pop("call_id", None)
        items.append(d)
    return items


# ---------------------------------------------------------------------------------------------- real engine


def test_plain_text_matches_chat_completions(served, client, recorded):
    srv, engine, _ = served
    r = client.responses.create(
        model=engine.model_name, input="Hi", max_output_tokens=3, temperature=0, extra_body=NOISE
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == engine.model_name
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    # the prompt is the chat endpoint's for the same conversation, and so is the greedy text
    user = [{"role": "user", "content": "Hi"}]
    assert recorded[-1]["prompt"] == _tokenize(srv, user)
    assert r.usage.input_tokens == len(recorded[-1]["prompt"]) and r.usage.output_tokens == 3
    assert r.usage.total_tokens == r.usage.input_tokens + 3 and r.usage.output_tokens_details.reasoning_tokens == 0
    chat = client.chat.completions.create(
        model=engine.model_name, messages=user, max_tokens=3, temperature=0, extra_body=NOISE
    )
    assert chat.choices[0].message.content == r.output_text
    # input as message items with input_text parts, and instructions as the system turn
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    r2 = client.responses.create(
        input=items, instructions="Be brief.", max_output_tokens=2, temperature=0, extra_body=NOISE
    )
    assert recorded[-1]["prompt"] == _tokenize(srv, [{"role": "system", "content": "Be brief."}] + user)
    assert r2.instructions == "Be brief." and r2.usage.input_tokens == len(recorded[-1]["prompt"])
    # stored: GET returns the same object
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_streaming_events_parse_and_join_to_the_response(served, client):
    _, engine, _ = served
    kw = dict(model=engine.model_name, input="Tell me", max_output_tokens=4, temperature=0, extra_body=NOISE)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(deltas) == final.output_text == plain.output_text
    assert _shape(final.output) == _shape(plain.output)
    assert final.usage.output_tokens == 4 and final.status == "incomplete"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert client.responses.retrieve(final.id).output_text == plain.output_text


def test_raw_stream_has_event_lines(served):
    srv = served[0]
    with httpx.stream(
        "POST",
        srv.base_url + "/v1/responses",
        timeout=60,
        json={"input": "Hi", "max_output_tokens": 2, "stream": True, **NOISE},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    datas = [
        json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert names == [d["type"] for d in datas] and names[0] == "response.created"


def test_previous_response_id_reuses_the_prefix_cache(served, client, recorded):
    srv, engine, async_engine = served
    a = engine.tokenizer.encode("a", add_bos=False)[0]
    # a reply whose text re-tokenizes to the generated ids ("aaaa"), so the continued prompt must also
    # equal the explicit conversation's
    first = client.responses.create(
        input="Say a", max_output_tokens=4, temperature=0, extra_body={**NOISE, "logit_bias": {str(a): 100}}
    )
    assert first.output_text == "aaaa"
    p1, o1 = recorded[-1]["prompt"], recorded[-1]["output"]
    before = async_engine.metrics()
    second = client.responses.create(
        input="And b?", previous_response_id=first.id, max_output_tokens=2, temperature=0, extra_body=NOISE
    )
    after = async_engine.metrics()
    p2 = recorded[-1]["prompt"]
    assert second.previous_response_id == first.id
    assert p2[: len(p1) + len(o1) + 1] == p1 + o1 + [engine.tokenizer.eos_id]
    explicit = (
        [{"role": "user", "content": "Say a"}]
        + [o.model_dump(exclude_none=True) for o in first.output]
        + [{"role": "user", "content": "And b?"}]
    )
    third = client.responses.create(input=explicit, max_output_tokens=2, temperature=0, extra_body=NOISE)
    assert recorded[-1]["prompt"] == p2
    assert third.output_text == second.output_text
    assert p2 == _tokenize(
        srv,
        [
            {"role": "user", "content": "Say a"},
            {"role": "assistant", "content": "aaaa"},
            {"role": "user", "content": "And b?"},
        ],
    )
    # everything the first request computed (prompt and all but its last token) came from the cache
    computed = len(p1) + len(o1) - 1
    assert second.usage.input_tokens_details.cached_tokens >= computed
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= computed
    assert after["prefix_cache_snapshot_hits"] - before["prefix_cache_snapshot_hits"] >= 1


def test_continuation_keeps_the_generated_ids(served, client, recorded):
    """Sampled noise need not re-tokenize to what was generated; the continued prompt keeps the model's
    own ids, so the whole earlier request is a cache hit even then."""
    _, engine, _ = served
    first = client.responses.create(
        input="Noise please", max_output_tokens=6, temperature=1.0, extra_body={**NOISE, "seed": 5}
    )
    p1, o1 = recorded[-1]["prompt"], recorded[-1]["output"]
    second = client.responses.create(input="More", previous_response_id=first.id, max_output_tokens=1, extra_body=NOISE)
    p2 = recorded[-1]["prompt"]
    assert p2[: len(p1) + len(o1) + 1] == p1 + o1 + [engine.tokenizer.eos_id]
    assert second.usage.input_tokens == len(p2)
    assert second.usage.input_tokens_details.cached_tokens >= len(p1) + len(o1) - 1
    # a chain: the third turn continues the second, which holds the first
    third = client.responses.create(
        input="Again", previous_response_id=second.id, max_output_tokens=1, extra_body=NOISE
    )
    assert recorded[-1]["prompt"][: len(p2)] == p2 and third.usage.input_tokens > len(p2)


def test_thinking_mode_renders_the_effort(served, client, recorded):
    srv, engine, _ = served
    a = engine.tokenizer.encode("a", add_bos=False)[0]
    r = client.responses.create(
        input="Think",
        reasoning={"effort": "low"},
        max_output_tokens=3,
        temperature=0,
        extra_body={**NOISE, "logit_bias": {str(a): 100}},
    )
    assert recorded[-1]["prompt"] == _tokenize(srv, [{"role": "user", "content": "Think"}], reasoning_effort="low")
    assert r.reasoning.effort == "low" and r.status == "incomplete"
    # cut off by max_output_tokens before </think>: all of it is reasoning, and there is no answer yet
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].text == "aaa" and item.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == 3 and r.output_text == ""
    none = client.responses.create(input="Think", reasoning={"effort": "none"}, max_output_tokens=1, extra_body=NOISE)
    assert recorded[-1]["prompt"] == _tokenize(srv, [{"role": "user", "content": "Think"}])
    assert [o.type for o in none.output] == ["message"]


def _status_of(exc_info) -> tuple[int, dict]:
    exc = exc_info.value
    return exc.status_code, exc.body


@pytest.mark.parametrize(
    "kw,status,param,code",
    [
        (
            {"input": "Hi", "previous_response_id": "resp_nope"},
            400,
            "previous_response_id",
            "previous_response_not_found",
        ),
        ({"input": [{"type": "bogus"}]}, 400, "input", None),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input", None),
        ({"input": []}, 400, "input", None),
        ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens", None),
        ({"input": "Hi", "max_output_tokens": 100_000}, 400, "input", "context_length_exceeded"),
        ({"input": "Hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", None),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", None),
        ({"input": "Hi", "tool_choice": "auto"}, 400, "tool_choice", None),
        ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format", None),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema", None),
        ({"input": "Hi", "background": True}, 400, "background", None),
        ({"input": "Hi", "temperature": -1}, 400, "temperature", None),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, 400, "input", None),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input", None),
        ({"input": "Hi", "model": "gpt-5"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_input_gets_openai_errors(served, client, kw, status, param, code):
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(**kw)
    got, body = _status_of(info)
    assert got == status, body
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["code"] == code
    with pytest.raises(openai.APIStatusError) as info:  # streamed: refused before the stream starts
        client.responses.create(**kw, stream=True)
    assert _status_of(info)[0] == status


@pytest.mark.parametrize(
    "body",
    [
        b'{"input": ',
        {"input": 12},
        {},
        {"input": "x", "tools": "x"},
        {"input": "x", "previous_response_id": ""},
        {"input": [["nested"]]},
    ],
)
def test_malformed_bodies_are_400(served, body):
    srv = served[0]
    if isinstance(body, bytes):
        r = httpx.post(srv.base_url + "/v1/responses", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_store_false_get_delete_and_unknown_ids(served, client):
    srv, _, _ = served
    r = client.responses.create(input="Hi", max_output_tokens=1, store=False, extra_body=NOISE)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input="Hi", previous_response_id=r.id, max_output_tokens=1)
    kept = client.responses.create(input="Hi", max_output_tokens=1, extra_body=NOISE)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(kept.id)
    assert info.value.body["code"] == "not_found"
    assert httpx.delete(srv.base_url + f"/v1/responses/{kept.id}").status_code == 404


def test_bad_responses_requests_do_not_affect_a_bystander(served, client):
    _, engine, _ = served
    kw = dict(
        model=engine.model_name,
        messages=[{"role": "user", "content": "bystander"}],
        max_tokens=4,
        temperature=0,
        extra_body=NOISE,
    )
    alone = client.chat.completions.create(**kw).choices[0].message.content
    results, statuses, errors = [], [], []

    def good():
        try:
            results.append(client.chat.completions.create(**kw).choices[0].message.content)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def bad():
        for body in (
            {"input": [{"type": "bogus"}]},
            {"input": "x", "previous_response_id": "resp_x"},
            {"input": "x", "max_output_tokens": -3},
            {"input": "x", "stream": True, "tool_choice": "required"},
        ):
            statuses.append(httpx.post(served[0].base_url + "/v1/responses", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=good), threading.Thread(target=bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [alone]
    assert statuses == [400, 400, 400, 400]


# ---------------------------------------------------------------------------------------------- scripted engine

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
SCRIPT = "The user wants weather.</think>Let me check.\n\n" + render_tool_calls([CALL])
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]


@pytest.fixture
def scripted(request):
    """(openai client, FakeAsyncEngine, ServerThread); parametrize indirectly with FakeAsyncEngine kwargs."""
    fake = FakeAsyncEngine(**getattr(request, "param", {"script": SCRIPT}))
    with ServerThread(create_app(FakeEngine(), fake, max_stored_responses=3)) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=30), fake, srv


def _prompt(fake, k=-1) -> str:
    return FakeEngine().tokenizer.decode(fake.requests[k][1])


def test_reasoning_and_function_call_items(scripted):
    client, fake, _ = scripted
    r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=TOOLS, reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == "The user wants weather."
    assert message.content[0].text == "Let me check." and r.output_text == "Let me check."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed" and r.status == "completed"
    assert r.usage.output_tokens_details.reasoning_tokens == len("The user wants weather.")  # one byte a token
    prompt = _prompt(fake)
    assert "Reasoning Effort: 50" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert prompt.endswith("<｜Assistant｜><think>")

    events = list(
        client.responses.create(
            model="fake-model", input="Weather in Paris?", tools=TOOLS, reasoning={"effort": "low"}, stream=True
        )
    )
    final = events[-1].response
    assert events[-1].type == "response.completed" and _shape(final.output) == _shape(r.output)
    by_type = {}
    for e in events:
        by_type.setdefault(e.type, []).append(e)
    assert "".join(e.delta for e in by_type["response.reasoning_text.delta"]) == "The user wants weather."
    assert by_type["response.reasoning_text.done"][0].text == "The user wants weather."
    assert "".join(e.delta for e in by_type["response.output_text.delta"]) == "Let me check."
    (args_done,) = by_type["response.function_call_arguments.done"]
    assert json.loads(args_done.arguments) == {"city": "Paris"} and args_done.output_index == 2
    assert [e.item.type for e in by_type["response.output_item.done"]] == ["reasoning", "message", "function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_tool_loop_with_previous_response_id_equals_explicit_input(scripted):
    client, fake, _ = scripted
    first = client.responses.create(input="Weather in Paris?", tools=TOOLS, reasoning={"effort": "high"})
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    client.responses.create(previous_response_id=first.id, input=[result], tools=TOOLS, reasoning={"effort": "high"})
    continued = _prompt(fake)
    assert "<tool_result>sunny, 21 C</tool_result>" in continued
    assert continued.count('invoke name="get_weather"') == 1  # the earlier call is in the assistant turn
    assert "The user wants weather.</think>Let me check." in continued  # with tools, reasoning is kept
    explicit = (
        [{"role": "user", "content": "Weather in Paris?"}]
        + [o.model_dump(exclude_none=True) for o in first.output]
        + [result]
    )
    client.responses.create(input=explicit, tools=TOOLS, reasoning={"effort": "high"})
    assert _prompt(fake) == continued


@pytest.mark.parametrize("scripted", [{"script": "Plain answer.\n\n" + render_tool_calls([CALL])}], indirect=True)
def test_tool_choice_none(scripted):
    client, fake, _ = scripted
    r = client.responses.create(input="Weather?", tools=TOOLS, tool_choice="none")
    assert '"name": "get_weather"' not in _prompt(fake) and [o.type for o in r.output] == ["message"]


@pytest.mark.parametrize("scripted", [{"script": "Plain answer.\n\n" + render_tool_calls([CALL])}], indirect=True)
def test_tool_choice_named(scripted):
    """A named function is enforced by a grammar, so it needs the structured extra (llguidance); without
    it the server answers 400 naming the extra (tests/server/test_structured_outputs.py)."""
    optional_import("llguidance")
    client, fake, _ = scripted
    r = client.responses.create(input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_time"})
    assert '"name": "get_time"' in _prompt(fake) and '"name": "get_weather"' not in _prompt(fake)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.tool_choice.name == "get_time"


def test_store_is_a_bounded_lru(scripted):
    client, _, _ = scripted  # max_stored_responses=3
    ids = [client.responses.create(input=f"q{k}").id for k in range(3)]
    client.responses.retrieve(ids[0])  # now the most recent: ids[1] is the oldest
    ids.append(client.responses.create(input="q3").id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    assert [client.responses.retrieve(i).id for i in (ids[0], ids[2], ids[3])] == [ids[0], ids[2], ids[3]]


# ---------------------------------------------------------------------------------------------- conversions


def test_input_items_to_messages():
    items = [
        {"role": "developer", "content": "Rules."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Calling."}],
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]
    with pytest.raises(ValueError, match=r"input\[0\]\.type"):
        input_messages([{"type": "item_reference", "id": "x"}])


def test_response_store_unit():
    store = ResponseStore(2)

    def entry(i):
        return StoredResponse({"id": f"r{i}"}, [], [], [], "stop")

    for i in range(3):
        store.put(entry(i))
    assert store.get("r0") is None and len(store) == 2 and store.get("r2").response["id"] == "r2"
    assert store.delete("r1") and not store.delete("r1")
    empty = ResponseStore(0)
    empty.put(entry(0))
    assert empty.get("r0") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_serve_option_sets_the_store_size(monkeypatch):
    import dsv41.cli as cli
    import dsv41.server.run as run

    got = {}
    monkeypatch.setattr(run, "serve", lambda model, **kw: got.update(kw))
    assert cli.cmd_serve(cli.build_parser().parse_args(["serve", "tiny", "--max-stored-responses", "0"])) == 0
    assert got["max_stored_responses"] == 0
    assert cli.build_parser().parse_args(["serve", "tiny"]).max_stored_responses == 256
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "tiny", "--max-stored-responses", "-1"])


class _FailingEngine(FakeAsyncEngine):
    """Generates "A", then fails in the engine (finish_reason "error")."""

    async def generate(self, request_id, prompt_token_ids, params, images=None):
        from dsv41.engine.types import RequestOutput

        self.requests.append((request_id, list(prompt_token_ids), params))
        yield RequestOutput(request_id, [65], "A", [65], "A", num_prompt_tokens=len(prompt_token_ids))
        yield RequestOutput(request_id, [], "", [65], "A", finished=True, finish_reason="error", error="boom")


def test_engine_failure_mid_stream_is_an_error_event_and_nothing_is_stored():
    with ServerThread(create_app(FakeEngine(), _FailingEngine())) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        seen = []
        with pytest.raises(openai.APIError) as info:
            for event in client.responses.create(input="Hi", stream=True):
                seen.append(event)
        assert "internal error" in info.value.message
        assert [e.type for e in seen][:2] == ["response.created", "response.in_progress"]
        assert [e.delta for e in seen if e.type == "response.output_text.delta"] == ["A"]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(seen[0].response.id)
        with pytest.raises(openai.InternalServerError):
            client.responses.create(input="Hi")
        with httpx.stream("POST", srv.base_url + "/v1/responses", json={"input": "Hi", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        i = lines.index("event: error")
        assert json.loads(lines[i + 1][len("data: ") :])["error"]["code"] == "internal_error"


@pytest.mark.parametrize("scripted", [{"busy_exc": EngineBusy("64 requests waiting")}], indirect=True)
def test_full_queue_is_a_429(scripted):
    client, _, _ = scripted
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError):
            client.responses.create(input="Hi", stream=stream)


def test_continued_prompt_splices_only_where_the_turn_renders_as_it_stood():
    from dsv41.server.chat import build_chat_prompt
    from dsv41.server.responses import continued_prompt

    tok = FakeEngine().tokenizer
    eos = tok.eos_id
    q1, q2 = [{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]
    turn = [{"role": "assistant", "content": "xy"}]
    generated = [300, 301]  # what the model "generated" for "xy": not what re-tokenizing "xy" gives

    def case(finish, output, *, thinking=False, tools=None, system=(), earlier_system=()):
        kw = dict(thinking=thinking, effort=75 if thinking else None, tools=tools)
        rendered1 = build_chat_prompt(tok, list(earlier_system) + q1, **kw)
        previous = StoredResponse({"id": "r"}, q1 + turn, rendered1, output, finish, rendered1)
        messages = list(system) + q1 + turn + q2
        prompt, full = continued_prompt(tok, messages, list(system) + q1 + turn, previous, token_limit=None, **kw)
        assert full == build_chat_prompt(tok, messages, **kw)
        return prompt, full, rendered1

    prompt, full, p1 = case("stop", generated + [eos])
    head = build_chat_prompt(tok, q1 + turn, add_generation_prompt=False, thinking=False, effort=None, tools=None)
    assert prompt == p1 + generated + [eos] + full[len(head) :] and prompt != full
    prompt, full, p1 = case("length", generated)  # cut off: the turn is closed by EOS as rendered
    assert prompt == p1 + generated + [eos] + full[len(head) :]
    tools = [{"type": "function", "function": {"name": "f"}}]
    prompt, full, p1 = case("stop", generated + [eos], thinking=True, tools=tools)  # tools keep reasoning
    assert prompt[: len(p1) + 3] == p1 + generated + [eos]
    # the plain rendering where the earlier turn is rendered differently now, or its end is unknown
    assert case("stop", generated + [eos], thinking=True)[0] == case("stop", generated + [eos], thinking=True)[1]
    assert case("stop", generated + [7])[0] == case("stop", generated + [7])[1]  # ended on a stop string
    system = [{"role": "system", "content": "new rules"}]
    prompt, full, _ = case("stop", generated + [eos], system=system)
    assert prompt == full
    prompt, full, p1 = case("stop", generated + [eos], system=system, earlier_system=system)  # same instructions
    assert prompt[: len(p1) + 3] == p1 + generated + [eos] and prompt != full


# ---------------------------------------------------------------------------------------------- constrained
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "size"],
    "properties": {"name": {"type": "string", "maxLength": 4}, "size": {"enum": ["S", "M", "L"]}},
}
TOOL = {
    "type": "function",
    "name": "book",
    "parameters": {
        "type": "object",
        "required": ["who", "seats"],
        "properties": {
            "who": {"type": "string", "maxLength": 3},
            "seats": {"type": "array", "items": {"enum": ["A1", "B2"]}, "minItems": 1, "maxItems": 2},
        },
    },
}


@pytest.fixture(scope="module")
def constrained_client():
    """tiny with a 4,096-token context (a tools system prompt alone is over 1,000 byte tokens), llguidance
    required."""
    optional_import("llguidance")
    from dsv41.engine import EngineConfig, build_engine

    engine = build_engine("tiny", EngineConfig(kv_pool_tokens=16384, max_model_len=4096), seed=0)
    with ServerThread(create_app(engine, max_waiting=16)) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_format_json_schema_is_enforced(constrained_client):
    """Random weights write noise; with text.format json_schema every reply parses and validates."""
    jsonschema = optional_import("jsonschema")
    fmt = {"type": "json_schema", "name": "item", "schema": SCHEMA, "strict": True}
    for seed in (1, 2):
        r = constrained_client.responses.create(
            input="Reply in JSON.",
            text={"format": fmt},
            temperature=1.0,
            max_output_tokens=120,
            extra_body={"seed": seed},
        )
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"


# grammar-enforced calls from random weights decode hundreds of noise tokens after a ~1,100-token tools prompt
# (~17 s on one core): the slow tier. In the default tier, test_tool_choice_named (scripted) checks the Responses
# tool_choice's prompt and function_call items, and tests/server/test_structured_outputs.py the real engine's
# enforced calls validating
@pytest.mark.slow
def test_tool_choice_required_gives_a_valid_function_call(constrained_client):
    jsonschema = optional_import("jsonschema")
    for choice in ("required", {"type": "function", "name": "book"}):
        r = constrained_client.responses.create(
            input="Book a seat.",
            tools=[TOOL],
            tool_choice=choice,
            temperature=1.0,
            max_output_tokens=600,
            extra_body={"seed": 3},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        # "required": one call or more (parallel calls allowed by default); a named function: exactly one
        assert calls and (choice == "required" or len(calls) == 1), r.output
        for call in calls:
            assert call.name == "book"
            jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
