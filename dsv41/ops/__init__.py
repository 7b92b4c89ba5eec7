"""Tensor kernels behind stable signatures; each module holds the pure-PyTorch reference.

Faster implementations (Triton, fused CUDA) can replace these functions one by one as long as they keep
the documented shapes and numerics.
"""

from dsv41.ops import canonical, linear_cpu, mhc
from dsv41.ops.engram_hash import ngram_hash
from dsv41.ops.gemm import (
    dequant_weight,
    grouped_linear,
    invariant_matmul,
    linear,
)
from dsv41.ops.indexer import (
    block_maxima,
    blocks_to_mask,
    candidate_blocks,
    candidate_entries,
    candidate_pool,
    index_scores,
    index_scores_gathered,
    index_scores_mm,
    mask_invisible,
    merge_topk,
    select_topk,
    topk_canonical,
)
from dsv41.ops.moe import clamped_swiglu, route, router_scores
from dsv41.ops.paged import (
    PagedCache,
    gather_picked,
    paged_index_scores,
    paged_sparse_attn,
)
from dsv41.ops.quant import fp4_qdq, fp4_quant, fp8_qdq, fp8_quant
from dsv41.ops.reductions import mean_of_squares, sum_fp32_terms
from dsv41.ops.rope import RotaryTable, apply_rope
from dsv41.ops.sinkhorn import hc_split_sinkhorn
from dsv41.ops.sparse_attn import dense_decode_attn, sparse_attn

__all__ = [
    "canonical",
    "linear_cpu",
    "mhc",
    "ngram_hash",
    "dequant_weight",
    "grouped_linear",
    "invariant_matmul",
    "linear",
    "candidate_pool",
    "index_scores",
    "mask_invisible",
    "block_maxima",
    "blocks_to_mask",
    "candidate_entries",
    "index_scores_gathered",
    "index_scores_mm",
    "merge_topk",
    "select_topk",
    "topk_canonical",
    "candidate_blocks",
    "clamped_swiglu",
    "route",
    "router_scores",
    "fp4_qdq",
    "fp4_quant",
    "fp8_qdq",
    "fp8_quant",
    "mean_of_squares",
    "sum_fp32_terms",
    "RotaryTable",
    "apply_rope",
    "hc_split_sinkhorn",
    "sparse_attn",
    "dense_decode_attn",
    "PagedCache",
    "gather_picked",
    "paged_index_scores",
    "paged_sparse_attn",
]
