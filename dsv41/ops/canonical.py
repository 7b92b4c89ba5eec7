"""Canonical numerics: the reference mode's one rule (the golden sets' README, "Numerics").

Every floating-point operation whose result could depend on the machine (a sum's order or blocking, SIMD
width, the math library behind a transcendental) is computed in float64 from its operands as the model
holds them and rounded once: to float32, then to bf16 where the model produces bf16 at that point.
Products of fp32, bf16, FP8 and FP4 values are exact in float64, and float64 accumulation error (~1e-16
relative) disappears in that one rounding, so the result is the same on every CPU, at any thread count,
by construction rather than by copying one machine's kernels.

Sums over a dimension (`sum`, `mean`, `mean_of_squares`, softmax denominators) follow a fixed pairwise tree,
the order the sets were made with; GEMMs and einsums are plain float64 BLAS calls, whose order differs
between machines only below the float64 rounding (the sets' `fp64_native_order` row: identical).

Everything here is for golden parity and reference checks (`Transformer.set_reference_numerics`), not
for speed: the engine and trainer run the fast kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def round_to(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float64 result -> fp32, then `dtype` (the one rounding; fp64 -> bf16 goes through fp32 by rule).
    dtype float64: no rounding (an intermediate of a longer float64 computation)."""
    if dtype == torch.float64:
        return x.double()
    x = x.float()
    return x if dtype == torch.float32 else x.to(dtype)


def pairwise_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The float64 sum over `dim` in a fixed pairwise tree -> float64: the reduced elements zero-padded to a
    power of two n, element i + n/2 added onto element i, n halved, repeated. The same order on every
    machine (log2(n) vectorised adds, each an IEEE float64 add)."""
    t = x.double().movedim(dim, -1)
    n = t.size(-1)
    if n == 0:
        out = t.sum(-1)
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            t = F.pad(t, (0, width - n))
        while width > 1:
            width //= 2
            t = t[..., :width] + t[..., width:]
        out = t[..., 0]
    return out.unsqueeze(dim if dim >= 0 else dim + x.dim()) if keepdim else out


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """sum over `dim` of x's terms (taken exactly into float64), rounded once to `dtype`."""
    return round_to(pairwise_sum(x, dim, keepdim), dtype)


def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """mean over `dim` in float64 (the pairwise sum divided by the count), rounded once to `dtype`."""
    return round_to(pairwise_sum(x, dim, keepdim) / x.size(dim), dtype)


def mean_of_squares(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """x [..., n] -> fp32 mean(x^2) over the last dim: the squares in fp32 (an elementwise op, IEEE), their
    mean in float64, one rounding."""
    return mean(x.float().square(), -1, keepdim)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x) in float64 -> fp32."""
    return round_to(1.0 / x.double().sqrt())


def exp(x: torch.Tensor) -> torch.Tensor:
    return round_to(x.double().exp())


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return round_to(torch.sigmoid(x.double()))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) in float64 (F.softplus: x itself above 20, where the two agree after the rounding)."""
    return round_to(F.softplus(x.double()))


def silu(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x / (1 + exp(-x)) in float64 -> `dtype`."""
    xd = x.double()
    return round_to(xd / (1.0 + torch.exp(-xd)), dtype)


def gelu(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact (erf) GELU in float64 -> `dtype`, written x/2 * erfc(-x/sqrt(2)): the same function as
    x/2 * (1 + erf(x/sqrt(2))) without its cancellation for negative x, where 1 + erf loses the digits that
    tell one math library's float64 erf from another's."""
    xd = x.double()
    return round_to(0.5 * xd * torch.erfc(xd * (-1.0 / math.sqrt(2.0))), dtype)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """exp(x - max) / sum, entirely in float64 -> `dtype`."""
    xd = x.double()
    e = torch.exp(xd - xd.amax(dim, keepdim=True))
    return round_to(e / pairwise_sum(e, dim, keepdim=True), dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N], added in float64) in float64 -> `dtype` (default x's) [..., N]."""
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return round_to(out, x.dtype if dtype is None else dtype)


def einsum(equation: str, *operands: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.einsum over the operands taken into float64, rounded once to `dtype`."""
    return round_to(torch.einsum(equation, *(op.double() for op in operands)), dtype)
