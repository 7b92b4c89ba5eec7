"""The server's OpenAPI schema as its contract, and docs/http-api.md written from it.

`install(app, state)` makes `GET /openapi.json` serve a schema that says what this server accepts and
answers: the request bodies with their fields' types, ranges and enums (dsv41.server.shapes), the errors
each route can answer in OpenAI's shape (`ErrorResponse`; validation errors are 400s, never FastAPI's
422), the streaming and Prometheus content types, and what depends on this server: the model name, the
bounds set by max_model_len, the vocabulary and --max-choices, image parts (a model with a vision tower),
structured outputs (llguidance installed), and the bearer API key (with --api-key, every keyed route
documents 401).

What a JSON schema cannot say stays in the descriptions and is still refused with 400: a prompt longer
than the context, `min_tokens` above `max_tokens`, `best_of` below `n`, a `previous_response_id` that is
not stored, tool-call arguments that are not a JSON object, a grammar or JSON schema that does not
compile.

`python -m dsv41.server.openapi [PATH]` writes the Markdown reference (default docs/http-api.md) from the
schema of a stand-in server, with those server-dependent values named instead of filled in.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from dsv41.server.shapes import MARK

REF = "#/components/schemas/"
DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


# ---------------------------------------------------------------------------------------------- shapes


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong, for people")
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, when there is one")
    code: str | None = Field(description="a machine-readable reason (context_length_exceeded, queue_full, ...)")


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every error this server answers has it."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    numerics: Literal["fast", "deterministic", "reference"] | None = Field(
        None, description="the engine's numerics mode: what a reply's bits are promised to depend on"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="with return_token_strs")


class DetokenizeResponse(BaseModel):
    prompt: str


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    token_ids: list[int] = Field(None, description="with return_token_ids")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="in thinking mode")
    tool_calls: list[dict[str, Any]] = Field(None, description="when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    token_ids: list[int] = Field(None, description="with return_token_ids")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")


class Response(BaseModel):
    """A Responses API response object (OpenAI's shape)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


# ---------------------------------------------------------------------------------------------- routes

ERRORS = {
    400: "Invalid request: a field of the wrong type or out of range, malformed JSON, a prompt that does not fit "
    "the context (`context_length_exceeded`), ...",
    401: "Missing or wrong API key: send `Authorization: Bearer <key>`.",
    404: "A model this server does not serve (`model_not_found`).",
    413: "The body is larger than this server accepts (`--max-request-bytes`).",
    422: "The KV hand-off is corrupt or does not fit this engine.",
    429: "The request queue is full (`queue_full`): retry after `Retry-After` seconds.",
    500: "Internal error; the server log has the details under the request id (header `X-Request-Id`).",
    503: "The engine is not running, or it aborted the request.",
}
HEADERS = {
    429: {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}},
    500: {"X-Request-Id": {"description": "the id the log records the error under", "schema": {"type": "string"}}},
}


def errors(*codes: int, **when: str) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these error statuses (OpenAI's error body); `when={"404": ...}`
    replaces a status's description."""
    return {
        code: {
            "model": ErrorResponse,
            "description": when.get(str(code), ERRORS[code]),
            **({"headers": HEADERS[code]} if code in HEADERS else {}),
        }
        for code in codes
    }


def ok(model: type | None = None, *, stream: bool = False, description: str = "Successful Response") -> dict:
    """The 200 entry: `model` as JSON, and with `stream` an SSE body (stream: true) too."""
    entry: dict[str, Any] = {"description": description}
    if model is not None:
        entry["model"] = model
    if stream:
        entry["description"] = "JSON, or with `stream: true` server-sent events"
        entry["content"] = {"text/event-stream": {"schema": {"$ref": REF + "ServerSentEvent"}}}
    return {200: entry}


# one server-sent event (OpenAPI before 3.2: the schema of an event stream describes each event)
SSE_EVENT = {
    "title": "ServerSentEvent",
    "description": "One event of a stream (the schema of `text/event-stream` describes each event).",
    "type": "object",
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk (an error object if the engine fails); `[DONE]` last"},
        "event": {"type": "string", "description": "/v1/responses: the event's type"},
    },
    "required": ["data"],
}
GENERATION_ERRORS = errors(400, 404, 413, 429, 500, 503)
NO_SUCH_RESPONSE = errors(404, **{"404": "No stored response has this id (`not_found`)."})
TOKENIZER_ERRORS = errors(400, 404, 413)


# ---------------------------------------------------------------------------------------------- the schema


@dataclass(frozen=True)
class ServerFacts:
    """What the schema of one server depends on."""

    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_choices: int
    vision: bool
    structured_outputs: bool
    api_key: bool


def server_facts(state) -> ServerFacts:
    from dsv41.engine.grammar import grammar_available

    names = tuple(dict.fromkeys([state.model_name, state.engine.model_name]))
    return ServerFacts(
        model_names=names,
        max_model_len=state.max_model_len,
        vocab_size=state.vocab_size,
        max_choices=state.max_choices,
        vision=state.image_loader is not None,
        structured_outputs=grammar_available(),
        api_key=bool(state.api_key),
    )


def install(app, state, keyed_prefixes: tuple[str, ...]) -> None:
    """Serve `build_schema(app, server_facts(state))` as the app's OpenAPI schema (built on first use)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, server_facts(state), keyed_prefixes)
        return app.openapi_schema

    app.openapi = openapi


LIMITS = {
    "max_seed": (lambda f: 2**63 - 1, None),  # exact: FastAPI writes numeric bounds as floats
    "max_new_tokens": (lambda f: f.max_model_len - 1, "max_model_len - 1"),
    "max_token_id": (lambda f: f.vocab_size - 1, "vocab_size - 1"),
    "max_choices": (lambda f: f.max_choices, "the server's --max-choices"),
}
CAPABILITIES = {
    "vision": "models with a vision tower only",
    "structured_outputs": "needs llguidance: `pip install dsv41[structured]`",
}


def build_schema(app, facts: ServerFacts | None, keyed_prefixes: tuple[str, ...] = ()) -> dict:
    """The OpenAPI schema of `app`; with `facts` None (the documentation), server-dependent values are
    named in descriptions instead of filled in."""
    schema = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=DESCRIPTION,
        routes=app.routes,
    )
    schema = copy.deepcopy(schema)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ServerSentEvent"] = copy.deepcopy(SSE_EVENT)
    for path, item in schema["paths"].items():
        for op in item.values():
            responses = op.get("responses", {})
            if "HTTPValidationError" in str(responses.get("422", "")):
                del responses["422"]  # FastAPI's default; validation errors are 400s here
            if facts is not None and facts.api_key and path.startswith(keyed_prefixes):
                op["security"] = [{"bearer": []}]
                responses["401"] = _error_entry(401)
    if facts is not None and facts.api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    unavailable = set()
    if facts is not None:
        unavailable = {c for c in CAPABILITIES if not getattr(facts, c)}
    dropped = {name for name, s in components.items() if s.get(MARK + "needs") in unavailable}
    _drop_branches(schema, dropped, unavailable)
    _resolve_marks(schema, facts)
    _drop_orphans(schema)
    return schema


DESCRIPTION = (
    "OpenAI-compatible API of dsv41 (DeepSeek-V4.1-Flash). Errors have OpenAI's shape (`ErrorResponse`); "
    "every route may also answer 431 to request headers over 64 KiB, and 405 (with `Allow`) to a method it "
    "does not serve."
)


def _error_entry(code: int) -> dict:
    return {
        "description": ERRORS[code],
        "content": {"application/json": {"schema": {"$ref": REF + "ErrorResponse"}}},
    }


def _drop_branches(node: Any, dropped: set[str], unavailable: set[str]) -> None:
    """Remove anyOf / oneOf branches that refer to `dropped` components or carry an unavailable mark."""

    def gone(branch: Any) -> bool:
        return isinstance(branch, dict) and (
            branch.get("$ref", "").removeprefix(REF) in dropped or branch.get(MARK + "needs") in unavailable
        )

    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and any(gone(b) for b in node[key]):
                node[key] = [b for b in node[key] if not gone(b)]
                mapping = node.get("discriminator", {}).get("mapping")
                if mapping:
                    for value, ref in list(mapping.items()):
                        if ref.removeprefix(REF) in dropped:
                            del mapping[value]
        for value in node.values():
            _drop_branches(value, dropped, unavailable)
    elif isinstance(node, list):
        for value in node:
            _drop_branches(value, dropped, unavailable)


def _note(node: dict, text: str) -> None:
    """Documentation only: a note the Markdown shows next to this value's type."""
    node[NOTE] = f"{node[NOTE]}; {text}" if NOTE in node else text


NOTE = "x-note"


def _resolve_marks(node: Any, facts: ServerFacts | None) -> None:
    """Fill in (or, for the documentation, name) what depends on the server."""
    if isinstance(node, list):
        for value in node:
            _resolve_marks(value, facts)
        return
    if not isinstance(node, dict):
        return
    limit = node.pop(MARK + "maximum", None)
    if limit is not None:
        value, name = LIMITS[limit]
        if facts is not None or name is None:
            node["maximum"] = value(facts)
        else:
            _note(node, f"≤ {name}")
    if node.pop(MARK + "enum", None) is not None:
        if facts is not None:
            node["enum"] = list(facts.model_names)
        else:
            _note(node, "the served model's name")
    if node.pop(MARK + "token_id_key", None) is not None:
        node["type"] = "string"
        if facts is not None:
            node["pattern"] = int_below_pattern(facts.vocab_size)
        else:
            node["pattern"] = "^[0-9]+$"
            _note(node, "below vocab_size")
    capability = node.pop(MARK + "needs", None)
    if capability is not None and facts is None:
        _note(node, CAPABILITIES[capability])
    for value in node.values():
        _resolve_marks(value, facts)


def _refs(node: Any, found: set[str]) -> set[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(REF):
            found.add(ref.removeprefix(REF))
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)
    return found


def _drop_orphans(schema: dict) -> None:
    components = schema["components"]["schemas"]
    used, todo = set(), _refs(schema["paths"], set())
    while todo:
        name = todo.pop()
        if name not in used and name in components:
            used.add(name)
            todo |= _refs(components[name], set())
    for name in [name for name in components if name not in used]:
        del components[name]


def int_below_pattern(n: int) -> str:
    """A regex for the decimal integers 0 .. n-1 (no sign, no leading zeros)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    top = str(n - 1)
    alts = ["0"] if len(top) > 1 else []
    if len(top) > 2:
        alts.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    elif len(top) == 2:
        alts.append("[1-9]")
    for i, digit in enumerate(top):  # numbers as long as `top`: equal up to i, then a smaller digit
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            span = f"[{low}-{int(digit) - 1}]" if int(digit) - 1 > low else str(low)
            alts.append(top[:i] + span + (f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]" if rest else ""))
    alts.append(top)
    return "^(" + "|".join(alts) + ")$"


# ---------------------------------------------------------------------------------------------- the docs


def reference_app():
    """The app over a stand-in engine (no model, no weights): the routes and bodies of `dsv41 serve`."""
    from dsv41.server.app import create_app

    engine = SimpleNamespace(
        model_name="dsv41",
        max_model_len=4096,
        model_config=SimpleNamespace(vocab_size=1024, vision_enabled=False),
        tokenizer=None,
    )
    return create_app(engine, SimpleNamespace(metrics=dict))


def markdown(schema: dict) -> str:
    """docs/http-api.md from an OpenAPI schema: each path and method, its body's fields, its responses,
    then the schemas they refer to."""
    components = schema["components"]["schemas"]
    out = [
        "# HTTP API",
        "",
        "<!-- Written by `python -m dsv41.server.openapi` from the server's OpenAPI schema; do not edit. -->",
        "",
        "The routes of `dsv41 serve`, from the OpenAPI schema that a running server also serves at "
        "`/openapi.json` (and as pages at `/docs`). That schema is this server's contract: a request it "
        "describes is accepted, and every answer is one it lists. There, the values that depend on the "
        "server are filled in: the model name, bounds from `max_model_len` (`max_new_tokens` is "
        "max_model_len - 1) and the vocabulary, `--max-choices`, image parts (a model with a vision "
        "tower), structured outputs (llguidance installed), and with `--api-key` a bearer security scheme "
        "and 401 on every `/v1`, `/tokenize` and `/detokenize` route. Here they are named instead.",
        "",
        schema["info"].get("description", ""),
        "",
        "Some rules no JSON schema can state are checked all the same (400): the prompt and `max_tokens` "
        "must fit the context, `min_tokens` may not exceed `max_tokens`, `best_of` may not be below `n`, "
        "`previous_response_id` must name a stored response, tool-call arguments must be a JSON object, and "
        "grammars and JSON schemas must compile. Prefill and decode workers (`--disaggregation-mode`) add "
        "internal routes, not listed here (see [Several devices](devices.md)).",
        "",
    ]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("description"):
                out += [_one_line(op["description"]), ""]
            for param in op.get("parameters", []):
                out += [f"Path parameter `{param['name']}`: {_type(param.get('schema', {}))}.", ""]
            body = op.get("requestBody")
            if body:
                for media, content in body["content"].items():
                    out += [f"Request body (`{media}`): {_type(content['schema'])}.", ""]
            out += ["| Status | Content type | Body | When |", "| --- | --- | --- | --- |"]
            for status, response in op["responses"].items():
                contents = response.get("content") or {"": {}}
                for media, content in contents.items():
                    body_type = _type(content["schema"]) if content.get("schema") else ""
                    cell = f"`{media}`" if media else ""
                    out.append(f"| {status} | {cell} | {body_type} | {_cell(response.get('description', ''))} |")
            out.append("")
    out += ["## Schemas", ""]
    for name, component in components.items():
        out += [f"### {name}", ""]
        text = " ".join(t for t in (component.get("description"), component.get(NOTE) and f"({component[NOTE]})") if t)
        if text:
            out += [_one_line(text), ""]
        rules = [
            r for key in ("anyOf", "oneOf", "allOf") for r in ([{key: component[key]}] if key in component else [])
        ]
        if component.get("properties"):
            required = set(component.get("required", ()))
            out += ["| Field | Type | Required | Description |", "| --- | --- | --- | --- |"]
            for field, sub in component["properties"].items():
                desc = sub.get("description", "")
                out.append(f"| `{field}` | {_type(sub)} | {'yes' if field in required else ''} | {_cell(desc)} |")
            out.append("")
        elif not rules:
            out += [f"{_type(component)}.", ""]
        if rules:
            out += [f"Rules: {_rules(component)}.", ""]
    return "\n".join(out).rstrip() + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _rules(component: dict) -> str:
    """Body-level anyOf / oneOf / allOf, in words."""
    parts = []
    for key in ("allOf", "anyOf", "oneOf"):
        if key not in component:
            continue
        branches = component[key]
        if key == "allOf":
            parts += [_rules(b) for b in branches]
            continue
        words = [_condition(b) for b in branches]
        parts.append(
            ("exactly one of: " if key == "oneOf" else "either ") + (" / " if key == "oneOf" else ", or ").join(words)
        )
    return "; and ".join(parts)


def _condition(branch: dict) -> str:
    if "anyOf" in branch or "oneOf" in branch or "allOf" in branch:
        return _rules(branch)
    words = []
    required = set(branch.get("required", ()))
    for field, sub in branch.get("properties", {}).items():
        if sub == {"type": "null"}:
            words.append(f"`{field}` absent or null")
        elif "not" in sub:
            words.append(f"`{field}` given, not {_type(sub['not'])}")
        else:
            words.append(f"`{field}` {'' if field in required else 'if given, '}{_type(sub)}")
    for field in required - set(branch.get("properties", {})):
        words.append(f"`{field}` given")
    return " and ".join(words) or "anything"


def _type(s: dict) -> str:
    """A JSON schema in a few words (Markdown)."""
    if "$ref" in s:
        name = s["$ref"].removeprefix(REF)
        return f"[{name}](#{name.lower()})"
    note = f" ({s[NOTE]})" if NOTE in s else ""
    for key in ("anyOf", "oneOf"):
        if key in s and "properties" not in s:
            return " or ".join(_type(b) for b in s[key]) + note
    if "const" in s:
        return f"`{_json(s['const'])}`{note}"
    if "enum" in s:
        return " or ".join(f"`{_json(v)}`" for v in s["enum"]) + note
    kind = s.get("type")
    bounds = []
    if "minimum" in s:
        bounds.append(f"≥ {_num(s['minimum'])}")
    if "exclusiveMinimum" in s:
        bounds.append(f"> {_num(s['exclusiveMinimum'])}")
    if "maximum" in s:
        bounds.append(f"≤ {_num(s['maximum'])}")
    if "exclusiveMaximum" in s:
        bounds.append(f"< {_num(s['exclusiveMaximum'])}")
    if "minLength" in s:
        bounds.append(f"length ≥ {s['minLength']}")
    if "maxLength" in s:
        bounds.append(f"length ≤ {s['maxLength']}")
    if "pattern" in s:
        bounds.append(f"matching `{s['pattern']}`")
    if "minItems" in s:
        bounds.append(f"≥ {s['minItems']} items")
    if "maxItems" in s:
        bounds.append(f"≤ {s['maxItems']} items")
    if "maxProperties" in s:
        bounds.append(f"≤ {s['maxProperties']} keys")
    if NOTE in s:
        bounds.append(s[NOTE])
    if kind == "array":
        text = f"array of {_type(s['items'])}" if "items" in s else "array"
    elif kind == "object" and isinstance(s.get("additionalProperties"), dict):
        keys = f"{_type(s['propertyNames'])} " if "propertyNames" in s else ""
        text = f"object ({keys}-> {_type(s['additionalProperties'])})"
    elif kind == "null":
        text = "null"
    elif kind:
        text = kind
    elif "properties" in s:
        text = "object"
    elif "not" in s:
        text = f"not {_type(s['not'])}"
    else:
        text = "any"
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _json(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value) if isinstance(value, (int, float)) else f'"{value}"'


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else repr(value)


def write_docs(path: Path | str = DOCS_PATH) -> str:
    text = markdown(build_schema(reference_app(), None))
    Path(path).write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the HTTP API reference (Markdown) from the OpenAPI schema.")
    parser.add_argument("path", nargs="?", default=str(DOCS_PATH))
    args = parser.parse_args(argv)
    write_docs(args.path)
    print(f"wrote {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
