"""Triton kernels against their dsv41.ops references. Without a GPU they run under TRITON_INTERPRET=1
(the interpreter executes the kernel on CPU tensors), at small shapes. Needs the `triton` extra."""

import os

import pytest
import torch

from tests.conftest import optional_import

if not torch.cuda.is_available():
    # read when functions are decorated, Triton's own @jit library included: set before importing it
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = optional_import("triton")  # required under DSV41_REQUIRE_OPTIONAL (.ci/run)

from dsv41 import ops  # noqa: E402
from dsv41.config import tiny  # noqa: E402
from dsv41.engine.kv_pool import PagedKVPool  # noqa: E402
from dsv41.ops import triton_kernels as tk  # noqa: E402
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_dequant_bf16, fp4_qdq, fp4_quant  # noqa: E402
from dsv41.ops.sparse_attn import sparse_attn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block,fmt", [(FP4_BLOCK, "ue8m0"), (KV_FP4_BLOCK, "e4m3")])
def test_fp4_dequant_kernel_is_exact(block, fmt):
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(0)) * 5
    codes, scale = fp4_quant(x, block, fmt)
    want = fp4_dequant_bf16(codes, scale, block)
    got = tk.fp4_dequant_bf16(codes.to(DEVICE), scale.to(DEVICE), block).cpu()
    assert torch.equal(got, want)


def test_index_scores_paged_equals_the_reference_on_dequantised_keys():
    """Keys written into a real pool (scattered blocks, two sequences of different lengths); the kernel
    reads the packed bytes through the block tables and must give ops.index_scores' bits."""
    cfg = tiny()
    layer = cfg.candidate_source_layer
    pool = PagedKVPool(cfg, block_size=8, num_blocks=12)
    per = pool.sources[layer].entries_per_block
    g = torch.Generator().manual_seed(1)
    tables = torch.tensor([[7, 2, 9, 4, 0], [3, 11, 5, 5, 5]])  # the second padded with its own block
    visible = torch.tensor([37, 19])
    keys = []
    for seq, n in enumerate(visible.tolist()):
        spread = 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)
        k = fp4_qdq(torch.randn(n, cfg.index_head_dim, generator=g) * spread, FP4_BLOCK, "ue8m0").bfloat16()
        kv = fp4_qdq(torch.randn(n, cfg.head_dim, generator=g), KV_FP4_BLOCK, "e4m3").bfloat16()
        pool.write(layer, tables[seq], 0, kv, k)
        keys.append(k)
    h, d = cfg.index_n_heads, cfg.index_head_dim
    q = fp4_qdq(torch.randn(2, h, d, generator=g), FP4_BLOCK, "ue8m0").bfloat16()
    w = torch.randn(2, h, generator=g).bfloat16()
    n_out = 40
    got = tk.index_scores_paged(
        q.to(DEVICE),
        w.to(DEVICE),
        pool.key_codes[layer].to(DEVICE),
        pool.key_scale[layer].to(DEVICE),
        tables.to(DEVICE),
        per,
        visible.to(DEVICE),
        n_out,
    ).cpu()
    for seq, n in enumerate(visible.tolist()):
        want = ops.index_scores(q[seq].view(1, 1, h, d), keys[seq].unsqueeze(0), w[seq].view(1, 1, h))[0, 0]
        assert torch.equal(got[seq, :n], want), seq
        assert torch.isneginf(got[seq, n:]).all()


def test_the_paged_scan_runs_the_kernel_with_the_reference_bits():
    """`ops.paged_index_scores`, the engine's one call for a Full index layer's scan: its Triton path
    (forced here; automatic on a GPU) gives the bits of its pure-PyTorch reference."""
    cfg = tiny()
    layer = cfg.candidate_source_layer
    pool = PagedKVPool(cfg, block_size=8, num_blocks=12)
    g = torch.Generator().manual_seed(2)
    tables = torch.tensor([[7, 2, 9, 4, 0], [3, 11, 5, 5, 5]])
    visible = torch.tensor([37, 19])
    for seq, n in enumerate(visible.tolist()):
        k = fp4_qdq(torch.randn(n, cfg.index_head_dim, generator=g), FP4_BLOCK, "ue8m0").bfloat16()
        pool.write(
            layer,
            tables[seq],
            0,
            fp4_qdq(torch.randn(n, cfg.head_dim, generator=g), KV_FP4_BLOCK, "e4m3").bfloat16(),
            k,
        )
    h, d = cfg.index_n_heads, cfg.index_head_dim
    q = fp4_qdq(torch.randn(2, 1, h, d, generator=g), FP4_BLOCK, "ue8m0").bfloat16()
    w = torch.randn(2, 1, h, generator=g).bfloat16()
    pages = pool.pages(layer)
    want = ops.paged_index_scores(q, w, pages, tables, visible, fast=False)
    on = ops.PagedCache(
        *(t.to(DEVICE) for t in (pages.kv_codes, pages.kv_scale, pages.key_codes, pages.key_scale)),
        pages.entries_per_block,
    )
    got = ops.paged_index_scores(q.to(DEVICE), w.to(DEVICE), on, tables.to(DEVICE), visible.to(DEVICE), fast=True).cpu()
    assert got.shape == want.shape == (2, 1, 37)
    assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # an empty row: exp(sink + 1e30), as in the reference
@pytest.mark.parametrize("n_idx", [64, 100])
def test_sparse_attn_decode_matches_the_reference(n_idx):
    g = torch.Generator().manual_seed(n_idx)
    b, h, d, n = 3, 4, 64, 150
    q = torch.randn(b, 1, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, 1, n_idx), generator=g, dtype=torch.int32)
    idx[0, 0, 5:40] = -1  # holes
    idx[2] = -1  # a row with nothing to attend: the reference gives 0
    want = sparse_attn(q, kv, sink, idx, d**-0.5)
    got = tk.sparse_attn_decode(q.to(DEVICE), kv.to(DEVICE), sink.to(DEVICE), idx.to(DEVICE), d**-0.5).cpu()
    assert torch.equal(got[2], want[2]) and not got[2].any()
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    # closer than the bf16 output rounding on almost every value
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).float().mean() > 0.99
