import pytest
import torch

from dsv41 import ops
from dsv41.ops.sparse_attn import dense_reference_attn


def _sinkhorn_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 24, generator=g) * 3, torch.randn(3, generator=g), torch.randn(24, generator=g)


def test_sinkhorn_comb_is_doubly_stochastic():
    pre, post, comb = ops.hc_split_sinkhorn(*_sinkhorn_inputs(), hc=4, iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-5)  # ends on a column normalisation
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-3)
    assert (comb > 0).all() and (pre > 0).all() and (post > 0).all() and (post < 2).all()


def test_sinkhorn_matches_float64_formulation():
    mixes, scale, base = _sinkhorn_inputs(1)
    pre, post, comb = ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    m, s, b = mixes.double(), scale.double(), base.double()
    c = torch.softmax((m[:, 8:] * s[2] + b[8:]).view(5, 4, 4), -1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    assert torch.allclose(comb.double(), c, atol=1e-6)
    assert torch.allclose(pre.double(), torch.sigmoid(m[:, :4] * s[0] + b[:4]) + 1e-6, atol=1e-6)


def test_sparse_attn_matches_plain_softmax_and_handles_empty_rows():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 64, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 150, 64, generator=g).to(torch.bfloat16)
    sink = torch.randn(4, generator=g)
    idx = torch.randint(0, 150, (2, 5, 100), generator=g).int()  # two online-softmax blocks
    idx[:, :, ::7] = -1
    idx[1, 3] = -1  # a row with nothing to attend to
    out = ops.sparse_attn(q, kv, sink, idx, 64**-0.5)
    ref = dense_reference_attn(q, kv, sink, idx, 64**-0.5)
    assert torch.equal(out[1, 3], torch.zeros_like(out[1, 3]))
    assert torch.allclose(out.float(), ref, atol=2e-2)
    # masked entries carry no weight: changing the kv rows only they point at changes nothing
    used = set(idx[0, 0][idx[0, 0] >= 0].tolist())
    spare = [i for i in range(150) if i not in used][0]
    kv2 = kv.clone()
    kv2[0, spare] = 100
    assert torch.equal(ops.sparse_attn(q, kv2, sink, idx, 64**-0.5)[0, 0], out[0, 0])


def test_dense_decode_attention_matches_the_reference_kernel_over_a_set_of_rows():
    """`fast` decode attention reads the rows a query lists as a set: the reference kernel over the same index
    list (any order, -1 padding, a row with nothing valid) agrees to bf16 precision, and rows outside the set,
    or the set's order, do not matter."""
    g = torch.Generator().manual_seed(0)
    b, h, d, n = 3, 6, 64, 150
    q = torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16)
    rows = torch.randn(b, n, d, generator=g).to(torch.bfloat16)
    sink = torch.randn(h, generator=g) + 5  # large enough to take a good share of the softmax
    ids = torch.stack([torch.randperm(n, generator=g)[:100] for _ in range(b)]).unsqueeze(1)  # [B, 1, 100]
    ids[:, :, 90:] = -1
    ids[2] = -1  # nothing to attend to: 0, as in the reference
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        valid[i, ids[i, 0][ids[i, 0] >= 0]] = True
    out = ops.dense_decode_attn(q, rows, valid, sink, d**-0.5)
    ref = ops.sparse_attn(q, rows, sink, ids.int(), d**-0.5)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=0)
    # the sink counts: without it the outputs grow (every row's share of the denominator goes up)
    no_sink = ops.dense_decode_attn(q, rows, valid, torch.full((h,), -torch.inf), d**-0.5)
    assert no_sink[:2].float().abs().sum() > 1.2 * out[:2].float().abs().sum()
    rows2 = rows.clone()
    rows2[~valid] = 100  # rows outside the set carry no weight
    assert torch.equal(ops.dense_decode_attn(q, rows2, valid, sink, d**-0.5), out)
    perm = torch.randperm(n, generator=g)  # the set's order does not change the sum beyond rounding
    torch.testing.assert_close(
        ops.dense_decode_attn(q, rows[:, perm], valid[:, perm], sink, d**-0.5).float(), out.float(), atol=1e-2, rtol=0
    )


def test_candidate_pool_keeps_newest_block_and_at_most_n_blocks():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 6, 40, generator=g)
    visible = torch.tensor([[3], [9], [17], [25], [33], [40]])
    scores = ops.mask_invisible(scores, visible)
    pool = ops.candidate_pool(scores, visible, n_blocks=3, block_size=4)
    for s, v in enumerate(visible.view(-1).tolist()):
        blocks = pool[0, s].view(10, 4).any(-1)
        assert blocks.sum() <= 3 and blocks[(v - 1) // 4]
        assert not pool[0, s, ((v - 1) // 4 + 1) * 4 :].any()  # nothing past the newest block
        kept_scores = scores[0, s].view(10, 4).amax(-1)
        others = [b for b in range(10) if b != (v - 1) // 4 and b * 4 < v]
        best = sorted(others, key=lambda b: -kept_scores[b].item())[:2]
        assert all(blocks[b] for b in best)


def test_select_topk_is_sorted_and_marks_unusable_entries():
    scores = torch.tensor([[[0.5, 3.0, -torch.inf, 2.0, 1.0]]])
    ids = ops.select_topk(scores, 4, offset=10)
    assert ids.tolist() == [[[10, 11, 13, 14]]]
    ids = ops.select_topk(torch.tensor([[[1.0, -torch.inf, -torch.inf]]]), 3, offset=0)
    assert sorted(ids.view(-1).tolist()) == [-1, -1, 0]


def test_rope_inverse_undoes_rotation():
    table = ops.RotaryTable(16, 160000.0, 64, 4.0)
    x = torch.randn(1, 7, 2, 32)
    freqs = table(3, 7)
    y = ops.apply_rope(ops.apply_rope(x, freqs, 16), freqs, 16, inverse=True)
    assert torch.allclose(y, x, atol=1e-5) and torch.equal(y[..., :16], x[..., :16])


def test_invariant_matmul_rows_do_not_depend_on_the_batch():
    from dsv41.ops.gemm import invariant_matmul

    g = torch.Generator().manual_seed(0)
    for dtype, (k, n) in [
        (torch.float32, (64, 48)),
        (torch.float32, (96, 700)),
        (torch.bfloat16, (64, 64)),
        (torch.bfloat16, (256, 512)),
    ]:  # the last takes the per-chunk path
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(37, k, generator=g).to(dtype)
        full = invariant_matmul(x, w, 16)
        assert torch.allclose(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-1)
        for m in (1, 2, 3, 5, 16, 17, 33):  # each row's result is the same whatever else is in the call
            assert torch.equal(invariant_matmul(x[:m], w, 16), full[:m]), (dtype, k, n, m)
        assert torch.equal(invariant_matmul(x[5:9], w, 16), full[5:9])


@pytest.mark.parametrize("k,n", [(384, 384), (768, 384), (192, 768)])
def test_invariant_matmul_wide_calls_keep_rows_batch_invariant(k, n):
    """Runs of 256 / 64 rows go to one call only where the machine's probe says it equals the 16-row calls;
    either way each row's bits are those of a lone 16-row call, whatever the batch (up to 600 rows)."""
    from dsv41.ops.gemm import WIDE_ROWS, invariant_matmul, order_revealing, wide_rows_agree

    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(600, k, generator=g).bfloat16()
    alone = torch.cat([invariant_matmul(row, w, 16) for row in x.split(1)])
    for m in (600, 333, 256, 255, 100, 64, 17):
        assert torch.equal(invariant_matmul(x[:m], w, 16), alone[:m]), m
    assert torch.equal(invariant_matmul(x[37:400], w, 16), alone[37:400])
    for wide in WIDE_ROWS:  # where the probe says "agree", the calls agree on other data than its own
        if wide_rows_agree(k, n, torch.bfloat16, 16, wide, torch.get_num_threads(), "cpu"):
            for a, b in ((x[:wide], w), tuple(t.bfloat16() for t in order_revealing(wide, k, n, trial=100))):
                assert torch.equal(
                    torch.nn.functional.linear(a, b), torch.cat([torch.nn.functional.linear(p, b) for p in a.split(16)])
                ), wide


def test_wide_rows_probe_can_say_no(monkeypatch):
    """The probe compares real results: a GEMM whose wide calls round differently is refused."""
    import torch.nn.functional as F

    from dsv41.ops import gemm

    real = F.linear

    def skewed(x, w):  # a 'library' whose wide calls sum in another order
        y = real(x, w)
        return y + (y.abs() * 2**-7).to(y.dtype) if x.size(0) > 16 else y

    monkeypatch.setattr(gemm.F, "linear", skewed)
    assert not gemm.wide_rows_agree.__wrapped__(64, 32, torch.bfloat16, 16, 64, 1, "cpu")
    monkeypatch.setattr(gemm.F, "linear", real)
    assert gemm.wide_rows_agree.__wrapped__(64, 32, torch.bfloat16, 16, 64, 1, "cpu")


def test_narrow_rows_probe_can_say_no(monkeypatch):
    """A decode batch of B < 16 rows skips the padding only where the probe found the B-row call gives the
    bits of the padded 16-row call; a 'library' whose narrow calls round differently is refused, and then
    invariant_matmul still pads (its rows equal the padded call's)."""
    import torch.nn.functional as F

    from dsv41.ops import gemm

    real = F.linear

    def skewed(x, w):  # narrow calls sum in another order
        y = real(x, w)
        return y + (y.abs() * 2**-7).to(y.dtype) if x.size(0) < 16 else y

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16()
    padded = real(torch.nn.functional.pad(x, (0, 0, 0, 13)), w)[:3]
    monkeypatch.setattr(gemm.F, "linear", skewed)
    gemm.narrow_rows_agree.cache_clear()
    try:
        assert not gemm.narrow_rows_agree(64, 48, torch.bfloat16, torch.bfloat16, 16, 3, 1, "cpu")
        assert torch.equal(gemm.invariant_matmul(x, w, 16), padded)  # refused: the padded call ran
    finally:
        gemm.narrow_rows_agree.cache_clear()
    monkeypatch.setattr(gemm.F, "linear", real)
    assert torch.equal(gemm.invariant_matmul(x, w, 16), padded)  # the real kernel: the same bits either way


def _sum_in_order(x, w, lanes: int):
    """x [M, K] @ w [N, K]^T in fp32 with `lanes` interleaved partial sums (1: one left-to-right chain),
    halved pairwise at the end, rounded to bf16: a stand-in for a GEMM kernel's summation order."""
    xf, wf = x.float(), w.float()
    partial = torch.zeros(xf.size(0), wf.size(0), lanes)
    k = xf.size(1)
    for i in range(0, k, lanes):
        span = min(lanes, k - i)
        partial[..., :span] = partial[..., :span] + xf[:, None, i : i + span] * wf[None, :, i : i + span]
    while partial.size(-1) > 1:
        half = partial.size(-1) // 2
        partial = partial[..., :half] + partial[..., half:]
    return partial[..., 0].bfloat16()


@pytest.mark.parametrize("lanes", [4, 16])
def test_narrow_rows_probe_sees_an_order_change_that_bf16_rounding_hides(monkeypatch, lanes):
    """The failure the probe must catch is subtle: a narrow call summing in another fp32 order (ATen's
    1-row kernel against oneDNN's 16-row one) lands on the same bf16 value for almost every output of
    random inputs, so a probe on random inputs said "agree" and a sequence's log-probs changed with its
    batch. On `order_revealing` inputs the probe refuses such a library."""
    from dsv41.ops import gemm

    def library(x, w):  # narrow calls: one chain; 16-row calls: `lanes` partial sums
        return _sum_in_order(x, w, 1 if x.size(0) < 16 else lanes)

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 64, generator=g).bfloat16(), torch.randn(64, 64, generator=g).bfloat16()
    assert torch.equal(library(x[:2], w), library(x, w)[:2])  # plain random inputs: the order is invisible
    monkeypatch.setattr(gemm.F, "linear", library)
    assert not gemm.narrow_rows_agree.__wrapped__(64, 64, torch.bfloat16, torch.bfloat16, 16, 2, 1, "cpu")
    assert not gemm.wide_rows_agree.__wrapped__(64, 64, torch.bfloat16, 8, 16, 1, "cpu")
    # and a library that keeps one order at every row count is accepted
    monkeypatch.setattr(gemm.F, "linear", lambda x, w: _sum_in_order(x, w, lanes))
    assert gemm.narrow_rows_agree.__wrapped__(64, 64, torch.bfloat16, torch.bfloat16, 16, 2, 1, "cpu")


def _fp4_operands(rows: int, cols: int, d: int = 128, seed: int = 0):
    """MXFP4-rounded bf16 index q [rows, d] and keys [cols, d], each 32-channel block at its own scale
    (spread 2^-4..2^4 per block), as the indexer scores them."""
    from dsv41.ops.quant import FP4_BLOCK

    g = torch.Generator().manual_seed(seed)

    def make(n):
        spread = 2.0 ** torch.randint(-4, 5, (n, d // FP4_BLOCK, 1), generator=g)
        x = (torch.randn(n, d // FP4_BLOCK, FP4_BLOCK, generator=g) * spread).flatten(1)
        return ops.fp4_qdq(x, FP4_BLOCK, "ue8m0").bfloat16()

    return make(rows), make(cols)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows,cols", [(1, 300), (8, 4096), (512, 512)])
def test_fp4_products_round_the_exact_dot_product_once_on_either_path(monkeypatch, native, rows, cols):
    """The indexer's q.k products on FP4-rounded operands are the exact dot products rounded once to bf16,
    whether the bf16 GEMM computes them (CPUs with bf16 instructions) or an fp32 GEMM of the upcast values
    (the others: ~4x faster there). The exact value comes from an fp64 product (an independent formulation)."""
    from dsv41.ops import indexer

    monkeypatch.setattr(indexer, "bf16_gemm_is_native", lambda device: native)
    q, k = _fp4_operands(rows, cols, seed=rows + cols)
    exact = (q.double() @ k.double().t()).to(torch.bfloat16)
    got = indexer.fp4_products(q, k.t())
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact)
    # the gathered form (a key list per query) gives every entry the same score
    w = torch.rand(1, rows, 1, generator=torch.Generator().manual_seed(1)).bfloat16()
    gathered = indexer.index_scores_gathered(q.view(1, rows, 1, -1), k[:5].expand(1, rows, 5, -1), w)
    assert torch.equal(gathered, (exact[:, :5].relu() * w.view(rows, 1)).unsqueeze(0))


def test_sparse_attention_in_head_groups_does_not_depend_on_the_other_heads():
    """heads_per_call: a group of heads gets the bits it gets when it is the only group in the call (what a
    tensor-parallel rank computes), whatever the library's GEMM order for other head counts (MKL on an
    AVX-512 CPU sums a 6-head and a 3-head q.k product in different orders: the fp32 scores differ on ~2,000
    of 22,000 values there); and the values are still the attention (close to the one-call result)."""
    from dsv41.ops.sparse_attn import _per_heads

    g = torch.Generator().manual_seed(5)
    b, m, h, d, n = 1, 21, 6, 128, 90
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    rows = torch.randn(b, m, 64, d, generator=g).bfloat16().float()
    scores = _per_heads("bmhd,bmkd->bmhk", q.float(), rows, 3)
    for s in (0, 3):
        assert torch.equal(scores[:, :, s : s + 3], _per_heads("bmhd,bmkd->bmhk", q[:, :, s : s + 3].float(), rows, 3))
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    ids = torch.randint(-1, n, (b, m, 80), generator=g).int()
    grouped = ops.sparse_attn(q, kv, sink, ids, d**-0.5, heads_per_call=3)
    for s in (0, 3):
        alone = ops.sparse_attn(q[:, :, s : s + 3].contiguous(), kv, sink[s : s + 3], ids, d**-0.5, heads_per_call=3)
        assert torch.equal(grouped[:, :, s : s + 3], alone)
    torch.testing.assert_close(grouped.float(), ops.sparse_attn(q, kv, sink, ids, d**-0.5).float(), atol=2e-2, rtol=0)
