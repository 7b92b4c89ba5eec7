"""MoE tensor math: router scores and the clamped SwiGLU (spec-v41.md §7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """fp32 router logits [T, E] -> affinity scores [T, E] (sqrt(softplus) for V4.1)."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def route(scores: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
          route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick k experts per token by scores + bias; weight them by the unbiased scores.

    scores [T, E] fp32, bias [E] or [T, E] fp32. Returns (weights [T, k] fp32, indices [T, k] int64).
    """
    indices = (scores + bias).topk(k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if normalize and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, indices


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32; limit <= 0 disables the clamps."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up
