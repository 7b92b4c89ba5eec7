"""One backbone block: (Engram) + attention and MoE sublayers joined by single-pass mHC (spec-v41.md §2,
§5, §6). The DSpark drafter's stages are blocks too (dsv41.model.dspark).

Single-pass mHC (spec §6): a block's attention collapses the copies with the `pre` mix computed by the
previous block's FFN (layer 0: one-hot on copy 0); the FFN collapses with the `pre` computed from this
block's attention input. `post` and `comb` of each sublayer expand its output back to the copies and
mix the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model.attention import Attention, _trace
from dsv41.model.engram import Engram
from dsv41.model.layers import RMSNorm
from dsv41.model.moe import MoE
from dsv41.ops import canonical


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: ops.RotaryTable, engram_rows: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.eps = cfg.norm_eps
        self.hc, self.sinkhorn_iters, self.hc_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.engram = Engram(cfg, layer_id, engram_rows) if engram_rows is not None else None
        self.attn = Attention(cfg, layer_id, rope)
        self.ffn = MoE(cfg, layer_id)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        n_mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        f32 = dict(dtype=torch.float32)
        self.hc_attn_fn = nn.Parameter(torch.zeros(n_mix, width, **f32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(n_mix, width, **f32))
        self.hc_attn_base = nn.Parameter(torch.zeros(n_mix, **f32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(n_mix, **f32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, **f32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, **f32))
        # canonical numerics (dsv41.ops.canonical) for the RMS statistic, the mix projection, Sinkhorn and the
        # hc collapse/expand sums: bit-exact on every CPU, slow (see Transformer.set_reference_numerics)
        self.reference_numerics = False
        self.row_chunk = 0  # > 0: batch-invariant mix projection (see ops.invariant_matmul)

    def hc_mixes(self, h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, calls=None):
        """h [B, S, hc, dim] -> (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc]), one RMS statistic per token.
        calls: the tokens' separate calls when several sequences' chunks share this one (dsv41.ops.lanes)."""
        flat = h.flatten(2).float()
        ref = self.reference_numerics
        rstd = ops.reductions.rsqrt(ops.mean_of_squares(flat, ref, keepdim=True) + self.eps, ref)
        if ref:
            mixes = canonical.linear(flat, fn) * rstd
        else:
            mixes = ops.invariant_matmul(flat, fn, self.row_chunk) * rstd
        return ops.hc_split_sinkhorn(mixes, scale, base, self.hc, self.sinkhorn_iters, self.hc_eps, calls, ref)

    @staticmethod
    def hc_pre(h: torch.Tensor, pre: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """Collapse the copies: [B,S,hc,dim] x [B,S,hc] -> [B,S,dim] in h's dtype (fp32 products, their sum
        in float64 under reference numerics; dsv41.ops.mhc)."""
        return ops.mhc.hc_pre(h, pre, reference)

    @staticmethod
    def hc_post(
        out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, reference: bool = False
    ) -> torch.Tensor:
        """copy_j = post_j * out + sum_i comb[i, j] * residual_i; [B,S,dim] -> [B,S,hc,dim] (dsv41.ops.mhc)."""
        return ops.mhc.hc_post(out, residual, post, comb, reference)

    def forward(
        self,
        h: torch.Tensor,
        pre_mix: torch.Tensor,
        attend,
        shared: dict,
        image_mask: torch.Tensor | None = None,
        engram_ids: torch.Tensor | None = None,
        capture=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, S, hc, dim] bf16, pre_mix [B, S, hc] fp32 -> (h, the FFN pre mix for the next block).

        attend: the normed attention input [B, S, dim] -> the attention output (the forward's attention
        backend, dsv41.model.forward); engram_ids [B, S, columns]: this block's Engram rows (applied first;
        inside the module call, so FSDP2's hooks cover the Engram tables too); capture: called with the
        stream entering the block after its Engram (the DSpark drafter's input)."""
        if engram_ids is not None and self.engram is not None:
            regions = shared.get("regions")  # a fast decode step's compiled regions (dsv41.engine.compiled)
            # the region reads an FP8 table in place (not one made trainable, nor one sharded over ranks)
            fp8_table = getattr(self.engram.embed, "scale", None) is not None
            if regions is not None and regions.engram is not None and image_mask is None and fp8_table:
                h = regions.engram(self.engram, h, engram_ids)
            else:
                calls = shared.get("token_calls")
                h = self.engram(h, engram_ids, None if image_mask is None else ~image_mask, calls)
            _trace(shared, f"hidden.layers.{self.layer_id}.engram_out", h)
        if capture is not None:
            capture(h)
        return self.run(h, pre_mix, attend, shared, image_mask)

    def run(
        self, h: torch.Tensor, pre_mix: torch.Tensor, attend, shared: dict, image_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block with the attention call supplied by the caller (`attend`: normed input -> output),
        so the engine can run one block over a ragged batch of sequences; `shared["token_calls"]` then
        lists each sequence chunk's token count, so every token's numbers are those of its chunk run
        alone (dsv41.ops.lanes)."""
        calls = shared.get("token_calls")
        regions = shared.get("regions")  # compiled token-wise regions of a fast decode step (dsv41.engine.compiled)
        residual = h
        ref = self.reference_numerics
        if regions is not None and (whole := regions.run_block(self, h, pre_mix, image_mask, shared)) is not None:
            return whole  # a decode step's block as two graphs around its sequence mixing
        if regions is not None:
            (attn_pre, attn_post, attn_comb), x = regions.pre_attention(self, h, pre_mix)
            x = attend(x)
            # the MoE joins the compiled region where the regions say it may (dsv41.engine.compiled)
            stacks = regions.stacks_for(self, image_mask, shared)
            if stacks is not None:
                return regions.post_attention_ffn(self, x, residual, attn_post, attn_comb, attn_pre, stacks)
            h, (ffn_pre, ffn_post, ffn_comb), x = regions.post_attention(
                self, x, residual, attn_post, attn_comb, attn_pre
            )
        else:
            attn_pre, attn_post, attn_comb = self.hc_mixes(
                h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, calls
            )
            x = attend(self.attn_input(h, pre_mix))
            _trace(shared, f"hidden.layers.{self.layer_id}.attn_out", x)
            h = self.hc_post(x, residual, attn_post, attn_comb, ref)
            ffn_pre, ffn_post, ffn_comb = self.hc_mixes(h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, calls)
            x = self.ffn_norm(self.hc_pre(h, attn_pre, ref))
        residual = h
        x = self.ffn(x, image_mask, shared.get("moe_aux"), calls)
        _trace(shared, f"hidden.layers.{self.layer_id}.ffn_out", x)
        h = self.hc_post(x, residual, ffn_post, ffn_comb, ref)
        return h, ffn_pre

    def attn_input(self, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """The normed attention input: the copies collapsed with the previous block's pre mix."""
        return self.attn_norm(self.hc_pre(h, pre_mix, self.reference_numerics))
