"""Keeping the MoE routers balanced while training (issue 11; spec-v41.md §7, training.md §5;
docs/moe-balancing.md has the measurements).

The release balances its routers with the auxiliary-loss-free selection bias (b_e += 1e-3 * sign(mean
load - load_e) per step) plus a 1e-4 sequence-wise balance loss, under a 2,000-step warm-up at lr 2.6e-4
and million-token batches. At our scale (hundreds of steps, thousands of tokens per step, lr 3e-3) that
is far too slow: within ~10 steps the routers' input (`ffn_norm(hc_pre(h))`) is mostly a component
shared by the tokens (window averages swamp the small initial embedding, then unigram learning), the
per-expert logit offset it causes exceeds the per-token spread, every token ranks the experts alike and
the layer collapses onto its top-k favourites. Everything here changes the training procedure only: the
model, the checkpoint format and the inference path are unchanged.

- `solve_balancing_bias`: the selection bias that balances a given batch's routing (a per-expert
  Rprop search on its scores). The trainer's look-ahead (`--bias-update lookahead`) solves it before
  every step on a probe batch routed with the weights the step will use: solved on the previous step it
  is always one update out of date.
- `decorrelate_router`: W <- W - (W u) u^T with u the unit mean router input, so a component common to
  all tokens shifts no expert's logit.
- `proportional_bias_update`: the load-driven bias with a step proportional to the relative load error.

`load_ratio` and `dsv41.model.training.gate_input_shared_fraction` are what the trainer logs.
"""

from __future__ import annotations

import math

import torch


def load_ratio(load: torch.Tensor) -> float:
    """max/mean tokens per expert (1 = balanced; top-k of E experts collapsed onto k gives E/k)."""
    return float(load.max() / load.mean().clamp_min(1e-9))


def proportional_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """b_e += rate * (mean - load_e) / mean; an all-zero load (modality absent) leaves the bias as is."""
    if load.sum() == 0:
        return bias.clone()
    mean = load.mean()
    return bias + rate * (mean - load) / mean


@torch.no_grad()
def decorrelate_router(weight: torch.Tensor, direction: torch.Tensor) -> None:
    """In place: W [E, dim] <- W - (W u) u^T with u = direction / |direction| (no-op for a zero direction)."""
    norm = direction.norm()
    if norm <= 0:
        return
    u = (direction / norm).to(weight.dtype)
    weight.sub_(torch.outer(weight @ u, u))


@torch.no_grad()
def solve_balancing_bias(
    scores: torch.Tensor, bias: torch.Tensor, k: int, iters: int = 64, reduce=None, canonical: bool = True
) -> torch.Tensor:
    """The selection bias that balances this step's routing: b' such that top-k(scores + b') gives every
    expert as close to the mean load as the search finds, starting from b and returning the best b' seen.

    scores [T, E] fp32 router affinities of the step's tokens (this rank's); bias [E]; reduce: in-place sum
    of a load vector over ranks (all_reduce) so every rank searches on the global loads and returns the
    same b'. Per-expert step sizes grow by 1.2 while an expert stays on one side of the mean and halve
    when it crosses (Rprop), starting from about a tenth of the scores' spread. The centre of b' is kept at b's,
    since adding a constant to every expert changes no selection."""
    from dsv41.ops import topk_canonical

    n_experts = scores.size(-1)

    def load_of(b: torch.Tensor) -> torch.Tensor:
        biased = scores + b
        picks = topk_canonical(biased, k) if canonical else biased.topk(k, dim=-1)[1]
        load = torch.bincount(picks.reshape(-1), minlength=n_experts).to(torch.float64)
        if reduce is not None:
            reduce(load)
        return load

    moments = torch.tensor([scores.numel(), scores.double().sum(), scores.double().square().sum()], dtype=torch.float64)
    if reduce is not None:
        reduce(moments)
    n, total, sq = moments.tolist()
    spread = math.sqrt(max(sq / max(n, 1) - (total / max(n, 1)) ** 2, 1e-12))
    # a power of two, so that ranks and process counts that sum in different orders start alike
    first_step = 2.0 ** round(math.log2(0.1 * spread))
    b = bias.to(torch.float64).clone()
    step = torch.full_like(b, first_step)
    last_sign = torch.zeros_like(b)
    best, best_ratio = b.clone(), float("inf")
    for _ in range(iters):
        load = load_of(b.to(bias.dtype))
        if load.sum() == 0:
            return bias.clone()
        ratio = float(load.max() / load.mean())
        if ratio < best_ratio:
            best, best_ratio = b.clone(), ratio
        if ratio <= 1.0 + 1e-9:
            break
        sign = torch.sign(load - load.mean())
        step = torch.where(sign * last_sign > 0, step * 1.2, torch.where(sign * last_sign < 0, step * 0.5, step))
        last_sign = sign
        delta = -step * sign
        b = b + (delta - delta.mean())
    return best.to(bias.dtype)
