"""Request-level types of the inference engine: sampling parameters and streamed outputs.

Field names follow the OpenAI API and vLLM's `SamplingParams`, so server code maps them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the request types stay importable without loading torch
    import torch


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint (structured outputs, enforced tool calls; `dsv41.engine.grammar`):
    an llguidance grammar, compiled and checked by the server, and the token id after which it applies
    (`</think>` in thinking mode: the reasoning is never constrained), None: from the first token."""

    grammar: str
    start_after: int | None = None
    kind: str = "grammar"  # what it came from (json_schema, regex, choice, tool_call, ...), for logs


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 (or anything below 1e-5) is greedy; top_k 0
    disables top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # stop strings; the match is cut from the text
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request (kept in ids)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's logprob plus the top n
    # None: none; n >= 0: every prompt token's logprob given the tokens before it, plus the top n (vLLM's
    # prompt_logprobs; always the model's own distribution). Such a request computes its whole prompt
    # itself, every layer at every position: it reads nothing from the prefix cache and skips bounded replay.
    prompt_logprobs: int | None = None
    # Logit processing before temperature (vLLM's order, `sampling.process_logits`): min_tokens holds back
    # EOS and stop_token_ids, logit_bias adds to single ids, then the penalties. presence/frequency count
    # generated tokens only; repetition_penalty also tokens of the prompt (divides positive logits of seen
    # tokens, multiplies negative ones). These apply to greedy requests too.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # no EOS / stop id / stop string before this many generated tokens
    min_p: float = 0.0  # after temperature: drop tokens below min_p x the top token's probability
    # tokens outside the grammar are set to -inf after the logit processing; EOS only where it accepts
    structured: GrammarSpec | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024  # ids per request: every step of the request adds each one
    LOGIT_BIAS_RANGE = 100.0  # OpenAI's range, -100..100
    PENALTY_RANGE = 2.0  # presence/frequency: OpenAI's range, -2..2
    MAX_REPETITION_PENALTY = 2.0
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-self.PENALTY_RANGE <= value <= self.PENALTY_RANGE):  # NaN fails too
                raise ValueError(f"{name} must be in [-{self.PENALTY_RANGE:g}, {self.PENALTY_RANGE:g}], got {value}")
        if not (0.0 < self.repetition_penalty <= self.MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be in (0, {self.MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias accepts at most {self.MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not (0 <= token < vocab_size):
                raise ValueError(
                    f"logit_bias has token id {token!r}, outside this model's vocabulary [0, {vocab_size})"
                )
            if not (-self.LOGIT_BIAS_RANGE <= bias <= self.LOGIT_BIAS_RANGE):
                raise ValueError(
                    f"logit_bias values must be in [-{self.LOGIT_BIAS_RANGE:g}, "
                    f"{self.LOGIT_BIAS_RANGE:g}], got {bias} for token {token}"
                )
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured outputs: the grammar decides where the output ends"
            )
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > self.MAX_STOP:
            raise ValueError(f"stop accepts at most {self.MAX_STOP} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(len(s) > self.MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings may be at most {self.MAX_STOP_CHARS} characters long")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids accepts at most {self.MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if any(not (0 <= t < vocab_size) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab_size})")

    @property
    def processes_logits(self) -> bool:
        """Whether any logit processing before temperature applies (see `sampling.process_logits`)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.structured is not None
        )


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]  # (id, text, logprob), best first
    # EngineConfig.logprobs_mode "processed": the ids the token could have been drawn from (int64,
    # ascending; greedy: the argmax), None when top-k/top-p cut nothing away
    support: torch.Tensor | None = None


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (see `error`)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose prefill was skipped thanks to the prefix cache
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # finish_reason "error": what failed (for logs, not for clients)
    queue_time_s: float | None = None  # on the final output: seconds from arrival to first admission
    # EngineConfig.record_routing, on the final output: the expert ids every MoE layer picked at every
    # position the engine computed, int [positions, n_layers, k] (positions 0 .. prompt + output - 2), and
    # the (start, end) spans it computed them in, in order (prefill chunks, then one per decode step)
    routed_experts: torch.Tensor | None = None
    spans: list | None = None
    preemptions: int = 0  # times the request was preempted and recomputed
    # SamplingParams.prompt_logprobs, on every output once the prompt is computed: entry i is prompt token
    # i's logprob given tokens 0..i-1 (entry 0, which has no context, is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # a prefill-only request (disaggregation), on its final output (finish_reason "handoff"): the
    # dsv41.engine.handoff.KVHandoff a decode engine continues from
    handoff: object | None = None
