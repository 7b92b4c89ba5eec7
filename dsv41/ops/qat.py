"""Quantisation-aware training: fake quantisation with a straight-through gradient (training.md §5,
spec-v41.md §8).

The forward value is exactly the inference rounding (`fp8_qdq` for the window KV, E2M1 + E4M3/16 for the
compressed KV, MXFP4 for the indexer q/k), applied where the cache would be written, after RoPE. The
backward is the identity (straight-through estimator); with `clip=True` the gradient is zeroed where the
value saturates (|x| beyond the block's largest representable magnitude), the clipped STE.
"""

from __future__ import annotations

import torch

from dsv41.ops.quant import FP4_BLOCK, FP8_BLOCK, KV_FP4_BLOCK, fp4_qdq, fp8_qdq


class _Rounded(torch.autograd.Function):
    """Forward `fn(x, *args)` computed on x itself, backward the identity."""

    @staticmethod
    def forward(ctx, x, fn, args):  # noqa: D102 - autograd protocol
        return fn(x, *args)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - autograd protocol
        return grad, None, None


def rounded(x: torch.Tensor, fn, *args) -> torch.Tensor:
    """`fn(x, *args)` (an inference rounding such as `fp8_qdq`), with a straight-through gradient when x
    needs one. The value is fn's own result bit for bit (`straight_through`'s x + (q - x) is exact only
    when q - x is), so a differentiable run of the inference forward (the RL learner's replay,
    dsv41.rl.policy) computes exactly what inference computes. Without autograd it is just fn(x)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Rounded.apply(x, fn, args)
    return fn(x, *args)


def straight_through(x: torch.Tensor, rounded: torch.Tensor, clip_mask=None) -> torch.Tensor:
    """Forward `rounded`, backward the identity (or zero where `clip_mask` is True)."""
    passthrough = x if clip_mask is None else torch.where(clip_mask, x.detach(), x)
    return passthrough + (rounded - passthrough).detach()


def fp8_fake_quant(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The window-KV rounding (E4M3, UE8M0 per block) with a straight-through gradient. The UE8M0 scale
    is a power of two at or above amax/448, so nothing saturates and no gradient is clipped."""
    return straight_through(x, fp8_qdq(x, block))


def fp4_fake_quant(
    x: torch.Tensor, block: int = FP4_BLOCK, scale_fmt: str = "ue8m0", clip: bool = False
) -> torch.Tensor:
    """E2M1 rounding with a straight-through gradient. block 16 + 'e4m3': compressed main KV; block 32 +
    'ue8m0': indexer q/k. clip: zero the gradient of values that saturated at the block's maximum."""
    rounded = fp4_qdq(x, block, scale_fmt)
    mask = None
    if clip:
        # a value saturated when it exceeds what its block can represent (the block's largest |rounded|)
        top = rounded.detach().abs().unflatten(-1, (-1, block)).amax(-1, keepdim=True)
        mask = (x.detach().abs().unflatten(-1, (-1, block)) > top).flatten(-2)
    return straight_through(x, rounded, mask)


def kv_fake_quant(x: torch.Tensor, clip: bool = False) -> torch.Tensor:
    """The compressed main-KV format (E2M1 + E4M3 scale per 16)."""
    return fp4_fake_quant(x, KV_FP4_BLOCK, "e4m3", clip)
