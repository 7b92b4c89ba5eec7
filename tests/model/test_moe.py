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
