"""mHC's collapse and expand of the residual copies (spec-v41.md §2): the eager forms (the reference), and
the expand as a fused kernel bit-identical to it.

The eager expand multiplies every copy by every mixing weight into a [B, S, hc, hc, dim] fp32 tensor and
sums it over the input copies: at a 1,024-token `small` chunk that is 25 MB written and read per call, twice a
layer, a third of a prefill chunk's time on a 2-core CPU. `hc_post_chain` spells the sum as the left-to-right
chain ATen's reduction takes over the copies, so a compiled kernel (dsv41.ops.fused) computes each output value
in one pass with the same roundings (13 ms -> 1 ms a call there, one thread); `mix_fusion_agrees` checks that on
this machine before it is used.
"""

from __future__ import annotations

import functools

import torch

from dsv41.ops import canonical, fused


def hc_pre(h: torch.Tensor, pre: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """Collapse the copies: h [B, S, hc, dim] x pre [B, S, hc] -> [B, S, dim] in h's dtype (fp32 products, their
    sum in float64 under reference numerics). Eager: its temporary is hc times smaller than the expand's, and
    a fused form saved ~0.4 of ~1.8 ms at a 1,024-token `small` chunk, not worth a compile."""
    terms = pre.unsqueeze(-1) * h.float()
    if reference:
        return canonical.sum(terms, dim=2, dtype=h.dtype)
    return torch.sum(terms, dim=2).to(h.dtype)


def hc_post(
    out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, reference: bool = False
) -> torch.Tensor:
    """copy_j = post_j * out + sum_i comb[i, j] * residual_i: out [B, S, dim], residual [B, S, hc, dim], post
    [B, S, hc], comb [B, S, hc, hc] -> [B, S, hc, dim]; the fused kernel where it serves."""
    if not reference and usable(out, residual, post, comb):  # one pass: no [B, S, hc, hc, dim] temporary
        return compiled_post()(out, residual, post, comb)
    return hc_post_eager(out, residual, post, comb, reference)


def hc_post_eager(
    out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, reference: bool = False
) -> torch.Tensor:
    terms = comb.unsqueeze(-1) * residual.unsqueeze(-2)
    mixed = canonical.sum(terms, dim=2) if reference else torch.sum(terms, dim=2)
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).type_as(out)


def hc_post_chain(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`Block.hc_post`: copy_j = post_j * out + sum_i comb[i, j] * residual_i; out [B, S, dim], residual
    [B, S, hc, dim], post [B, S, hc], comb [B, S, hc, hc] -> [B, S, hc, dim] in out's dtype."""
    mixed = comb[..., 0, :, None] * residual[..., 0, None, :].float()
    for i in range(1, residual.size(-2)):
        mixed = mixed + comb[..., i, :, None] * residual[..., i, None, :].float()
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).type_as(out)


@functools.cache
def compiled_post():
    return fused.compile_fused(hc_post_chain)


def usable(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> bool:
    """The fused expand serves where no gradient is wanted (it is an inference kernel), outside a graph being
    compiled (which fuses the eager form itself) and where the probe agreed."""
    if not fused.enabled() or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, residual, post, comb)):
        return False
    return mix_fusion_agrees(residual.size(-2), out.device.type)


@fused.Verdict
def mix_fusion_agrees(hc: int, device: str) -> bool:
    """Is the compiled expand bit-identical to the eager one here (one row, which the compiler specialises,
    and many)? See dsv41.ops.fused."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, dim in ((1, 64), (517, 384)):
        out = (torch.randn(2, rows, dim, generator=g) * 4).bfloat16().to(device)
        residual = (torch.randn(2, rows, hc, dim, generator=g) * 4).bfloat16().to(device)
        post = torch.rand(2, rows, hc, generator=g).to(device) * 2
        comb = torch.rand(2, rows, hc, hc, generator=g).to(device) * 2
        cases.append((out, residual, post, comb))
    return fused.agrees(compiled_post(), hc_post_eager, cases)
