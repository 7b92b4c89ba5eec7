"""Hyper-connection coefficients with Sinkhorn normalisation (spec-v41.md §6).

From one projection of the flattened residual stream, each sublayer derives `pre` (collapse weights),
`post` (expansion weights) and `comb` (hc x hc residual mixing), `comb` pushed towards a doubly
stochastic matrix: a row softmax, then a column normalisation, then (iters - 1) x (row, column). It ends
on a column normalisation, with eps inside every denominator. All fp32.
"""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                      iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) * hc] fp32; scale [3]; base [(2 + hc) * hc].

    Returns pre [..., hc], post [..., hc], comb [..., hc, hc] (comb[i, j]: weight of residual copy i
    in output copy j).
    """
    m, scale, base = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
