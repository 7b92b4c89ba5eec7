"""Graded GRPO with reasoning effort: rewards, subgroup advantages and the policy loss (training.md §8,
spec-v41.md §10).

- Reward of a response to a prompt asked at effort b: its task grade (partial credit allowed) minus a
  length penalty min(C_max, k(b) * length / L_norm), k(b) = k0 * exp(-(b - b_min) / tau), so a higher
  effort pays less for every token (b_min: the lowest effort trained).
- Advantages are group-relative *within each (prompt, effort) subgroup*: (r - mean) / (std + eps), the
  same for every token of the response; or r - mean (`scale_rewards="none"`, Dr. GRPO, Liu et al. 2025),
  which keeps the reward's units across subgroups: a subgroup whose styles differ by a small reward then
  pushes less than one where they differ by a large one, where std scaling makes every subgroup push alike.
- Loss, per token t of a response (token-level: a batch's tokens weigh the same, whatever their
  sequence's length): -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta * KL_t, with
  rho = pi / pi_old from the rollout's log-probabilities, and KL_t the unbiased K3 estimator of
  KL(pi || pi_ref) corrected by the importance ratio (DeepSeek-V3.2): rho * (r - log r - 1) with
  r = pi_ref / pi.
- Off-policy sequence masking (V3.2): a response with a negative advantage whose mean per-token KL
  from the rollout policy, log pi_old - log pi, exceeds `offpolicy_kl` is left out of the loss.
- "Keep sampling mask": log-probabilities are taken under the distribution the token was sampled from
  (temperature, top-k/top-p support), with the rollout's support (`dsv41.engine.sampling.processed_logprobs`).

Everything here is plain tensor math on per-token log-probabilities; the learner computes those
(`dsv41.rl.policy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ADVANTAGE_SCALES = ("group", "none")  # (r - mean) / std per subgroup (GRPO), or r - mean (Dr. GRPO)


@dataclass
class GRPOConfig:
    efforts: tuple[int, ...] = field(
        default=(25, 50, 75, 100),
        metadata={
            "help": (
                "reasoning efforts sampled for every prompt; advantages are normalised within each (prompt, effort)"
            )
        },
    )
    group_size: int = field(default=8, metadata={"help": "responses sampled per (prompt, effort) subgroup"})
    k0: float = field(default=0.5, metadata={"help": "length-penalty strength at the lowest effort, k(b_min)"})
    tau: float = field(
        default=25.0, metadata={"help": ("effort scale of the length penalty: k(b) = k0 * exp(-(b - b_min) / tau)")}
    )
    c_max: float = field(default=0.5, metadata={"help": "cap of the length penalty, C_max"})
    l_norm: float = field(default=64.0, metadata={"help": "response length (tokens) that costs k(b), L_norm"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip below: rho >= 1 - clip_low"})
    clip_high: float = field(default=0.2, metadata={"help": "PPO clip above: rho <= 1 + clip_high"})
    kl_coef: float = field(default=0.01, metadata={"help": "beta: weight of the KL to the reference policy"})
    offpolicy_kl: float = field(
        default=0.5,
        metadata={
            "help": (
                "off-policy sequence masking: drop negative-advantage responses whose mean per-token "
                "log pi_old - log pi exceeds this (<= 0 disables)"
            )
        },
    )
    adv_eps: float = field(default=1e-4, metadata={"help": "added to the subgroup's reward std"})
    scale_rewards: str = field(
        default="group",
        metadata={
            "choices": ADVANTAGE_SCALES,
            "help": ("group: advantages (r - mean) / (std + eps) within each subgroup; none: r - mean (Dr. GRPO)"),
        },
    )

    def validate(self) -> None:
        if not self.efforts or any(not 1 <= int(b) <= 100 for b in self.efforts):
            raise ValueError(f"GRPOConfig.efforts must be reasoning efforts in 1..100, got {self.efforts}")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size must be >= 2 (advantages are relative), got {self.group_size}")
        for name in ("tau", "l_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GRPOConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("k0", "c_max", "clip_low", "clip_high", "kl_coef", "adv_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"GRPOConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.scale_rewards not in ADVANTAGE_SCALES:
            raise ValueError(f"GRPOConfig.scale_rewards must be one of {ADVANTAGE_SCALES}, got {self.scale_rewards!r}")
        if self.clip_low >= 1:
            raise ValueError(f"GRPOConfig.clip_low must be < 1, got {self.clip_low}")


def length_coefficient(effort: float, cfg: GRPOConfig) -> float:
    """k(b) = k0 * exp(-(b - b_min) / tau), b_min the lowest trained effort."""
    return cfg.k0 * math.exp(-(effort - min(cfg.efforts)) / cfg.tau)


def length_penalty(length: int, effort: float, cfg: GRPOConfig) -> float:
    """min(C_max, k(b) * length / L_norm)."""
    return min(cfg.c_max, length_coefficient(effort, cfg) * length / cfg.l_norm)


def reward(grade: float, length: int, effort: float, cfg: GRPOConfig) -> float:
    """Task grade in [0, 1] minus the effort-dependent length penalty."""
    return float(grade) - length_penalty(length, effort, cfg)


def style_gaps(reasoning: tuple[float, float], direct: tuple[float, float], cfg: GRPOConfig) -> dict[int, float]:
    """{b: reward of a reply that reasons - reward of one that answers directly} at every effort of `cfg`,
    for replies of the given (mean grade, mean length): what the penalty asks of the choice of style at each
    effort (> 0: reasoning pays). Means in, so a capped penalty is approximated by the cap at the mean length."""
    return {
        int(b): reward(reasoning[0], reasoning[1], b, cfg) - reward(direct[0], direct[1], b, cfg) for b in cfg.efforts
    }


def shared_push(gaps: dict, reasoning_share: dict) -> float:
    """sum_b p_b (1 - p_b) gap_b, p_b the share of replies that reason at effort b: the expected policy
    gradient of one on-policy step on the logit of reasoning, summed over the efforts, i.e. its push on a
    style bias that every effort shares (> 0: towards reasoning at every effort). A model that reads b weakly
    moves mostly along this shared bias (docs/rl-effort.md, fourth part), so a penalty whose gaps differ in
    sign across efforts separates them only while this sum stays near 0."""
    return float(sum(reasoning_share[b] * (1 - reasoning_share[b]) * gap for b, gap in gaps.items()))


def subgroup_advantages(
    rewards: Sequence[float], groups: Sequence, eps: float = 1e-4, scale: str = "group"
) -> torch.Tensor:
    """(r - mean) / (std + eps) within each subgroup (responses with equal `groups` key, e.g.
    (prompt id, effort)); std is the population std of the subgroup. scale="none": r - mean.
    Returns fp32 [N]."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    members: dict = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    for idx in members.values():
        sub = r[idx]
        centred = sub - sub.mean()
        out[idx] = centred / (sub.std(unbiased=False) + eps) if scale == "group" else centred
    return out.float()


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar to minimise
    policy: torch.Tensor  # the clipped-ratio term (mean over counted tokens)
    kl: torch.Tensor  # mean K3 KL estimate to the reference
    clip_fraction: float  # counted tokens whose ratio left the clip range on the side that matters
    masked_sequences: int  # responses left out by off-policy masking
    ratio_max_deviation: float  # max |rho - 1| over counted tokens (0 on the first, on-policy step)
    tokens: int  # tokens counted


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
) -> LossParts:
    """The GRPO objective over a padded batch of responses.

    logp [N, L] (current policy, differentiable), old_logp [N, L] (the rollout's, the sampling
    distribution's), ref_logp [N, L] or None (reference policy; None skips the KL), advantages [N],
    mask [N, L] bool (real response tokens). All log-probabilities are of the sampled tokens under the
    processed (temperature / top-k / top-p) distribution."""
    mask = mask.bool()
    old_logp, advantages = old_logp.detach(), advantages.detach().to(logp.dtype)
    log_ratio = (logp - old_logp).masked_fill(~mask, 0.0)
    keep = torch.ones(logp.size(0), dtype=torch.bool, device=logp.device)
    if cfg.offpolicy_kl > 0:  # mean log pi_old - log pi per sequence, on the detached values
        lengths = mask.sum(-1).clamp_min(1)
        seq_kl = (-log_ratio.detach()).sum(-1) / lengths
        keep = ~((advantages < 0) & (seq_kl > cfg.offpolicy_kl))
    counted = mask & keep.unsqueeze(-1)
    tokens = int(counted.sum())
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    denom = max(tokens, 1)
    policy = -(surrogate * counted).sum() / denom
    kl = logp.new_zeros(())
    if ref_logp is not None and cfg.kl_coef > 0:
        log_r = (ref_logp.detach() - logp).masked_fill(~mask, 0.0)
        # importance-corrected K3; the ratio keeps its gradient: d(rho * k3) = rho * dlog pi * log(pi / pi_ref),
        # whose expectation under pi_old is the gradient of KL(pi || pi_ref)
        k3 = ratio * (torch.exp(log_r) - log_r - 1)
        kl = (k3 * counted).sum() / denom
    loss = policy + cfg.kl_coef * kl
    with torch.no_grad():
        out_of_range = ((ratio > 1 + cfg.clip_high) & (adv > 0)) | ((ratio < 1 - cfg.clip_low) & (adv < 0))
        clip_fraction = float((out_of_range & counted).sum()) / denom
        deviation = float(((ratio - 1).abs() * counted).max()) if tokens else 0.0
    return LossParts(loss, policy.detach(), kl.detach(), clip_fraction, int((~keep).sum()), deviation, tokens)
