"""Lightning-indexer scoring, top-k selection and the hierarchical candidate pool (spec-v41.md §4).

score[b, s, t] = sum_h ReLU(q[b, s, h] . k[b, t]) * w[b, s, h]; there is no softmax. Scores are kept
in bf16 like the reference (the einsum and the head sum run in bf16), because top-k over these scores
is discontinuous and the rounding decides ties at the boundary.

Ties: bf16 scores tie exactly far more often than fp32 ones, and `torch.topk` breaks ties by where an
entry sits in the row it is handed (and by its kernel's traversal), so the same scores laid out
differently (a batch padded to its longest row, candidate entries gathered in block-rank order) can pick
different entries. Every selection here therefore takes `canonical`: True breaks ties towards the lowest
position (`topk_canonical`), a rule that depends only on the scores of the entries a query may see;
False keeps `torch.topk`'s own choice, which is what the reference does (golden parity).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsv41.ops import canonical, fused


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """q [B, S, H, D] (fp4-rounded, bf16); k [B, T, D] bf16; weights [B, S, H] bf16 -> scores [B, S, T] bf16.
    reference: canonical numerics (the dot products, and the sum over heads of the bf16 terms, in float64,
    each rounded once to bf16)."""
    if reference:
        per_head = canonical.einsum("bshd,btd->bsht", q, k, dtype=torch.bfloat16)
        return canonical.sum(per_head.relu() * weights.unsqueeze(-1), dim=2, dtype=torch.bfloat16)
    per_head = torch.einsum("bshd,btd->bsht", q, k)
    return (per_head.relu() * weights.unsqueeze(-1)).sum(dim=2)


@functools.cache
def bf16_gemm_is_native(device: str) -> bool:
    """Does this machine multiply bf16 matrices with bf16 instructions (oneDNN on AVX512-BF16 or AMX; any
    GPU)? Without them (an AVX2 CPU) ATen's bf16 GEMM is a per-row fallback: a [8192, 128] x [128, 512]
    scoring GEMM takes ~200 ms there against ~55 ms for an fp32 GEMM of the same values, rounded after."""
    if device != "cpu":
        return True
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # no oneDNN in this build: nothing native either
        return False


def fp4_products(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a [..., M, D] @ b_t [..., D, T] for FP4-rounded bf16 operands (MXFP4 index q and keys) -> bf16.

    Every product of two such values and every partial sum of a row's products is exact in fp32, so any
    fp32-accumulating GEMM gives the exact dot product, rounded once to bf16: the bf16 GEMM where the CPU
    has bf16 instructions, an fp32 GEMM of the (exactly) upcast values where it does not, the same bits."""
    if bf16_gemm_is_native(a.device.type):
        return a @ b_t
    return (a.float() @ b_t.float()).to(torch.bfloat16)


def index_scores_mm(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`index_scores` with the per-head dot products as GEMMs, not the einsum (this CPU's batched bf16 GEMM,
    what the einsum becomes, is 10-20x slower at decode shapes): small calls (decode steps, a speculative
    verify's tokens, one row each) as one fp32 batched GEMM over every row, large ones (prefill) as one 2-D
    GEMM per batch row, [S*H, D] x [D, T], with the fused epilogue. Same shapes in and out, same bf16
    roundings (ReLU and weight applied in place); the products of FP4-rounded q and k and their partial sums
    are exact in fp32, so neither the GEMM's summation order nor its batching changes a score (tested
    equal)."""
    b, s, h, d = q.shape
    fuse = s * k.size(1) >= 1 << 12 and fused.enabled() and epilogue_fusion_agrees(h, q.device.type)
    if not fuse:  # small calls (decode steps, a verify's tokens): all rows in one fp32 batched GEMM, whose
        # exact products and sums round once to bf16 like `fp4_products`, then the epilogue in place
        per_head = torch.matmul(q.reshape(b, s * h, d).float(), k.float().transpose(1, 2))  # [B, S*H, T]
        per_head = per_head.to(torch.bfloat16).view(b, s, h, -1)
        return per_head.relu_().mul_(weights.unsqueeze(-1)).sum(dim=2)
    rows = []
    for i in range(b):
        per_head = fp4_products(q[i].reshape(s * h, d), k[i].t()).view(s, h, -1)  # [S, H, T] bf16
        rows.append(_compiled_epilogue()(per_head, weights[i]))  # ReLU, weight and head sum in one pass
    return rows[0].unsqueeze(0) if b == 1 else torch.stack(rows)


def score_epilogue(per_head: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """per_head [S, H, T] bf16, weights [S, H] bf16 -> [S, T] bf16: sum_h ReLU(per_head) * w_h, the weighted
    terms rounded to bf16 and summed over heads in order (fp32 accumulator, one final rounding), as ATen does."""
    return (per_head.relu() * weights.unsqueeze(-1)).sum(dim=1)


@functools.cache
def _compiled_epilogue():
    return fused.compile_fused(score_epilogue, emulate_precision_casts=True)


@fused.Verdict
def epilogue_fusion_agrees(heads: int, device: str) -> bool:
    """Is the compiled `score_epilogue` bit-identical to the eager one here, for this head count? Small
    calls (decode) stay eager: the compiled call's fixed cost is larger than what it saves there."""
    g = torch.Generator().manual_seed(0)
    cases = [
        (
            torch.randn(s, heads, t, generator=g).bfloat16().to(device) * 4,
            torch.rand(s, heads, generator=g).bfloat16().to(device),
        )
        for s, t in ((1, 4096), (3, 1500), (64, 1024))
    ]
    return fused.agrees(_compiled_epilogue(), score_epilogue, cases)


def index_scores_gathered(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`index_scores` against a separate key list per query: q [B, S, H, D]; k [B, S, E, D] bf16 (query s's
    own E entries, e.g. its candidate blocks); weights [B, S, H] -> scores [B, S, E] bf16. The same
    operations, so an entry's score is the one `index_scores` gives it (the FP4 x FP4 products and their
    partial sums are exact in fp32, so the GEMM's summation order does not matter)."""
    if bf16_gemm_is_native(q.device.type):
        per_head = torch.einsum("bshd,bsed->bshe", q, k)
    else:  # [B, S, H, D] @ [B, S, D, E]: the same exact products (`fp4_products`)
        per_head = fp4_products(q, k.transpose(-1, -2))
    return (per_head.relu() * weights.unsqueeze(-1)).sum(dim=2)


def mask_invisible(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Set scores of compressed entries a query cannot see yet to -inf.

    scores [B, S, T]; visible [S, 1] int, the count of complete groups for each query, (pos+1)//ratio.
    """
    positions = torch.arange(scores.size(-1), device=scores.device)
    return scores.masked_fill(positions >= visible, -torch.inf)


def topk_canonical(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Indices [..., k] of the k largest entries of `scores` [..., N] along the last dim, ties broken
    towards the lowest position, in descending score order (equal scores: ascending position).

    `positions` [..., N] (optional, distinct per row) says where each entry really sits when the row is a
    gather of entries in some other order; by default position = index. Invisible entries should be
    -inf: they tie with each other and are then taken lowest position first, like any other tie.
    """
    if positions is not None:  # (score desc, position asc) by two stable sorts; rows here are short
        by_position = positions.argsort(dim=-1, stable=True)
        ordered = scores.gather(-1, by_position)
        return by_position.gather(-1, ordered.argsort(dim=-1, descending=True, stable=True)[..., :k])
    # one top-k over distinct integer keys (score, then position reversed): exactly the canonical order
    return canonical_keys(scores).topk(k, dim=-1).indices


def canonical_keys(scores: torch.Tensor) -> torch.Tensor:
    """Integer keys [..., N], all distinct, ordered like (score desc, position asc): the score's bits made
    monotone (negative floats get their magnitude bits flipped; -0.0 first becomes +0.0, so equal scores
    get equal high halves) in the high half, N-1-position in the low half. int32 for 16-bit scores
    (bf16/fp16) over at most 2^16 entries, int64 otherwise (fp32 bits). -inf sorts below every finite
    score and ties like any other value."""
    n = scores.size(-1)
    small = scores.dtype in (torch.bfloat16, torch.float16) and n <= 1 << 16
    if small and scores.numel() >= 1 << 16 and fused.enabled() and keys16_fusion_agrees(scores.device.type):
        return _compiled_keys16()(scores)  # one pass instead of six (integer ops: exact either way)
    return _canonical_keys_eager(scores)


def _canonical_keys_eager(scores: torch.Tensor) -> torch.Tensor:
    n = scores.size(-1)
    small = scores.dtype in (torch.bfloat16, torch.float16) and n <= 1 << 16
    width, bits_dtype, key_dtype = (16, torch.int16, torch.int32) if small else (32, torch.int32, torch.int64)
    values = scores if small else scores.float()
    keys = (values + 0.0).view(bits_dtype).to(key_dtype)  # + 0.0 maps -0.0 to +0.0
    keys ^= (keys >> (2 * width - 1)) & ((1 << (width - 1)) - 1)  # negatives: flip the magnitude bits
    keys <<= width
    keys |= n - 1 - torch.arange(n, dtype=key_dtype, device=scores.device)
    return keys


def canonical_keys16(scores: torch.Tensor) -> torch.Tensor:
    """`canonical_keys` for 16-bit scores written as one expression (what the fused kernel compiles)."""
    n = scores.size(-1)
    keys = (scores + 0.0).view(torch.int16).to(torch.int32)
    keys = keys ^ ((keys >> 31) & 0x7FFF)
    return (keys << 16) | (n - 1 - torch.arange(n, dtype=torch.int32, device=scores.device))


@functools.cache
def _compiled_keys16():
    return fused.compile_fused(canonical_keys16)


@fused.Verdict
def keys16_fusion_agrees(device: str) -> bool:
    """Is the compiled `canonical_keys16` identical to the eager `canonical_keys` here (bf16 and fp16, with
    ties, -0.0, +-inf)?"""
    g = torch.Generator().manual_seed(0)
    cases = []
    for dtype, (rows, n) in ((torch.bfloat16, (1, 65536)), (torch.bfloat16, (300, 777)), (torch.float16, (64, 2048))):
        scores = (torch.randint(-9, 10, (rows, n), generator=g) / 4).to(dtype)
        scores[:, ::7], scores[:, 1::11], scores[:, 2::13] = -torch.inf, -0.0, torch.inf
        cases.append((scores.to(device),))
    return fused.agrees(_compiled_keys16(), _canonical_keys_eager, cases)


def _topk(scores: torch.Tensor, k: int, canonical: bool, positions: torch.Tensor | None = None) -> torch.Tensor:
    if canonical:
        return topk_canonical(scores, k, positions)
    return scores.topk(k, dim=-1).indices


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block_size: int, canonical: bool = True
) -> torch.Tensor:
    """Level one of the two-level top-k: the `n_blocks` best blocks of `block_size` positions, a block
    scored by its best position, as block ids int64 [B, S, min(n_blocks, blocks)] (-1: no visible entry).

    scores [B, S, T] with invisible entries at -inf; visible [S, 1] (or [B, 1, 1], or a 0-dim) count of
    visible entries. The block holding the query's newest visible entry is always kept.
    """
    block_scores = block_maxima(scores, block_size)  # [B, S, NB]
    n_total = block_scores.size(-1)
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")
    block_scores = block_scores.masked_fill(torch.arange(n_total, device=scores.device) == newest, torch.inf)
    top = _topk(block_scores, min(n_blocks, n_total), canonical)
    return torch.where(block_scores.gather(-1, top) > -torch.inf, top, -1)


def candidate_pool(
    scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block_size: int, canonical: bool = True
) -> torch.Tensor:
    """The candidate pool as a boolean mask [B, S, T] over positions (see `candidate_blocks`); blocks with
    no visible entry are never kept."""
    blocks = candidate_blocks(scores, visible, n_blocks, block_size, canonical)
    return blocks_to_mask(blocks, scores.size(-1), block_size)


def blocks_to_mask(blocks: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """Block ids [..., n] (-1: none) -> boolean mask [..., width] over the positions they cover."""
    n_total = -(-width // block_size)
    keep = torch.zeros(*blocks.shape[:-1], n_total + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, torch.where(blocks >= 0, blocks, n_total), True)  # -1 goes to a spare column
    return keep[..., :n_total].repeat_interleave(block_size, dim=-1)[..., :width]


def candidate_entries(
    blocks: torch.Tensor, visible: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions inside candidate blocks [..., n] (-1: none): (entries int64 [..., n * block_size], usable
    bool, False for the padding of missing blocks and for positions at or past `visible` (broadcasting))."""
    entries = (blocks.clamp_min(0).unsqueeze(-1) * block_size + torch.arange(block_size, device=blocks.device)).flatten(
        -2
    )
    usable = (blocks >= 0).repeat_interleave(block_size, dim=-1) & (entries < visible)
    return entries, usable


def merge_topk(
    kept_scores: torch.Tensor, kept_pos: torch.Tensor, scores: torch.Tensor, pos: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of a streaming top-k: the canonical top-k (score desc, ties to the lowest position) of the
    kept entries and a new block, returned in ascending position order.

    kept_* [..., m] (m <= k) in ascending position order; scores [..., n] of the block's entries at
    positions `pos` ([n] or [..., n], ascending), all above every kept position. The union is then in
    position order, so `topk_canonical` needs no positions; and since the order (score desc, position asc)
    is total, the top-k of the union of the blocks' top-k's is the top-k of everything: streaming the
    blocks in order gives exactly `topk_canonical` over the whole row (-inf entries included).
    """
    pos = pos.expand_as(scores)
    merged_scores, merged_pos = torch.cat([kept_scores, scores], -1), torch.cat([kept_pos, pos], -1)
    if merged_scores.size(-1) <= k:
        return merged_scores, merged_pos
    keep = topk_canonical(merged_scores, k).sort(dim=-1).values
    return merged_scores.gather(-1, keep), merged_pos.gather(-1, keep)


def block_maxima(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """scores [..., T] -> [..., ceil(T / block_size)]: each block's best score (a short last block is
    padded with -inf), the block score of the candidate pool."""
    padded = F.pad(scores, (0, -scores.size(-1) % block_size), value=-torch.inf)
    return padded.unflatten(-1, (-1, block_size)).amax(dim=-1)


def select_topk(scores: torch.Tensor, k: int, offset: int = 0, canonical: bool = True) -> torch.Tensor:
    """The k best entries per query, in ascending position order, as int32 [B, S, k].

    Entries whose score is -inf (not visible, or outside the candidate pool) become -1; the others are
    shifted by `offset` (the window length, so they index into cat(window_kv, compressed_kv)).
    """
    if canonical:
        idx = topk_canonical(scores, k).sort(dim=-1).values
    else:
        idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    usable = scores.gather(-1, idx) > -torch.inf
    return torch.where(usable, idx + offset, -1).int()
