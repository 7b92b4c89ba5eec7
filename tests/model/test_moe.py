"""The MoE layer's two dispatch paths: the per-expert loop (autograd) and the sorted pass (inference) give the
same bits, for any batch, including tokens that pick an expert no other token picks."""

import pytest
import torch

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer


@pytest.fixture(scope="module")
def moe():
    return init_random_weights(Transformer(tiny()), seed=2).eval().layers[3].ffn


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 301])
def test_the_sorted_pass_gives_the_per_expert_loops_bits(moe, tokens):
    x = torch.randn(1, tokens, moe.dim, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    with torch.no_grad():
        fast = moe(x)
    with torch.enable_grad():  # the per-expert loop (every expert, idle ones on zero rows)
        loop = moe(x).detach()
    assert torch.equal(fast, loop)


def test_the_sorted_pass_adds_each_tokens_experts_in_order(moe):
    """Forced picks: token 0 takes the last and first expert (in that order), token 1 the reverse; the sum is
    still taken in ascending expert order, as the loop takes it."""
    x = torch.randn(2, moe.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    e = len(moe.experts) - 1
    indices = torch.tensor([[e, 0], [0, e]])
    weights = torch.tensor([[0.7, 0.3], [0.3, 0.7]])
    with torch.no_grad():
        got = moe._routed_sorted(x, weights, indices)
        want = torch.zeros(2, moe.dim)
        for t in range(2):
            for expert in (0, e):  # ascending expert order
                slot = int((indices[t] == expert).nonzero())
                want[t] += moe.experts[expert](x[t : t + 1], weights[t, slot].view(1, 1))[0]
    assert torch.equal(got, want)


def _fresh_moe(seed: int = 3):
    return init_random_weights(Transformer(tiny()), seed=seed).eval().layers[3].ffn


def test_the_decode_form_routes_and_sums_like_the_module():
    """MoE.decode_forward (the compiled decode step's MoE: gathered rows of the stacked weights, the shared
    expert as one more pick) gives the module's output up to bf16 rounding, for tokens of one batch."""
    moe = _fresh_moe()
    x = torch.randn(1, 5, moe.dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        want = moe(x).float()
        assert moe.stack_experts()
        got = moe.decode_forward(x, moe.stacked()).float()
    assert got.shape == want.shape
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-2, err
    # a wrong expert read (rows of the next expert) is far off: the comparison can fail
    w1, w3, w2 = moe.stacked()
    with torch.no_grad():
        wrong = moe.decode_forward(x, (w1.roll(1, 0), w3.roll(1, 0), w2.roll(1, 0))).float()
    assert (wrong - want).abs().max() / want.abs().max() > 0.1


def test_stacked_experts_are_the_modules_weights():
    """After stack_experts every expert Linear's weight is a view into the stacks: an in-place update of either
    shows in both (no second copy of the weights), and a weight whose storage is replaced drops the stacking."""
    moe = _fresh_moe()
    assert moe.stacked() is None
    before = [e.w2.weight.clone() for e in moe.experts]
    assert moe.stack_experts()
    w1, w3, w2 = moe.stacked()
    assert w1.shape == (len(moe.experts) + 1, *moe.experts[0].w1.weight.shape)
    assert all(torch.equal(e.w2.weight, b) for e, b in zip(moe.experts, before))
    assert torch.equal(w2[-1], moe.shared_experts.w2.weight)
    with torch.no_grad():
        moe.experts[2].w1.weight.mul_(2)
    assert torch.equal(moe.stacked()[0][2], moe.experts[2].w1.weight)
    moe.experts[1].w3.weight.data = moe.experts[1].w3.weight.detach().clone()
    assert moe.stacked() is None


def test_quantized_experts_are_not_stacked():
    cfg = tiny()
    cfg.expert_dtype = "fp4"
    moe = init_random_weights(Transformer(cfg), seed=1).eval().layers[3].ffn
    assert not moe.stack_experts() and moe.stacked() is None
