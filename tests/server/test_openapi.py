"""The OpenAPI schema says what the server accepts and answers (dsv41.server.openapi): OpenAI-shaped errors
documented per route instead of FastAPI's 422, the server's own limits, the bearer key, the content types,
the methods in `Allow`; request fields take JSON's types strictly; docs/http-api.md is the schema's.
tests/server/test_openapi_fuzz.py runs schemathesis against `dsv41 serve tiny` (slow tier)."""

import re

import httpx
import pytest

from dsv41.engine.grammar import grammar_available
from dsv41.server import create_app
from dsv41.server.openapi import DOCS_PATH, build_schema, int_below_pattern, markdown, reference_app
from dsv41.server.run import ServerThread
from tests.server.fake_engine import FakeAsyncEngine, FakeEngine

GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
REF = "#/components/schemas/"


def _schema(**kw) -> dict:
    return create_app(FakeEngine(vocab_size=1024, max_model_len=4096), FakeAsyncEngine(), **kw).openapi()


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            yield path, method, op


def _error_ref(response) -> str:
    return response["content"]["application/json"]["schema"]["$ref"]


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(FakeEngine(), FakeAsyncEngine("Hello there"))) as srv:
        yield srv.base_url


def test_errors_are_documented_in_openai_shape_and_never_as_422():
    schema = _schema()
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, method, op in _operations(schema):
        responses = op["responses"]
        assert "422" not in responses, (method, path)
        assert "401" not in responses  # no API key: never answered
        for status, response in responses.items():
            if status != "200":
                assert _error_ref(response) == REF + "ErrorResponse", (method, path, status)
        if method == "post":
            assert {"400", "404", "413"} <= set(responses), path
    for path in GENERATION:
        responses = schema["paths"][path]["post"]["responses"]
        assert {"429", "500", "503"} <= set(responses)
        assert "Retry-After" in responses["429"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "404" in schema["paths"]["/v1/responses/{response_id}"]["delete"]["responses"]


def test_the_schema_states_this_servers_limits():
    schema = _schema(max_choices=3)
    components = schema["components"]["schemas"]
    chat = components["ChatCompletionRequest"]["properties"]
    assert chat["n"]["anyOf"][0]["maximum"] == 3
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 4095
    assert chat["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert chat["model"]["anyOf"][0]["enum"] == ["fake-model"]
    assert components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 1023
    keys = chat["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"]
    assert re.fullmatch(keys, "1023") and not re.fullmatch(keys, "1024")
    assert "ImageURLPart" not in components and "InputImagePart" not in components  # no vision tower
    assert not any("x-dsv41-" in key for key in str(schema).split("'"))
    structured = [b for b in chat["structured_outputs"]["anyOf"] if b.get("type") != "null"]
    assert bool(structured) == grammar_available() == ("JSONSchemaFormat" in components)
    assert set(components["TokenizeRequest"]) >= {"oneOf"}  # prompt or messages
    assert "anyOf" in components["AssistantMessage"]  # content, or tool calls


def test_an_api_key_adds_the_bearer_scheme_and_401():
    schema = _schema(api_key="k")
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, _, op in _operations(schema):
        keyed = path.startswith(("/v1", "/tokenize", "/detokenize"))
        assert ("401" in op["responses"]) == keyed == ("security" in op), path


def test_allow_lists_every_method_of_the_path(server):
    r = httpx.request("OPTIONS", server + "/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.put(server + "/v1/completions").headers["allow"] == "POST"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": 0}),
        ("/v1/completions", {"prompt": "x", "max_tokens": "1"}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": "false"}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": True}),
        ("/detokenize", {"tokens": ["1"]}),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f", "strict": 0}}]},
        ),
        # lax inputs the server used to let through
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": {}}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "tool_calls": [{"id": [1], "function": {"name": "f"}}]}]},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1, "max_tokens": -5},
        ),
        ("/v1/responses", {"input": [{"type": "reasoning", "content": 0}]}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "structured_outputs": {"json_object": 5}}),
    ],
)
def test_fields_take_json_types_strictly(server, path, body):
    r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": [1.0, 2], "max_tokens": 2.0, "n": 1.0, "temperature": 0}),
        ("/detokenize", {"tokens": [65.0]}),
        ("/v1/responses", {"input": "x", "max_output_tokens": 2, "reasoning": {"effort": 50.0}}),
        ("/tokenize", {"prompt": "x", "continue_final_message": True, "reasoning_effort": "ignored"}),
    ],
)
def test_integral_numbers_are_integers(server, path, body):
    """JSON has one number type: 2.0 is the integer 2, as JSON Schema counts it. (/tokenize with a prompt
    ignores the chat fields, as its schema says.)"""
    r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 99, 100, 101, 1000, 1024, 129280, 4096])
def test_int_below_pattern(n):
    pattern = re.compile(int_below_pattern(n))
    for k in set(range(min(n + 50, 3000))) | {n - 1, n, n + 1, 10 * n}:
        assert bool(pattern.fullmatch(str(k))) == (k < n), (n, k)
    for text in ("", "-1", "01", "1.0", " 1", "+1", "a"):
        assert not pattern.fullmatch(text)


def test_the_http_api_page_is_the_schemas():
    """docs/http-api.md is written by `python -m dsv41.server.openapi`; rerun it after changing the API."""
    want = markdown(build_schema(reference_app(), None))
    assert DOCS_PATH.read_text(encoding="utf-8") == want, "docs/http-api.md is stale: python -m dsv41.server.openapi"
