"""The few-row bf16 linear kernel (dsv41.ops.linear_cpu) against a float64 reference: fp32 sums of exact
products, so within fp32 rounding of the exact result; each row's bits independent of the other rows (the
`deterministic` tiles rely on that); repeated rows computed once with the bits each gets alone."""

import pytest
import torch

from dsv41.ops import linear_cpu

pytestmark = pytest.mark.skipif(
    not linear_cpu.available(), reason="the kernel serves only where the CPU has bf16 dot-product instructions"
)


def _case(tokens: int, out: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, width, generator=g).bfloat16(), torch.randn(out, width, generator=g).bfloat16()


# out 100 and 17: rows past the last whole block of 16; 8192 x 384: the head, on two threads
@pytest.mark.parametrize(
    ("tokens", "out", "width"), [(1, 16, 32), (3, 100, 384), (17, 17, 96), (64, 768, 192), (8, 8192, 384)]
)
def test_the_kernel_gives_the_exact_products_summed_in_fp32(tokens, out, width):
    x, w = _case(tokens, out, width, seed=tokens + out)
    got = linear_cpu.rows_linear(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (tokens, out)
    # fp32 sums of `width` exact products: a few fp32 ulps of the terms' scale (sqrt(width) for unit normals)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=width * 2**-23 * width**0.5 * 4)
    assert linear_cpu.rows_linear(x.view(1, tokens, width), w).shape == (1, tokens, out)  # leading dims kept


def test_each_row_gets_the_bits_it_gets_alone_whatever_shares_its_call():
    x, w = _case(12, 100, 384, seed=3)
    alone = torch.cat([linear_cpu.rows_linear(x[t : t + 1], w) for t in range(12)])
    assert torch.equal(linear_cpu.rows_linear(x, w), alone)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(linear_cpu.rows_linear(x[order], w), alone[order])
    big = torch.cat([x, (torch.randn(40, 384) * 1e3).bfloat16()])  # other companions, other row counts
    assert torch.equal(linear_cpu.rows_linear(big, w)[:12], alone)


def test_repeated_rows_are_computed_once_with_the_bits_of_each_row_alone():
    x, w = _case(4, 48, 64, seed=5)
    rows = torch.tensor([0, 1, 1, 1, 2, 0, 3, 3])  # runs of copies, and a row seen again after another
    got = linear_cpu.rows_linear(x[rows], w)
    for t, r in enumerate(rows.tolist()):
        assert torch.equal(got[t], linear_cpu.rows_linear(x[r : r + 1], w)[0]), t


def test_a_call_without_rows_gives_an_empty_result():
    w = _case(1, 48, 64)[1]
    assert linear_cpu.rows_linear(torch.zeros(0, 64, dtype=torch.bfloat16), w).shape == (0, 48)


def test_fits_takes_bf16_calls_of_a_few_rows_whose_width_is_a_multiple_of_32():
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16)
    assert linear_cpu.fits(x, w)
    assert not linear_cpu.fits(x.float(), w.float())
    assert not linear_cpu.fits(torch.zeros(8, 48, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16))
    assert not linear_cpu.fits(torch.zeros(linear_cpu.MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
