"""MoE tensor math: router scores, the clamped SwiGLU, and the training-time balancing (spec-v41.md §7,
training.md §7): the aux-loss-free bias update and the sequence-wise balance loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv41.ops import canonical
from dsv41.ops.indexer import topk_canonical
from dsv41.ops.lanes import per_call


def router_scores(logits: torch.Tensor, score_func: str, calls=None, reference: bool = False) -> torch.Tensor:
    """fp32 router logits [T, E] -> affinity scores [T, E] (sqrt(softplus) for V4.1). calls: the tokens'
    separate calls (`ops.lanes.per_call`; the engine's chunks), None for one call; reference: canonical
    numerics (the function in float64, rounded once to fp32; the sqrt is fp32, exact)."""
    if reference:
        fn = {"softmax": canonical.softmax, "sigmoid": canonical.sigmoid}.get(score_func)
        return fn(logits) if fn is not None else canonical.softplus(logits).sqrt()
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return per_call("sigmoid", logits, calls)
    return per_call("softplus", logits, calls).sqrt()


def route(
    scores: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    normalize: bool,
    route_scale: float,
    canonical_ties: bool = True,
    reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick k experts per token by scores + bias; weight them by the unbiased scores.

    scores [T, E] fp32, bias [E] or [T, E] fp32. Returns (weights [T, k] fp32, indices [T, k] int64).
    canonical_ties: exact ties go to the lowest expert id (`topk_canonical`); False keeps `torch.topk`'s
    choice (the reference's). reference: canonical numerics for the weights' sum (`route_weights`).
    """
    biased = scores + bias
    indices = topk_canonical(biased, k) if canonical_ties else biased.topk(k, dim=-1)[1]
    return route_weights(scores, indices, normalize, route_scale, reference), indices


def route_weights(
    scores: torch.Tensor, indices: torch.Tensor, normalize: bool, route_scale: float, reference: bool = False
) -> torch.Tensor:
    """The weights of picked experts: their unbiased scores [T, E] at indices [T, k], normalised over the
    picks when `normalize` (and k > 1), times `route_scale` -> fp32 [T, k]. reference: the picks' sum in
    float64, rounded once."""
    weights = scores.gather(1, indices)
    if normalize and indices.size(-1) > 1:
        total = canonical.sum(weights, -1, keepdim=True) if reference else weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20)
    return weights * route_scale


def capacity_topk(biased: torch.Tensor, k: int, capacity: int, canonical: bool = True) -> torch.Tensor:
    """Top-k experts per token under a per-expert capacity: biased [T, E] fp32 (scores + bias) -> indices
    [T, k] with no expert picked by more than `capacity` tokens (needs capacity * E >= T * k).

    Deferred acceptance, every token proposing in parallel: each token picks its k best experts not yet
    closed to it; an expert holding more than `capacity` picks keeps the `capacity` with the highest
    biased score and closes itself to the rest, who move on to their next choice. The result is the
    token-optimal stable assignment (independent of the order of proposals), so a token only leaves
    a preferred expert for tokens that prefer it more, and when no expert overflows it equals the plain
    top-k. Ties in the keep order go to the lower token index (stable sorts). Near a tight capacity a
    token can be turned away by every expert but fewer than k (its picks must be distinct experts); such
    a token keeps a closed pick, and only those picks exceed the capacity."""
    t, e = biased.shape
    if capacity * e < t * k:
        raise ValueError(f"capacity {capacity} x {e} experts cannot hold {t} tokens x top-{k}")
    masked = biased.clone()
    token = torch.arange(t, device=biased.device).repeat_interleave(k)  # [T*k] row of each pick
    while True:  # each round closes at least one (token, expert) pair, so at most T*E rounds
        indices = topk_canonical(masked, k) if canonical else masked.topk(k, dim=-1)[1]
        expert = indices.flatten()
        load = torch.bincount(expert, minlength=e)
        over = load > capacity
        if not bool(over.any()):
            return indices
        order = torch.argsort(masked[token, expert], descending=True, stable=True)
        order = order[torch.argsort(expert[order], stable=True)]  # by expert, best first within each
        by_expert = expert[order]
        rank = torch.arange(order.numel(), device=biased.device) - (torch.cumsum(load, 0) - load)[by_expert]
        drop = order[over[by_expert] & (rank >= capacity)]
        drop = drop[masked[token[drop], expert[drop]] > float("-inf")]
        if drop.numel() == 0:  # only tokens that every open expert has turned away overflow: keep them
            return indices
        masked[token[drop], expert[drop]] = float("-inf")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, reference: bool = False) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32; limit <= 0 disables the clamps.
    reference: the SiLU in float64, rounded once to fp32."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return (canonical.silu(gate) if reference else F.silu(gate)) * up


def gathered_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The picked experts' weighted outputs summed, for a few tokens, as dot products over gathered rows of
    stacked expert weights: x [T, D] bf16, weights [T, k] fp32, indices [T, k] into w1, w3 [E, I, D] and
    w2 [E, D, I] bf16 -> fp32 [T, D].

    For the compiled decode step (dsv41.engine.compiled): written as broadcast products and sums, inductor
    turns each into one loop that reads the picked experts' weight rows where they lie (the gather is folded
    into the load, nothing is copied), so a decode step's experts cost one kernel instead of three GEMM calls
    and their glue per pick. Eager, the same expression materialises [T, k, I, D] products: a reference,
    not a fast path. Each GEMM's output is rounded to x's dtype where the expert's Linear would round it."""
    xf = x.float()[:, None, None, :]  # [T, 1, 1, D]
    gate = (xf * w1[indices].float()).sum(-1).to(x.dtype)  # [T, k, I]
    up = (xf * w3[indices].float()).sum(-1).to(x.dtype)
    h = (clamped_swiglu(gate, up, limit) * weights.unsqueeze(-1)).to(x.dtype).float()  # [T, k, I]
    out = (h[:, :, None, :] * w2[indices].float()).sum(-1).to(x.dtype)  # [T, k, D]
    return out.float().sum(1)


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
