"""The persistent per-sequence decode state of a V4.1 model (spec-v41.md §8).

Exactly what the model needs between calls, and nothing it can recompute:
- every layer's sliding-window ring of post-RoPE, FP8-rounded KV  [B, window, head_dim] (and one per
  DSpark drafter stage, holding backbone rows);
- for each kv-source layer (spec §2: 2, 8, 14, 20 in Flash): the compressed KV latents
  [B, max_len/ratio, head_dim] (post-RoPE, FP4-rounded) and the indexer keys [B, max_len/ratio, index_head_dim];
- for each ratio-2 kv source: the partial compression group (kv and gate scores, fp32 [B, ratio, head_dim]);
- the Engram compressed-id history [B, max_len] (the hash at p needs ids p-3..p).

The values live in bf16 containers holding exactly the FP8/FP4-representable numbers the reference
stores; `bytes_per_token` reports the logical (packed) size, which is what a packed cache would take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.config import ModelConfig


@dataclass
class ModelCache:
    batch_size: int
    max_seq_len: int
    window_kv: list[torch.Tensor]  # per layer [B, window, head_dim] bf16
    compressed_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [B, max/ratio, head_dim]
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [B, max/ratio, index_head_dim]
    group_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # ratio>1 source -> [B, ratio, head_dim] fp32
    group_score: dict[int, torch.Tensor] = field(default_factory=dict)  # same shape, -inf when empty
    engram_ids: torch.Tensor | None = None  # [B, max_len] int64 compressed ids

    @classmethod
    def create(cls, cfg: ModelConfig, batch_size: int, max_seq_len: int, device=None) -> ModelCache:
        if batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(f"cache needs batch_size > 0 and max_seq_len > 0, got {batch_size}, {max_seq_len}")
        bf16 = dict(dtype=torch.bfloat16, device=device)
        # one ring per layer; the DSpark stages (layer ids n_layers..) hold backbone rows for the drafter
        window = [
            torch.zeros(batch_size, cfg.window_size, cfg.head_dim, **bf16)
            for _ in range(cfg.n_layers + cfg.drafter_stages)
        ]
        cache = cls(batch_size, max_seq_len, window)
        for layer in cfg.kv_source_layers:
            ratio = cfg.compress_ratios[layer]
            rows = max_seq_len // ratio
            cache.compressed_kv[layer] = torch.zeros(batch_size, rows, cfg.head_dim, **bf16)
            cache.index_k[layer] = torch.zeros(batch_size, rows, cfg.index_head_dim, **bf16)
            if ratio > 1:
                shape = (batch_size, ratio, cfg.head_dim)
                cache.group_kv[layer] = torch.zeros(shape, dtype=torch.float32, device=device)
                cache.group_score[layer] = torch.full(shape, -torch.inf, dtype=torch.float32, device=device)
        if cfg.engram_layer_ids:
            cache.engram_ids = torch.zeros(batch_size, max_seq_len, dtype=torch.int64, device=device)
        return cache

    # The storage protocol the attention layers use (the engine's paged FP4 cache implements the same).
    def window_first(self, layer: int) -> int:
        """First position the layer's window may hold (always 0 here; later after a bounded replay)."""
        return 0

    def window_read(self, layer: int, b: int) -> torch.Tensor:
        return self.window_kv[layer][:b]

    def window_write(self, layer: int, b: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.window_kv[layer][:b, slots] = values

    def group_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.group_kv[layer], self.group_score[layer]

    def write_compressed(self, layer: int, b: int, first: int, kv: torch.Tensor, keys: torch.Tensor | None) -> None:
        n = kv.size(1)
        self.compressed_kv[layer][:b, first : first + n] = kv
        if keys is not None:
            self.index_k[layer][:b, first : first + n] = keys

    def read_compressed(self, layer: int, b: int, n: int) -> torch.Tensor:
        return self.compressed_kv[layer][:b, :n]

    def read_index_keys(self, layer: int, b: int, n: int, start: int = 0) -> torch.Tensor:
        return self.index_k[layer][:b, start:n]

    def read_index_keys_at(self, layer: int, b: int, entries: torch.Tensor) -> torch.Tensor:
        """Index keys of given entries per batch row: entries [b, ...] int64 -> [b, ..., index_head_dim]."""
        keys = self.index_k[layer][:b]
        rows = torch.arange(b, device=keys.device).view(b, *[1] * (entries.dim() - 1))
        return keys[rows, entries]

    def read_selected(
        self, layer: int, b: int, n: int, ids: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed rows a query set reads and ids into them (here: all n rows, ids unchanged)."""
        return self.compressed_kv[layer][:b, :n], ids

    def check_fits(self, batch_size: int, start_pos: int, length: int) -> None:
        if batch_size > self.batch_size:
            raise ValueError(f"batch of {batch_size} does not fit a cache made for {self.batch_size}")
        if start_pos < 0 or start_pos + length > self.max_seq_len:
            raise ValueError(
                f"positions {start_pos}..{start_pos + length - 1} do not fit a cache of max_seq_len {self.max_seq_len}"
            )


def global_kv_bytes_per_token(cfg: ModelConfig) -> dict[str, float]:
    """Persistent global-cache bytes per token, by component, in the stored formats of spec §8:
    main KV E2M1 + one E4M3 scale per 16 channels; index keys E2M1 + one UE8M0 per 32."""
    main = index = 0.0
    for layer in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[layer]
        main += (cfg.head_dim // 2 + cfg.head_dim // 16) / ratio
        index += (cfg.index_head_dim // 2 + cfg.index_head_dim // 32) / ratio
    return {"compressed_kv": main, "index_k": index, "total": main + index}


def fixed_state_bytes_per_sequence(cfg: ModelConfig) -> dict[str, int]:
    """Per-sequence state that does not grow with length: SWA rings as FP8 + UE8M0 per 32 (logical),
    the same in the reference's bf16 container, and the ratio-2 partial groups (fp32 kv + score)."""
    n_layers = cfg.n_layers + cfg.n_mtp_layers
    slot_fp8 = cfg.head_dim + cfg.head_dim // 32
    groups = sum(
        2 * 4 * cfg.compress_ratios[s] * cfg.head_dim for s in cfg.kv_source_layers if cfg.compress_ratios[s] > 1
    )
    return {
        "window_fp8": n_layers * cfg.window_size * slot_fp8,
        "window_bf16_container": n_layers * cfg.window_size * cfg.head_dim * 2,
        "compressor_partial_groups": groups,
    }
