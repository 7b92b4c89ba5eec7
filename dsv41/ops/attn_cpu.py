"""The sparse attention of a `fast` prefill chunk, and a compiled engine's decode-step and verify-chunk attention,
as C++ kernels on a CPU (attn_cpu.cpp beside this file).

`ops.sparse_attn` (the reference: the model's blocked online softmax with bf16 probabilities) gathers each
query's picked rows into a [queries, picks, D] tensor 64 picks at a time and runs a small batched GEMM per
query; on a 1,024-token chunk the gather and those GEMMs are about a third of the chunk's time. This kernel
reads each query's rows where they lie and does one fp32 softmax per query and head: the `fast` numerics of
decode (`ops.dense_decode_attn`), for a whole chunk. It is judged like every `fast` kernel, statistically
(docs/numerics.md), never by bits.

Built and loaded by `cpp_build` as `torch.ops.dsv41.sparse_attn_cpu`, `torch.ops.dsv41.decode_attn_cpu` (and its
in-place form over the engine's state pool, `decode_ring_attn_cpu`) and `torch.ops.dsv41.chunk_attn_cpu`; used only where they were built with the bf16 dot-product instructions
(`available`): the first by a model inside `Transformer.numerics(fast=True)` (the engine's `fast` mode), the
second by the compiled `fast` decode regions and the `deterministic` tiles (dsv41.engine.compiled), in place of
their `window_attention` graph, the third by `fast` verify chunks where the compiled regions serve.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import cpp_build


@functools.cache
def library() -> str | None:
    """The built kernel's path, its op registered, or None where it cannot be built or loaded."""
    return cpp_build.load("attn_cpu")


def available(build: bool = True) -> bool:
    """Is the kernel built here with the bf16 dot-product instructions? Builds it if needed; with build=False
    only a build already in the cache counts."""
    if not build and not cpp_build.is_built("attn_cpu"):
        return False
    return library() is not None and torch.ops.dsv41.sparse_attn_cpu_bf16_dot()


def fits(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """bf16 on a CPU with a head dim that is a whole number of 32-value dot products, and no gradient wanted
    (the kernel has no backward)."""
    return (
        q.device.type == "cpu"
        and q.dtype == kv.dtype == torch.bfloat16
        and q.size(-1) % 32 == 0
        and not (torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad))
    )


def sparse_attn_cpu(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [B, M, H, D] bf16, kv [B, N, D] bf16, attn_sink [H], indices [B, M, K] (-1 unused) -> bf16 [B, M, H, D]:
    sum_k softmax_k(scale * q . kv[idx_k]) * kv[idx_k], the sink in the denominator, in fp32 (`library()` must
    have loaded the kernel)."""
    return torch.ops.dsv41.sparse_attn_cpu(q, kv, attn_sink, indices, softmax_scale)


def decode_attn_cpu(q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale: float):
    """One decode step's attention, as `dsv41.engine.batched.window_attention` (its reference, same arguments and
    results) computes it with tensor ops: q [B, 1, H, D] bf16, ring_codes [B, W, D] e4m3, ring_scale [B, W, D/32]
    uint8 (UE8M0 bits), kv [B, 1, D] bf16, valid [B, W + 1 (+ K)], selected [B, K, D] bf16 or None -> (o [B, 1, H,
    D] bf16, the new row's ring codes [B, D] e4m3 and scale bits [B, D/32] uint8). The codes are `fp8_quant`'s
    bits; the attention is judged statistically. Each sequence's result is computed alone, in one order, so it
    does not depend on the batch (`library()` must have loaded the kernel)."""
    if selected is None:
        selected = kv.new_empty(kv.size(0), 0, kv.size(-1))
    return torch.ops.dsv41.decode_attn_cpu(q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale)


def decode_ring_attn_cpu(
    q, window_codes, window_scale, slots, layer: int, ring_rows, kv, valid, selected, attn_sink, softmax_scale: float
):
    """`decode_attn_cpu` with the rings read, and the new rows' codes written, where they lie in the engine's state
    pool (no gathered copies): window_codes [S, L, W, D] e4m3 and window_scale [S, L, W, D/32] uint8 (every slot's
    rings, contiguous), slots [B] (distinct), layer, ring_rows [B] (the ring row each new token takes) -> o [B, 1, H,
    D] bf16; window_codes[slots[b], layer, ring_rows[b]] and its scale bits then hold `decode_attn_cpu`'s codes for
    the new row. The same bits as `decode_attn_cpu` on the gathered rings, its codes written back."""
    if selected is None:
        selected = kv.new_empty(kv.size(0), 0, kv.size(-1))
    return torch.ops.dsv41.decode_ring_attn_cpu(
        q, window_codes, window_scale, slots, layer, ring_rows, kv, valid, selected, attn_sink, softmax_scale
    )


def chunk_attn_cpu(q, ring_codes, ring_scale, ring_of, chunk, valid, selected, attn_sink, softmax_scale: float):
    """The attention of the tokens of multi-token chunks (speculative verify chunks) in one call, as
    `dsv41.engine.batched.chunk_decode_attend` computes it with tensor ops: q [T, 1, H, D] bf16; the rings as they
    were before the chunks, ring_codes [S, W, D] e4m3 and ring_scale [S, W, D/32] uint8, ring_of [T] the ring of
    each token; chunk [T, n, D] bf16 the rows of each token's chunk; valid [T, W + n (+ K)] (ring, chunk rows,
    selected); selected [T, K, D] bf16 or None -> o [T, 1, H, D] bf16. Each token's result is computed alone, in
    one order (`library()` must have loaded the kernel)."""
    if selected is None:
        selected = chunk.new_empty(chunk.size(0), 0, chunk.size(-1))
    return torch.ops.dsv41.chunk_attn_cpu(
        q, ring_codes, ring_scale, ring_of, chunk, valid, selected, attn_sink, softmax_scale
    )
