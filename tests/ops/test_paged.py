"""The paged decode ops (dsv41.ops.paged) against a per-sequence, per-entry walk of the block tables with
the fp32 dequantisation, and against the dense softmax."""

import torch

from dsv41 import ops
from dsv41.ops.paged import (
    PagedCache,
    block_keys,
    gather_picked,
    page_rows,
    paged_index_scores,
    paged_sparse_attn,
)
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_dequant, fp4_quant
from dsv41.ops.sparse_attn import dense_reference_attn

PER, BLOCKS, D, DI, H, HI = 4, 12, 64, 32, 4, 2


def make_pages(g):
    rows = PER * BLOCKS
    kv_codes, kv_scale = fp4_quant(torch.randn(rows, D, generator=g) * 2, KV_FP4_BLOCK, "e4m3")
    key_codes, key_scale = fp4_quant(torch.randn(rows, DI, generator=g), FP4_BLOCK, "ue8m0")
    return PagedCache(
        kv_codes, kv_scale.to(torch.float8_e4m3fn), key_codes, key_scale.to(torch.float8_e8m0fnu).view(torch.uint8), PER
    )


def walk(pages, table, entry, keys=False):
    """One entry of one sequence: its block from the table, its row, the fp32 dequantisation."""
    row = table[entry // PER] * PER + entry % PER
    if keys:
        return fp4_dequant(pages.key_codes[row], pages.key_scale[row].view(torch.float8_e8m0fnu).float(), FP4_BLOCK)
    return fp4_dequant(pages.kv_codes[row], pages.kv_scale[row].float(), KV_FP4_BLOCK)


def tables_and_visible(g):
    tables = torch.stack([torch.randperm(BLOCKS, generator=g)[:5] for _ in range(3)])  # [3, 5] scattered blocks
    visible = torch.tensor([7, 20, 1])
    return tables, visible


def test_index_scores_from_pages_equal_scores_of_the_walked_keys():
    g = torch.Generator().manual_seed(0)
    pages, (tables, visible) = make_pages(g), tables_and_visible(g)
    q = ops.fp4_qdq(torch.randn(3, 1, HI, DI, generator=g).bfloat16(), FP4_BLOCK, "ue8m0")
    w = torch.randn(3, 1, HI, generator=g).bfloat16()
    scan = paged_index_scores(q, w, pages, tables, visible)  # [3, 1, 20]
    entries = torch.tensor([[[0, 5, 19, 3, 12, 8]], [[4, 4, 0, 1, 2, 3]], [[0, 1, 2, 3, 4, 5]]])
    usable = torch.ones_like(entries, dtype=torch.bool)
    usable[1, 0, 1] = False  # a padding candidate
    picked = paged_index_scores(q, w, pages, tables, visible, entries, usable)
    for b in range(3):
        keys = torch.stack([walk(pages, tables[b], e, keys=True) for e in range(20)]).bfloat16()
        expected = ops.index_scores(q[b : b + 1], keys.unsqueeze(0), w[b : b + 1])[0, 0]  # [20]
        expected = expected.masked_fill(torch.arange(20) >= visible[b], -torch.inf)
        assert torch.equal(scan[b, 0], expected)
        cand = expected[entries[b, 0].clamp_max(19)].masked_fill(~usable[b, 0], -torch.inf)
        assert torch.equal(picked[b, 0], cand)


def test_sparse_attention_over_pages_equals_the_walked_rows():
    g = torch.Generator().manual_seed(1)
    pages, (tables, _) = make_pages(g), tables_and_visible(g)
    w, k = 6, 5
    q = torch.randn(3, 1, H, D, generator=g).bfloat16()
    window = torch.randn(3, w + 1, D, generator=g).bfloat16()
    window_ids = torch.tensor([[[-1, -1, 0, 1, 2, 6]], [[0, 1, 2, 3, 4, 6]], [[-1, -1, -1, -1, -1, 6]]])
    picked = torch.tensor([[[0, 3, 6, -1, -1]], [[1, 2, 9, 15, 19]], [[-1, -1, -1, -1, -1]]])
    sink = torch.randn(H, generator=g)
    out = paged_sparse_attn(q, window, window_ids, pages, tables, picked, sink, 0.125)
    for b in range(3):
        comp = torch.stack([walk(pages, tables[b], max(int(e), 0)) for e in picked[b, 0]]).bfloat16()
        rows = torch.cat([window[b], comp])  # [w + 1 + k, D]
        ids = torch.cat([window_ids[b, 0], torch.where(picked[b, 0] >= 0, w + 1 + torch.arange(k), -1)])
        one = ops.sparse_attn(q[b : b + 1], rows.unsqueeze(0), sink, ids.view(1, 1, -1).int(), 0.125)
        assert torch.equal(out[b], one[0])
        dense = dense_reference_attn(q[b : b + 1], rows.unsqueeze(0), sink, ids.view(1, 1, -1), 0.125)
        assert (out[b].float() - dense[0]).abs().max() < 2e-2  # bf16 probabilities, nothing else
    # rows grouped by width attend at their own width; the pre-gathered selection is what the pages hold
    widths = [(2, torch.tensor([0])), (5, torch.tensor([1, 2]))]
    grouped = paged_sparse_attn(
        q, window, window_ids, pages, tables, picked, sink, 0.125, widths, gather_picked(pages, tables, picked)
    )
    assert torch.equal(grouped[1:], out[1:])
    narrow = paged_sparse_attn(q[:1], window[:1], window_ids[:1], pages, tables[:1], picked[:1, :, :2], sink, 0.125)
    assert torch.equal(grouped[:1], narrow)


def test_block_keys_and_rows_follow_the_table():
    g = torch.Generator().manual_seed(2)
    pages, (tables, _) = make_pages(g), tables_and_visible(g)
    keys = block_keys(pages, tables[:, :2])  # [3, 2 * PER, DI]
    for b in range(3):
        for e in range(2 * PER):
            assert torch.equal(keys[b, e], walk(pages, tables[b], e, keys=True).bfloat16())
    entries = torch.tensor([[0, 7, 19]] * 3)
    assert torch.equal(page_rows(tables, entries, PER), tables.gather(1, entries // PER) * PER + entries % PER)
