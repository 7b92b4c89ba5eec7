"""Sinkhorn-normalised momentum (training.md §1.3, §11)."""

import pytest
import torch

from dsv41.optim import SinkMomentum, active_rows, sinkhorn_normalize


def rms_rows(x):
    return x.double().pow(2).mean(dim=1).sqrt()


def rms_cols(x):
    return x.double().pow(2).mean(dim=0).sqrt()


@pytest.mark.parametrize("kind", ["gaussian", "heavy"])
def test_fixed_point_rows_and_cols(kind):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(512, 256, generator=g)
    if kind == "heavy":
        u = u * torch.exp(2 * torch.randn(512, 1, generator=g)) * torch.exp(torch.randn(1, 256, generator=g))
    x = sinkhorn_normalize(u)
    assert (rms_rows(x) - 1).abs().max() < 1e-3
    assert (rms_cols(x) - 1).abs().max() < 1e-3


def test_masked_rows_zero_and_cols_over_active_rows():
    g = torch.Generator().manual_seed(1)
    u = torch.zeros(400, 64)
    used = torch.randperm(400, generator=g)[:20]
    u[used] = torch.randn(20, 64, generator=g)
    active = active_rows(u, u)
    assert active.sum() == 20 and active[used].all()
    x = sinkhorn_normalize(u, active)
    assert (x[~active] == 0).all()
    assert (rms_rows(x[active]) - 1).abs().max() < 1e-3
    assert (rms_cols(x[active]) - 1).abs().max() < 1e-3


def test_tau_mask():
    u = torch.ones(10, 8)
    u[3] = 1e-5
    active = active_rows(u, None, mode="tau", tau=1e-3)
    assert not active[3] and active.sum() == 9


def test_scale_invariance():
    u = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(sinkhorn_normalize(u * 1e3), sinkhorn_normalize(u), rtol=1e-5, atol=1e-5)


def test_step_absent_rows_bit_identical_and_rms():
    torch.manual_seed(3)
    emb = torch.nn.Embedding(100, 16)
    w0 = emb.weight.detach().clone()
    opt = SinkMomentum(emb.parameters(), lr=0.1)
    seen = torch.zeros(100, dtype=torch.bool)
    for ids in (torch.tensor([1, 5, 7, 7, 40]), torch.tensor([5, 9, 41])):
        seen[ids] = True
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        before = emb.weight.detach().clone()
        opt.step()
        after = emb.weight.detach()
        absent = torch.ones(100, dtype=torch.bool)
        absent[ids] = False
        assert torch.equal(after[absent], before[absent])
        assert not torch.equal(after[ids], before[ids])
    assert torch.equal(emb.weight.detach()[~seen], w0[~seen])


def test_update_rms_is_gamma_and_deterministic():
    def run():
        p = torch.nn.Parameter(torch.zeros(128, 64))
        opt = SinkMomentum([p], lr=1.0)
        p.grad = torch.randn(128, 64, generator=torch.Generator().manual_seed(4))
        opt.step()
        return p.detach().clone()

    a, b = run(), run()
    assert torch.equal(a, b)
    assert abs(a.pow(2).mean().sqrt().item() / 0.18 - 1) < 1e-3


def test_stateless_keeps_no_buffer():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    opt = SinkMomentum([p], momentum=0.0)
    p.grad = torch.randn(8, 4)
    opt.step()
    assert len(opt.state) == 0
