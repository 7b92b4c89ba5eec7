"""The C++ selection kernel of a Full indexer layer (dsv41.ops.index_cpu) against its reference: the scores of
`ops.index_scores`, the visibility mask and the canonical top-k (`ops.select_topk`). The kernel's integer
products are exact, so its picks must equal the reference's exactly, ties included. Built here with this
machine's instruction set: the AVX512-VNNI form where the CPU has it, the portable form elsewhere; both are
checked by the same tests."""

import pytest
import torch

from dsv41 import ops
from dsv41.ops import index_cpu
from dsv41.ops.quant import fp4_qdq

pytestmark = pytest.mark.skipif(index_cpu.library() is None, reason="no C++ compiler to build the kernel")


def _case(s, t, heads=8, dim=64, seed=0, tied=False):
    g = torch.Generator().manual_seed(seed)
    q = fp4_qdq(torch.randn(s, heads, dim, generator=g).bfloat16(), 32, "ue8m0")
    if tied:  # a few distinct keys repeated: many entries score exactly alike
        k = fp4_qdq(torch.randn(5, dim, generator=g).bfloat16(), 32, "ue8m0")[torch.randint(0, 5, (t,), generator=g)]
    else:  # keys of very different scales, so blocks carry different powers of two
        k = fp4_qdq((torch.randn(t, dim, generator=g) * torch.rand(t, 1, generator=g) * 8).bfloat16(), 32, "ue8m0")
    w = (torch.randn(s, heads, generator=g) * 0.2).bfloat16()  # negative weights too
    return q, k, w


def _reference(q, k, w, visible, topk):
    scores = ops.mask_invisible(ops.index_scores(q[None], k[None], w[None]), visible.view(-1, 1))
    picks = ops.select_topk(scores, topk, 0, canonical=True)[0].long()
    # the reference's unusable picks (fewer visible entries than topk) are -1; the kernel puts them last too
    return picks


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tied", [False, True])
def test_the_kernel_picks_what_the_reference_picks(dim, tied):
    s, t, topk = 37, 300, 16
    q, k, w = _case(s, t, dim=dim, seed=dim + tied, tied=tied)
    # visible counts from none to all, some below topk, some not a whole tile of 16
    visible = torch.linspace(0, t, s).long()
    got = index_cpu.index_topk_cpu(q, k, w, visible, topk)
    want = _reference(q, k, w, visible, topk)
    assert got.dtype == torch.int64 and got.shape == (s, topk)
    assert torch.equal(got, want)
    assert (got[0] == -1).all() and (got[-1] >= 0).all()  # the case covers "nothing visible" and "all visible"


def test_the_kernel_breaks_ties_towards_the_lowest_position():
    q, k, w = _case(4, 64, seed=1)
    k = k[:1].expand(64, -1).contiguous()  # every entry the same key: every score ties
    got = index_cpu.index_topk_cpu(q, k, w, torch.full((4,), 64), 5)
    assert torch.equal(got, torch.arange(5).expand(4, 5))


def test_the_kernel_does_not_depend_on_the_thread_count():
    q, k, w = _case(33, 500, seed=2)
    visible = torch.full((33,), 500)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = index_cpu.index_topk_cpu(q, k, w, visible, 24)
        torch.set_num_threads(2)
        two = index_cpu.index_topk_cpu(q, k, w, visible, 24)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_values_off_the_mxfp4_grid_are_refused():
    q, k, w = _case(3, 40, seed=3)
    with pytest.raises(RuntimeError, match="not MXFP4-rounded"):
        index_cpu.index_topk_cpu(q, (k.float() * 1.01).bfloat16(), w, torch.full((3,), 40), 4)
    with pytest.raises(RuntimeError, match="not MXFP4-rounded"):
        index_cpu.index_topk_cpu((q.float() + 0.01).bfloat16(), k, w, torch.full((3,), 40), 4)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        index_cpu.index_topk_cpu(q[..., :48], k[:, :48], w, torch.full((3,), 40), 4)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_paged_scores_equal_the_dequantised_scan(monkeypatch, dim):
    """A decode step's Full-layer scores read from the packed pool (E2M1 codes and UE8M0 bytes, through
    scattered block tables) equal `ops.paged_index_scores`' dequantise-then-GEMM reference, -inf included.
    Head dims that the key unpacking takes by its scalar loop (32) and by its vector form (64, 128)."""
    from dsv41.ops.paged import PagedCache, paged_index_scores
    from dsv41.ops.quant import fp4_quant

    g = torch.Generator().manual_seed(4 + dim)
    per, blocks, heads = 4, 40, 8
    rows = per * blocks
    # keys of very different scales: the blocks' UE8M0 bytes differ
    key_codes, key_scale = fp4_quant(
        torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 8, 32, "ue8m0"
    )
    kv_codes, kv_scale = fp4_quant(torch.randn(rows, 32, generator=g), 16, "e4m3")
    pages = PagedCache(
        kv_codes, kv_scale.to(torch.float8_e4m3fn), key_codes, key_scale.to(torch.float8_e8m0fnu).view(torch.uint8), per
    )
    tables = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(4)])  # [4, 12] scattered
    visible = torch.tensor([37, 0, 16, 45])  # none, a whole tile, partial tiles
    q = fp4_qdq(torch.randn(4, 1, heads, dim, generator=g).bfloat16(), 32, "ue8m0")
    w = (torch.randn(4, 1, heads, generator=g) * 0.3).bfloat16()
    got = index_cpu.paged_index_scores_cpu(q[:, 0], w[:, 0], pages.key_codes, pages.key_scale, tables, per, visible, 45)
    monkeypatch.setattr(index_cpu, "available", lambda build=True: False)  # the reference path
    want = paged_index_scores(q, w, pages, tables, visible)[:, 0]
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (4, 45)
    assert torch.equal(got, want)
    assert torch.isinf(got[1]).all() and torch.isfinite(got[3]).all()


def _pool(seed=4, per=4, blocks=40, dim=64, kv_dim=32):
    """A packed pool of `blocks` blocks: keys (E2M1 with UE8M0 bytes per 32) and main KV (E2M1 with E4M3 scales
    per 16), both of very different scales per row, so that rows and blocks carry different scale bytes."""
    from dsv41.ops.paged import PagedCache
    from dsv41.ops.quant import fp4_quant

    g = torch.Generator().manual_seed(seed)
    rows = per * blocks
    key_codes, key_scale = fp4_quant(
        torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 8, 32, "ue8m0"
    )
    kv_codes, kv_scale = fp4_quant(
        torch.randn(rows, kv_dim, generator=g) * torch.rand(rows, 1, generator=g), 16, "e4m3"
    )
    return PagedCache(
        kv_codes, kv_scale.to(torch.float8_e4m3fn), key_codes, key_scale.to(torch.float8_e8m0fnu).view(torch.uint8), per
    ), g


def _reference_reads(monkeypatch):
    """Every read of the packed pool by its tensor-op reference (no C++ scoring or gather)."""
    monkeypatch.setattr(index_cpu, "available", lambda build=True: False)
    monkeypatch.setattr(index_cpu, "loaded", lambda build=True: False)


def test_candidate_scores_equal_the_dequantised_gather(monkeypatch):
    """A Reindex layer's decode scores over explicit candidate entries (some past a sequence's visible count,
    some marked unusable, repeated ones, every order), read from the packed pool, equal the reference's gather,
    dequantise and GEMM, -inf included."""
    from dsv41.ops.paged import paged_index_scores

    pages, g = _pool()
    heads, dim = 8, 64
    tables = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(4)])
    visible = torch.tensor([37, 0, 16, 45])
    entries = torch.randint(0, 48, (4, 1, 40), generator=g)  # ids up to 47: some past every visible count
    entries[0, 0, :5] = 3  # one entry repeated
    usable = torch.rand(4, 1, 40, generator=g) > 0.2
    q = fp4_qdq(torch.randn(4, 1, heads, dim, generator=g).bfloat16(), 32, "ue8m0")
    w = (torch.randn(4, 1, heads, generator=g) * 0.3).bfloat16()
    for mask in (usable, None):
        got = paged_index_scores(q, w, pages, tables, visible, entries, mask)
        with monkeypatch.context() as m:
            _reference_reads(m)
            want = paged_index_scores(q, w, pages, tables, visible, entries, mask)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape == (4, 1, 40)
        assert torch.equal(got, want)
        assert torch.isinf(got[1]).all() and torch.isfinite(got).any()


@pytest.mark.parametrize("which", ["kv", "keys"])
def test_the_gather_reads_the_rows_the_reference_dequantises(monkeypatch, which):
    """The packed rows read back as bf16 by the C++ gather (E4M3 scales per 16 for the main KV, UE8M0 per 32 for
    the index keys) have the bits of the reference's table lookup and scaling, signed zeros included, at any
    rows (repeated, any order) and shape; a row outside the pool is refused."""
    from dsv41.ops.paged import gather_keys, gather_kv

    pages, g = _pool(seed=7)
    read = gather_kv if which == "kv" else gather_keys
    rows = torch.randint(0, 160, (3, 5, 7), generator=g)
    rows[0, 0, :3] = 11
    got = read(pages, rows)
    with monkeypatch.context() as m:
        _reference_reads(m)
        want = read(pages, rows)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit: -0.0 is not 0.0
    assert (got.view(torch.int16) == -32768).any()  # the case of a negative zero was exercised
    codes = pages.kv_codes if which == "kv" else pages.key_codes
    with pytest.raises(RuntimeError, match="outside the pool"):
        index_cpu.gather_fp4(codes, torch.zeros(160, 2, dtype=torch.uint8), torch.tensor([160]), ue8m0=True)
