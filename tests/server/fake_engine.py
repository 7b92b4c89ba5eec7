"""A scripted stand-in for `LLMEngine` + `AsyncEngine`: it "generates" a fixed text one token at a time,
so the server's text handling (reasoning / content / DSML tool calls, stop, logprobs) can be tested with
known model output. The real engine (random weights) only produces noise."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from dsv41.engine.types import RequestOutput, TokenLogprob
from dsv41.tokenizer import ByteTokenizer


class FakeEngine:
    model_name = "fake-model"

    def __init__(self, vocab_size: int = 1024, max_model_len: int = 4096):
        self.tokenizer = ByteTokenizer(vocab_size)
        self.model_config = SimpleNamespace(vocab_size=vocab_size, vision_enabled=False)
        self.max_model_len = max_model_len
        self._grammar_compiler = None

    @property
    def grammar_compiler(self):  # as LLMEngine's: structured outputs are compiled and checked by the server
        if self._grammar_compiler is None:
            from dsv41.engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler


class FakeAsyncEngine:
    """`script` is the completion text; `delay` seconds between tokens. Records what it was asked."""

    def __init__(self, script: str = "Hello there", delay: float = 0.0, busy_exc=None):
        self.script, self.delay, self.busy_exc = script, delay, busy_exc
        self.requests: list[tuple[str, list[int], object]] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self._lock = threading.Lock()

    def start(self):
        pass

    def shutdown(self):
        pass

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.running:
                self.running.discard(request_id)
                self.aborted.append(request_id)

    def metrics(self) -> dict:
        return {
            "waiting": 0,
            "running": len(self.running),
            "kv_usage": 0.25,
            "prefix_cache_hit_rate": 0.5,
            "generation_tokens_total": 7,
            "requests_finished_total": 3,
        }

    async def generate(self, request_id, prompt_token_ids, params, images=None):
        if images:
            raise AssertionError("a text-only fake engine was handed images")
        if self.busy_exc is not None:
            raise self.busy_exc
        tok = FakeEngine().tokenizer
        self.requests.append((request_id, list(prompt_token_ids), params))
        ids = tok.encode(self.script, add_bos=False)[: params.max_tokens]
        self.running.add(request_id)
        done = False
        try:
            text = ""
            for k in range(len(ids)):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if request_id not in self.running:
                    return
                full = tok.decode(ids[: k + 1])
                new_text, text = full[len(text) :], full
                finished = k == len(ids) - 1
                lps = []
                if params.logprobs is not None:
                    top = [(ids[k], tok.decode([ids[k]]), -0.5), (5, tok.decode([5]), -1.5)][: params.logprobs]
                    lps = [TokenLogprob(ids[k], tok.decode([ids[k]]), -0.5, top)]
                yield RequestOutput(
                    request_id,
                    [ids[k]],
                    new_text,
                    ids[: k + 1],
                    text,
                    finished=finished,
                    finish_reason=("length" if len(ids) == params.max_tokens else "stop") if finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=2,
                    new_logprobs=lps,
                )
            done = True
        finally:  # like AsyncEngine: leaving the iteration early aborts the request
            if not done:
                self.abort(request_id)
            self.running.discard(request_id)
