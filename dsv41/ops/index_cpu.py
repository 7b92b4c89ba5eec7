"""A Full indexer layer's prefill selection as one C++ kernel on a CPU (index_cpu.cpp beside this file).

`Indexer._select_streaming` (the reference: bf16 GEMMs of the MXFP4 query and keys, the score epilogue, and a
running canonical top-k merged per span of keys) writes every per-head score of a chunk and re-reads it
several times; its cost grows with the context (the encoder's Full layers scan every visible entry, spec
§4), so it is what makes a long prompt's later chunks slower. This kernel scores and selects in one pass per
query: the MXFP4 values as exact small integers (int8 dot products, 64 per instruction with AVX512-VNNI), the
reference's bf16 roundings, and a running top-k per query; no [S, T] tensor is written. Its picks equal the
reference's (tested).

A decode step's index layers score their one query per sequence from the packed pool the same way
(`paged_index_scores_cpu`: the E2M1 codes are the integers, the UE8M0 bytes the powers of two; every visible
entry of a Full layer, the candidates of a Reindex layer), without dequantising the keys to bf16 first; and
the picked entries' KV is read back to bf16 in one pass (`gather_fp4`).

Built and loaded by `cpp_build` as `torch.ops.dsv41.index_topk_cpu`, `paged_index_scores_cpu` and
`gather_fp4_cpu`. The scoring is used only where it was built with AVX512-VNNI (`available`); elsewhere the
reference's bf16 or fp32 GEMMs keep the work. The gather serves wherever the library is built (`loaded`).
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import cpp_build


@functools.cache
def library() -> str | None:
    """The built kernel's path, its op registered, or None where it cannot be built or loaded."""
    return cpp_build.load("index_cpu")


def loaded(build: bool = True) -> bool:
    """Is the library built and loaded here (any instruction set: `gather_fp4` needs none of VNNI's)? With
    build=False only a build already in the cache counts."""
    if not build and not cpp_build.is_built("index_cpu"):
        return False
    return library() is not None


def available(build: bool = True) -> bool:
    """Is the kernel built here with AVX512-VNNI (the form that beats the GEMM path)? Builds it if needed; with
    build=False only a build already in the cache counts (a decode step never waits ~8 s for the compiler)."""
    return loaded(build) and torch.ops.dsv41.index_topk_cpu_vnni()


def fits(q: torch.Tensor) -> bool:
    """Can the kernel take these queries: bf16 on a CPU, a head dim of one to four MXFP4 blocks (the op checks
    that the keys match)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(-1) in (32, 64, 96, 128)


def paged_index_scores_cpu(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    tables: torch.Tensor,
    entries_per_block: int,
    visible: torch.Tensor,
    n: int,
    entries: torch.Tensor | None = None,
    usable: torch.Tensor | None = None,
) -> torch.Tensor:
    """An index layer's decode scores straight from the packed pool: q [B, H, D] (MXFP4-rounded) and weights
    [B, H] bf16, key_codes [rows, D/2] (E2M1 pairs) and key_scale [rows, D/32] (UE8M0 bytes) uint8, tables [B,
    max_blocks] int64, visible [B] -> bf16 [B, n]: entries 0 .. n-1 (a Full layer's scan), -inf past each
    sequence's visible entries; or, given entries [B, n] int64 (a Reindex layer's candidates), those entries,
    -inf where one is not visible or `usable` [B, n] is false. What `ops.paged_index_scores` computes by
    dequantising the keys and a GEMM, the same bits."""
    return torch.ops.dsv41.paged_index_scores_cpu(
        q, weights, key_codes, key_scale, tables, entries_per_block, visible, n, entries, usable
    )


def gather_fp4(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """Packed FP4 rows of the pool dequantised to bf16: codes [R, D/2] uint8, scale [R, D/block] uint8 (E4M3
    bytes, or UE8M0 with ue8m0), rows [...] int64 -> bf16 [..., D]; `ops.quant.fp4_dequant_bf16` of the gathered
    rows, the same bits, in one pass instead of a dozen tensor ops. `library()` must have loaded the kernel."""
    return torch.ops.dsv41.gather_fp4_cpu(codes, scale, rows, ue8m0)


def index_topk_cpu(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """q [S, H, D] (MXFP4-rounded), keys [T, D] (MXFP4-rounded), weights [S, H] bf16, visible [S] (entries each
    query may see) -> int64 [S, topk]: the positions of each query's top-k entries by (score desc, position
    asc), ascending, -1 after them where fewer than topk are visible. `library()` must have loaded the kernel."""
    return torch.ops.dsv41.index_topk_cpu(q, keys, weights, visible, topk)
