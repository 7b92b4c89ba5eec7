"""Structured outputs and enforced tool choice through the official `openai` client against the real
engine (`tiny` preset, random weights: unconstrained output is noise, so every valid reply is the
grammar's doing). Every reply is validated against its schema; bad grammars are 400s in OpenAI's error
shape while a bystander streams on; without llguidance a constrained request is a 400 saying what to
install (issue 34 items 1, 2, 6)."""

import json
import re
import sys
import threading

import httpx
import openai
import pytest

from dsv41.chat.dsml import parse_assistant_output
from dsv41.server import create_app
from dsv41.server.run import ServerThread
from dsv41.tokenizer import THINK_END_TOKEN
from tests.conftest import optional_import
from tests.server.fake_engine import FakeAsyncEngine, FakeEngine
from tests.server.test_hardening import _stream_tokens

USER = [{"role": "user", "content": "Reply in JSON."}]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "size", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "required": ["city", "days"],
                "properties": {
                    "city": {"type": "string", "maxLength": 3},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"enum": ["c", "f"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "required": ["who", "seats"],
                "properties": {
                    "who": {
                        "type": "object",
                        "required": ["first"],
                        "additionalProperties": False,
                        "properties": {"first": {"type": "string", "maxLength": 3}, "vip": {"type": "boolean"}},
                    },
                    "seats": {"type": "array", "items": {"enum": ["A1", "B2"]}, "minItems": 1, "maxItems": 2},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(served):
    optional_import("llguidance")
    return _client(served[0])


@pytest.fixture(scope="module")
def tool_server():
    """(ServerThread, engine, client): tiny with a 4,096-token context (the tools' system prompt alone is
    over 1,000 byte tokens)."""
    optional_import("llguidance")
    from dsv41.engine import EngineConfig, build_engine

    engine = build_engine("tiny", EngineConfig(kv_pool_tokens=16384, max_model_len=4096), seed=0)
    with ServerThread(create_app(engine, max_waiting=16)) as srv:
        yield srv, engine, _client(srv)


def _valid(value, schema) -> None:
    jsonschema = optional_import("jsonschema")
    jsonschema.validate(value, schema)


def test_json_schema_replies_always_validate(served, client):
    free = client.chat.completions.create(model=served[1].model_name, messages=USER, max_tokens=30, seed=1)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # unconstrained: noise
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model=served[1].model_name, messages=USER, max_tokens=150, seed=1, n=3, temperature=1.0, response_format=fmt
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        _valid(json.loads(c.message.content), SCHEMA)
    # reproducible with the seed
    again = client.chat.completions.create(
        model=served[1].model_name, messages=USER, max_tokens=150, seed=1, n=3, temperature=1.0, response_format=fmt
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_json_object_and_streaming(served, client):
    schema = {
        "type": "object",
        "properties": {"k": {"type": "boolean"}},
        "required": ["k"],
        "additionalProperties": False,
    }
    stream = client.chat.completions.create(
        model=served[1].model_name,
        messages=USER,
        max_tokens=60,
        seed=4,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "k", "schema": schema}},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    _valid(json.loads(text), schema)
    r = client.completions.create(
        model=served[1].model_name,
        prompt="{",
        max_tokens=300,
        seed=2,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    if r.choices[0].finish_reason == "stop":  # free-form JSON can outrun any budget; what ends is an object
        assert isinstance(json.loads(r.choices[0].text), dict)


def test_choice_regex_and_grammar(served, client):
    name = served[1].model_name
    r = client.completions.create(
        model=name,
        prompt="Pick one:",
        max_tokens=10,
        n=4,
        seed=7,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(
        model=name,
        prompt="A date:",
        max_tokens=20,
        n=2,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}},
    )
    assert all(re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", c.text) for c in r.choices), [c.text for c in r.choices]
    lark = 'start: "(" num ("+" num)? ")"\nnum: /[1-9][0-9]?/'
    r = client.chat.completions.create(
        model=name, messages=USER, max_tokens=20, seed=5, extra_body={"structured_outputs": {"grammar": lark}}
    )
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", r.choices[0].message.content)


def test_thinking_mode_constrains_only_after_think_end(served, client):
    engine = served[1]
    think_end = engine.tokenizer.token_to_id(THINK_END_TOKEN)
    # the bias puts </think> first (a mask from the start would forbid it); the rest follows the schema
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        max_tokens=150,
        seed=6,
        logit_bias={str(think_end): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "" and r.choices[0].finish_reason == "stop"
    _valid(json.loads(msg.content), SCHEMA)


def _schemas():
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS}


def test_required_tool_choice_gives_calls_that_validate(tool_server):
    served, client = tool_server[:2], tool_server[2]
    free = client.chat.completions.create(model=served[1].model_name, messages=USER, tools=TOOLS, max_tokens=30, seed=2)
    assert not free.choices[0].message.tool_calls  # "auto" stays free: noise is no tool call
    schemas = _schemas()
    r = client.chat.completions.create(
        model=served[1].model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=1500,
        n=2,
        seed=11,
        temperature=1.0,
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            _valid(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow  # ~300 more noise tokens after the tools prompt (~8 s on one core); CI runs -m slow
def test_required_tool_choice_without_parallel_calls_gives_one_call(tool_server):
    served, client = tool_server[:2], tool_server[2]
    schemas = _schemas()
    r = client.chat.completions.create(
        model=served[1].model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=600,
        n=2,
        seed=12,
        temperature=1.0,
    )
    for c in r.choices:
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        _valid(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_calls_that_tool(tool_server):
    served, client = tool_server[:2], tool_server[2]
    schemas = _schemas()
    r = client.chat.completions.create(
        model=served[1].model_name,
        messages=USER,
        tools=TOOLS,
        max_tokens=600,
        n=2,
        seed=13,
        temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "book"}},
        extra_body={"return_token_ids": True},
    )
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "book"
        _valid(json.loads(call.function.arguments), schemas["book"])
        # the raw output is exactly the DSML block the template renders (parsed strictly)
        text = served[1].tokenizer.decode(c.model_extra["token_ids"][:-1])
        assert len(parse_assistant_output(text, thinking=False).tool_calls) == 1


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}, "min_tokens": 3}}, "min_tokens"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": 'say"hi'}}], "tool_choice": "required"}, "tools"),
]


def test_bad_constraints_are_400s_and_a_bystander_is_unaffected(served, client):
    results = {}
    bystander = threading.Thread(target=_stream_tokens, args=(served[0], 16, results, "bystander"))
    bystander.start()
    for kw, param in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=served[1].model_name, messages=USER, max_tokens=5, **kw)
        err = info.value.body
        assert err["param"] == param and err["type"] == "invalid_request_error", (kw, err)
        assert set(err) >= {"message", "type", "param", "code"}
    # the completions endpoint too, with the raw HTTP shape
    r = httpx.post(
        served[0].base_url + "/v1/completions", timeout=60, json={"prompt": "x", "structured_outputs": {"regex": "(("}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    bystander.join(300)
    assert results == {"bystander": ("length", [])}


def test_missing_llguidance_is_a_clear_400(monkeypatch):
    """Without the optional extra: a 400 naming the install, for structured outputs and enforced tools;
    plain requests are unaffected."""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with ServerThread(create_app(FakeEngine(), FakeAsyncEngine(script="hi"))) as srv:
        client = _client(srv)
        for kw in ({"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"}):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="fake-model", messages=USER, max_tokens=5, **kw)
            assert "pip install dsv41[structured]" in info.value.body["message"]
            assert info.value.body["code"] == "structured_outputs_unavailable"
        r = client.chat.completions.create(
            model="fake-model", messages=USER, max_tokens=5, tools=TOOLS, tool_choice="auto"
        )
        assert r.choices[0].message.content == "hi"


@pytest.mark.slow
def test_small_preset_choice_and_required_tool(served_small):
    """`dsv41 serve small` (8,192-id byte vocabulary): a choice and an enforced tool call."""
    optional_import("llguidance")
    srv, engine, _ = served_small
    client = _client(srv)
    r = client.completions.create(
        model=engine.model_name,
        prompt="Pick:",
        max_tokens=8,
        n=2,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert all(c.text in ("yes", "no") for c in r.choices)
    tool = [t for t in TOOLS if t["function"]["name"] == "get_weather"]
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        tools=tool,
        max_tokens=600,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=3,
    )
    (call,) = r.choices[0].message.tool_calls
    _valid(json.loads(call.function.arguments), tool[0]["function"]["parameters"])
