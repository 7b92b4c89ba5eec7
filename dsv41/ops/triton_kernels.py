"""Triton kernels for the decode hot path (issue 12; spec-v41.md §3 step 4, §4, §8), behind the same
shapes and numerics as their pure-PyTorch references in dsv41.ops.

- `fp4_dequant_bf16`: packed E2M1 codes + per-block scales -> bf16 (reference: ops.quant.fp4_dequant_bf16).
  Exact, so it must match bit for bit.
- `index_scores_paged`: the indexer's decode scores read straight from the paged pool's packed FP4 keys
  through a block table (no dequantised copy of the keys is made): per head the exact FP4 x FP4 dot
  product in fp32, rounded to bf16, ReLU, times the head weight (rounded to bf16), summed over heads in
  fp32 in head order, rounded to bf16; -inf past each sequence's visible entries (reference:
  ops.index_scores on the dequantised keys, then the visibility mask). Bit for bit, because every
  rounding point is the reference's and the dot products are exact.
- `sparse_attn_decode`: one query token per sequence over its listed rows, the reference kernel's
  online softmax in blocks of 64 indices with bf16-rounded probabilities and the per-head sink
  (reference: ops.sparse_attn). Its 512-wide fp32 dot products are summed in another order than the
  reference's GEMM, so it agrees to fp32 rounding, not bit for bit.

No GPU has been available to this project's sessions so far: these kernels are checked only under
`TRITON_INTERPRET=1` on CPU (tests/ops/test_triton.py), at small shapes. Import this module only when
Triton is installed (the `triton` extra).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv41.ops.quant import FP4_BLOCK


@triton.jit
def _e2m1_value(code):
    """E2M1 code (int32, 0..15) -> fp32 value: sign bit 3, exponent bits 1-2, mantissa bit 0."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32, so that the final `.to(tl.bfloat16)`
    is exact. Written out in integer ops because Triton's interpreter truncates in its fp32 -> bf16
    conversion (GPUs round to nearest even); this way both give the reference's bits."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_dequant_kernel(
    codes_ptr, scale_ptr, out_ptr, n_rows, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HALF)  # byte index: values 2i (low nibble) and 2i + 1 (high nibble)
    live = rows[:, None] < n_rows
    byte = tl.load(codes_ptr + rows[:, None] * HALF + cols[None, :], mask=live, other=0).to(tl.int32)
    scale = tl.load(
        scale_ptr + rows[:, None] * (2 * HALF // BLOCK) + (2 * cols[None, :]) // BLOCK, mask=live, other=0.0
    )
    low = (_e2m1_value(byte & 15) * scale).to(tl.bfloat16)
    high = (_e2m1_value(byte >> 4) * scale).to(tl.bfloat16)
    base = out_ptr + rows[:, None] * (2 * HALF) + 2 * cols[None, :]
    tl.store(base, low, mask=live)
    tl.store(base + 1, high, mask=live)


def fp4_dequant_bf16(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """packed uint8 [..., K/2], scale [..., K/block] (any float dtype) -> bf16 [..., K]."""
    half = packed.size(-1)
    codes = packed.reshape(-1, half).contiguous()
    scales = scale.reshape(-1, scale.size(-1)).float().contiguous()
    out = torch.empty(codes.size(0), 2 * half, dtype=torch.bfloat16, device=packed.device)
    rows = 16
    _fp4_dequant_kernel[(triton.cdiv(codes.size(0), rows),)](
        codes, scales, out, codes.size(0), HALF=half, BLOCK=block, ROWS=rows
    )
    return out.view(*packed.shape[:-1], 2 * half)


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    codes_ptr,
    scale_ptr,
    table_ptr,
    visible_ptr,
    out_ptr,
    max_blocks,
    n_out,
    H: tl.constexpr,
    HALF: tl.constexpr,
    PER: tl.constexpr,
    TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    entries = tl.program_id(1) * TILE + tl.arange(0, TILE)
    visible = tl.load(visible_ptr + seq)
    live = entries < visible
    block = tl.load(table_ptr + seq * max_blocks + entries // PER, mask=live, other=0)
    rows = block * PER + entries % PER
    cols = tl.arange(0, HALF)
    byte = tl.load(codes_ptr + rows[:, None] * HALF + cols[None, :], mask=live[:, None], other=0).to(tl.int32)
    # UE8M0 scale of the 32 values (16 bytes) each byte belongs to: 2^(raw - 127)
    raw = tl.load(scale_ptr + rows[:, None] * (HALF // 16) + cols[None, :] // 16, mask=live[:, None], other=127)
    scale = tl.exp2((raw.to(tl.int32) - 127).to(tl.float32))
    low = _e2m1_value(byte & 15) * scale  # [TILE, HALF] key values at even dims, exact in fp32
    high = _e2m1_value(byte >> 4) * scale  # odd dims
    acc = tl.zeros([TILE], dtype=tl.float32)
    for h in tl.static_range(H):  # head order, like the reference's sum over heads
        q_even = tl.load(q_ptr + (seq * H + h) * 2 * HALF + 2 * cols).to(tl.float32)
        q_odd = tl.load(q_ptr + (seq * H + h) * 2 * HALF + 2 * cols + 1).to(tl.float32)
        dot = tl.sum(low * q_even[None, :] + high * q_odd[None, :], axis=1)  # exact: FP4 x FP4 products
        head = tl.maximum(_round_bf16(dot), 0.0)
        weight = tl.load(w_ptr + seq * H + h).to(tl.float32)
        acc += _round_bf16(head * weight)
    score = tl.where(live, _round_bf16(acc), float("-inf"))
    tl.store(out_ptr + seq * n_out + entries, score.to(tl.bfloat16), mask=entries < n_out)


def index_scores_paged(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    tables: torch.Tensor,
    entries_per_block: int,
    visible: torch.Tensor,
    n_out: int,
) -> torch.Tensor:
    """Decode index scores from the packed pool.

    q [B, H, D] bf16 (FP4-rounded, RoPE'd); weights [B, H] bf16 (already scaled); key_codes uint8
    [rows, D/2] and key_scale uint8 [rows, D/32] (raw UE8M0 bytes) of one kv source; tables [B, max_blocks]
    int64 block ids; visible [B] entries each sequence may see. Returns bf16 [B, n_out], -inf at and past
    `visible` (what `ops.index_scores` + the visibility mask give on the dequantised keys).
    """
    b, h, d = q.shape
    out = torch.empty(b, n_out, dtype=torch.bfloat16, device=q.device)
    tile = 32
    _index_scores_kernel[(b, triton.cdiv(n_out, tile))](
        q.contiguous(),
        weights.contiguous(),
        key_codes,
        key_scale,
        tables.contiguous(),
        visible.contiguous(),
        out,
        tables.size(1),
        n_out,
        H=h,
        HALF=d // 2,
        PER=entries_per_block,
        TILE=tile,
    )
    return out


@triton.jit
def _sparse_attn_kernel(
    q_ptr,
    kv_ptr,
    sink_ptr,
    idx_ptr,
    out_ptr,
    n_rows,
    scale,
    N_IDX: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * H + head) * D + dims).to(tl.float32)
    running_max = tl.max(tl.full([BLOCK], -1e30, dtype=tl.float32), axis=0)  # 0-d fp32
    denom = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    out = tl.zeros([D], dtype=tl.float32)
    for start in tl.static_range(0, N_IDX, BLOCK):  # the index count is fixed per layer (window + top-k)
        slots = start + tl.arange(0, BLOCK)
        idx = tl.load(idx_ptr + seq * N_IDX + slots, mask=slots < N_IDX, other=-1)
        valid = idx != -1
        rows = tl.load(
            kv_ptr + (seq * n_rows + tl.where(valid, idx, 0))[:, None] * D + dims[None, :],
            mask=valid[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK, D]
        logits = tl.sum(rows * q[None, :], axis=1)
        logits = tl.where(valid, logits, float("-inf")) * scale
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(logits - new_max)
        denom = denom * rescale + tl.sum(probs, axis=0)
        rounded = _round_bf16(probs)  # the reference multiplies V by bf16 probabilities
        out = out * rescale + tl.sum(rounded[:, None] * rows, axis=0)
        running_max = new_max
    sink = tl.load(sink_ptr + head)
    denom = denom + tl.exp(sink - running_max)
    tl.store(out_ptr + (seq * H + head) * D + dims, _round_bf16(out / denom).to(tl.bfloat16))


def sparse_attn_decode(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [B, 1, H, D] bf16; kv [B, N, D] bf16; attn_sink [H] fp32; indices [B, 1, K] (-1 unused) ->
    bf16 [B, 1, H, D], like ops.sparse_attn for one query per sequence."""
    b, m, h, d = q.shape
    if m != 1:
        raise ValueError(f"sparse_attn_decode takes one query per sequence, got {m}")
    out = torch.empty(b, 1, h, d, dtype=torch.bfloat16, device=q.device)
    _sparse_attn_kernel[(b, h)](
        q.contiguous(),
        kv.contiguous(),
        attn_sink.float().contiguous(),
        indices.to(torch.int32).contiguous(),
        out,
        kv.size(1),
        softmax_scale,
        N_IDX=indices.size(-1),
        H=h,
        D=d,
        BLOCK=64,
    )
    return out
