"""What every generation endpoint shares: the server's state, request checks that need the model
(model name, sampling ranges, context length), tokenization off the event loop, and driving the engine
(`_start` submits one engine request per choice and awaits each first output, `_run_to_end` collects a
non-streamed request, `_stream_body` is the SSE body of a streamed one, `_guarded` aborts on disconnect).
Moved out of app.py unchanged; app.py (completions, chat) and responses_api.py (the Responses API) call it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dsv41.engine import EngineBusy, RequestOutput, SamplingParams
from dsv41.server.chat import PromptTooLong
from dsv41.server.metrics import ServerMetrics
from dsv41.server.protocol import APIError, bad_request, error_body

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "logprobs",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
)
DEFAULT_MAX_CHOICES = 16  # n and best_of: each choice is an engine request of its own
MIN_REQUEST_BYTES = 8 << 20

log = logging.getLogger("dsv41.server")


class ClientGone(Exception):
    """The client disconnected before its response started."""


@dataclass
class ServerState:
    engine: Any  # LLMEngine: tokenizer, model_name, max_model_len, model_config
    async_engine: Any  # AsyncEngine
    model_name: str
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    api_key: str | None = None
    max_request_bytes: int = MIN_REQUEST_BYTES
    image_loader: Any = None  # dsv41.vision.ImageLoader when the model has a vision tower
    max_choices: int = DEFAULT_MAX_CHOICES  # the cap on n and best_of
    disaggregation: Any = None  # dsv41.server.disaggregation.Disaggregation on a prefill or decode worker
    responses: Any = None  # dsv41.server.responses.ResponseStore: stored /v1/responses results

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def numerics(self) -> str | None:
        """The engine's numerics mode (EngineConfig.numerics), None for an engine without a config."""
        return getattr(getattr(self.engine, "config", None), "numerics", None)


def internal_error_message(request_id: str) -> str:
    return f"internal error (request id {request_id}); the details are in the server log"


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "dsv41",
        "max_model_len": state.max_model_len,
        "numerics": state.numerics,
    }


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in (state.model_name, state.engine.model_name):
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) -> {id: bias}; ranges are checked by
    SamplingParams.validate against the model's vocabulary."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        out[token] = float(value)
    return out


def _choices(state: ServerState, n: int | None, best_of: int | None = None, stream: bool = False) -> tuple[int, int]:
    """(choices returned, sequences generated) from n and best_of, checked against the server's cap."""
    n = 1 if n is None else n
    if not (1 <= n <= state.max_choices):
        raise bad_request(f"n must be in [1, {state.max_choices}], got {n}", "n")
    if best_of is None:
        return n, n
    if not (n <= best_of <= state.max_choices):
        raise bad_request(f"best_of must be in [n={n}, {state.max_choices}], got {best_of}", "best_of")
    if stream and best_of > n:
        raise bad_request("best_of > n cannot be streamed: the best choices are known only at the end", "best_of")
    return n, best_of


def _choice_params(params: SamplingParams, count: int) -> list[SamplingParams]:
    """One SamplingParams per generated sequence: with a seed, choice i draws with seed + i (vLLM's rule),
    so every choice is reproducible and the choices differ."""
    if params.seed is None:
        return [params] + [dataclasses.replace(params) for _ in range(count - 1)]
    return [dataclasses.replace(params, seed=(params.seed + i) % 2**63) for i in range(count)]


def _sampling_params(
    state: ServerState,
    req,
    *,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    structured=None,
) -> SamplingParams:
    if prompt_len >= state.max_model_len:
        raise _too_long(state, prompt_len, max_tokens or 0, prompt_param)
    if max_tokens is None:  # like vLLM: the rest of the context
        max_tokens = state.max_model_len - prompt_len
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens or 0,
        logit_bias=_logit_bias(req.logit_bias),
        structured=structured,
    )
    try:
        params.validate(state.vocab_size)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), name if name in SAMPLING_FIELDS else None) from None
    if prompt_len + params.max_tokens > state.max_model_len:
        raise _too_long(state, prompt_len, params.max_tokens, prompt_param)
    return params


async def _off_loop(state: ServerState, fn, param: str):
    """Run `fn` (render + tokenize: CPU-bound, proportional to the body) in a worker thread so the event
    loop keeps serving other requests; map its refusals to 400s."""
    try:
        return await anyio.to_thread.run_sync(fn)
    except PromptTooLong as exc:
        raise bad_request(
            f"This model's maximum context length is {state.max_model_len} tokens, but the prompt alone has at "
            f"least {exc.min_tokens} tokens. Shorten the prompt.",
            param,
            "context_length_exceeded",
        ) from None
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def _too_long(state: ServerState, prompt_len: int, max_tokens: int, param: str) -> APIError:
    return bad_request(
        f"This model's maximum context length is {state.max_model_len} tokens, but {prompt_len + max_tokens} were "
        f"requested ({prompt_len} in the prompt, {max_tokens} for the completion). Shorten the prompt or "
        f"lower max_tokens.",
        param,
        "context_length_exceeded",
    )


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _guarded(state: ServerState, request: Request, request_ids: list[str], coro):
    """Run `coro` (which drives the engine) until it ends or the client disconnects (-> abort every one of
    `request_ids`, ClientGone). Maps the engine's refusals to API errors."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        for request_id in request_ids:
            state.async_engine.abort(request_id)
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        for request_id in request_ids:
            state.async_engine.abort(request_id)
        state.metrics.client_disconnects.inc()
        raise ClientGone(request_ids[0])
    try:
        return task.result()
    except EngineBusy as exc:
        state.metrics.rejected_queue_full.inc()
        raise APIError(
            429,
            f"The server's request queue is full; retry later ({exc}).".replace(" ()", ""),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(state.retry_after_s)},
        ) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def _first(stream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _start(
    state: ServerState,
    request: Request,
    request_ids: list[str],
    prompt_ids: list[int],
    params: list[SamplingParams],
    images: list | None = None,
) -> list[tuple[Any, Any]]:
    """Submit one engine request per choice and wait for each one's first output; returns (stream, first
    output or None) per choice. With several choices (and prefix caching on) the first runs alone until its
    first token: its prompt is then in the prefix cache (exact reuse keeps the logits of the prompt's last position), so
    the other choices compute no prompt token again. Any refusal aborts the choices already started."""
    streams: list = []
    extra = {}  # a disaggregated worker: prefill computes the prompt here; decode starts from a hand-off
    if state.disaggregation is not None:
        extra = await state.disaggregation.engine_kwargs(state, request, request_ids, prompt_ids, params, images)
    # without a prefix cache there is nothing to share: every choice starts at once (nor from a hand-off)
    share = (
        len(request_ids) > 1
        and not extra
        and getattr(getattr(state.engine, "config", None), "enable_prefix_caching", False)
    )

    async def begin():
        firsts = []
        if share:
            streams.append(state.async_engine.generate(request_ids[0], prompt_ids, params[0], images))
            firsts.append(await _first(streams[0]))
        for request_id, p in zip(request_ids[len(streams) :], params[len(streams) :]):
            streams.append(state.async_engine.generate(request_id, prompt_ids, p, images, **extra))
        rest = await asyncio.gather(*(_first(s) for s in streams[len(firsts) :]), return_exceptions=True)
        for item in rest:
            if isinstance(item, BaseException):
                raise item
        return firsts + rest

    try:
        outs = await _guarded(state, request, request_ids, begin())
    except BaseException:
        for stream in streams:
            await _close(stream)
        raise
    return list(zip(streams, outs))


async def _close(stream) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except Exception:
            pass


async def _outputs(stream, first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
    out = first
    while out is not None:
        yield out
        if out.finished:
            return
        try:
            out = await stream.__anext__()
        except StopAsyncIteration:
            return


def _usage(prompt_len: int, lasts: list[RequestOutput | None]) -> dict:
    """Usage over a request's choices: the prompt once (the first choice's cache hits: the later choices
    reuse the first's prompt and are not counted again), completion tokens of every choice."""
    completion = sum(len(last.token_ids) for last in lasts if last)
    last = lasts[0]
    prompt = last.num_prompt_tokens if last and last.num_prompt_tokens else prompt_len
    cached = last.num_cached_tokens if last else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _disconnected_response() -> JSONResponse:
    # Nobody reads this (the client has gone); 499 is the conventional "client closed request".
    return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)


def _sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


class _Timer:
    """A request's latencies, observed into the server's histograms as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics, self.t0, self.last = metrics, time.perf_counter(), None

    def output(self, out: RequestOutput):
        if not out.new_token_ids:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.t0)
        else:  # several tokens in one output share the gap
            gap = (now - self.last) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                self.metrics.inter_token.observe(gap)
        self.last = now

    def done(self, last: RequestOutput | None):
        if last is None or last.finish_reason in ("abort", "error"):
            return
        self.metrics.finished(
            e2e_s=time.perf_counter() - self.t0,
            queue_time_s=last.queue_time_s,
            prompt_tokens=last.num_prompt_tokens,
            generation_tokens=len(last.token_ids),
        )


async def _merged(started: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several choices' streams as they arrive (one stream: in order)."""
    if len(started) == 1:
        async for out in _outputs(*started[0]):
            yield 0, out
        return
    iters = [_outputs(stream, first) for stream, first in started]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):  # ties in choice order
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            await it.aclose()


async def _stream_body(
    state: ServerState, request_ids: list[str], started: list, timers: list[_Timer], on_output, on_end, frame=None
):
    """The SSE body shared by both endpoints, over one engine request per choice: `on_output(i, out)` and
    `on_end(lasts)` return lists of payloads. Aborts the requests that did not finish; an engine failure
    mid-stream becomes an error event (and ends the other choices). `frame(payload)` writes one payload
    (default `_sse`: a bare `data:` line)."""
    frame = frame or _sse
    n = len(started)
    finished = [False] * n
    lasts: list[RequestOutput | None] = [None] * n
    source = _merged(started)
    try:
        async for i, out in source:
            timers[i].output(out)
            lasts[i] = out
            if out.finish_reason == "error":  # failed in the engine (logged there under its request id)
                finished[i] = True
                yield frame(error_body(internal_error_message(request_ids[i]), "server_error", None, "internal_error"))
                yield "data: [DONE]\n\n"
                return
            for payload in on_output(i, out):
                yield frame(payload)
            finished[i] = out.finished
        finished = [True] * n
        for timer, last in zip(timers, lasts):
            timer.done(last)
        for payload in on_end(lasts):
            yield frame(payload)
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        if not all(finished):
            state.metrics.client_disconnects.inc()
        raise
    except Exception as exc:  # the response has started: report in-band, as OpenAI-style servers do
        log.error("request %s failed while streaming", request_ids[0], exc_info=(type(exc), exc, exc.__traceback__))
        yield frame(error_body(internal_error_message(request_ids[0]), "server_error", None, "internal_error"))
        yield "data: [DONE]\n\n"
    finally:
        for request_id, done in zip(request_ids, finished):
            if not done:
                state.async_engine.abort(request_id)
        await _close(source)  # first: its reads of the streams end before the streams are closed
        for stream, _ in started:
            await _close(stream)


async def _run_to_end(
    state: ServerState,
    request: Request,
    request_ids: list[str],
    prompt_ids,
    params: list[SamplingParams],
    timers: list[_Timer],
    images: list | None = None,
) -> list[list[RequestOutput]] | None:
    """Every output of each choice of a non-streamed request, or None when the client went away first."""
    try:
        started = await _start(state, request, request_ids, prompt_ids, params, images)
    except ClientGone:
        return None
    try:
        outs = await _guarded(
            state, request, request_ids, asyncio.gather(*(_collect(s, f, t) for (s, f), t in zip(started, timers)))
        )
    except ClientGone:
        return None
    finally:
        for stream, _ in started:
            await _close(stream)
    for timer, o in zip(timers, outs):
        timer.done(o[-1] if o else None)
    return list(outs)


async def _collect(stream, first: RequestOutput | None, timer: _Timer) -> list[RequestOutput]:
    """Every output of one started choice (run inside `_guarded`)."""
    outs = []
    try:
        async for out in _outputs(stream, first):
            timer.output(out)
            outs.append(out)
    finally:
        await _close(stream)
    return outs


def _last(outs: list[RequestOutput], request_id: str) -> RequestOutput:
    if not outs:
        raise APIError(500, "the engine returned no output")
    last = outs[-1]
    if last.finish_reason == "error":  # failed in the engine, which logged it under request_id
        raise APIError(
            500, internal_error_message(request_id), code="internal_error", headers={"X-Request-Id": request_id}
        )
    if last.finish_reason == "abort":
        raise APIError(503, "the request was aborted by the engine", code="aborted")
    return last
