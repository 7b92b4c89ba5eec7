"""The disaggregation front: `dsv41 router --prefill URL... --decode URL...` (SGLang's shape).

It speaks the OpenAI API (`/v1/completions`, `/v1/chat/completions`, streamed or not, `/v1/models`,
`/health`, `/stats`) and holds no model. Per request: a prefill worker (round robin over the healthy ones)
validates, tokenizes and computes the prompt and answers the KV hand-off bytes; the bytes go to a decode
worker (`HandoffTransport.deliver`), which verifies every block's checksum before keeping them; then the
client's body goes to that decode worker's ordinary route with the hand-off's id, and its answer (SSE or
JSON) is relayed as it comes.

Failures, and what the client sees (never a hang: every call has a timeout):
- the prefill worker refuses the request (4xx: bad input) -> that answer, unchanged;
- a hand-off rejected by the decode side (corrupt, truncated, missing, other prompt: 422 handoff_*) ->
  the prompt is prefilled again, once (`handoff_retries`); a second rejection -> 502 `handoff_failed` with
  the decode worker's message (which names the bad block);
- a worker that cannot be reached, times out or answers 5xx before the response has started -> it is
  marked down for `retry_down_s` and the request moves to another worker (the hand-off bytes are kept,
  so a decode failover costs no prefill); none left -> 503 `no_worker`;
- a decode worker that dies while streaming -> an in-band error event (`decode_worker_failed`) and
  `[DONE]`; non-streamed -> 502. Its other requests fail the same way; new requests go to the others.
`/health` probes every worker: 200 while at least one prefill and one decode worker answer, else 503.

The transport is an interface: `HttpTransport` moves the bytes over HTTP (CPU, any network); a GPU
transfer (NIXL-style: the prefill worker registers its pages, the decode worker reads them one-sided)
plugs in by implementing `prefill` (returning a small descriptor instead of the bytes) and `deliver`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsv41.distributed.affinity import AffinityConfig, PrefixAffinity
from dsv41.server.disaggregation import HANDOFF_HEADER, HANDOFF_MEDIA_TYPE
from dsv41.server.protocol import error_body

log = logging.getLogger("dsv41.router")
FORWARDED_HEADERS = ("authorization", "content-type")


@dataclass
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    timeout_s: float = field(default=600.0, metadata={"help": "longest wait for a worker's next bytes"})
    connect_timeout_s: float = 5.0
    retry_down_s: float = 5.0  # a worker that failed is skipped this long, then tried again
    handoff_retries: int = 1  # re-prefills after a rejected hand-off
    # prefix-cache-aware choice of prefill worker (dsv41.distributed.affinity); False: round robin
    cache_aware: bool = True
    affinity: AffinityConfig = field(default_factory=lambda: AffinityConfig(chunk=64))

    def validate(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode worker URL")
        for url in self.prefill + self.decode:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("router timeouts must be > 0")


class WorkerFailed(Exception):
    """A worker could not be reached, timed out or answered 5xx."""


class Answered(Exception):
    """A worker gave a final answer to relay to the client as it is (a 4xx about the request)."""

    def __init__(self, status: int, body: bytes, headers: dict):
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers


class HandoffRejected(Exception):
    """The decode side refused the hand-off (422 handoff_*): the message names what was wrong."""


class HandoffTransport:
    """How a hand-off gets from a prefill worker to a decode worker. `prefill` runs the prompt and returns
    what `deliver` needs (here the bytes themselves); `deliver` returns the id the decode request cites."""

    async def prefill(self, worker: str, path: str, body: bytes, headers: dict) -> bytes:
        raise NotImplementedError

    async def deliver(self, worker: str, handoff: bytes, headers: dict) -> str:
        raise NotImplementedError


class HttpTransport(HandoffTransport):
    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def _post(self, url: str, **kw) -> httpx.Response:
        try:
            r = await self.client.post(url, **kw)
        except httpx.HTTPError as exc:
            raise WorkerFailed(f"{url}: {type(exc).__name__}: {exc}") from None
        if r.status_code >= 500:
            raise WorkerFailed(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        return r

    async def prefill(self, worker: str, path: str, body: bytes, headers: dict) -> bytes:
        r = await self._post(f"{worker}/internal/prefill{path}", content=body, headers=headers)
        if r.status_code != 200:
            raise Answered(r.status_code, r.content, _relayed_headers(r))
        if r.headers.get("content-type", "").split(";")[0] != HANDOFF_MEDIA_TYPE:
            raise WorkerFailed(f"{worker} answered {r.headers.get('content-type')!r}, not a KV hand-off")
        return r.content

    async def deliver(self, worker: str, handoff: bytes, headers: dict) -> str:
        auth = {k: v for k, v in headers.items() if k == "authorization"}
        r = await self._post(
            f"{worker}/internal/handoff", content=handoff, headers={**auth, "content-type": HANDOFF_MEDIA_TYPE}
        )
        if r.status_code == 422:
            raise HandoffRejected(_message(r.content))
        if r.status_code != 200:
            raise WorkerFailed(f"{worker}/internal/handoff: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["handoff_id"]


def _relayed_headers(r: httpx.Response) -> dict:
    """What a worker's refusal says besides its body: its type, and when to retry (429 queue full)."""
    out = {"content-type": r.headers.get("content-type", "application/json")}
    if "retry-after" in r.headers:
        out["retry-after"] = r.headers["retry-after"]
    return out


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        error_body(message, "server_error" if status >= 500 else "invalid_request_error", None, code),
        status_code=status,
    )


@dataclass
class RouterStats:
    requests: int = 0
    handoffs: int = 0
    handoff_bytes: int = 0
    prefill_s: float = 0.0  # prefill worker: validate, tokenize, compute the prompt, serialise, send back
    deliver_s: float = 0.0  # the bytes to the decode worker, checked and stored there
    handoff_rejections: int = 0
    reprefills: int = 0
    worker_failures: int = 0


class WorkerPool:
    """One role's workers, skipping those marked down (until `retry_down_s` passes): round robin, or with
    `affinity` the worker whose record matches the longest start of the prompt (`pick(keys=)`), else the one
    with the fewest requests in flight (`load`, kept by the caller)."""

    def __init__(self, urls: list[str], retry_down_s: float, affinity: PrefixAffinity | None = None):
        self.urls = [u.rstrip("/") for u in urls]
        self.down_until = {u: 0.0 for u in self.urls}
        self.retry_down_s = retry_down_s
        self.affinity = affinity
        self.load = {u: 0 for u in self.urls}
        self._next = 0

    def pick(self, exclude: set, keys: list | None = None) -> str | None:
        now = time.monotonic()
        live = [self.urls[(self._next + k) % len(self.urls)] for k in range(len(self.urls))]
        live = [u for u in live if u not in exclude and self.down_until[u] <= now]
        if not live:
            return None
        url = live[0] if self.affinity is None or keys is None else self.affinity.choose(live, keys, self.load)
        self._next = (self.urls.index(url) + 1) % len(self.urls)
        return url

    def mark_down(self, url: str) -> None:
        self.down_until[url] = time.monotonic() + self.retry_down_s
        if self.affinity is not None:
            self.affinity.forget(url)  # a restarted worker comes back with an empty cache

    def mark_up(self, url: str) -> None:
        self.down_until[url] = 0.0


def create_router(config: RouterConfig, transport: HandoffTransport | None = None) -> FastAPI:
    config.validate()
    # the prefill worker is where a prompt's prefix cache pays (it computes prompts); the decode side starts
    # every request from its hand-off and reads no prefix cache, so decode stays round robin
    affinity = PrefixAffinity(config.affinity) if config.cache_aware else None
    prefill = WorkerPool(config.prefill, config.retry_down_s, affinity)
    decode = WorkerPool(config.decode, config.retry_down_s)
    stats = RouterStats()
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256))
    transport = transport or HttpTransport(client)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="dsv41-router", lifespan=lifespan)
    app.state.stats, app.state.pools = stats, (prefill, decode)

    async def route(path: str, request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        try:
            streamed = bool(json.loads(body).get("stream"))
        except (ValueError, AttributeError):
            streamed = False  # the prefill worker answers the 400
        stats.requests += 1
        keys = affinity.keys(prompt_text(body)) if affinity is not None else None
        tried_prefill: set = set()
        tried_decode: set = set()
        rejections, handoff = 0, None
        while True:
            if handoff is None:
                worker = prefill.pick(tried_prefill, keys)
                if worker is None:
                    return _error(503, "no prefill worker is reachable", "no_worker")
                t0 = time.perf_counter()
                prefill.load[worker] += 1
                try:
                    handoff = await transport.prefill(worker, path, body, headers)
                except Answered as a:
                    return Response(a.body, status_code=a.status, headers=a.headers)
                except WorkerFailed as exc:
                    log.warning("prefill worker failed: %s", exc)
                    stats.worker_failures += 1
                    prefill.mark_down(worker)
                    tried_prefill.add(worker)
                    continue
                finally:
                    prefill.load[worker] -= 1
                stats.prefill_s += time.perf_counter() - t0
            target = decode.pick(tried_decode)
            if target is None:
                return _error(503, "no decode worker is reachable", "no_worker")
            t0 = time.perf_counter()
            try:
                handoff_id = await transport.deliver(target, handoff, headers)
                stats.deliver_s += time.perf_counter() - t0
                upstream = await _open(client, f"{target}{path}", body, {**headers, HANDOFF_HEADER: handoff_id})
            except HandoffRejected as exc:
                rejections += 1
                stats.handoff_rejections += 1
                log.warning("decode worker %s rejected a KV hand-off: %s", target, exc)
                if rejections > config.handoff_retries:
                    return _error(
                        502, f"the KV hand-off was rejected {rejections} times; last: {exc}", "handoff_failed"
                    )
                stats.reprefills += 1
                handoff = None  # prefill it again
                continue
            except WorkerFailed as exc:
                log.warning("decode worker failed: %s", exc)
                stats.worker_failures += 1
                decode.mark_down(target)
                tried_decode.add(target)
                continue
            stats.handoffs += 1
            stats.handoff_bytes += len(handoff)
            if upstream.status_code != 200:
                data = await upstream.aread()
                await upstream.aclose()
                return Response(data, status_code=upstream.status_code, headers=_relayed_headers(upstream))
            if streamed:
                return StreamingResponse(
                    _relay(upstream, target, decode),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            try:
                data = await upstream.aread()
            except httpx.HTTPError as exc:
                decode.mark_down(target)
                stats.worker_failures += 1
                return _error(
                    502, f"decode worker {target} failed before answering: {type(exc).__name__}", "decode_worker_failed"
                )
            finally:
                await upstream.aclose()
            return Response(data, status_code=200, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        for url in decode.urls:
            try:
                r = await client.get(f"{url}/v1/models", headers=headers, timeout=10)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.HTTPError:
                decode.mark_down(url)
        return _error(503, "no decode worker is reachable", "no_worker")

    @app.get("/health")
    async def health():
        async def probe(pool: WorkerPool, url: str) -> dict:
            try:
                ok = (await client.get(f"{url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            (pool.mark_up if ok else pool.mark_down)(url)
            return {"url": url, "healthy": ok}

        p = await asyncio.gather(*(probe(prefill, u) for u in prefill.urls))
        d = await asyncio.gather(*(probe(decode, u) for u in decode.urls))
        body = {"status": "ok", "prefill": list(p), "decode": list(d)}
        if not any(w["healthy"] for w in p) or not any(w["healthy"] for w in d):
            body["status"] = "unhealthy"
            body["error"] = error_body(
                "no healthy " + ("prefill" if not any(w["healthy"] for w in p) else "decode") + " worker",
                "server_error",
                None,
                "no_worker",
            )["error"]
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/stats")
    async def get_stats():
        out = dict(vars(stats))
        if affinity is not None:
            out.update(prefill_cache_choices=affinity.cache_choices, prefill_balance_choices=affinity.balance_choices)
        return out

    return app


def prompt_text(body: bytes) -> str:
    """What the prefix-aware choice hashes: the request's prompt as the client sent it. For a chat, the tools
    and then each message's canonical JSON, so a conversation's next turn (the same messages plus new ones)
    starts with the previous turn's text; for a completion, the prompt (text, or token ids written out)."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    if isinstance(req.get("messages"), list):
        head = json.dumps(req["tools"], sort_keys=True) if req.get("tools") else ""
        return head + "".join(json.dumps(m, sort_keys=True) for m in req["messages"])
    prompt = req.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt)[1:]  # a token-id list: "1, 2, 3, ..." (no closing bracket before the end)


async def _open(client: httpx.AsyncClient, url: str, body: bytes, headers: dict) -> httpx.Response:
    """Send the decode request and wait for its status line; 422 handoff_* -> HandoffRejected."""
    try:
        r = await client.send(client.build_request("POST", url, content=body, headers=headers), stream=True)
    except httpx.HTTPError as exc:
        raise WorkerFailed(f"{url}: {type(exc).__name__}: {exc}") from None
    if r.status_code >= 500 or r.status_code == 422:
        data = await r.aread()
        await r.aclose()
        if r.status_code == 422 and b"handoff_" in data:
            raise HandoffRejected(_message(data))
        if r.status_code >= 500:
            raise WorkerFailed(f"{url}: HTTP {r.status_code}: {data[:300]!r}")
        r = httpx.Response(r.status_code, content=data, headers=r.headers)
    return r


async def _relay(upstream: httpx.Response, worker: str, pool: WorkerPool) -> AsyncIterator[bytes]:
    """Forward the decode worker's SSE events whole; if it dies mid-stream, end with an error event."""
    pending = b""
    try:
        async for chunk in upstream.aiter_raw():
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut >= 0:
                yield pending[: cut + 2]
                pending = pending[cut + 2 :]
        if pending:
            yield pending
    except httpx.HTTPError as exc:
        pool.mark_down(worker)
        log.warning("decode worker %s failed mid-stream: %s", worker, exc)
        message = f"decode worker {worker} failed mid-stream ({type(exc).__name__}); the request is lost"
        yield f"data: {json.dumps(error_body(message, 'server_error', None, 'decode_worker_failed'))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        await upstream.aclose()
