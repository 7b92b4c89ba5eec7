"""fp32 reductions that decide later roundings (RMSNorm's variance and the hc RMS statistic, spec-v41.md §6;
Engram's gate, §5), with the reference's canonical form beside the fast one.

`reference` False: the plain vectorised fp32 reduction the engine and trainer use (its summation order is
the CPU kernel's). True: canonical numerics (`dsv41.ops.canonical`): the fp32 terms summed in float64 and
rounded once, the same bits on every CPU.
"""

from __future__ import annotations

import torch

from dsv41.ops import canonical


def mean_of_squares(x: torch.Tensor, reference: bool = False, keepdim: bool = False) -> torch.Tensor:
    """mean(x^2) over the last dim in fp32: x [..., n] -> fp32 [...] ([..., 1] with keepdim)."""
    if reference:
        return canonical.mean_of_squares(x, keepdim)
    return x.float().square().mean(-1, keepdim=keepdim)


def sum_fp32_terms(terms: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """The sum of fp32 terms over the last dim: [..., n] -> fp32 [...]."""
    if reference:
        return canonical.sum(terms.float(), -1)
    return terms.float().sum(-1)


def rsqrt(x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """1 / sqrt(x), fp32 in and out (canonically: in float64, rounded once)."""
    return canonical.rsqrt(x) if reference else torch.rsqrt(x)
