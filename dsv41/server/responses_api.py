"""The `/v1/responses` routes (OpenAI Responses API) over the shared serving path: `POST /v1/responses`
(non-streamed, or SSE events `event: <type>` / `data: <event>` when `stream: true`), `GET` and `DELETE
/v1/responses/{id}` for stored responses. Shapes and conversions live in `responses.py`; checks, engine
submission, disconnect handling and the SSE body are `serving.py`'s, as for chat completions, so a bad
request is refused with a 4xx in OpenAI's error shape before any engine work and before the stream starts.
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request

from dsv41.server.chat import build_chat_prompt
from dsv41.server.openapi import GENERATION_ERRORS, NO_SUCH_RESPONSE, Response, ResponseDeleted, ok
from dsv41.server.protocol import APIError, bad_request
from dsv41.server.responses import (
    ResponseBuilder,
    ResponsesRequest,
    StoredResponse,
    chat_tools,
    continued_prompt,
    input_messages,
    reasoning_token_count,
    resolve_reasoning,
    think_end_id,
    usage,
)
from dsv41.server.serving import (
    ClientGone,
    ServerState,
    _check_model,
    _disconnected_response,
    _last,
    _off_loop,
    _run_to_end,
    _sampling_params,
    _sse_response,
    _start,
    _stream_body,
    _Timer,
)
from dsv41.server.structured import chat_constraint


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """Register the Responses API routes on `app`; `state.responses` is the store (a ResponseStore)."""

    created = ok(Response, stream=True)
    created[200]["links"] = {  # a stored response (store not false) can be fetched and deleted by its id
        name: {"operationId": name, "parameters": {"response_id": "$response.body#/id"}}
        for name in ("retrieve_response", "delete_response")
    }

    @app.post("/v1/responses", responses={**created, **GENERATION_ERRORS})
    async def create_response(body: ResponsesRequest, request: Request):
        """OpenAI Responses API: a response to `input` (continuing `previous_response_id`), stored unless
        `store` is false."""
        return await _create(state, body, request)

    @app.get(
        "/v1/responses/{response_id}", operation_id="retrieve_response", responses={**ok(Response), **NO_SUCH_RESPONSE}
    )
    async def retrieve_response(response_id: str):
        """A stored response."""
        entry = state.responses.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @app.delete(
        "/v1/responses/{response_id}",
        operation_id="delete_response",
        responses={**ok(ResponseDeleted), **NO_SUCH_RESPONSE},
    )
    async def delete_response(response_id: str):
        """Delete a stored response."""
        if not state.responses.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _sse_event(payload: dict) -> str:
    """One Responses stream event: the `event:` line names its type, as OpenAI sends it."""
    return f"event: {payload.get('type', 'error')}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _check(state: ServerState, req: ResponsesRequest) -> None:
    """Refusals that need no rendering."""
    _check_model(state, req.model)
    if req.background:
        raise bad_request("background responses are not supported", "background")
    _response_format(req)  # text.format is checked here; its grammar is compiled with the prompt
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", "max_output_tokens")
    if req.truncation not in (None, "disabled", "auto"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {req.truncation!r}", "truncation")


def _response_format(req: ResponsesRequest) -> dict | None:
    """The Responses `text.format` ({type: text | json_object | json_schema, name, schema, strict}) as chat's
    `response_format`, or None for plain text."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    raise bad_request(f"text.format type must be text, json_object or json_schema, got {kind!r}", "text.format")


def _constraint(state: ServerState, req: ResponsesRequest, tools: list[dict] | None, thinking: bool):
    """The request's grammar (dsv41.server.structured), as for chat: an enforced function call for
    tool_choice "required" or a named function, else text.format, else None. Call it off the event loop."""
    asked = SimpleNamespace(
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req),
        structured_outputs=None,
    )
    return chat_constraint(state, asked, tools, thinking)


async def _create(state: ServerState, req: ResponsesRequest, request: Request):
    _check(state, req)
    tools, parse_tools = chat_tools(req.tools, req.tool_choice)
    try:
        thinking, effort = resolve_reasoning(req.reasoning)
    except ValueError as exc:
        raise bad_request(str(exc), "reasoning.effort") from None
    previous = None
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
    try:
        new_messages = input_messages(req.input)
    except ValueError as exc:
        raise bad_request(str(exc), "input") from None
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    earlier = previous.conversation if previous is not None else []
    messages = system + earlier + new_messages
    images: list = []
    tokenizer, limit = state.engine.tokenizer, state.max_model_len - 1
    kw = dict(
        thinking=thinking, effort=effort, tools=tools, token_limit=limit, image_loader=state.image_loader, spans=images
    )
    if previous is not None:
        prompt_ids, rendered_ids = await _off_loop(
            state, lambda: continued_prompt(tokenizer, messages, system + earlier, previous, **kw), "input"
        )
    else:
        prompt_ids = rendered_ids = await _off_loop(
            state, lambda: build_chat_prompt(tokenizer, messages, **kw), "input"
        )
    structured = await _off_loop(state, lambda: _constraint(state, req, tools, thinking), "text.format")
    params = _sampling_params(
        state,
        req,
        prompt_len=len(prompt_ids),
        max_tokens=req.max_output_tokens,
        logprobs=None,
        prompt_param="input",
        structured=structured,
    )
    response_id = f"resp_{uuid.uuid4().hex}"
    builder = ResponseBuilder(_base(state, req, response_id), thinking=thinking, tools=parse_tools)
    end_id = think_end_id(tokenizer)
    timers = [_Timer(state.metrics)]

    def finish(last) -> list[dict]:
        """The closing events; stores the response (unless `store` is false)."""
        incomplete = last is not None and last.finish_reason == "length"
        token_ids = list(last.token_ids) if last is not None else []
        use = usage(last, len(prompt_ids), reasoning_token_count(token_ids, thinking, end_id))
        events = builder.finish(
            "incomplete" if incomplete else "completed", use, "max_output_tokens" if incomplete else None
        )
        if req.store is not False and last is not None and last.finish_reason in ("stop", "length"):
            state.responses.put(
                StoredResponse(
                    events[-1]["response"],
                    earlier + new_messages + [builder.assistant_message()],
                    list(prompt_ids),
                    token_ids,
                    last.finish_reason,
                    list(rendered_ids),
                )
            )
        return events

    if req.stream:
        try:
            started = await _start(state, request, [response_id], prompt_ids, [params], images)
        except ClientGone:
            return _disconnected_response()

        def on_output(i: int, out) -> list[dict]:
            return builder.feed(out.new_text)

        def on_end(lasts) -> list[dict]:
            return finish(lasts[0])

        return _sse_response(_stream_body(state, [response_id], started, timers, on_output, on_end, _sse_event))

    outs = await _run_to_end(state, request, [response_id], prompt_ids, [params], timers, images)
    if outs is None:
        return _disconnected_response()
    last = _last(outs[0], response_id)
    builder.feed(last.text)
    return finish(last)[-1]["response"]


def _base(state: ServerState, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object's fields that do not depend on the output."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": state.model_name,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "output": [],
        "usage": None,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [dict(t, type="function") for t in (req.tools or [])],
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
    }
