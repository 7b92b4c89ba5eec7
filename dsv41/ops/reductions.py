"""fp32 reductions summed in one fixed order: the reference's numerics for the statistics that decide later
roundings (the golden sets' README, "Numerics of these expected values"; spec-v41.md §6 for the hc RMS
statistic, §5 for Engram's gate).

A vectorised fp32 `mean` sums in whatever order the CPU's kernel picks (lane count, blocking), so a value
that lands within an ulp of a bf16 rounding midpoint rounds one way on an AMD EPYC and the other on an
Intel AMX Xeon. The golden sets pin these reductions instead:

- a mean of squares (RMSNorm's variance, the hc RMS statistic, Engram's two rstd statistics): the fp32
  squares, converted to fp64 (exactly), summed left to right in fp64, divided by the length in fp64,
  rounded once to fp32;
- Engram's gate dot product: its fp32 terms summed left to right in fp64, rounded once to fp32;
- the vision tower's bf16 linears: products and bias summed in fp64, rounded once (in practice the exactly
  rounded result: products of bf16 values are exact in fp64 and their sum is, short of a 2^29 spread of
  magnitudes, exact too).

Every step of that is an IEEE fp64 add, so the result is the same on every CPU. The fast versions (`pinned`
False) are the plain vectorised fp32 reductions the engine and trainer use.
"""

from __future__ import annotations

from typing import Optional

import torch


def sum_fp64_in_order(terms: torch.Tensor) -> torch.Tensor:
    """terms [..., n] (any float dtype, converted to fp64 exactly) -> fp64 [...]: ((t0 + t1) + t2) + ...

    On a CPU this is the last entry of `cumsum`, whose kernel walks the dimension with one running fp64
    accumulator (a loop-carried dependency the compiler may not reorder). Elsewhere (a GPU's cumsum is a
    parallel scan) the columns are added one at a time, which is the same order by construction."""
    t = terms.double()
    if t.size(-1) == 0:
        return t.sum(-1)
    if t.device.type == "cpu":
        return t.cumsum(-1)[..., -1]
    return _sum_columns_in_order(t)


def _sum_columns_in_order(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] fp64, n >= 1 -> ((t0 + t1) + t2) + ..., one elementwise add per column (any device)."""
    total = t[..., 0]
    for k in range(1, t.size(-1)):
        total = total + t[..., k]
    return total


def mean_of_squares(x: torch.Tensor, pinned: bool = False, keepdim: bool = False) -> torch.Tensor:
    """mean(x^2) over the last dim in fp32: x [..., n] -> fp32 [...] ([..., 1] with keepdim).

    pinned: the squares (fp32) summed left to right in fp64, divided by n in fp64, rounded once to fp32
    (the same bits on every CPU); otherwise the vectorised fp32 mean."""
    squares = x.float().square()
    if not pinned:
        return squares.mean(-1, keepdim=keepdim)
    mean = (sum_fp64_in_order(squares) / squares.size(-1)).float()
    return mean.unsqueeze(-1) if keepdim else mean


def sum_fp32_terms(terms: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """The sum of fp32 terms over the last dim: [..., n] -> fp32 [...]. pinned: left to right in fp64,
    rounded once to fp32; otherwise the vectorised fp32 sum."""
    if not pinned:
        return terms.float().sum(-1)
    return sum_fp64_in_order(terms.float()).float()


def linear_fp64_accumulate(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype: accumulated in fp64, the bias
    added in fp64, rounded once. Where a CPU's bf16 GEMM rounds differently (fp32 accumulation order,
    the bias added after a partial rounding) this gives the same bits everywhere."""
    acc = torch.matmul(x.double(), weight.double().t())
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(x.dtype)
