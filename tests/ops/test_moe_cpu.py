"""The C++ expert kernel (dsv41.ops.moe_cpu) against its reference, ops.moe.gathered_experts: the same
routing and math, sums in another order (so within bf16 rounding of the reference, not bit for bit). Built
here with this machine's instruction set: the bf16 dot-product form where the CPU has it, the portable
form elsewhere; both are checked by the same test."""

import pytest
import torch

from dsv41.ops import moe_cpu
from dsv41.ops.moe import gathered_experts

pytestmark = pytest.mark.skipif(moe_cpu.library() is None, reason="no C++ compiler to build the kernel")


def _case(tokens: int, k: int, experts: int = 9, dim: int = 96, inter: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g).bfloat16()
    w1 = (torch.randn(experts, inter, dim, generator=g) * 0.2).bfloat16()
    w3 = (torch.randn(experts, inter, dim, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(experts, dim, inter, generator=g) * 0.2).bfloat16()
    # k - 1 routed picks per token (several tokens share experts) and the last expert as a shared one
    routed = torch.stack([torch.randperm(experts - 1, generator=g)[: k - 1] for _ in range(tokens)])
    indices = torch.cat([routed, torch.full((tokens, 1), experts - 1)], dim=1)
    weights = torch.cat([torch.rand(tokens, k - 1, generator=g), torch.ones(tokens, 1)], dim=1)
    return x, weights, indices, w1, w3, w2


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("limit", [0.0, 0.75])
def test_the_kernel_gives_the_reference_within_bf16_rounding(tokens, limit):
    args = _case(tokens, k=3, seed=tokens)
    got = torch.ops.dsv41.gathered_experts_cpu(*args, limit)
    want = gathered_experts(*args, limit)
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    # each bf16 rounding of the reference's intermediates (gate, up, h, each pair's output) may land one step
    # away when the sums run in another order: a few bf16 steps of the result's scale at worst, far less on
    # average
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * scale)
    assert (got - want).abs().mean().item() <= 2e-3 * scale


def test_a_clamp_that_binds_and_experts_nobody_picked():
    x, weights, indices, w1, w3, w2 = _case(6, k=2, experts=12, seed=7)
    x = x * 8  # large gate and up values: the limit clamps most of them
    got = torch.ops.dsv41.gathered_experts_cpu(x, weights, indices, w1, w3, w2, 0.5)
    want = gathered_experts(x, weights, indices, w1, w3, w2, 0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    assert len(set(indices.flatten().tolist())) < 12  # some experts were not picked at all


def test_fits_takes_bf16_cpu_weights_whose_rows_are_multiples_of_32():
    w1, w2 = torch.zeros(2, 64, 96, dtype=torch.bfloat16), torch.zeros(2, 96, 64, dtype=torch.bfloat16)
    assert moe_cpu.fits(w1, w2)
    assert not moe_cpu.fits(w1.float(), w2.float())
    assert not moe_cpu.fits(torch.zeros(2, 64, 100, dtype=torch.bfloat16), w2)


def test_repeated_tokens_are_computed_once_with_the_bits_of_each_token_alone():
    """Padding rows repeat a row (the compiled tiles and buckets): the kernel computes a run of copies once.
    Every token, copies included, gets the bits it gets alone."""
    x, weights, indices, w1, w3, w2 = _case(4, k=3, seed=11)
    rows = torch.tensor([0, 1, 1, 1, 2, 3, 3])  # runs of copies in the middle and at the end
    args = (x[rows], weights[rows], indices[rows], w1, w3, w2)
    got = torch.ops.dsv41.gathered_experts_cpu(*args, 0.75)
    for t, r in enumerate(rows.tolist()):
        alone = torch.ops.dsv41.gathered_experts_cpu(
            x[r : r + 1], weights[r : r + 1], indices[r : r + 1], w1, w3, w2, 0.75
        )
        assert torch.equal(got[t : t + 1], alone), t
    # a copy whose weights differ is no copy: it is computed with its own
    changed = weights[rows].clone()
    changed[2, 0] *= 0.5
    out = torch.ops.dsv41.gathered_experts_cpu(x[rows], changed, indices[rows], w1, w3, w2, 0.75)
    assert not torch.equal(out[2], got[2]) and torch.equal(out[3], got[3])
