"""The OpenAI-compatible HTTP server: FastAPI routes over `dsv41.engine.AsyncEngine`.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with SSE when `stream: true`), `/v1/responses` (responses_api.py), `/tokenize`, `/detokenize`,
`GET /health`, `GET /metrics` (Prometheus, `prometheus_client`). Shared checks and engine driving: serving.py.
`GET /openapi.json` is the contract: every body, answer and error of this server (openapi.py).

Life of a request: with an API key set, every /v1 route needs `Authorization: Bearer <key>` (401);
a body over `max_request_bytes` is refused with 413 while it is still arriving; the body is validated
(pydantic, lone surrogates refused, then model-dependent ranges); a prompt whose text cannot fit the
context is refused before tokenization, which runs in a worker thread, off the event loop (chat: the
V4.1 encoder renders it first, and message text is tokenized as text, never as control tokens); then
`AsyncEngine.generate` yields
`RequestOutput` deltas from the engine thread. Everything that can be refused is refused before the
first byte is sent, so a stream either starts with 200 or gets a 4xx in OpenAI's error shape: the
first engine output is awaited before the response starts, which is also when a full queue
(`EngineBusy` -> 429 + Retry-After) or an engine-side ValueError (-> 400) surfaces. A client that goes
away aborts its request in the engine: while waiting, a watcher on the ASGI `receive` channel sees
`http.disconnect`; during a stream, Starlette cancels the body iterator and its `finally` aborts.

Failures: a request that fails in the engine fails alone (the engine retries its batch without it);
its client gets a 500 (or an in-band error event once a stream has started) whose body says "internal
error" and the request id, and the details go to the log under that id. No malformed input gives a 5xx.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from dsv41.engine import AsyncEngine, RequestOutput, TokenLogprob
from dsv41.server.chat import (
    ChatStreamSplitter,
    build_chat_prompt,
    check_text_fits,
    parse_chat_output,
    parse_tool_calls,
    resolve_thinking,
)
from dsv41.server.metrics import CONTENT_TYPE, ServerMetrics
from dsv41.server.openapi import (
    GENERATION_ERRORS,
    TOKENIZER_ERRORS,
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeResponse,
    errors,
    ok,
)
from dsv41.server.openapi import install as install_openapi
from dsv41.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    error_body,
)
from dsv41.server.responses import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from dsv41.server.responses_api import add_responses_routes
from dsv41.server.serving import (
    DEFAULT_MAX_CHOICES,
    MIN_REQUEST_BYTES,
    ClientGone,  # noqa: F401
    ServerState,
    _check_model,
    _choice_params,
    _choices,
    _disconnected_response,
    _last,
    _model_card,
    _off_loop,
    _run_to_end,
    _sampling_params,
    _sse_response,
    _start,
    _stream_body,
    _Timer,
    _usage,
    internal_error_message,
)
from dsv41.server.structured import chat_constraint, output_constraint

ENDPOINTS = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)
KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/internal")  # routes that need the API key when one is set
UNCAPPED_PATHS = ("/internal/handoff",)  # a KV hand-off grows with the prompt: the route applies its own cap
MAX_HEADER_BYTES = 64 << 10  # all header lines together; nginx's default allows 32 KiB
# a context's worth of JSON: a token is a few bytes of text, and JSON escapes can take 6 bytes a byte
REQUEST_BYTES_PER_TOKEN = 32

log = logging.getLogger("dsv41.server")


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body cap: 8 MiB, or 32 bytes per token of context when that is more."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)


def create_app(
    engine,
    async_engine=None,
    *,
    served_model_name: str | None = None,
    max_waiting: int = 64,
    retry_after_s: int = 1,
    api_key: str | None = None,
    max_request_bytes: int | None = None,
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    disaggregation_mode: str | None = None,
) -> FastAPI:
    """Build the app over a built `LLMEngine`. Without `async_engine`, one is made (queue bound
    `max_waiting`) and started/stopped with the app; a given one is left to its owner. With `api_key`,
    every /v1 route needs `Authorization: Bearer <api_key>`. Bodies over `max_request_bytes` (default
    `default_max_request_bytes(max_model_len)`) get 413. `n` and `best_of` may be at most `max_choices`.
    At most `max_stored_responses` finished /v1/responses results are kept for `previous_response_id`.
    `disaggregation_mode` 'prefill' or 'decode' adds a worker's internal routes (dsv41.server.disaggregation)."""
    owns = async_engine is None
    if owns:
        async_engine = AsyncEngine(engine, max_waiting=max_waiting)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.max_model_len)
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if max_choices < 1:
        raise ValueError(f"max_choices must be >= 1, got {max_choices}")
    state = ServerState(
        engine,
        async_engine,
        served_model_name or engine.model_name,
        retry_after_s,
        metrics=ServerMetrics(async_engine.metrics, getattr(getattr(engine, "config", None), "numerics", None)),
        api_key=api_key or None,
        max_request_bytes=max_request_bytes,
        max_choices=max_choices,
        responses=ResponseStore(max_stored_responses),
    )
    if engine.model_config.vision_enabled:
        from dsv41.vision.inputs import ImageLoader

        state.image_loader = ImageLoader.from_config(engine.model_config)

    @asynccontextmanager
    async def lifespan(app):
        if owns:
            async_engine.start()
        try:
            yield
        finally:
            if owns:
                async_engine.shutdown()

    app = FastAPI(title="dsv41", lifespan=lifespan)
    app.state.server = state
    if disaggregation_mode:
        from dsv41.server.disaggregation import Disaggregation, install_routes

        state.disaggregation = Disaggregation(disaggregation_mode)
        install_routes(app, state.disaggregation)
    # outermost last: responses (401/413 included) are counted, then the key, then the body cap
    app.add_middleware(_LimitSize, max_bytes=state.max_request_bytes)
    app.add_middleware(_RequireKey, api_key=state.api_key)
    app.add_middleware(_CountResponses, metrics=state.metrics)
    _install_error_handlers(app)

    @app.get("/health", responses={**ok(Health), **errors(503, **{"503": "The engine thread is not running."})})
    async def health():
        """Liveness: 503 once the engine thread has stopped. Open without an API key."""
        alive = getattr(async_engine, "is_alive", None)
        if callable(alive) and not alive():
            raise APIError(503, "the engine thread is not running", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ok(description="Prometheus text format"))
    async def metrics():
        """Prometheus metrics (text format): HTTP responses, queue, KV cache, latency histograms. Open
        without an API key."""
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=ok(ModelList))
    async def list_models():
        """The one model this server serves."""
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model:path}", responses={**ok(ModelCard), **errors(404)})
    async def get_model(model: str):
        """The served model by name (404 for any other)."""
        _check_model(state, model)
        return _model_card(state)

    @app.post("/v1/completions", responses={**ok(Completion, stream=True), **GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        """Text completion (OpenAI legacy completions, with vLLM's extensions)."""
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions", responses={**ok(ChatCompletion, stream=True), **GENERATION_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completion: the messages rendered by the V4.1 encoder; reasoning, tool calls and logprobs
        parsed back."""
        return await _chat(state, body, request)

    @app.post("/tokenize", responses={**ok(TokenizeResponse), **TOKENIZER_ERRORS})
    async def tokenize(body: TokenizeRequest):
        """vLLM's /tokenize: the ids the generation routes would compute from the same prompt or messages."""
        return await _tokenize(state, body)

    @app.post("/detokenize", responses={**ok(DetokenizeResponse), **TOKENIZER_ERRORS})
    async def detokenize(body: DetokenizeRequest):
        """vLLM's /detokenize: token ids to text, special tokens spelled out."""
        return await _detokenize(state, body)

    add_responses_routes(app, state)
    install_openapi(app, state, KEYED_PREFIXES)
    return app


# ---------------------------------------------------------------------------------------------- errors


class _ErrorResponse(JSONResponse):
    """Error bodies are ASCII-escaped JSON: they may quote what the client sent, and text that cannot be
    encoded (a lone surrogate) must not turn a 4xx into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            return _ErrorResponse(
                error_body(f"malformed JSON body: {detail}", "invalid_request_error", None, "invalid_json"),
                status_code=400,
            )
        where = ".".join(loc) or "body"
        return _ErrorResponse(
            error_body(f"{where}: {err.get('msg')}", "invalid_request_error", loc[0] if loc else None, "invalid_value"),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the first matching route's methods only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return _ErrorResponse(
            error_body(str(exc.detail), type_, None, code), status_code=exc.status_code, headers=headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        request_id = f"err-{uuid.uuid4().hex}"
        log.error(
            "internal error, request id %s: %s %s",
            request_id,
            request.method,
            request.url.path,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return _ErrorResponse(
            error_body(internal_error_message(request_id), "server_error", None, "internal_error"),
            status_code=500,
            headers={"X-Request-Id": request_id},
        )


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path (GET and DELETE /v1/responses/{id} are two
    routes)."""
    scope = {**request.scope, "method": ""}  # no route serves it: a path match is a partial match
    methods = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


async def _send_error(send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    """Answer from ASGI middleware, before the app has seen the request."""
    response = _ErrorResponse(
        error_body(message, "invalid_request_error", None, code), status_code=status, headers=headers
    )
    await response({"type": "http"}, None, send)


class _RequireKey:
    """With an API key, every /v1 route and /tokenize, /detokenize need `Authorization: Bearer <key>` (401
    otherwise, as OpenAI and vLLM answer): they cost the server work; /health and /metrics stay open for
    probes and scrapers. Compared in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.expected is not None and scope["type"] == "http" and scope.get("path", "").startswith(KEYED_PREFIXES):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(
                    send,
                    401,
                    "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                )
        return await self.app(scope, receive, send)


class _LimitSize:
    """Refuse header blocks over `MAX_HEADER_BYTES` with 431, and bodies over `max_bytes` with 413: at
    once when Content-Length says so, otherwise as soon as the bytes received pass the cap (chunked
    uploads), so a huge body is never held in memory. (uvicorn's own h11 limit, `H11_MAX_HEADER_BYTES`
    in run.py, sits above this one: h11 can only answer 400 and drop the connection.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"The request body is larger than this server accepts ({self.max_bytes} bytes)."

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or ()
        if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEADER_BYTES:
            return await _send_error(
                send,
                431,
                f"The request headers are larger than this server accepts ({MAX_HEADER_BYTES} bytes).",
                "headers_too_large",
            )
        if scope.get("path") in UNCAPPED_PATHS:
            return await self.app(scope, receive, send)
        declared = dict(headers).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, self._too_large(), "request_too_large")
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI lets HTTPException out of body reading as it is
                    raise StarletteHTTPException(413, self._too_large())
            return message

        return await self.app(scope, limited_receive, send)


class _CountResponses:
    """Pure ASGI middleware counting responses by endpoint and status (BaseHTTPMiddleware would get in
    the way of disconnect detection on streams)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.response(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


# ---------------------------------------------------------------------------------------------- shared


# ---------------------------------------------------------------------------------------------- completions


async def _completion_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokenizer = state.engine.tokenizer

        def tokenize() -> list[int]:
            check_text_fits(tokenizer, len(prompt), state.max_model_len - 1)
            return tokenizer.encode(prompt, add_bos=True)

        return await _off_loop(state, tokenize, "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    bad = [t for t in prompt if not (0 <= t < state.vocab_size)]
    if bad:
        raise bad_request(f"prompt token ids must lie in [0, {state.vocab_size}); got {bad[0]}", "prompt")
    return list(prompt)


class _CompletionLogprobs:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, top_n: int):
        self.top_n, self.offset = top_n, 0

    def block(self, items: list[TokenLogprob]) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for lp in items:
            tokens.append(lp.token)
            lps.append(lp.logprob)
            tops.append({text: value for _, text, value in lp.top[: self.top_n]})
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _rank_best(outs: list[list[RequestOutput]], n: int) -> list[int]:
    """best_of: the indices of the n choices with the highest mean log-probability per token (OpenAI's
    "highest log probability per token"), best first; ties keep the generation order."""

    def score(o: list[RequestOutput]) -> float:
        lps = [x.logprob for out in o for x in out.new_logprobs]
        return sum(lps) / len(lps) if lps else float("-inf")

    return sorted(range(len(outs)), key=lambda i: -score(outs[i]))[:n]


async def _completions(state: ServerState, req: CompletionRequest, request: Request):
    _check_model(state, req.model)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    n, generated = _choices(state, req.n, req.best_of, bool(req.stream))
    prompt_ids = await _completion_prompt(state, req.prompt)
    structured = await _off_loop(
        state, lambda: output_constraint(state, req.response_format, req.structured_outputs), "structured_outputs"
    )
    params = _sampling_params(
        state,
        req,
        prompt_len=len(prompt_ids),
        max_tokens=16 if req.max_tokens is None else req.max_tokens,
        logprobs=req.logprobs,
        prompt_param="prompt",
        structured=structured,
    )
    want_lp = req.logprobs is not None
    if generated > n and not want_lp:  # ranking needs each token's logprob; not sent back
        params = dataclasses.replace(params, logprobs=0)
    plist = _choice_params(params, generated)
    base_id = f"cmpl-{uuid.uuid4().hex}"
    request_ids = [base_id] + [f"{base_id}-{i}" for i in range(1, generated)]
    created = int(time.time())
    timers = [_Timer(state.metrics) for _ in range(generated)]
    lps = [_CompletionLogprobs(req.logprobs or 0) for _ in range(generated)]

    def choice(i: int, text: str, finish_reason=None, logprobs=None) -> dict:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def body(choices: list[dict]) -> dict:
        return {
            "id": base_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            started = await _start(state, request, request_ids, prompt_ids, plist)
        except ClientGone:
            return _disconnected_response()

        def on_output(i: int, out: RequestOutput):
            if not (out.new_text or out.finished or out.new_logprobs or (req.return_token_ids and out.new_token_ids)):
                return []
            c = body(
                [
                    choice(
                        i,
                        out.new_text,
                        out.finish_reason if out.finished else None,
                        lps[i].block(out.new_logprobs) if want_lp else None,
                    )
                ]
            )
            if req.return_token_ids:
                c["choices"][0]["token_ids"] = list(out.new_token_ids)
            if include_usage:
                c["usage"] = None
            return [c]

        def on_end(lasts):
            if not include_usage:
                return []
            return [{**body([]), "usage": _usage(len(prompt_ids), lasts)}]

        return _sse_response(_stream_body(state, request_ids, started, timers, on_output, on_end))

    outs = await _run_to_end(state, request, request_ids, prompt_ids, plist, timers)
    if outs is None:
        return _disconnected_response()
    lasts = [_last(o, rid) for o, rid in zip(outs, request_ids)]
    order = _rank_best(outs, n) if generated > n else list(range(n))
    choices = [
        choice(
            k,
            lasts[i].text,
            lasts[i].finish_reason,
            lps[i].block([x for o in outs[i] for x in o.new_logprobs]) if want_lp else None,
        )
        for k, i in enumerate(order)
    ]
    if req.return_token_ids:
        for c, i in zip(choices, order):
            c["token_ids"] = list(lasts[i].token_ids)
    result = body(choices)
    if req.return_token_ids:
        result["prompt_token_ids"] = list(prompt_ids)
    result["usage"] = _usage(len(prompt_ids), lasts)  # every generated sequence's tokens count (OpenAI)
    return result


# ---------------------------------------------------------------------------------------------- chat


def _chat_logprob(lp: TokenLogprob, top_n: int) -> dict:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for _, t, v in lp.top[:top_n]],
    }


def _chat_tools(req: ChatCompletionRequest) -> tuple[list[dict] | None, bool]:
    """(tools to render, whether to parse tool calls) from `tools` and `tool_choice`.
    `required` and a named function are enforced by constrained decoding (dsv41.server.structured); a
    named function renders only that tool."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice is None:
        return tools, bool(tools)
    if not tools:
        raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
    if choice == "none":
        return None, False
    if choice in ("auto", "required"):
        return tools, True
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise bad_request(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
        return chosen, True
    raise bad_request(
        f"tool_choice must be 'none', 'auto', 'required' or a function object, got {choice!r}", "tool_choice"
    )


async def _chat(state: ServerState, req: ChatCompletionRequest, request: Request):
    _check_model(state, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    n, _ = _choices(state, req.n)
    tools, parse_tools = _chat_tools(req)
    try:
        thinking, effort = resolve_thinking(req.chat_template_kwargs, req.reasoning_effort)
    except ValueError as exc:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "reasoning_effort"
        raise bad_request(str(exc), param) from None
    images: list = []  # (start, ImagePatches) of each image part, filled while the prompt is built
    prompt_ids = await _off_loop(
        state,
        lambda: build_chat_prompt(
            state.engine.tokenizer,
            req.messages,
            thinking=thinking,
            effort=effort,
            tools=tools,
            token_limit=state.max_model_len - 1,
            image_loader=state.image_loader,
            spans=images,
        ),
        "messages",
    )
    structured = await _off_loop(state, lambda: chat_constraint(state, req, tools, thinking), "response_format")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    overridden = req.max_completion_tokens is not None and req.max_tokens is not None
    if overridden and not 1 <= req.max_tokens < state.max_model_len:  # checked even when not used
        raise bad_request(f"max_tokens must be in [1, {state.max_model_len - 1}], got {req.max_tokens}", "max_tokens")
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    params = _sampling_params(
        state,
        req,
        prompt_len=len(prompt_ids),
        max_tokens=max_tokens,
        logprobs=top_n if req.logprobs else None,
        prompt_param="messages",
        structured=structured,
    )
    plist = _choice_params(params, n)
    base_id = f"chatcmpl-{uuid.uuid4().hex}"
    request_ids = [base_id] + [f"{base_id}-{i}" for i in range(1, n)]
    created = int(time.time())
    timers = [_Timer(state.metrics) for _ in range(n)]

    if req.stream:
        return await _chat_stream(
            state,
            req,
            request,
            request_ids,
            created,
            prompt_ids,
            plist,
            timers,
            thinking=thinking,
            parse_tools=parse_tools,
            top_n=top_n,
            images=images,
        )

    outs = await _run_to_end(state, request, request_ids, prompt_ids, plist, timers, images)
    if outs is None:
        return _disconnected_response()
    lasts = [_last(o, rid) for o, rid in zip(outs, request_ids)]
    choices = []
    for i, (o, last) in enumerate(zip(outs, lasts)):
        parsed = parse_chat_output(last.text, thinking=thinking, tools=parse_tools)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if thinking:
            message["reasoning_content"] = parsed.reasoning_content
        finish = last.finish_reason
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls[:1] if req.parallel_tool_calls is False else parsed.tool_calls
            finish = "tool_calls"
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [_chat_logprob(x, top_n) for out in o for x in out.new_logprobs]}
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        if req.return_token_ids:
            choices[-1]["token_ids"] = list(last.token_ids)
    result = {
        "id": base_id,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(len(prompt_ids), lasts),
        "system_fingerprint": None,
    }
    if req.return_token_ids:
        result["prompt_token_ids"] = list(prompt_ids)
    return result


async def _chat_stream(
    state, req, request, request_ids, created, prompt_ids, params, timers, *, thinking, parse_tools, top_n, images=None
):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        started = await _start(state, request, request_ids, prompt_ids, params, images)
    except ClientGone:
        return _disconnected_response()
    n = len(started)
    splitters = [ChatStreamSplitter(thinking=thinking, tools=parse_tools) for _ in range(n)]

    def chunk(i: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
        c = {
            "id": request_ids[0],
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if include_usage:
            c["usage"] = None
        return c

    def deltas(pieces) -> list[dict]:
        return [{"reasoning_content": text} if kind == "reasoning" else {"content": text} for kind, text in pieces]

    role_sent = [False] * n

    def on_output(i: int, out: RequestOutput):
        payloads = [] if role_sent[i] else [chunk(i, {"role": "assistant", "content": ""})]
        role_sent[i] = True
        ds = deltas(splitters[i].feed(out.new_text))
        lps = {"content": [_chat_logprob(x, top_n) for x in out.new_logprobs]} if req.logprobs else None
        if lps and lps["content"] and not ds:
            ds = [{}]  # logprobs of tokens whose text is held back still go out with their step
        if req.return_token_ids and out.new_token_ids and not ds:
            ds = [{}]
        for k, d in enumerate(ds):
            payloads.append(chunk(i, d, logprobs=lps if k == 0 else None))
            if req.return_token_ids:
                payloads[-1]["choices"][0]["token_ids"] = list(out.new_token_ids) if k == 0 else []
        return payloads

    def on_end(lasts: list[RequestOutput | None]):
        payloads = []
        for i, (splitter, last) in enumerate(zip(splitters, lasts)):
            payloads += [chunk(i, d) for d in deltas(splitter.finish())]
            finish = last.finish_reason if last else "abort"
            if splitter.tool_text:
                calls = parse_tool_calls(splitter.tool_text)[: 1 if req.parallel_tool_calls is False else None]
                if calls:
                    finish = "tool_calls"
                    payloads.append(
                        chunk(
                            i,
                            {
                                "tool_calls": [
                                    {"index": k, "id": c["id"], "type": "function", "function": c["function"]}
                                    for k, c in enumerate(calls)
                                ]
                            },
                        )
                    )
                else:
                    payloads.append(chunk(i, {"content": splitter.tool_text}))
            payloads.append(chunk(i, {}, finish_reason=finish))
        if include_usage:
            payloads.append(
                {
                    "id": request_ids[0],
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": _usage(len(prompt_ids), lasts),
                }
            )
        return payloads

    return _sse_response(_stream_body(state, request_ids, started, timers, on_output, on_end))


# ---------------------------------------------------------------------------------------------- tokenizer


async def _tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    """vLLM's /tokenize: the ids the generation endpoints would compute from the same prompt or messages."""
    _check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt (text) or messages (a chat)", "prompt")
    tokenizer = state.engine.tokenizer
    if req.prompt is not None:
        add_bos = req.add_special_tokens is not False

        def encode() -> list[int]:
            check_text_fits(tokenizer, len(req.prompt), state.max_model_len)
            return tokenizer.encode(req.prompt, add_bos=add_bos)

        ids = await _off_loop(state, encode, "prompt")
    else:
        if req.continue_final_message:
            raise bad_request("continue_final_message is not supported", "continue_final_message")
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            thinking, effort = resolve_thinking(req.chat_template_kwargs, req.reasoning_effort)
        except ValueError as exc:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "reasoning_effort"
            raise bad_request(str(exc), param) from None
        ids = await _off_loop(
            state,
            lambda: build_chat_prompt(
                tokenizer,
                req.messages,
                thinking=thinking,
                effort=effort,
                tools=tools,
                token_limit=state.max_model_len,
                image_loader=state.image_loader,
                spans=[],
                add_generation_prompt=req.add_generation_prompt,
            ),
            "messages",
        )
    strs = [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


async def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    """vLLM's /detokenize: ids -> text (special tokens spelled out, as the generation endpoints decode)."""
    _check_model(state, req.model)
    bad = [t for t in req.tokens if not (0 <= t < state.vocab_size)]
    if bad:
        raise bad_request(f"tokens must lie in [0, {state.vocab_size}); got {bad[0]}", "tokens")
    text = await _off_loop(state, lambda: state.engine.tokenizer.decode(req.tokens), "tokens")
    return {"prompt": text}
