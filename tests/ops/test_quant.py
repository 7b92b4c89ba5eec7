import math

import pytest
import torch

from dsv41.ops import quant


def test_ceil_pow2_matches_math():
    x = torch.tensor([1e-30, 0.3, 0.5, 1.0, 1.0000001, 3.0, 448.0, 1e20])
    want = torch.tensor([2.0 ** math.ceil(math.log2(v)) for v in x.double().tolist()], dtype=torch.float32)
    assert torch.equal(quant.ceil_pow2(x), want)


def test_e2m1_grid_points_are_exact_and_codes_round_trip():
    grid = quant.e2m1_table()
    assert torch.equal(quant.round_e2m1(grid), grid)
    codes = quant.e2m1_codes(grid)
    assert codes.tolist() == list(range(16))
    packed = quant.pack_fp4(codes.view(1, 16))
    assert packed.shape == (1, 8) and packed[0, 0].item() == (0 | 1 << 4)  # even element in the low nibble
    assert torch.equal(quant.unpack_fp4(packed).view(-1), grid)


def test_e2m1_ties_go_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert quant.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


def test_e2m1_rounds_to_nearest():
    v = torch.linspace(-6, 6, 2001)
    r = quant.round_e2m1(v)
    dist = (v.unsqueeze(-1) - quant.e2m1_table()).abs().amin(-1)
    assert torch.allclose((v - r).abs(), dist)


@pytest.mark.parametrize("block,fmt", [(32, "ue8m0"), (16, "e4m3")])
def test_fp4_qdq_idempotent_bounded_and_zero_safe(block, fmt):
    x = torch.randn(4, 128).to(torch.bfloat16)
    y = quant.fp4_qdq(x, block, fmt)
    assert torch.equal(quant.fp4_qdq(y, block, fmt), y)
    # error per element at most half the widest grid step (2) times the block scale
    groups = x.float().unflatten(-1, (-1, block))
    scale = quant._fp4_scale(groups.abs().amax(-1), fmt).unsqueeze(-1)
    assert ((y.float().unflatten(-1, (-1, block)) - groups).abs() <= scale * 1.0 + 1e-6).all()
    zeros = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert torch.equal(quant.fp4_qdq(zeros, block, fmt), zeros)
    packed, s = quant.fp4_quant(x, block, fmt)
    assert torch.equal(quant.fp4_dequant(packed, s, block).to(torch.bfloat16), y)


@pytest.mark.parametrize("block,fmt", [(32, "ue8m0"), (16, "e4m3")])
def test_packing_rounded_values_is_lossless_at_every_magnitude(block, fmt):
    """What the cache stores: `fp4_quant_rounded` of fp4_qdq output decodes to that output exactly, for
    block maxima swept across the subnormal-scale band (E4M3 scales below 2^-6) and beyond."""
    g = torch.Generator().manual_seed(0)
    amax = 2.0 ** torch.linspace(-12, 6, 4000)  # [n] block maxima, dense around 9..10 x 2^-9
    x = torch.rand(4000, 4 * block, generator=g) * 2 - 1
    x = x / x.abs().unflatten(-1, (-1, block)).amax(-1).repeat_interleave(block, -1) * amax.unsqueeze(-1)
    rounded = quant.fp4_qdq(x.bfloat16(), block, fmt)
    packed, scale = quant.fp4_quant_rounded(rounded, block, fmt)
    assert torch.equal(quant.fp4_dequant(packed, scale, block).bfloat16(), rounded)
    assert torch.equal(quant.fp4_dequant_bf16(packed, scale, block), rounded)
    if fmt == "e4m3":  # the scales stay E4M3 values, and the sweep did reach the blocks plain re-quantising breaks
        assert torch.equal(quant.e4m3_saturate(scale).float(), scale)
        plain, plain_scale = quant.fp4_quant(rounded, block, fmt)
        assert not torch.equal(quant.fp4_dequant(plain, plain_scale, block).bfloat16(), rounded)


def test_packing_refuses_values_off_the_grid():
    with pytest.raises(ValueError, match="not on the E2M1"):
        quant.fp4_quant_rounded(torch.full((1, 16), 0.001).index_fill(1, torch.tensor([0]), 0.0183), 16, "e4m3")


def test_fp8_qdq_idempotent_bounded_and_zero_safe():
    x = torch.randn(3, 96).to(torch.bfloat16) * 10
    y = quant.fp8_qdq(x)
    assert torch.equal(quant.fp8_qdq(y), y)
    rel = (y.float() - x.float()).abs() / x.float().abs().clamp_min(1e-3)
    assert rel.max() <= 2**-4 + 1e-3  # E4M3: 3 mantissa bits
    zeros = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert torch.isfinite(quant.fp8_qdq(zeros)).all() and torch.equal(quant.fp8_qdq(zeros), zeros)
    big = torch.full((1, 32), 1e30)
    assert torch.isfinite(quant.fp8_qdq(big)).all()


def test_weight_quantizers_round_trip():
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(0))
    q, s = quant.quantize_fp8_weight(w)
    assert s.shape == (3, 3) and s.dtype == torch.float8_e8m0fnu
    back = quant.dequant_fp8_weight(q, s)
    # half an E4M3 ulp: 2^-4 relative for normals, 2^-10 of the tile scale in the subnormal range
    tile_scale = s.float().repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :96]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, tile_scale * 2**-10)).all()
    q4, s4 = quant.quantize_fp4_weight(w)
    assert q4.shape == (70, 48) and s4.shape == (70, 3)
    assert torch.equal(quant.dequant_fp4_weight(q4, s4), quant.fp4_qdq(w, 32, "ue8m0"))


def test_fp4_dequant_to_bf16_is_exact():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-6, 6, 64).unsqueeze(1)
    for block, fmt in ((16, "e4m3"), (32, "ue8m0")):
        codes, scale = quant.fp4_quant(x, block, fmt)
        assert torch.equal(
            quant.fp4_dequant_bf16(codes, scale, block), quant.fp4_dequant(codes, scale, block).bfloat16()
        )
        assert torch.equal(quant.fp4_dequant_bf16(codes, scale, block).float(), quant.fp4_dequant(codes, scale, block))
