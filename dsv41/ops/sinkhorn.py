"""Hyper-connection coefficients with Sinkhorn normalisation (spec-v41.md §6).

From one projection of the flattened residual stream, each sublayer derives `pre` (collapse weights),
`post` (expansion weights) and `comb` (hc x hc residual mixing), `comb` pushed towards a doubly
stochastic matrix: a row softmax, then a column normalisation, then (iters - 1) x (row, column). It ends
on a column normalisation, with eps inside every denominator. All fp32.

The normalisation is ~120 tiny eager ops per call (24 calls per decode step of `small`, a third of a
batch-1 step on a CPU). `fused_normalize` is the same arithmetic written so that `torch.compile` keeps
every rounding (row sums as an explicit left-to-right chain: ATen sums a 4-wide row in that order, while
inductor's vectorised reduction pairs the terms differently), used only where a probe on this machine
found it bit-identical to the eager reference (`fused_normalize_agrees`, dsv41.ops.fused) and never
under autograd.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import canonical, fused
from dsv41.ops.lanes import per_call


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    calls=None,
    reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) * hc] fp32; scale [3]; base [(2 + hc) * hc]; calls: the tokens' separate calls
    when several sequences' chunks share this one (`ops.lanes.per_call`), None for one call; reference:
    canonical numerics (sigmoid, exp and every row/column sum in float64, each rounded once).

    Returns pre [..., hc], post [..., hc], comb [..., hc, hc] (comb[i, j]: weight of residual copy i
    in output copy j).
    """
    m, scale, base = mixes.float(), scale.float(), base.float()
    if reference:
        pre = canonical.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
        post = 2 * canonical.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        logits = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
        comb = canonical.exp(logits - logits.amax(dim=-1, keepdim=True))
        return pre, post, sinkhorn_normalize(comb, iters, eps, reference=True)
    # as if each call ran alone (dsv41.ops.lanes): the sigmoid's scalar tail depends on the call's size
    pre = per_call("sigmoid", m[..., :hc] * scale[0] + base[:hc], calls) + eps
    post = 2 * per_call("sigmoid", m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc], calls)
    logits = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    if (
        fused.enabled()
        and not (torch.is_grad_enabled() and comb.requires_grad)
        and fused_normalize_agrees(hc, iters, eps, comb.device.type)
    ):
        lead = comb.shape[:-2]
        return pre, post, _compiled_normalize()(comb.reshape(-1, hc, hc), iters, eps).reshape(*lead, hc, hc)
    return pre, post, sinkhorn_normalize(comb, iters, eps)


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float, reference: bool = False) -> torch.Tensor:
    """The eager form: comb [..., hc, hc] positive (exp of centred logits) -> the normalised mixing.
    reference: every row and column sum in float64, rounded once (the divisions stay fp32)."""

    def total(x: torch.Tensor, dim: int) -> torch.Tensor:
        return canonical.sum(x, dim, keepdim=True) if reference else x.sum(dim=dim, keepdim=True)

    comb = comb / total(comb, -1) + eps
    comb = comb / (total(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (total(comb, -1) + eps)
        comb = comb / (total(comb, -2) + eps)
    return comb


def _row_sums(comb: torch.Tensor) -> torch.Tensor:
    """Sums over the last dim as a left-to-right chain, ((c0 + c1) + c2) + ..., keepdim."""
    terms = comb.unbind(-1)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total.unsqueeze(-1)


def fused_normalize(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_normalize` in a form the compiler cannot reorder (the column sums, an outer reduction,
    are already accumulated row by row in both)."""
    comb = comb / _row_sums(comb) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (_row_sums(comb) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@functools.cache
def _compiled_normalize():
    return fused.compile_fused(fused_normalize)


@fused.Verdict
def fused_normalize_agrees(hc: int, iters: int, eps: float, device: str) -> bool:
    """Is the compiled `fused_normalize` bit-identical to `sinkhorn_normalize` here (one row, which the
    compiler specialises, and many rows)? See dsv41.ops.fused."""
    g = torch.Generator().manual_seed(0)
    cases = [(torch.exp(torch.randn(rows, hc, hc, generator=g) * 3).to(device), iters, eps) for rows in (1, 3, 517)]
    return fused.agrees(_compiled_normalize(), sinkhorn_normalize, cases)
