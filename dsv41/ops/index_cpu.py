"""A Full indexer layer's prefill selection as one C++ kernel on a CPU (index_cpu.cpp beside this file).

`Indexer._select_streaming` (the reference: bf16 GEMMs of the MXFP4 query and keys, the score epilogue, and a
running canonical top-k merged per span of keys) writes every per-head score of a chunk and re-reads it
several times; its cost grows with the context (the encoder's Full layers scan every visible entry, spec
§4), so it is what makes a long prompt's later chunks slower. This kernel scores and selects in one pass per
query: the MXFP4 values as exact small integers (int8 dot products, 64 per instruction with AVX512-VNNI), the
reference's bf16 roundings, and a running top-k per query; no [S, T] tensor is written. Its picks equal the
reference's (tested).

Built and loaded by `cpp_build` as `torch.ops.dsv41.index_topk_cpu`. Used only where it was built with
AVX512-VNNI (`available`); elsewhere the reference's bf16 or fp32 GEMMs keep the work.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import cpp_build


@functools.cache
def library() -> str | None:
    """The built kernel's path, its op registered, or None where it cannot be built or loaded."""
    return cpp_build.load("index_cpu")


def available() -> bool:
    """Is the kernel built here with AVX512-VNNI (the form that beats the GEMM path)? Builds it if needed."""
    return library() is not None and torch.ops.dsv41.index_topk_cpu_vnni()


def fits(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Can the kernel take these: bf16 on a CPU, a head dim that is a whole number of MXFP4 blocks."""
    return (
        q.device.type == "cpu"
        and q.dtype == keys.dtype == torch.bfloat16
        and q.size(-1) in (32, 64, 96, 128)
        and keys.size(-1) == q.size(-1)
    )


def index_topk_cpu(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """q [S, H, D] (MXFP4-rounded), keys [T, D] (MXFP4-rounded), weights [S, H] bf16, visible [S] (entries each
    query may see) -> int64 [S, topk]: the positions of each query's top-k entries by (score desc, position
    asc), ascending, -1 after them where fewer than topk are visible. `library()` must have loaded the kernel."""
    return torch.ops.dsv41.index_topk_cpu(q, keys, weights, visible, topk)
