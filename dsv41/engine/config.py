"""Engine settings (a dataclass, like the model config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    block_size: int = 64  # tokens per KV block (a multiple of every compress ratio)
    kv_pool_tokens: int = 262_144  # capacity of the global-KV pool; it is also the prefix-cache budget
    max_num_seqs: int = 32  # running sequences per step
    max_num_batched_tokens: int = 1024  # tokens per step (decode tokens + prefill chunks)
    prefill_chunk_size: int = 512  # prefill chunk boundaries are fixed multiples of this
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings, capped by the pool
    prefill_mode: str = "bounded"  # "bounded": CED bounded replay (spec §2.1); "full": all layers on all tokens
    enable_prefix_caching: bool = True
    window_ttl_s: float = 300.0  # how long a finished request's window rings are kept
    max_snapshots: int = 256  # message-boundary snapshots kept (LRU)
    batch_invariant: bool = True  # fixed-row GEMMs so a request's output does not depend on its batch
    row_chunk: int = 16

    def validate(self) -> None:
        for name in ("block_size", "kv_pool_tokens", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_mode not in ("bounded", "full"):
            raise ValueError(f"EngineConfig.prefill_mode must be 'bounded' or 'full', got {self.prefill_mode!r}")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError("EngineConfig.prefill_chunk_size must not exceed max_num_batched_tokens")
        if self.kv_pool_tokens < self.block_size:
            raise ValueError("EngineConfig.kv_pool_tokens must hold at least one block")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be > 0, got {self.max_model_len}")
