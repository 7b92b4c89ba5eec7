"""Graded GRPO: rewards with the effort-dependent length penalty, subgroup advantages, and the loss
(clipped ratio, importance-corrected K3 KL, off-policy masking), against independent formulations."""

import math

import pytest
import torch

from dsv41.rl.grpo import (
    GRPOConfig,
    grpo_loss,
    length_coefficient,
    length_penalty,
    reward,
    shared_push,
    style_gaps,
    subgroup_advantages,
)


def test_length_penalty_follows_the_formula_and_weakens_with_effort():
    cfg = GRPOConfig(efforts=(25, 50, 75, 100), k0=0.5, tau=25, c_max=0.3, l_norm=64)
    assert length_coefficient(25, cfg) == 0.5
    assert math.isclose(length_coefficient(75, cfg), 0.5 * math.exp(-2))
    for b in (25, 50, 75, 100):
        assert math.isclose(length_penalty(40, b, cfg), min(0.3, 0.5 * math.exp(-(b - 25) / 25) * 40 / 64))
    assert length_penalty(1000, 25, cfg) == 0.3  # capped
    ks = [length_coefficient(b, cfg) for b in cfg.efforts]
    assert ks == sorted(ks, reverse=True)
    assert math.isclose(reward(0.75, 32, 50, cfg), 0.75 - min(0.3, 0.5 * math.exp(-1) * 0.5))


def test_advantages_are_normalised_within_each_subgroup_only():
    rewards = [1.0, 0.0, 0.5, 2.0, 2.0, 1.0, 2.0, 7.0]
    groups = [("a", 25)] * 3 + [("a", 50)] * 2 + [("b", 25)] * 3
    adv = subgroup_advantages(rewards, groups, eps=0.0 + 1e-12)
    for key in set(groups):
        idx = [i for i, g in enumerate(groups) if g == key]
        sub = torch.tensor([rewards[i] for i in idx])
        want = (sub - sub.mean()) / (sub.std(unbiased=False) + 1e-12) if sub.std() > 0 else torch.zeros(len(idx))
        torch.testing.assert_close(adv[idx], want.float())
    assert adv[3] == 0 and adv[4] == 0  # equal rewards: no signal
    # a constant added to one subgroup changes nothing anywhere
    shifted = [r + (10 if g == ("b", 25) else 0) for r, g in zip(rewards, groups)]
    torch.testing.assert_close(subgroup_advantages(shifted, groups, 1e-12), adv)


def test_unscaled_advantages_keep_the_reward_units():
    # Dr. GRPO: r - mean per subgroup, no std; a subgroup with twice the spread pushes twice as hard,
    # where std scaling gives both the same magnitude
    rewards = [0.0, 1.0, 0.0, 2.0]
    groups = [("a", 25)] * 2 + [("a", 100)] * 2
    torch.testing.assert_close(subgroup_advantages(rewards, groups, scale="none"), torch.tensor([-0.5, 0.5, -1.0, 1.0]))
    torch.testing.assert_close(subgroup_advantages(rewards, groups, 1e-12), torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="scale"):
        subgroup_advantages(rewards, groups, scale="batch")


def _batch(seed=0, n=4, length=6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, length, generator=g) * 3).requires_grad_()
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[0, 4:] = False
    return logp, mask


def test_on_policy_gradient_is_the_policy_gradient():
    logp, mask = _batch()
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
    cfg = GRPOConfig(kl_coef=0.0, offpolicy_kl=0.0)
    parts = grpo_loss(logp, logp.detach(), None, adv, mask, cfg)
    assert parts.ratio_max_deviation == 0.0 and parts.clip_fraction == 0.0
    parts.loss.backward()
    want = -(adv.unsqueeze(-1) * mask) / mask.sum()  # d/dlogp of -mean_t(A_t * rho_t) at rho = 1
    torch.testing.assert_close(logp.grad, want)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    logp, mask = _batch()
    old = logp.detach() - torch.tensor([0.5, -0.5, 0.0, 0.0]).unsqueeze(-1)  # rho = e^0.5, e^-0.5, 1, 1
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.2, kl_coef=0.0, offpolicy_kl=0.0)
    parts = grpo_loss(logp, old, None, adv, mask, cfg)
    parts.loss.backward()
    assert torch.all(logp.grad[0] == 0) and torch.all(logp.grad[1] == 0)  # pushed further out: clipped
    assert torch.all(logp.grad[2][mask[2]] != 0) and torch.all(logp.grad[3][mask[3]] != 0)
    assert parts.clip_fraction == pytest.approx((4 + 6) / mask.sum().item())


def test_kl_estimate_and_its_gradient_match_the_exact_kl():
    """On a categorical policy, the expectation over pi_old of grpo_loss's importance-corrected KL term
    equals KL(pi || pi_ref), and its gradient equals the gradient of that KL (both computed exactly, by
    enumeration of the vocabulary)."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, generator=g).requires_grad_()
    old = torch.log_softmax(torch.randn(5, generator=g), -1)
    ref = torch.log_softmax(torch.randn(5, generator=g), -1)
    logp = torch.log_softmax(theta, -1)
    cfg = GRPOConfig(kl_coef=1.0, offpolicy_kl=0.0)
    # every vocabulary entry as a one-token "response", weighted by pi_old (the exact expectation); with
    # zero advantages the policy term is 0, so each loss is the KL term alone, gradient included
    w = old.exp()
    kls, losses = [], []
    for i in range(5):
        parts = grpo_loss(
            logp[i].view(1, 1),
            old[i].view(1, 1),
            ref[i].view(1, 1),
            torch.zeros(1),
            torch.ones(1, 1, dtype=torch.bool),
            cfg,
        )
        kls.append(parts.kl)
        losses.append(parts.loss)
    expected_kl = (w * torch.stack(kls)).sum()
    estimate = (w * torch.stack(losses)).sum()
    exact = (logp.exp() * (logp - ref)).sum()  # KL(pi || pi_ref) by its definition
    assert float(exact) > 0.1 and float((logp - old).abs().max()) > 0.1  # pi is neither pi_ref nor pi_old
    torch.testing.assert_close(expected_kl, exact.detach())
    torch.testing.assert_close(estimate, exact)
    (grad_est,) = torch.autograd.grad(estimate, theta, retain_graph=True)
    (grad_exact,) = torch.autograd.grad(exact, theta)
    assert float(grad_exact.abs().max()) > 0.05
    torch.testing.assert_close(grad_est, grad_exact)


def test_kl_is_zero_at_the_reference():
    logp, mask = _batch()
    parts = grpo_loss(logp, logp.detach(), logp.detach(), torch.zeros(4), mask, GRPOConfig(kl_coef=1.0))
    assert float(parts.kl) == 0.0


def test_off_policy_masking_drops_only_negative_advantage_sequences_far_from_the_rollout():
    logp, mask = _batch()
    old = logp.detach().clone()
    old[1] += 2.0  # sequence 1: pi much smaller than pi_old (KL estimate 2 per token)
    old[2] += 2.0  # sequence 2: the same drift but a positive advantage: kept
    adv = torch.tensor([0.5, -1.0, 1.0, -0.5])
    parts = grpo_loss(logp, old, None, adv, mask, GRPOConfig(offpolicy_kl=0.5, kl_coef=0.0))
    assert parts.masked_sequences == 1
    parts.loss.backward()
    assert torch.all(logp.grad[1] == 0) and torch.any(logp.grad[2] != 0) and torch.any(logp.grad[3] != 0)


def test_config_validation():
    with pytest.raises(ValueError, match="efforts"):
        GRPOConfig(efforts=(0, 50)).validate()
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="scale_rewards"):
        GRPOConfig(scale_rewards="std").validate()


def test_style_gaps_and_the_shared_push_against_hand_sums():
    cfg = GRPOConfig(efforts=(25, 50, 100), k0=1.6, tau=15.0, c_max=100.0, l_norm=13.0)
    gaps = style_gaps((0.92, 21.5), (0.39, 8.5), cfg)
    for b in (25, 50, 100):  # uncapped: the grade gap minus k(b) times the length gap over L_norm
        assert gaps[b] == pytest.approx(0.53 - 1.6 * math.exp(-(b - 25) / 15) * 13 / 13)
    assert gaps[25] < 0 < gaps[50] < gaps[100]
    capped = style_gaps(
        (0.92, 21.5), (0.39, 8.5), GRPOConfig(efforts=(25, 100), k0=0.5, tau=25.0, c_max=2.6, l_norm=2.5)
    )
    assert capped[25] == pytest.approx(0.53 - 2.6 + 0.5 * 8.5 / 2.5)  # the long reply hits the cap
    shares = {25: 0.6, 50: 0.5, 100: 0.2}
    expected = 0.24 * gaps[25] + 0.25 * gaps[50] + 0.16 * gaps[100]
    assert shared_push(gaps, shares) == pytest.approx(expected)
    assert shared_push(gaps, {25: 0.0, 50: 1.0, 100: 1.0}) == 0.0  # no style left to move at any effort
    assert shared_push({25: -1.0, 100: -0.1}, {25: 0.5, 100: 0.5}) < 0  # every effort asks for direct answers
