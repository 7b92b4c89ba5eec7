"""Schemathesis hooks for tests/server/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

- A schema-valid request may still be refused (400) for a reason no JSON schema can state; the schema's
  descriptions and docs/http-api.md name each one. Such a refusal is not a contract failure when the
  server's error message says it is one of them; every other failure stands.
- Generations are kept short: a schema-valid request asks for at most `MAX_NEW_TOKENS` tokens (a smaller
  valid value, or that value where it asked for none, meaning the rest of the context). What is checked,
  the shapes, does not depend on the length, and a CPU generates the tiny model's tokens slowly.
"""

from __future__ import annotations

import json
import re

import schemathesis

RUNTIME_RULES = tuple(
    re.compile(pattern)
    for pattern in (
        r"maximum context length is \d+ tokens",  # the prompt (and max_tokens) must fit the context
        r"^min_tokens must be in \[0, max_tokens=\d+\]",  # min_tokens <= max_tokens
        r"^best_of must be in \[n=",  # best_of >= n
        r"^best_of > n cannot be streamed",
        r"^Previous response with id '.*' not found\.$",  # previous_response_id: a stored response
        r"tool_calls\[\d+\]: arguments of .* (are not valid JSON|must be a JSON object)",  # JSON text of an object
        r"tool_choice names a function that is not in tools",
        r"is not a valid JSON schema|is not valid JSON",  # a JSON schema (object or text) that must compile
        r"^(structured_outputs|response_format|text\.format)[^:]*: .*grammar|invalid_grammar",
        r"min_tokens cannot be combined with structured outputs",
        r"cannot be combined with tool_choice",
        r"give either response_format or structured_outputs",
    )
)


def runtime_refusal(body: bytes) -> bool:
    """Whether an error body's message is one of the documented rules a JSON schema cannot state."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(message, str) and any(rule.search(message) for rule in RUNTIME_RULES)


MAX_NEW_TOKENS = 4
LENGTH_FIELDS = {  # the fields that bound a generation, the one to set first
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


@schemathesis.hook
def map_case(context, case):
    """A schema-valid generation request asks for at most MAX_NEW_TOKENS tokens (negative cases are left
    as generated: their point is the value that breaks the schema)."""
    fields = LENGTH_FIELDS.get(case.operation.path)
    body = case.body
    if not fields or case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return case
    for name in (*fields, "min_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > MAX_NEW_TOKENS:
            body[name] = MAX_NEW_TOKENS
    if all(body.get(name) is None for name in fields):
        body[fields[0]] = MAX_NEW_TOKENS
    return case


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep every failure but a schema-valid request refused for one of the rules above."""
    return not (failure.code == "ST202" and response.status_code == 400 and runtime_refusal(response.content))
