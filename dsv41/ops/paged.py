"""Decode attention over the packed, paged compressed cache, behind one signature (spec-v41.md §3 step 4,
§4, §8; issue 30).

The engine's pool (dsv41.engine.kv_pool) keeps each kv-source layer's compressed entries as packed E2M1
codes with E4M3 scales per 16 (main KV) and E2M1 with UE8M0 scales per 32 (index keys), in blocks that a
per-sequence block table addresses. A decode step needs three things from it per layer: the indexer's
scores over the visible (or candidate) entries, the selected entries' KV, and the sparse attention over
the window rows plus those entries. Here each is one call that takes the packed pages and the padded
block tables, so the engine hands its tables down once per call instead of gathering rows, dequantising
and re-shaping in its own code; a kernel that gathers and dequantises inside (the Triton ones in
dsv41.ops.triton_kernels) can replace a reference below without the engine changing.

The references gather the packed bytes of exactly the rows they need and dequantise them straight to bf16
(exact: an E2M1 value times its scale has at most 6 significant bits), so their results are those of the
model's own bf16 cache, bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from dsv41.ops import index_cpu
from dsv41.ops.indexer import index_scores_mm
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_dequant_bf16
from dsv41.ops.sparse_attn import sparse_attn


@dataclass(frozen=True)
class PagedCache:
    """One kv-source layer's packed storage; flat row r = block * entries_per_block + entry."""

    kv_codes: torch.Tensor  # [rows, head_dim/2] uint8, two E2M1 codes per byte
    kv_scale: torch.Tensor  # [rows, head_dim/16] float8_e4m3fn
    key_codes: torch.Tensor  # [rows, index_dim/2] uint8
    key_scale: torch.Tensor  # [rows, index_dim/32] uint8 (UE8M0 bits)
    entries_per_block: int

    @property
    def num_blocks(self) -> int:
        return self.kv_codes.size(0) // self.entries_per_block


def page_rows(tables: torch.Tensor, entries: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Flat pool rows of entries [B, T] (int64, inside each sequence's table) through tables [B, max_blocks]."""
    return tables.gather(1, entries // entries_per_block) * entries_per_block + entries % entries_per_block


def gather_kv(pages: PagedCache, rows: torch.Tensor) -> torch.Tensor:
    """Main KV at flat rows (any shape [...]) -> bf16 [..., head_dim]."""
    if _gather_kernel_serves(pages.kv_codes, rows):  # the same bits in one pass
        return index_cpu.gather_fp4(pages.kv_codes, pages.kv_scale.view(torch.uint8), rows, ue8m0=False)
    return fp4_dequant_bf16(pages.kv_codes[rows], pages.kv_scale[rows].float(), KV_FP4_BLOCK)


def gather_keys(pages: PagedCache, rows: torch.Tensor) -> torch.Tensor:
    """Index keys at flat rows (any shape [...]) -> bf16 [..., index_dim]."""
    if _gather_kernel_serves(pages.key_codes, rows):
        return index_cpu.gather_fp4(pages.key_codes, pages.key_scale, rows, ue8m0=True)
    return fp4_dequant_bf16(pages.key_codes[rows], pages.key_scale[rows].view(torch.float8_e8m0fnu).float(), FP4_BLOCK)


def _gather_kernel_serves(codes: torch.Tensor, rows: torch.Tensor) -> bool:
    """The C++ gather (`index_cpu.gather_fp4`) for uint8 codes on a CPU, where its library is already built."""
    return codes.dtype == torch.uint8 and not codes.is_cuda and not rows.is_cuda and index_cpu.loaded(build=False)


def block_keys(pages: PagedCache, blocks: torch.Tensor) -> torch.Tensor:
    """Index keys of whole blocks: block ids [..., nb] -> bf16 [..., nb * entries_per_block, index_dim] in
    entry order (one gather per block; entries past what was written hold stale values: mask them)."""
    per = pages.entries_per_block
    codes = pages.key_codes.view(pages.num_blocks, per, -1)[blocks]  # [..., nb, per, d/2]
    scale = pages.key_scale.view(pages.num_blocks, per, -1)[blocks].view(torch.float8_e8m0fnu).float()
    return fp4_dequant_bf16(codes, scale, FP4_BLOCK).flatten(-3, -2)


def paged_index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    pages: PagedCache,
    tables: torch.Tensor,
    visible: torch.Tensor,
    entries: torch.Tensor | None = None,
    usable: torch.Tensor | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """The indexer's decode scores read from the packed keys.

    q [B, 1, H, d] bf16 (RoPE'd, MXFP4-rounded); weights [B, 1, H] bf16 (scaled); tables [B, max_blocks]
    int64; visible [B] entries each sequence may see. entries: None to score entries 0..max(visible)-1 (a
    Full index layer's scan, read a whole block at a time), or [B, 1, n] int64 entry ids to score (a
    Reindex layer's candidates; ids past a sequence's end are allowed and masked), with `usable` [B, 1, n]
    bool when some ids are padding (`ops.candidate_entries`). Returns bf16 [B, 1, n], -inf where an entry
    is not visible or not usable (`ops.index_scores` on the dequantised keys, then the mask).

    fast: the scan by the Triton kernel that scores the packed keys in place (`triton_kernels.index_scores_paged`,
    the same bits); None uses it on a GPU when Triton is installed, True forces it (its tests run it under
    Triton's CPU interpreter).
    """
    b = q.size(0)
    if entries is None and (fast or (fast is None and q.is_cuda and _triton_kernels() is not None)):
        kernels = _triton_kernels()
        if kernels is None:
            raise RuntimeError("paged_index_scores(fast=True) needs Triton (pip install dsv41[triton])")
        scores = kernels.index_scores_paged(
            q[:, 0],
            weights[:, 0],
            pages.key_codes,
            pages.key_scale,
            tables,
            pages.entries_per_block,
            visible,
            int(visible.max()),
        )
        return scores.unsqueeze(1)  # [B, 1, t]
    limit = visible.view(b, 1, 1)
    if _cpu_kernel_serves(q, pages):  # the same bits, read from the codes in place: a Full layer's every visible
        # entry, or a Reindex layer's candidates
        n = int(visible.max()) if entries is None else entries.size(-1)
        cut = (None, None) if entries is None else (entries[:, 0], None if usable is None else usable[:, 0])
        scores = index_cpu.paged_index_scores_cpu(
            q[:, 0], weights[:, 0], pages.key_codes, pages.key_scale, tables, pages.entries_per_block, visible, n, *cut
        )
        return scores.unsqueeze(1)  # [B, 1, n]
    if entries is None:
        t = int(visible.max())
        per = pages.entries_per_block
        keys = block_keys(pages, tables[:, : -(-t // per)])[:, :t]  # [B, t, d]
        usable = torch.arange(t, device=q.device).view(1, 1, t) < limit
    else:
        last = (limit - 1).clamp_min(0)
        keys = gather_keys(pages, page_rows(tables, torch.minimum(entries, last)[:, 0], pages.entries_per_block))
        usable = entries < limit if usable is None else usable & (entries < limit)
    return index_scores_mm(q, keys, weights).masked_fill(~usable, -torch.inf)


def _cpu_kernel_serves(q: torch.Tensor, pages: PagedCache) -> bool:
    """The C++ scan (dsv41.ops.index_cpu) where it is already built here with AVX512-VNNI: bf16 MXFP4 queries
    on a CPU, keys of at most 4 blocks of 32."""
    return pages.key_codes.dtype == torch.uint8 and index_cpu.fits(q) and index_cpu.available(build=False)


def paged_sparse_attn(
    q: torch.Tensor,
    window: torch.Tensor,
    window_ids: torch.Tensor,
    pages: PagedCache | None,
    tables: torch.Tensor,
    picked: torch.Tensor | None,
    attn_sink: torch.Tensor,
    softmax_scale: float,
    widths: list | None = None,
    selected: torch.Tensor | None = None,
    heads_per_call: int = 0,
) -> torch.Tensor:
    """One decode query per sequence over its window rows and its selected compressed entries.

    q [B, 1, H, D] bf16; window [B, W+1, D] bf16 (the ring as it was, then the new token); window_ids
    [B, 1, W] int (-1 before the window's first position); pages/tables/picked [B, 1, k] int64 (entry ids,
    -1 unused, unusable picks last): the compressed part, or pages None for a window-only layer. widths:
    None when every row lists all k picks, else (width, rows) groups (a lone decode lists
    min(k, visible entries), and the online softmax's block sums depend on that width). selected: the
    picked entries' KV [B, k, D] already gathered (Reuse layers attend exactly their source's selection).
    heads_per_call: as for `ops.sparse_attn`. Returns bf16 [B, 1, H, D] (`ops.sparse_attn` over
    cat(window, entries)).
    """
    if pages is None:
        return sparse_attn(q, window, attn_sink, window_ids.int(), softmax_scale, heads_per_call=heads_per_call)
    if selected is None:
        selected = gather_picked(pages, tables, picked)
    offset = window.size(1)
    rows = torch.cat([window, selected], dim=1)  # [B, W+1+k, D]
    comp_ids = torch.where(picked >= 0, offset + torch.arange(picked.size(-1), device=picked.device), -1)
    ids = torch.cat([window_ids, comp_ids], dim=-1).int()
    if not widths:
        return sparse_attn(q, rows, attn_sink, ids, softmax_scale, heads_per_call=heads_per_call)
    w = window_ids.size(-1)
    out = q.new_empty(q.shape)
    for k, group in widths:
        out[group] = sparse_attn(
            q[group], rows[group], attn_sink, ids[group, :, : w + k], softmax_scale, heads_per_call=heads_per_call
        )
    return out


def gather_picked(pages: PagedCache, tables: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """KV of picked entries [B, 1, k] (-1 unused: read as entry 0, masked by the attention) -> bf16 [B, k, D]."""
    return gather_kv(pages, page_rows(tables, picked[:, 0].clamp_min(0), pages.entries_per_block))


@functools.cache
def _triton_kernels():
    """dsv41.ops.triton_kernels when Triton is installed, else None (a constant per process)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from dsv41.ops import triton_kernels

    return triton_kernels
