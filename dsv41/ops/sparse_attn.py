"""Sparse single-latent attention with a per-head sink (spec-v41.md §3 step 4).

Every query attends to an explicit list of rows of one KV tensor (K and V are the same 512-d latent):
the layer's sliding window followed by the selected compressed entries. The per-head `attn_sink` logit
joins only the softmax denominator. Index -1 means "nothing here"; a row with no valid entry yields 0.

Numerics follow the reference kernel: an online softmax over blocks of 64 indices in fp32, with the
probabilities rounded to bf16 (relative to the running max) before they multiply V, the denominator
kept in fp32 from the unrounded probabilities, and the running max seeded at -1e30 so an all-empty row
gives exp(-inf) = 0 instead of NaN.
"""

from __future__ import annotations

import torch

from dsv41.ops import canonical

BLOCK = 64  # indices per online-softmax step, as in the reference kernel


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    reference: bool = False,
    heads_per_call: int = 0,
) -> torch.Tensor:
    """q [B, M, H, D] bf16; kv [B, N, D] bf16; attn_sink [H] fp32; indices [B, M, K] int (-1 = unused).

    Returns bf16 [B, M, H, D]: sum_k softmax_k(scale * q.kv[idx_k]) * kv[idx_k], sink in the denominator.
    reference: canonical numerics (`sparse_attn_canonical`). heads_per_call > 0: the q.k and P.V products
    in GEMMs of that many heads each (a divisor of H), so a head's bits do not depend on how many heads
    share the call: an fp32 GEMM's summation order follows its shape (MKL on AVX-512 sums a 6-head and a
    3-head [H, D] x [D, k] product differently), and tensor parallelism splits the heads by output group.
    """
    if reference:
        return sparse_attn_canonical(q, kv, attn_sink, indices, softmax_scale)
    b, m, h, d = q.shape
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=q.device)
    qf, kvf = q.float(), kv.float()
    out = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    running_max = torch.full((b, m, h), -1e30, dtype=torch.float32, device=q.device)
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    # in-place steps on fresh tensors: the same operations and roundings without new allocations; under
    # autograd (the RL learner's replay of the inference forward, dsv41.model.replay) the same steps out
    # of place, since backward needs the values the in-place versions overwrite
    inplace = not (torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad or attn_sink.requires_grad))
    for start in range(0, indices.size(-1), BLOCK):
        idx = indices[:, :, start : start + BLOCK].long()  # [B, M, k]
        valid = idx != -1
        rows = kvf[batch, idx.clamp_min(0)]  # [B, M, k, D], empty slots zeroed
        rows = rows.mul_(valid.unsqueeze(-1)) if inplace else rows * valid.unsqueeze(-1)
        logits = _per_heads("bmhd,bmkd->bmhk", qf, rows, heads_per_call)
        if inplace:
            logits = logits.masked_fill_(~valid.unsqueeze(2), -torch.inf).mul_(scale)
        else:
            logits = logits.masked_fill(~valid.unsqueeze(2), -torch.inf) * scale
        new_max = torch.maximum(running_max, logits.amax(dim=-1))
        rescale = torch.exp(running_max - new_max)
        probs = logits.sub_(new_max.unsqueeze(-1)).exp_() if inplace else (logits - new_max.unsqueeze(-1)).exp()
        pv = _per_heads("bmhk,bmkd->bmhd", probs.to(torch.bfloat16).float(), rows, heads_per_call)
        if inplace:
            denom = denom.mul_(rescale).add_(probs.sum(dim=-1))
            out = out.mul_(rescale.unsqueeze(-1)).add_(pv)
        else:
            denom = denom * rescale + probs.sum(dim=-1)
            out = out * rescale.unsqueeze(-1) + pv
        running_max = new_max
    denom = denom + torch.exp(attn_sink.float() - running_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


def dense_decode_attn(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """The `fast` numerics form of one decode query's attention (`sparse_attn` is its reference): q [B, 1, H, D]
    bf16 against its sequence's rows [B, N, D] bf16 where valid [B, N] is True, sink in the denominator.

    The rows a query reads are already gathered into one tensor (its window, then its selected entries), so
    the index list only says which of them count, and the softmax does not depend on their order. That allows
    one fp32 GEMM for the logits, one softmax (the sink as an extra column) and one GEMM for P.V, ~10 ops for
    the whole batch instead of ~20 per 64-index block: no online softmax and no bf16 rounding of the
    probabilities, so the bits differ from the reference kernel (statistically, the sum is the same).
    Returns bf16 [B, 1, H, D]; a query with no valid row gets 0."""
    b, n, _ = rows.shape
    h = q.size(2)
    r = rows.float()
    logits = torch.matmul(q[:, 0].float(), r.transpose(1, 2)).mul_(softmax_scale)  # [B, H, N]
    logits = logits.masked_fill_(~valid.unsqueeze(1), -torch.inf)
    sink = attn_sink.float().view(1, h, 1).expand(b, h, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :n]  # [B, H, N]
    return torch.matmul(probs, r).unsqueeze(1).to(torch.bfloat16)


def _per_heads(equation: str, per_head: torch.Tensor, rows: torch.Tensor, heads: int) -> torch.Tensor:
    """einsum(equation, per_head [B, M, H, ...], rows) in calls of `heads` heads (0: one call)."""
    if not heads or heads >= per_head.size(2):
        return torch.einsum(equation, per_head, rows)
    return torch.cat([torch.einsum(equation, part, rows) for part in per_head.split(heads, dim=2)], dim=2)


def sparse_attn_canonical(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """`sparse_attn` under canonical numerics (dsv41.ops.canonical): the same online softmax over blocks of
    64 indices and the same roundings (bf16 probabilities for P.V, fp32 running state), with the dot
    products q.k and P.V, every exp and each block's denominator sum in float64, each rounded once to fp32.
    Same shapes as `sparse_attn`."""
    b, m, h, d = q.shape
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=q.device)
    out = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    denom = torch.zeros(b, m, h, dtype=torch.float32, device=q.device)
    running_max = torch.full((b, m, h), -1e30, dtype=torch.float32, device=q.device)
    batch = torch.arange(b, device=q.device).view(b, 1, 1)
    for start in range(0, indices.size(-1), BLOCK):
        idx = indices[:, :, start : start + BLOCK].long()  # [B, M, k]
        valid = idx != -1
        rows = kv.float()[batch, idx.clamp_min(0)] * valid.unsqueeze(-1)  # [B, M, k, D], empty slots zeroed
        logits = canonical.einsum("bmhd,bmkd->bmhk", q, rows)
        logits = logits.masked_fill(~valid.unsqueeze(2), -torch.inf) * scale
        new_max = torch.maximum(running_max, logits.amax(dim=-1))
        rescale = canonical.exp(running_max - new_max)
        probs = canonical.exp(logits - new_max.unsqueeze(-1))  # [B, M, H, k] fp32
        pv = canonical.einsum("bmhk,bmkd->bmhd", probs.to(torch.bfloat16), rows)
        denom = denom * rescale + canonical.sum(probs, -1)
        out = out * rescale.unsqueeze(-1) + pv
        running_max = new_max
    denom = denom + canonical.exp(attn_sink.float() - running_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


def dense_reference_attn(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, indices: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """The same attention written as one plain fp32 softmax (no blocks, no bf16 probabilities).

    An independent formulation for tests: it differs from `sparse_attn` only by the bf16 rounding of
    the probabilities. Returns fp32 [B, M, H, D].
    """
    b = q.size(0)
    idx = indices.long()
    valid = idx != -1
    rows = kv.float()[torch.arange(b).view(b, 1, 1), idx.clamp_min(0)]  # [B, M, K, D]
    logits = torch.einsum("bmhd,bmkd->bmhk", q.float(), rows) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(2), -torch.inf)
    sink = attn_sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bmhk,bmkd->bmhd", probs, rows)
