"""An asyncio front for `LLMEngine`: the engine steps in one background thread, requests arrive from
any event loop, and each request's outputs stream back through its own asyncio queue.

All engine calls happen on the engine thread (the engine itself is not thread-safe); other threads
only put commands on a queue. Cancelling a `generate` iteration (e.g. a client that disconnects)
aborts the request, which frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from dsv41.engine.llm_engine import LLMEngine
from dsv41.engine.types import RequestOutput, SamplingParams


class EngineBusy(RuntimeError):
    """The waiting queue is full; retry later."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._metrics: dict = engine.metrics()
        self._pending = 0  # submitted but not yet seen by the engine thread
        # requests that can run at once (a data-parallel front: the sum over its ranks)
        self.max_running = engine.config.max_num_seqs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def metrics(self) -> dict:
        with self._lock:
            m = dict(self._metrics)
            m["waiting"] += self._pending
        return m

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list | None = None,
        **disaggregation,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises ValueError for bad input, EngineBusy when the queue is full.
        `images`: (start, ImagePatches) pairs, as LLMEngine.add_request takes them; `disaggregation`:
        its handoff / export_handoff arguments (dsv41.engine.handoff)."""
        params.validate(self.engine.model_config.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.engine.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context limit is "
                f"{self.engine.max_model_len} tokens, prompt and output together"
            )
        with self._lock:
            # requests that can start at once (free run slots) do not count against the waiting queue
            free_slots = max(0, self.max_running - self._metrics["running"])
            if self._metrics["waiting"] + self._pending >= self.max_waiting + free_slots:
                raise EngineBusy(f"{self.max_waiting} requests are already waiting")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            loop = asyncio.get_running_loop()
            stream: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (loop, stream)
            self._pending += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), params, images, disaggregation))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Thread-safe: cancel a request (no-op if it already finished)."""
        self._commands.put(("abort", request_id))

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the client's loop is gone
                pass

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, images, disaggregation = command
            try:
                self.engine.add_request(request_id, prompt, params, images, **disaggregation)
                queued = 1
            except ValueError as exc:
                self._deliver(request_id, exc)
                queued = 0
            with self._lock:  # hand the request from "pending" to "waiting" in one move (no gap to slip through)
                self._pending -= 1
                self._metrics["waiting"] += queued
        elif kind == "abort":
            self.engine.abort_request(command[1])

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                self._handle(command)
                while True:  # drain everything that arrived
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001
                    # The engine isolates a failing request itself (finish_reason "error"); an exception
                    # that still gets here is a bug in its bookkeeping, and must not hang every client.
                    for request_id in list(engine.requests):
                        engine.abort_request(request_id)
                        self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"))
                    outputs = []
                for out in outputs:
                    self._deliver(out.request_id, out)
            with self._lock:
                self._metrics = engine.metrics()
