"""Block quantizers for the V4.1 storage and fake-quant formats (spec-v41.md §7, §8, §13).

Formats:
- FP8 E4M3 with a power-of-two (UE8M0) scale per block of 32: activations before every FP8/FP4 GEMM,
  and the sliding-window KV (amax floored at 1e-4, scale = 2^ceil(log2(amax/448))).
- FP4 E2M1 ("MXFP4") with a UE8M0 scale per 32: indexer q/k (amax floored at 6*2^-126,
  scale = 2^ceil(log2(amax/6))), and routed-expert weights on disk.
- FP4 E2M1 with an E4M3 scale per 16: the compressed main KV (amax floored at 6*2^-9,
  scale = e4m3(amax/6)).

Rounding is round-to-nearest-even everywhere, with saturation. The FP8 path divides by
`amax * fp32(1/448)` rounded up to a power of two, exactly as the reference kernels do; the MXFP4 path
uses `amax * fp32(1/6)` (not `amax / 6`) for the same reason.

Packed FP4 layout: two E2M1 codes per byte, the even element in the low nibble; bit 3 of a code is the
sign and bits 0-2 index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6).
"""

from __future__ import annotations

import functools
import sys

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 32  # activation block and weight tile edge of every FP8 tensor in V4.1
FP4_BLOCK = 32  # MXFP4 block (weights, indexer q/k)
KV_FP4_BLOCK = 16  # compressed main KV block (E4M3 scales)

# fp32 reciprocals: the kernels multiply by these constants rather than divide by the maxima
_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_INV_FP4_MAX = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal fp32 x, computed exactly (the UE8M0 scale rule).

    x: any shape, fp32 > 0. Returns fp32, same shape.
    """
    mantissa, exponent = torch.frexp(x.float())  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two stay put
    return torch.ldexp(torch.ones_like(mantissa), exponent)


def e4m3_saturate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with RNE and saturation at +-448 (a bare cast maps overflow to NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already inside [-6, 6] to the nearest E2M1 value, ties to the even code.

    The E2M1 grid is uniform within each binade (step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]), and the
    code's parity equals the parity of the value's multiple of that step, so `torch.round` (half to even)
    on the scaled value is exactly RNE on the grid.
    """
    mag = v.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.round(v / step) * step


def e2m1_codes(rounded: torch.Tensor) -> torch.Tensor:
    """E2M1 values (already on the grid) -> 4-bit codes as uint8, sign in bit 3."""
    mag = rounded.abs()
    code = torch.where(mag <= 2, mag * 2, torch.where(mag < 6, mag + 2, torch.full_like(mag, 7.0)))
    return code.to(torch.uint8) | (torch.signbit(rounded).to(torch.uint8) << 3)


def e2m1_table(device=None) -> torch.Tensor:
    """The 16 code values as fp32 (codes 8-15 negative)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 bytes [..., K/2], even element in the low nibble."""
    if codes.size(-1) % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.size(-1)}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] (uint8, int8 or float4_e2m1fn_x2) -> fp32 values [..., K]."""
    b = packed.view(torch.uint8)
    table = e2m1_table(b.device)
    byte = torch.arange(256, device=b.device)
    pairs = torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1)  # [256, 2]: one lookup per byte
    return pairs[b.long()].flatten(-2)


# --------------------------------------------------------------------------- FP8
def fp8_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim in blocks with UE8M0 scales.

    x: [..., K] (K % block == 0), usually bf16. Returns (q float8_e4m3fn [..., K], scale fp32 [..., K/block]).
    """
    if x.size(-1) % block:
        raise ValueError(f"fp8_quant: last dim {x.size(-1)} is not a multiple of {block}")
    groups = x.float().unflatten(-1, (-1, block))  # [..., K/block, block]
    amax = groups.abs().amax(-1).clamp_min(1e-4)
    scale = ceil_pow2(amax * _INV_FP8_MAX.to(x.device))
    q = e4m3_saturate(groups / scale.unsqueeze(-1))
    return q.flatten(-2), scale


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of `fp8_quant`: q [..., K] e4m3, scale [..., K/block] -> fp32 [..., K]."""
    return (q.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def fp8_qdq(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Fake-quantize through FP8 E4M3 + UE8M0 blocks; returns x's dtype (the window-KV rounding)."""
    q, s = fp8_quant(x, block)
    return fp8_dequant(q, s, block).to(x.dtype)


# --------------------------------------------------------------------------- FP4
def _fp4_scale(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "ue8m0":
        return ceil_pow2(amax.clamp_min(FP4_MAX * 2.0**-126) * _INV_FP4_MAX.to(amax.device))
    if scale_fmt == "e4m3":
        return e4m3_saturate(amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).float()
    raise ValueError(f"unknown fp4 scale format {scale_fmt!r}; use 'ue8m0' or 'e4m3'")


def _fp4_round_groups(x: torch.Tensor, block: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E2M1 grid values [..., K/block, block] fp32, scale [..., K/block] fp32)."""
    if x.size(-1) % block:
        raise ValueError(f"fp4 quantization: last dim {x.size(-1)} is not a multiple of {block}")
    groups = x.float().unflatten(-1, (-1, block))
    scale = _fp4_scale(groups.abs().amax(-1), scale_fmt)
    return round_e2m1((groups / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)), scale


def fp4_quant(x: torch.Tensor, block: int = FP4_BLOCK, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim to packed E2M1.

    x: [..., K] (K % block == 0). Returns (packed uint8 [..., K/2], scale fp32 [..., K/block]); the scale
    values are exactly representable in `scale_fmt` (UE8M0 powers of two or E4M3).
    """
    rounded, scale = _fp4_round_groups(x, block, scale_fmt)
    return pack_fp4(e2m1_codes(rounded).flatten(-2)), scale


def fp4_quant_rounded(
    values: torch.Tensor, block: int = FP4_BLOCK, scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack values that are already `fp4_qdq` output, losslessly: `fp4_dequant` of the result gives back
    exactly `values` (the cache stores what the model computed, spec §8).

    Re-quantising is not always the identity. With UE8M0 scales it is (the block maximum re-derives the
    same power of two, or half of it when the maximum rounded to 3, and doubling 0..3 stays on the grid).
    With E4M3 scales it is not where the first rounding picked a *subnormal* scale above amax/6: a block
    whose amax lies in [9, 10) x 2^-9 gets s = 2 x 2^-9, its maximum rounds to 4s = 8 x 2^-9, and
    re-quantising that derives e4m3(8 x 2^-9 / 6) = 2^-9, under which 8 x 2^-9 saturates to 6 x 2^-9. Those
    blocks take the scale amax / g for the largest grid value g that gives an exact E4M3 scale putting
    every value on the grid (the original scale is one such candidate, so one always exists).

    values: [..., K] on the grid of (block, scale_fmt). Returns (packed uint8 [..., K/2], scale fp32 [..., K/block]).
    """
    packed, scale = fp4_quant(values, block, scale_fmt)
    if scale_fmt == "ue8m0":
        return packed, scale
    exact = values.float().unflatten(-1, (-1, block))  # [..., K/block, block]
    lossy = (fp4_dequant(packed, scale, block).unflatten(-1, (-1, block)) != exact).any(-1)  # [..., K/block]
    if not bool(lossy.any()):
        return packed, scale
    groups = exact[lossy]  # [n, block]
    amax = groups.abs().amax(-1, keepdim=True)  # [n, 1], > 0: an all-zero block is never lossy
    chosen = torch.zeros_like(amax)
    for top in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):  # the grid values the block maximum can have landed on
        candidate = amax / top  # exact when the maximum is top x an E4M3 scale
        on_grid = e4m3_saturate(candidate).float() == candidate
        ratio = groups / candidate
        fits = on_grid & ((ratio.abs() <= FP4_MAX) & (round_e2m1(ratio.clamp(-FP4_MAX, FP4_MAX)) == ratio)).all(
            -1, keepdim=True
        )
        chosen = torch.where((chosen == 0) & fits, candidate, chosen)
    if bool((chosen == 0).any()):
        raise ValueError("fp4_quant_rounded: values are not on the E2M1 x E4M3 grid (not fp4_qdq output)")
    codes = pack_fp4(e2m1_codes(groups / chosen))  # [n, block/2]
    packed, scale = packed.clone(), scale.clone()
    packed.unflatten(-1, (-1, block // 2))[lossy] = codes
    scale[lossy] = chosen[:, 0]
    return packed, scale


def fp4_dequant(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Inverse of `fp4_quant`: packed [..., K/2], scale [..., K/block] -> fp32 [..., K]."""
    values = unpack_fp4(packed)
    return (values.unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def fp4_dequant_bf16(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """`fp4_dequant` straight to bf16 (a cache read). Exact: an E2M1 value (2 significant bits) times a
    UE8M0 or E4M3 scale (at most 4) has at most 6 significant bits, within bf16's 8.

    Each byte is looked up once in a 256-entry table of its two bf16 values packed as one int32 (half the
    gathers of a per-value table, int32 indices instead of int64), then viewed back as bf16 pairs."""
    b = packed.view(torch.uint8)
    pairs = e2m1_pair_table(str(b.device)).index_select(0, b.reshape(-1).int()).view(b.shape)  # int32 pairs
    values = pairs.view(torch.bfloat16)  # [..., K]: the low half (the even element) comes first in memory
    return (values.unflatten(-1, (-1, block)) * scale.bfloat16().unsqueeze(-1)).flatten(-2)


@functools.cache
def e2m1_pair_table(device: str) -> torch.Tensor:
    """int32 [256]: for each byte, its low-nibble and high-nibble E2M1 values as bf16, packed as the
    little-endian pair (low nibble in the low half). A constant per device, built once."""
    if sys.byteorder != "little":
        raise NotImplementedError("the packed bf16 pair table assumes a little-endian machine")
    table = e2m1_table(device).bfloat16()
    byte = torch.arange(256, device=device)
    pairs = torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1)  # [256, 2] bf16
    return pairs.contiguous().view(torch.int32).view(256)


def fp4_qdq(x: torch.Tensor, block: int = FP4_BLOCK, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """Fake-quantize through E2M1 blocks; returns x's dtype.

    block 32 + 'ue8m0' is the indexer q/k rounding, block 16 + 'e4m3' the compressed-KV rounding.
    """
    rounded, scale = _fp4_round_groups(x, block, scale_fmt)
    return (rounded * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)


# --------------------------------------------------------------------------- weights
def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 weight [N, K] with UE8M0 tile scales [ceil(N/block), ceil(K/block)] -> fp32 [N, K]."""
    n, k = weight.shape
    tile = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return weight.float() * tile


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed FP4 weight [N, K/2] with UE8M0 scales [N, K/block] -> fp32 [N, K]."""
    return fp4_dequant(packed, scale, block)


def quantize_fp8_weight(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 weight [N, K] -> (e4m3 [N, K], float8_e8m0fnu tile scales [ceil(N/b), ceil(K/b)])."""
    n, k = weight.shape
    pad = (0, -k % block, 0, -n % block)
    tiles = torch.nn.functional.pad(weight.float(), pad).unflatten(0, (-1, block)).unflatten(-1, (-1, block))
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4)  # [N/b, K/b]
    scale = ceil_pow2(amax * _INV_FP8_MAX)
    q = e4m3_saturate(weight.float() / scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k])
    return q, scale.to(torch.float8_e8m0fnu)


def quantize_fp4_weight(weight: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 weight [N, K] -> (int8 packed [N, K/2], float8_e8m0fnu scales [N, K/block])."""
    packed, scale = fp4_quant(weight, block, "ue8m0")
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
