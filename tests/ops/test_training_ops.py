"""QAT fake quantisation and MoE balancing primitives (training.md §5, §7)."""

import pytest
import torch

from dsv41.ops import moe, qat, quant


def test_fake_quant_forward_is_the_inference_rounding_and_backward_is_identity():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=g) * 3).requires_grad_()
    for fn, ref in (
        (qat.fp8_fake_quant, quant.fp8_qdq(x.detach())),
        (qat.kv_fake_quant, quant.fp4_qdq(x.detach(), 16, "e4m3")),
        (lambda v: qat.fp4_fake_quant(v, 32, "ue8m0"), quant.fp4_qdq(x.detach(), 32, "ue8m0")),
    ):
        y = fn(x)
        assert torch.equal(y.detach(), ref)
        (grad,) = torch.autograd.grad((y * torch.arange(64.0)).sum(), x)
        assert torch.equal(grad, torch.arange(64.0).expand(4, 64))  # exactly the upstream gradient
    # idempotent: fake-quantising a rounded tensor changes nothing
    once = qat.kv_fake_quant(x).detach()
    assert torch.equal(qat.kv_fake_quant(once), once)


def test_clipped_straight_through_zeroes_saturated_values_only():
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([6.0, 0.7, -1.2])
    x[0, 3] = 9.0  # the E4M3 scale of amax/6 = 1.5 maps 9 to 6 * 1.5 exactly: not saturated
    x = x.requires_grad_()
    (grad,) = torch.autograd.grad(qat.kv_fake_quant(x, clip=True).sum(), x)
    assert torch.equal(grad, torch.ones_like(x))
    # an e4m3 scale that rounds down makes the block maximum saturate
    y = torch.zeros(1, 16)
    y[0, 0], y[0, 1] = 6.3, 1.0  # amax/6 = 1.05 rounds to 1.0 in E4M3 -> 6.3 clips to 6
    y = y.requires_grad_()
    (grad,) = torch.autograd.grad(qat.kv_fake_quant(y, clip=True).sum(), y)
    assert grad[0, 0] == 0 and torch.equal(grad[0, 1:], torch.ones(15))


def test_bias_update_moves_toward_balance_and_ignores_empty_modalities():
    n = 8
    g = torch.Generator().manual_seed(1)
    skew = torch.linspace(0, 2, n)  # a router that prefers high-index experts
    bias = torch.zeros(n)
    for _ in range(400):
        scores = torch.rand(512, n, generator=g) + skew
        _, idx = moe.route(scores, bias, 2, True, 1.0)
        bias = moe.balance_bias_update(bias, moe.expert_load(idx, n), rate=1e-2)
    _, idx = moe.route(torch.rand(4096, n, generator=g) + skew, bias, 2, True, 1.0)
    load = moe.expert_load(idx, n)
    assert load.max() / load.mean() < 1.2
    # a modality with no tokens in the batch keeps its bias
    image_bias = torch.randn(n, generator=g)
    empty = moe.expert_load(idx, n, mask=torch.zeros(4096, dtype=torch.bool))
    assert torch.equal(moe.balance_bias_update(image_bias, empty), image_bias)


def test_bias_changes_selection_but_not_the_weights_gradient_path():
    scores = torch.rand(16, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    bias = torch.zeros(6, requires_grad=True)
    weights, _ = moe.route(scores, bias, 2, True, 1.5)
    grad = torch.autograd.grad(weights.sum(), bias, allow_unused=True)[0]
    assert grad is None or torch.count_nonzero(grad) == 0


def test_sequence_balance_loss_values():
    b, t, e, k = 2, 32, 4, 2
    uniform = torch.full((b, t, e), 0.5)
    # perfectly balanced picks: each expert gets t*k/e tokens -> f_e = 1, P_e = 1/e -> loss 1
    idx = torch.stack([torch.arange(t) % e, (torch.arange(t) + 1) % e], dim=-1).expand(b, t, k)
    assert torch.isclose(moe.sequence_balance_loss(uniform, idx, e), torch.tensor(1.0))
    # everything on experts 0 and 1 with matching affinities: f = (2, 2, 0, 0), P = (.5, .5, 0, 0) -> 2
    skewed = torch.zeros(b, t, e)
    skewed[..., :2] = 1.0
    idx = torch.tensor([0, 1]).expand(b, t, k)
    assert torch.isclose(moe.sequence_balance_loss(skewed, idx, e), torch.tensor(2.0))
    # differentiable in the scores
    s = torch.rand(b, t, e).requires_grad_()
    moe.sequence_balance_loss(s, idx, e).backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def _sequential_deferred_acceptance(biased, k, capacity):
    """Token-proposing deferred acceptance, one proposal at a time (Gale-Shapley), in plain Python."""
    t, e = biased.shape
    prefs = [sorted(range(e), key=lambda j: -float(biased[i, j])) for i in range(t)]
    nxt, held = [0] * t, {j: [] for j in range(e)}
    free = [i for i in range(t) for _ in range(k)]
    while free:
        i = free.pop()
        j = prefs[i][nxt[i]]
        nxt[i] += 1
        held[j].append(i)
        if len(held[j]) > capacity:
            worst = min(held[j], key=lambda x: float(biased[x, j]))
            held[j].remove(worst)
            free.append(worst)
    return [sorted(j for j in range(e) if i in held[j]) for i in range(t)]


def test_capacity_topk_is_the_stable_assignment_and_bounds_every_expert():
    g = torch.Generator().manual_seed(0)
    for t, e, k, factor in ((40, 8, 2, 1.1), (64, 16, 2, 1.25), (30, 6, 3, 1.5), (256, 16, 2, 1.5)):
        biased = torch.randn(t, e, generator=g)
        biased[:, 0] += 1.5  # a favourite expert that overflows
        capacity = -(-int(factor * t * k) // e)
        got = moe.capacity_topk(biased, k, capacity)
        assert torch.bincount(got.flatten(), minlength=e).max() <= capacity
        assert got.sort(dim=-1).values.tolist() == _sequential_deferred_acceptance(biased, k, capacity)
    tight = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    tight[:, 0] += 1.5
    picks = moe.capacity_topk(tight, 2, 10)  # capacity x experts = demand: one token runs out of experts
    assert torch.bincount(picks.flatten(), minlength=8).max() <= 11
    assert all(len(set(row)) == 2 for row in picks.tolist())
    loose = moe.capacity_topk(biased, 3, biased.size(0))  # never binding: the plain top-k, in its order
    assert torch.equal(loose, biased.topk(3, dim=-1)[1])
    with pytest.raises(ValueError, match="cannot hold"):
        moe.capacity_topk(biased, 3, 2)
