"""Prefill/decode disaggregation, the worker side (`dsv41 serve MODEL --disaggregation-mode prefill|decode`).

A worker serves the ordinary OpenAI routes (so it can also be used alone) plus internal routes that the
front (`dsv41 router`, dsv41.server.router) drives:

- prefill worker: `POST /internal/prefill/v1/completions` and `/internal/prefill/v1/chat/completions` take
  the client's OpenAI body, validate and tokenize it exactly as the public route would (refusals are the
  same 4xx), compute the prompt (bounded replay, chunked, prefix cache) and answer the KV hand-off bytes
  (application/octet-stream, dsv41.engine.handoff's checksummed format). No token is sampled there.
- decode worker: `POST /internal/handoff` takes hand-off bytes, verifies every checksum, the model
  identity and the block shapes, and keeps the hand-off (at most `max_pending`, for `ttl_s`) under an id:
  200 `{"handoff_id": ...}`, or 422 with code `handoff_corrupt` naming the bad block. The client's body
  then goes to the ordinary `/v1/...` route with header `X-DSV41-Handoff: <id>`: the decode worker
  tokenizes it again and refuses (422 `handoff_mismatch`) a hand-off made for other tokens, else each
  choice's engine request starts from a copy of the hand-off (no prefill) and streams as usual. An
  unknown or expired id is 422 `handoff_missing`. In every refusal nothing was imported, so no token is
  produced from bad state.

With `--api-key` the internal routes need the key too (the router forwards the client's Authorization
header). The hand-off upload is exempt from the server's body cap and has its own: the largest hand-off
the engine's context allows (`max_handoff_bytes`).

Tokenizing on both sides costs a little CPU and buys a check that both workers built the same prompt
(same chat template, same tokenizer) before any state is trusted.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from dsv41.engine.handoff import HandoffError, KVHandoff, check_handoff
from dsv41.server.openapi import GENERATION_ERRORS, errors
from dsv41.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

MODES = ("prefill", "decode")
HANDOFF_HEADER = "x-dsv41-handoff"
HANDOFF_MEDIA_TYPE = "application/octet-stream"


class HandoffReady(Exception):
    """Raised out of the OpenAI handler on a prefill worker once the prompt is computed: the internal
    route answers with the hand-off instead of a completion."""

    def __init__(self, handoff: KVHandoff):
        super().__init__("hand-off ready")
        self.handoff = handoff


class HandoffStore:
    """Verified hand-offs waiting for their decode request: at most `max_pending` of them and `max_bytes`
    together (oldest dropped first), each for at most `ttl_s` seconds. Thread-safe (the upload is parsed off
    the event loop)."""

    def __init__(self, max_pending: int = 256, ttl_s: float = 120.0, max_bytes: int = 4 << 30):
        self.max_pending, self.ttl_s, self.max_bytes = max_pending, ttl_s, max_bytes
        self._items: OrderedDict[str, tuple[float, KVHandoff]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, handoff: KVHandoff) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._expire()
            self._items[key] = (time.monotonic(), handoff)
            self._bytes += handoff.nbytes()
            while len(self._items) > 1 and (len(self._items) > self.max_pending or self._bytes > self.max_bytes):
                self._drop_oldest()
        return key

    def _drop_oldest(self) -> None:
        _, (_, handoff) = self._items.popitem(last=False)
        self._bytes -= handoff.nbytes()

    def take(self, key: str) -> KVHandoff:
        with self._lock:
            self._expire()
            item = self._items.pop(key, None)
            if item is not None:
                self._bytes -= item[1].nbytes()
        if item is None:
            raise APIError(
                422,
                f"no KV hand-off {key!r} on this decode worker (never sent, already used, or "
                f"expired after {self.ttl_s:g} s)",
                code="handoff_missing",
            )
        return item[1]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items and now - next(iter(self._items.values()))[0] > self.ttl_s:
            self._drop_oldest()


class Disaggregation:
    """A worker's role; `create_app` keeps one on its ServerState, and its `_start` asks `engine_kwargs`."""

    def __init__(self, mode: str, store: HandoffStore | None = None):
        if mode not in MODES:
            raise ValueError(f"disaggregation mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.store = store or HandoffStore()
        self.exported = 0
        self.imported = 0

    async def engine_kwargs(
        self, state, request: Request, request_ids: list[str], prompt_ids: list[int], params: list, images
    ) -> dict:
        """What the engine requests of this HTTP request get: on an internal prefill route, the prompt is
        computed here and HandoffReady raised; with a hand-off header, the checked hand-off; else nothing
        (an ordinary colocated request)."""
        if request.scope.get("path", "").startswith("/internal/prefill/"):
            raise HandoffReady(await self._prefill(state, request, request_ids[0], prompt_ids, params[0], images))
        key = request.headers.get(HANDOFF_HEADER)
        if key is None:
            return {}
        if self.mode != "decode":
            raise APIError(422, "this worker is not a decode worker: it takes no KV hand-off", code="handoff_missing")
        handoff = self.store.take(key)
        try:
            # reads only fixed engine settings: thread-safe
            check_handoff(state.engine, handoff, prompt_ids, images)
        except HandoffError as exc:
            raise APIError(422, f"KV hand-off refused: {exc}", code="handoff_mismatch") from None
        self.imported += 1
        return {"handoff": handoff}

    async def _prefill(self, state, request: Request, request_id: str, prompt_ids: list[int], params, images):
        from dsv41.server.serving import _guarded

        async def run():
            stream = state.async_engine.generate(
                f"prefill-{request_id}", prompt_ids, params, images, export_handoff=True
            )
            try:
                async for out in stream:
                    if out.finished:
                        return out
            finally:
                await stream.aclose()
            return None

        out = await _guarded(state, request, [f"prefill-{request_id}"], run())
        if out is None or out.finish_reason != "handoff" or out.handoff is None:
            reason = None if out is None else out.finish_reason
            raise APIError(
                500,
                f"the prefill of {request_id} ended without a hand-off (finish reason {reason})",
                code="prefill_failed",
            )
        self.exported += 1
        return out.handoff


def max_handoff_bytes(engine) -> int:
    """The largest hand-off this engine can take: its context's packed entries, the fixed state, the logits,
    and the header (token ids as JSON, block list) with room to spare."""
    n = engine.max_model_len
    kv = sum(engine.pool.stored_bytes(layer, n // lay.ratio) for layer, lay in engine.pool.sources.items())
    return kv + engine.states.slot_bytes() + 4 * engine.model_config.vocab_size + 12 * n + (1 << 20)


def install_routes(app: FastAPI, disagg: Disaggregation) -> None:
    """The internal routes of a prefill or decode worker (see the module docstring)."""
    from dsv41.server import app as server_app

    state = app.state.server
    state.engine.identity()  # computed now (it reads every non-expert weight), not on the first request's loop
    if disagg.mode == "prefill":

        async def respond(call):
            try:
                await call
            except HandoffReady as ready:
                t0 = time.perf_counter()
                data = await anyio.to_thread.run_sync(ready.handoff.to_bytes)
                return Response(
                    data,
                    media_type=HANDOFF_MEDIA_TYPE,
                    headers={
                        "X-DSV41-Handoff-Kv-Bytes": str(ready.handoff.kv_bytes()),
                        "X-DSV41-Handoff-Tokens": str(len(ready.handoff.prompt_ids)),
                        "X-DSV41-Serialize-Ms": f"{(time.perf_counter() - t0) * 1e3:.3f}",
                    },
                )
            raise APIError(500, "the prefill route returned without a hand-off", code="prefill_failed")

        handoff = {200: {"description": "the KV hand-off", "content": {HANDOFF_MEDIA_TYPE: {}}}}
        prefill_responses = {**handoff, **GENERATION_ERRORS}

        @app.post("/internal/prefill/v1/completions", response_class=Response, responses=prefill_responses)
        async def prefill_completions(body: CompletionRequest, request: Request):
            return await respond(server_app._completions(state, body, request))

        @app.post("/internal/prefill/v1/chat/completions", response_class=Response, responses=prefill_responses)
        async def prefill_chat(body: ChatCompletionRequest, request: Request):
            return await respond(server_app._chat(state, body, request))

    else:
        limit = max_handoff_bytes(state.engine)

        @app.post(
            "/internal/handoff",
            openapi_extra={"requestBody": {"required": True, "content": {HANDOFF_MEDIA_TYPE: {}}}},
            responses=errors(413, 422),
        )
        async def receive_handoff(request: Request):
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise APIError(413, f"a KV hand-off for this engine is at most {limit} bytes", code="request_too_large")
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(
                        413, f"a KV hand-off for this engine is at most {limit} bytes", code="request_too_large"
                    )
                chunks.append(chunk)
            data = b"".join(chunks)
            identity = state.engine.identity()
            try:
                handoff = await anyio.to_thread.run_sync(lambda: KVHandoff.from_bytes(data, identity))
            except HandoffError as exc:
                raise APIError(422, f"KV hand-off refused: {exc}", code="handoff_corrupt") from None
            return {"handoff_id": disagg.store.put(handoff), "tokens": len(handoff.prompt_ids)}

    @app.get("/internal/disaggregation")
    async def info():
        await asyncio.sleep(0)
        return {
            "mode": disagg.mode,
            "handoffs_exported": disagg.exported,
            "handoffs_imported": disagg.imported,
            "handoffs_pending": len(disagg.store),
        }
