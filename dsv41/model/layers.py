"""Basic layers: a Linear over bf16/fp32/FP8/packed-FP4 weights and RMSNorm (spec-v41.md §7, §13)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41 import ops
from dsv41.ops.quant import FP4_BLOCK, FP8_BLOCK

# weight storage format -> dtype of the `weight` tensor as stored
WEIGHT_FORMATS = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn, "fp4": torch.int8}


def weight_copy(holder: dict, key: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `weight` in `dtype`, kept in `holder[key]` as (stamp, copy) and made again when the weight
    changed (its version counter or its storage): the fast paths' fp32 or bf16 copies of a weight."""
    stamp = (weight._version, weight.data_ptr())
    cached = holder.get(key)
    if cached is None or cached[0] != stamp:
        cached = holder[key] = (stamp, weight.detach().to(dtype))
    return cached[1]


class Linear(nn.Module):
    """y = x W^T without bias. `fmt` picks the storage:

    - "bf16" / "fp32": a plain weight [out, in]; the input must have the same dtype.
    - "fp8": E4M3 weight [out, in] + UE8M0 `scale` [ceil(out/32), ceil(in/32)] (one per 32x32 tile).
    - "fp4": E2M1 packed two per byte, int8 [out, in/2] + UE8M0 `scale` [out, in/32].
    Quantized formats round the activation through FP8 first and return bf16 (see dsv41.ops.gemm).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "bf16"):
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; choose one of {sorted(WEIGHT_FORMATS)}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        quantized = fmt in ("fp8", "fp4")
        if fmt == "fp4":
            if in_features % FP4_BLOCK:
                raise ValueError(f"fp4 weights need in_features % {FP4_BLOCK} == 0, got {in_features}")
            shape, scale_shape = (out_features, in_features // 2), (out_features, in_features // FP4_BLOCK)
        else:
            shape = (out_features, in_features)
            scale_shape = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        self.weight = nn.Parameter(torch.empty(shape, dtype=WEIGHT_FORMATS[fmt]), requires_grad=not quantized)
        if quantized:
            self.scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.register_parameter("scale", None)
        self.row_chunk = 0  # > 0: batch-invariant GEMMs in fixed row chunks (see ops.invariant_matmul)
        self.reference_numerics = False  # canonical numerics (dsv41.ops.canonical): golden parity
        # fast numerics (dsv41.ops.gemm_choice): calls of at most this many rows run as an fp32 GEMM over an
        # fp32 copy of a bf16 weight (`keep_fp32_copy`), where the probe found it faster; 0: never
        self.fp32_rows = 0
        # bf16 calls by the few-row C++ kernel (dsv41.ops.linear_cpu) where `_rows_kernel_serves` says so; set
        # (`Transformer.numerics`) by an engine whose forwards run compiled, where that kernel is built
        self.rows_kernel = False

    def keep_fp32_copy(self) -> int:
        """Keep an fp32 copy of a bf16 weight for `fp32_rows` (returns its bytes; 0 for other formats). The
        copy follows the weight: it is made again when the weight changes (its version or storage)."""
        if self.weight.dtype != torch.bfloat16:
            return 0
        self._refresh_fp32()
        return self.weight.numel() * 4

    def _refresh_fp32(self) -> torch.Tensor:
        return weight_copy(self.__dict__, "_fp32_copy", self.weight, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel and self._rows_kernel_serves(x):
            return ops.linear_cpu.rows_linear(x, self.weight).to(torch.bfloat16)
        if x.numel() == x.size(-1) and self.weight.dtype == x.dtype == torch.bfloat16 and torch.compiler.is_compiling():
            # one row inside a compiled decode region: a dot product per output row that inductor turns into one
            # loop over the bf16 weight (no GEMM call, no fp32 copy; ~2x a one-row GEMM on the CPUs measured)
            return ops.gemm.row_products(x, self.weight)
        if self.fp32_rows and x.dtype == torch.bfloat16 and "_fp32_copy" in self.__dict__:
            if x.numel() <= self.fp32_rows * x.size(-1):
                # inside a compiled graph the copy is an input as it is (a weight update between steps is
                # caught by the next eager call; the engine's compiled regions serve an unchanging model)
                w32 = self.__dict__["_fp32_copy"][1] if torch.compiler.is_compiling() else self._refresh_fp32()
                return F.linear(x.float(), w32).to(torch.bfloat16)
        return ops.linear(x, self.weight, self.scale, row_chunk=self.row_chunk, reference=self.reference_numerics)

    def _rows_kernel_serves(self, x: torch.Tensor) -> bool:
        """Does the few-row C++ kernel (dsv41.ops.linear_cpu, where `rows_kernel` is set) take this call? Under
        `fast` numerics, calls of at most `MAX_ROWS` rows inside the compiled decode regions. Under batch-invariant
        chunks (`row_chunk`, the `deterministic` mode), every call, eager or compiled, of any row count: each
        output is its own row's dot product summed in one fixed order, so a layer that always takes the kernel
        gives a token the same bits whatever shares its call. Never under canonical numerics or autograd."""
        if self.reference_numerics or torch.is_grad_enabled():
            return False
        if self.row_chunk:
            return ops.linear_cpu.fits(x, self.weight, max_rows=None)
        return torch.compiler.is_compiling() and ops.linear_cpu.fits(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in fp32, result in x's dtype.

    reference_numerics: canonical numerics (dsv41.ops.canonical): the mean of squares and rsqrt in float64,
    each rounded once to fp32, the same bits on every CPU; off, the vectorised fp32 kernels."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.reference_numerics = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ref = self.reference_numerics
        xf = xf * ops.reductions.rsqrt(ops.mean_of_squares(xf, ref, keepdim=True) + self.eps, ref)
        return (self.weight * xf).to(x.dtype)
