"""Engine settings (a dataclass, like the model config).

Each field's `metadata["help"]` says what it does; `dsv41 generate/chat/serve` turn every field into an
option with that text (`dsv41.cli`), so the explanation lives next to the default it explains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFILL_MODES = ("bounded", "full")
LOGPROBS_MODES = ("raw", "processed")
VERIFY_MODES = ("auto", "on", "off")
KERNEL_MODES = ("background", "now", "off")
NUMERICS_MODES = ("fast", "deterministic", "reference")


@dataclass
class EngineConfig:
    block_size: int = field(
        default=64,
        metadata={
            "help": (
                "tokens per KV-cache block, the unit of allocation and of prefix-cache sharing; a multiple of every "
                "compress ratio of the model"
            )
        },
    )
    kv_pool_tokens: int = field(
        default=262_144,
        metadata={
            "help": (
                "capacity of the global-KV pool in tokens, shared by all running requests and the prefix cache "
                "(finished requests' blocks stay cached until the space is needed); also caps the context length. "
                "Memory: about 890 bytes per token for flash, less for smaller models"
            )
        },
    )
    max_num_seqs: int = field(
        default=32,
        metadata={
            "help": ("most requests running at once (decoding or prefilling); further requests wait in the queue")
        },
    )
    max_num_batched_tokens: int = field(
        default=1024,
        metadata={
            "help": (
                "token budget of one engine step: one token per decoding request plus prefill chunks; larger "
                "admits long prompts faster at the cost of per-step latency for running requests"
            )
        },
    )
    prefill_chunk_size: int = field(
        default=512,
        metadata={
            "help": (
                "prompts are prefilled in chunks ending at multiples of this, so a request's numerics do not depend "
                "on what it is batched with; at most --max-num-batched-tokens"
            )
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": (
                "context limit per request, prompt and output together "
                "(default: the model's max_position_embeddings, capped by --kv-pool-tokens)"
            )
        },
    )
    prefill_mode: str = field(
        default="bounded",
        metadata={
            "choices": PREFILL_MODES,
            "help": (
                "'bounded': V4.1's bounded-replay prefill (the decoder layers run only over the last window "
                "of the prompt; faster); 'full': every layer over every prompt token"
            ),
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": (
                "reuse the KV cache of earlier requests that share a prompt prefix (whole blocks and "
                "message-boundary snapshots)"
            )
        },
    )
    exact_prefix_reuse: bool = field(
        default=True,
        metadata={
            "help": (
                "a prefix-cache hit must compute exactly what a miss would (same tokens out): it resumes only from "
                "a snapshot whose window state is kept and, in bounded mode, that ends before the last window of "
                "the prompt (or was made with the same decoder start). --no-exact-prefix-reuse also resumes from "
                "whole blocks alone, rebuilding the windows by an approximate replay: more reuse, not identical"
            )
        },
    )
    window_ttl_s: float = field(
        default=300.0,
        metadata={
            "help": (
                "seconds a finished request's sliding-window state is kept for a follow-up that continues it; "
                "after that the snapshot can no longer be resumed from exactly (with --no-exact-prefix-reuse a hit "
                "rebuilds the window by replaying the last window of tokens)"
            )
        },
    )
    max_snapshots: int = field(
        default=256,
        metadata={
            "help": (
                "most message-boundary snapshots (partial last block + window state of a finished prompt or "
                "reply) kept for prefix caching, least recently used dropped first; 0 keeps none"
            )
        },
    )
    numerics: str = field(
        default="fast",
        metadata={
            "choices": NUMERICS_MODES,
            "help": (
                "'fast': this machine's fastest kernels; a request's tokens can change in the last bits with "
                "what shares its batch (like vLLM and SGLang by default). 'deterministic' (also "
                "--deterministic): the same tokens and log-probs alone, batched, chunked, prefix-cached and "
                "speculatively verified, at a measured cost (docs/numerics.md). 'reference': the golden sets' "
                "canonical float64 numerics, for parity checks only (several times slower)"
            ),
        },
    )
    row_chunk: int = field(
        default=16,
        metadata={
            "help": ("rows per GEMM chunk under --numerics deterministic; changing it changes the numerics slightly")
        },
    )
    fused_kernels: str = field(
        default="now",
        metadata={
            "choices": KERNEL_MODES,
            "help": (
                "when to build the fused CPU kernels (dsv41.ops.fused; bit-identical to the eager ops, checked "
                "on this machine; 3-6 s with a warm compiler cache, 15-30 s cold): 'now' before the first "
                "request, 'background' on a thread while the eager ops serve (no start-up wait; `serve`'s "
                "default), 'off' not at all (`chat` and `generate`'s default: a short process does not repay the "
                "build; also DSV41_FUSED=0)"
            ),
        },
    )

    fast_gemm: str = field(
        default="auto",
        metadata={
            "choices": ("auto", "bf16"),
            "help": (
                "under --numerics fast: 'auto' runs small (decode) calls of bf16 layers as fp32 GEMMs over fp32 "
                "copies of their weights where a probe on this machine (cached on disk) found them faster, as "
                "on CPUs without bf16 instructions; 'bf16' always runs the bf16 GEMM (no copies)"
            ),
        },
    )
    compile_decode: str = field(
        default="off",
        metadata={
            "choices": KERNEL_MODES,
            "help": (
                "under --numerics fast, compile the token-wise parts of decode steps into one graph per batch "
                "bucket (1, 2, 4, 8, 16, 32, 48, ... up to the largest decode or verify forward of --max-num-seqs; "
                "dsv41.engine.compiled): 'now' before the first request "
                "(seconds per bucket with a warm compiler cache, a minute or more cold), 'background' on a thread "
                "while the eager ops serve (`serve`'s default), 'off' not at all (the default elsewhere: a short "
                "process does not repay the build; docs/engine-speed.md). Under --numerics deterministic (off by default, "
                "`serve` included), 'now' and 'background' both compile the token-wise regions at one tile shape for "
                "every forward before the first request, in a single-process engine (CompiledTiles: other bits than "
                "the eager ops, and an engine never switches while it serves; docs/numerics.md)"
            ),
        },
    )

    speculative: bool = field(
        default=False,
        metadata={
            "help": (
                "DSpark speculative decoding with the checkpoint's drafter (mtp.*): each step drafts up to "
                "dspark_block_size tokens per request and verifies them in one target pass; greedy output is "
                "identical to plain decoding, sampling keeps the target distribution"
            )
        },
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata={
            "help": (
                "most tokens drafted per step with --speculative (default and maximum: the model's dspark_block_size)"
            )
        },
    )
    speculative_min_confidence: float = field(
        default=0.0,
        metadata={
            "help": (
                "with --speculative, verify only the leading draft positions whose predicted acceptance (the "
                "drafter's confidence head, running product of sigmoids) is at least this; 0 verifies every draft"
            )
        },
    )
    batched_verify: str = field(
        default="auto",
        metadata={
            "choices": VERIFY_MODES,
            "help": (
                "with --speculative, how drafts are verified (the same tokens and bits either way): 'on' runs a "
                "draft of n tokens as n batched decode steps of the attention (every request's i-th token in step "
                "i), 'off' attends each request's draft on its own, 'auto' batches when a step has more drafts to "
                "verify than the longest draft has tokens (fewer attention calls; measured in "
                "benchmarks/bench_speculative.py)"
            ),
        },
    )

    logprobs_mode: str = field(
        default="raw",
        metadata={
            "choices": LOGPROBS_MODES,
            "help": (
                "what a request's logprobs describe: 'raw' the model's own distribution (OpenAI's logprobs); "
                "'processed' the distribution each token was drawn from (after temperature, top-k and top-p, "
                "renormalised), with the kept ids, what an RL learner's importance ratios need"
            ),
        },
    )
    record_routing: bool = field(
        default=False,
        metadata={
            "help": (
                "return, with each finished request, the expert ids every MoE layer picked at every position and "
                "the chunk spans the engine computed (for an RL learner's router replay, dsv41.rl); needs "
                "--prefill-mode full, no prefix caching and no speculative decoding, so that every position is "
                "computed by the request itself and the learner can replay exactly that computation"
            )
        },
    )

    def validate(self) -> None:
        for name in ("block_size", "kv_pool_tokens", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"EngineConfig.prefill_mode must be 'bounded' or 'full', got {self.prefill_mode!r}")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError("EngineConfig.prefill_chunk_size must not exceed max_num_batched_tokens")
        if self.kv_pool_tokens < self.block_size:
            raise ValueError("EngineConfig.kv_pool_tokens must hold at least one block")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 0.0 <= self.speculative_min_confidence <= 1.0:
            raise ValueError(
                f"EngineConfig.speculative_min_confidence must be in [0, 1], got {self.speculative_min_confidence}"
            )
        if self.fused_kernels not in KERNEL_MODES:
            raise ValueError(f"EngineConfig.fused_kernels must be one of {KERNEL_MODES}, got {self.fused_kernels!r}")
        if self.fast_gemm not in ("auto", "bf16"):
            raise ValueError(f"EngineConfig.fast_gemm must be 'auto' or 'bf16', got {self.fast_gemm!r}")
        if self.compile_decode not in KERNEL_MODES:
            raise ValueError(f"EngineConfig.compile_decode must be one of {KERNEL_MODES}, got {self.compile_decode!r}")
        if self.numerics not in NUMERICS_MODES:
            raise ValueError(f"EngineConfig.numerics must be one of {NUMERICS_MODES}, got {self.numerics!r}")
        if self.row_chunk <= 0:
            raise ValueError(f"EngineConfig.row_chunk must be > 0, got {self.row_chunk}")
        if self.batched_verify not in VERIFY_MODES:
            raise ValueError(f"EngineConfig.batched_verify must be one of {VERIFY_MODES}, got {self.batched_verify!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.record_routing:
            if self.prefill_mode != "full":
                raise ValueError(
                    "EngineConfig.record_routing needs prefill_mode='full' (a bounded-replay "
                    "prefill skips the decoder layers on most prompt positions)"
                )
            if self.enable_prefix_caching:
                raise ValueError(
                    "EngineConfig.record_routing needs enable_prefix_caching=False (a cache hit "
                    "skips the positions whose routing would be recorded)"
                )
            if self.speculative:
                raise ValueError("EngineConfig.record_routing does not work with speculative decoding")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be > 0, got {self.max_model_len}")
