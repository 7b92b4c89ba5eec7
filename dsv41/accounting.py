"""Parameter and KV-cache accounting from a config (spec-v41.md §2, §8, §9, §12).

Counts are logical parameters (an FP4 byte holds two), without quantisation scales. The vision tower +
aligner and the DSpark drafter are counted from their built modules (on the meta device).

Active parameters per token:
- decode: every backbone layer (attention incl. compressor/indexer, router, top-k routed + shared
  experts, norms, hyper-connection projections), the Engram key/value projections and the LM head.
  Embedding rows and Engram table rows are lookups, not counted (as in the published 16B figure);
- prefill (CED, spec §9): encoder layers 0..L/2-1, the Engram projections and layer L/2's compressor and
  index-key projection per prompt token; the decoder runs only on the last `window` tokens (bounded
  replay), which vanishes per token for long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.model.cache import fixed_state_bytes_per_sequence, global_kv_bytes_per_token


@dataclass
class LayerParams:
    attention: int
    compressor: int
    indexer: int
    router: int
    routed_experts: int
    routed_active: int
    shared_expert: int
    norms_and_hc: int
    engram_projection: int
    engram_table: int

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.compressor
            + self.indexer
            + self.router
            + self.routed_experts
            + self.shared_expert
            + self.norms_and_hc
            + self.engram_projection
            + self.engram_table
        )

    @property
    def active(self) -> int:
        return (
            self.attention
            + self.compressor
            + self.indexer
            + self.router
            + self.routed_active
            + self.shared_expert
            + self.norms_and_hc
            + self.engram_projection
        )


def layer_params(cfg: ModelConfig, layer: int, engram_rows: int = 0) -> LayerParams:
    d, h, hd, q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    attention = h + d * q + q + q * h * hd + d * hd + hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    compressor = indexer = 0
    if layer < cfg.n_layers and layer in cfg.kv_source_layers:
        compressor = d * hd * (2 if cfg.compress_ratios[layer] > 1 else 1) + hd
    if layer < cfg.n_layers and layer in cfg.index_source_layers:
        indexer = q * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_n_heads
        if layer in cfg.kv_source_layers:
            indexer += hd * cfg.index_head_dim + cfg.index_head_dim
    n_exp, k = cfg.moe_shape(layer)
    expert = 3 * d * cfg.moe_inter_dim
    router = n_exp * d + n_exp * (2 if cfg.vision_enabled else 1)
    n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
    norms_and_hc = 2 * d + 2 * (n_mix * cfg.hc_mult * d + n_mix + 3)
    engram_projection = engram_table = 0
    if layer < cfg.n_layers and layer in cfg.engram_layer_ids:
        engram_projection = cfg.n_hash_columns * cfg.engram_head_dim * d * (cfg.hc_mult + 1) + 2 * cfg.hc_mult * d
        engram_table = engram_rows * cfg.engram_head_dim
    return LayerParams(
        attention,
        compressor,
        indexer,
        router,
        n_exp * expert,
        k * expert,
        expert,
        norms_and_hc,
        engram_projection,
        engram_table,
    )


def vision_params(cfg: ModelConfig) -> int:
    """ViT + aligner + the three image-span embeddings (`vision.*`, `aligner.*`, `image_*`), counted from
    the built modules (dsv41.vision, on the meta device). With the Flash shapes this makes the total equal
    the published checkpoint count exactly."""
    if not cfg.vision_enabled:
        return 0
    from dsv41.vision.vit import Aligner, VisionTransformer

    with torch.device("meta"):
        vit = VisionTransformer(
            cfg.vision_dim,
            cfg.vision_n_layers,
            cfg.vision_n_heads,
            cfg.vision_inter_dim,
            cfg.vision_patch_size,
            cfg.vision_rope_theta,
        )
        aligner = Aligner(cfg.vision_dim, cfg.dim, cfg.vision_downsample_ratio)
    return sum(p.numel() for m in (vit, aligner) for p in m.parameters()) + 3 * cfg.dim


def dspark_params(cfg: ModelConfig) -> int:
    """DSpark drafter under mtp.* (spec §12b), counted from the built modules (on the meta device, so no
    memory): per stage a ratio-0 block with its own MoE; stage 0 adds main_proj and main_norm; the last
    stage a norm, the Markov head and the confidence head. Packed FP4 bytes count two parameters."""
    if not cfg.drafter_stages:
        return 0
    from dsv41.model.dspark import DSparkStage
    from dsv41.ops import RotaryTable

    rope = RotaryTable(cfg.rope_head_dim, cfg.rope_theta)
    with torch.device("meta"):
        stages = [DSparkStage(cfg, k, rope) for k in range(cfg.drafter_stages)]
    return sum(
        p.numel() * (2 if p.dtype == torch.int8 else 1)
        for stage in stages
        for name, p in stage.named_parameters()
        if not name.endswith(".scale")
    )


def account(cfg: ModelConfig) -> dict:
    """Every figure `dsv41 info` prints, as a JSON-ready dict."""
    from dsv41.model.engram import EngramLayout

    layout = EngramLayout.from_config(cfg)
    rows = dict(zip(cfg.engram_layer_ids, layout.table_rows())) if layout else {}
    layers = [layer_params(cfg, i, rows.get(i, 0)) for i in range(cfg.n_layers)]
    embed = head = cfg.vocab_size * cfg.dim
    final_norm = cfg.dim
    engram_tables = sum(lp.engram_table for lp in layers)
    backbone_layers = sum(lp.total for lp in layers) - engram_tables
    vision = vision_params(cfg)
    dspark = dspark_params(cfg)
    backbone = backbone_layers + embed + head + final_norm + vision
    total = backbone + engram_tables + dspark

    decode_active = sum(lp.active for lp in layers) + head + final_norm
    half = cfg.n_layers // 2
    prefill_active = sum(lp.active for lp in layers[:half])
    if half < cfg.n_layers and half in cfg.kv_source_layers:
        # the decoder's global KV source: its compressor and index-key projection see every prompt token
        decoder_source = layers[half]
        prefill_active += decoder_source.compressor
        prefill_active += cfg.head_dim * cfg.index_head_dim + cfg.index_head_dim
    prefill_active += sum(lp.engram_projection for lp in layers[half:])

    kv = global_kv_bytes_per_token(cfg)
    breakdown = {
        "routed_experts": sum(lp.routed_experts for lp in layers),
        "attention": sum(lp.attention + lp.compressor + lp.indexer for lp in layers),
        "shared_experts": sum(lp.shared_expert for lp in layers),
        "routers": sum(lp.router for lp in layers),
        "norms_and_hc": sum(lp.norms_and_hc for lp in layers) + final_norm,
        "embed_and_head": embed + head,
        "engram_projections": sum(lp.engram_projection for lp in layers),
        "vision": vision,
    }
    return {
        "params_total": total,
        "params_backbone": backbone,
        "params_engram_tables": engram_tables,
        "params_dspark": dspark,
        "params_active_decode": decode_active,
        "params_active_prefill": prefill_active,
        "backbone_breakdown": breakdown,
        "kv_bytes_per_token": kv["total"],
        "kv_bytes_per_token_by_component": {"compressed_kv": kv["compressed_kv"], "index_k": kv["index_k"]},
        "fixed_state_bytes_per_sequence": fixed_state_bytes_per_sequence(cfg),
        "attention_modes": {
            mode: sum(cfg.attention_mode(i) == mode for i in range(cfg.n_layers))
            for mode in ("swa", "full", "reindex", "reuse")
        },
    }


def format_table(cfg_name: str, acc: dict) -> str:
    def b(n: float) -> str:
        return f"{n / 1e9:10.3f} B" if n >= 1e8 else f"{n / 1e6:10.3f} M"

    lines = [f"dsv41 accounting: {cfg_name}", "", "parameters"]
    lines.append(f"  total (backbone + Engram tables + DSpark)  {b(acc['params_total'])}  ({acc['params_total']:,})")
    lines.append(f"  backbone                                   {b(acc['params_backbone'])}")
    for key, value in acc["backbone_breakdown"].items():
        lines.append(f"    {key:<40} {b(value)}")
    lines.append(f"  Engram tables                              {b(acc['params_engram_tables'])}")
    lines.append(f"  DSpark drafter                             {b(acc['params_dspark'])}")
    lines.append(f"  active per decode token                    {b(acc['params_active_decode'])}")
    lines.append(f"  active per prefill token (CED)             {b(acc['params_active_prefill'])}")
    lines.append("")
    lines.append("persistent global KV cache, bytes per token")
    for key, value in acc["kv_bytes_per_token_by_component"].items():
        lines.append(f"  {key:<42} {value:10.1f}")
    lines.append(f"  {'total':<42} {acc['kv_bytes_per_token']:10.1f}")
    lines.append("")
    lines.append("fixed per-sequence state, bytes")
    for key, value in acc["fixed_state_bytes_per_sequence"].items():
        lines.append(f"  {key:<42} {value:10,d}")
    modes = ", ".join(f"{k} {v}" for k, v in acc["attention_modes"].items())
    lines.append("")
    lines.append(f"attention modes: {modes}")
    return "\n".join(lines)
