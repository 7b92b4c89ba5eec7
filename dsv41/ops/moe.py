"""MoE tensor math: router scores, the clamped SwiGLU, and the training-time balancing (spec-v41.md §7,
training.md §7): the aux-loss-free bias update and the sequence-wise balance loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.ops.indexer import topk_canonical


def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """fp32 router logits [T, E] -> affinity scores [T, E] (sqrt(softplus) for V4.1)."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def route(scores: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
          route_scale: float, canonical: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick k experts per token by scores + bias; weight them by the unbiased scores.

    scores [T, E] fp32, bias [E] or [T, E] fp32. Returns (weights [T, k] fp32, indices [T, k] int64).
    canonical: exact ties go to the lowest expert id (`topk_canonical`); False keeps `torch.topk`'s choice
    (the reference's).
    """
    biased = scores + bias
    indices = topk_canonical(biased, k) if canonical else biased.topk(k, dim=-1)[1]
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


def expert_load(indices: torch.Tensor, n_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert: indices [..., k] -> fp32 counts [E] (only rows where mask is True)."""
    if mask is not None:
        indices = indices[mask]
    return torch.bincount(indices.reshape(-1), minlength=n_experts).float()


def balance_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """Aux-loss-free balancing: b_e += rate * sign(mean load - load_e). Returns the new bias; an all-zero
    load (no tokens of this modality in the batch) leaves the bias unchanged."""
    if load.sum() == 0:
        return bias.clone()
    return bias + rate * torch.sign(load.mean() - load)


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss sum_e f_e * P_e, averaged over sequences (multiply by the
    weight, 1e-4, outside). scores [B, T, E] router affinities (differentiable), indices [B, T, k] picks.

    f_e = E / (k T) * (tokens of the sequence routed to e); P_e = mean over the sequence of the
    affinities normalised per token. Balanced routing gives 1 for uniform scores.
    """
    b, t, k = indices.shape
    picked = torch.zeros(b, t, n_experts, device=scores.device).scatter_(-1, indices, 1.0)
    f = picked.sum(dim=1) * (n_experts / (k * t))  # [B, E]
    p = (scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)).mean(dim=1)  # [B, E]
    return (f * p).sum(dim=-1).mean()
