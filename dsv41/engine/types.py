"""Request-level types of the inference engine: sampling parameters and streamed outputs.

Field names follow the OpenAI API and vLLM's `SamplingParams`, so server code maps them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 (or anything below 1e-5) is greedy; top_k 0
    disables top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # stop strings; the match is cut from the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request (kept in ids)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: none; n >= 0: the chosen token's logprob plus the top n
    # None: none; n >= 0: every prompt token's logprob given the tokens before it, plus the top n (vLLM's
    # prompt_logprobs; always the model's own distribution). Such a request computes its whole prompt
    # itself, every layer at every position: it reads nothing from the prefix cache and skips bounded replay.
    prompt_logprobs: Optional[int] = None

    MAX_LOGPROBS = 20
    # Caps on what every step of the whole batch pays for: each stop string is searched for in new text
    # at each step, each stop id is checked per token. OpenAI allows 4 stop strings.
    MAX_STOP = 4
    MAX_STOP_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 256

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > self.MAX_STOP:
            raise ValueError(f"stop accepts at most {self.MAX_STOP} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(len(s) > self.MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings may be at most {self.MAX_STOP_CHARS} characters long")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids accepts at most {self.MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        if any(not (0 <= t < vocab_size) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab_size})")


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]  # (id, text, logprob), best first
    # EngineConfig.logprobs_mode "processed": the ids the token could have been drawn from (int64,
    # ascending; greedy: the argmax), None when top-k/top-p cut nothing away
    support: Optional["torch.Tensor"] = None


@dataclass
class RequestOutput:
    """One step's news about a request. `new_*` fields are the delta since the previous output;
    `text`/`token_ids` are everything generated so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" (see `error`)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose prefill was skipped thanks to the prefix cache
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: Optional[str] = None  # finish_reason "error": what failed (for logs, not for clients)
    queue_time_s: Optional[float] = None  # on the final output: seconds from arrival to first admission
    # EngineConfig.record_routing, on the final output: the expert ids every MoE layer picked at every
    # position the engine computed, int [positions, n_layers, k] (positions 0 .. prompt + output - 2), and
    # the (start, end) spans it computed them in, in order (prefill chunks, then one per decode step)
    routed_experts: Optional["torch.Tensor"] = None
    spans: Optional[list] = None
    preemptions: int = 0  # times the request was preempted and recomputed
    # SamplingParams.prompt_logprobs, on every output once the prompt is computed: entry i is prompt token
    # i's logprob given tokens 0..i-1 (entry 0, which has no context, is None)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
