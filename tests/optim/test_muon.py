"""Muon and head-wise Muon (training.md §1.1, §1.2, §11)."""

import math

import pytest
import torch

from dsv41.optim import KELLER_SCHEDULE, V4_HYBRID_SCHEDULE, Muon, muon_direction, newton_schulz


def ill_conditioned(rows, cols, cond=1e3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    return ((u * s) @ v.T).to(dtype)


SHAPES = [(256, 256), (512, 128), (128, 1024), (24, 256)]


def test_schedules_are_as_documented():
    assert len(V4_HYBRID_SCHEDULE) == 10
    assert V4_HYBRID_SCHEDULE[:8] == ((3.4445, -4.7750, 2.0315),) * 8
    assert V4_HYBRID_SCHEDULE[8:] == ((2.0, -1.5, 0.5),) * 2
    assert len(KELLER_SCHEDULE) == 5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["gaussian", "ill"])
def test_v4_schedule_singular_values_near_one(shape, kind):
    if kind == "ill":
        u = ill_conditioned(*shape)
    else:
        u = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(u, "v4").double())
    assert s.min() >= 0.99 and s.max() <= 1.01, (s.min(), s.max())


@pytest.mark.parametrize("shape", [(256, 256), (512, 128)])
def test_v4_schedule_bf16(shape):
    u = ill_conditioned(*shape, dtype=torch.bfloat16)
    s = torch.linalg.svdvals(newton_schulz(u, "v4", dtype=torch.bfloat16).double())
    assert s.min() >= 0.98 and s.max() <= 1.02, (s.min(), s.max())


@pytest.mark.parametrize("shape", [(256, 256), (128, 1024)])
def test_keller_schedule_bounds(shape):
    s = torch.linalg.svdvals(newton_schulz(ill_conditioned(*shape), "keller").double())
    assert s.min() > 0 and s.max() <= 1.25
    assert s.min() < 0.5  # the 5-step schedule does not reach 1 on ill-conditioned inputs


def test_ns_scale_invariance_and_equivariance():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(48, 80, generator=g)
    torch.testing.assert_close(newton_schulz(u * 37.0), newton_schulz(u), atol=1e-5, rtol=1e-4)
    p, _ = torch.linalg.qr(torch.randn(48, 48, generator=g))
    q, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    torch.testing.assert_close(newton_schulz(p @ u @ q), p @ newton_schulz(u) @ q, atol=2e-4, rtol=1e-3)


def test_ns_zero_is_finite_zero():
    out = newton_schulz(torch.zeros(16, 32))
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_update_rms_is_gamma(shape):
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    o = muon_direction(u)
    rms = o.pow(2).mean().sqrt().item()
    assert abs(rms / 0.18 - 1) < 0.02


def test_headwise_blocks_orthogonal_and_independent():
    heads, d, cols = 4, 16, 64
    g = torch.Generator().manual_seed(4)
    u = torch.randn(heads * d, cols, generator=g)
    o = muon_direction(u, heads=heads)
    for h in range(heads):
        block = o[h * d : (h + 1) * d] / (0.18 * math.sqrt(max(d, cols)))
        s = torch.linalg.svdvals(block.double())
        assert s.min() >= 0.99 and s.max() <= 1.01
    # equal to orthogonalising each block on its own
    for h in range(heads):
        torch.testing.assert_close(o[h * d : (h + 1) * d], muon_direction(u[h * d : (h + 1) * d]))
    # changing head 1's gradient leaves the other heads' updates unchanged ...
    u2 = u.clone()
    u2[d : 2 * d] = torch.randn(d, cols, generator=g)
    o2 = muon_direction(u2, heads=heads)
    for h in (0, 2, 3):
        assert torch.equal(o[h * d : (h + 1) * d], o2[h * d : (h + 1) * d])
    assert not torch.allclose(o[d : 2 * d], o2[d : 2 * d])
    # ... which full-matrix Muon does not do
    assert not torch.allclose(muon_direction(u)[:d], muon_direction(u2)[:d], atol=1e-4)
    # head_dim is the same as heads; heads=1 is plain Muon; permuting heads permutes blocks
    assert torch.equal(muon_direction(u, head_dim=d), o)
    perm = torch.tensor([2, 0, 3, 1])
    up = u.view(heads, d, cols)[perm].reshape(heads * d, cols)
    torch.testing.assert_close(muon_direction(up, heads=heads), o.view(heads, d, cols)[perm].reshape(-1, cols))


def test_batched_leading_dims():
    u = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(5))
    o = muon_direction(u)
    for e in range(3):
        torch.testing.assert_close(o[e], muon_direction(u[e]))


def test_headwise_rejects_bad_head_count():
    with pytest.raises(ValueError):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(10, 4))], "heads": 3}])


def test_step_matches_hand_computation():
    torch.manual_seed(0)
    w0 = torch.randn(8, 12)
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.01, weight_decay=0.1, momentum=0.9)
    grads = [torch.randn(8, 12) for _ in range(2)]
    m = torch.zeros(8, 12)
    w = w0.clone()
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
        m = 0.9 * m + gr
        w = w * (1 - 0.01 * 0.1) - 0.01 * muon_direction(gr + 0.9 * m)
        assert torch.equal(p.grad, gr)  # the gradient is not modified
    torch.testing.assert_close(p.detach(), w)


def test_decoupled_weight_decay_with_zero_grad():
    p = torch.nn.Parameter(torch.randn(6, 6))
    w0 = p.detach().clone()
    opt = Muon([p], lr=0.05, weight_decay=0.1)
    p.grad = torch.zeros(6, 6)
    opt.step()
    torch.testing.assert_close(p.detach(), w0 * (1 - 0.05 * 0.1), rtol=0, atol=0)
