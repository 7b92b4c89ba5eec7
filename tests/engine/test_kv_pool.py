"""Packed storage: lossless for values already on the model's grids, and the bytes the spec states."""

import torch

from dsv41.config import flash, tiny
from dsv41.engine.kv_pool import BlockAllocator, PagedKVPool, PoolExhausted
from dsv41.engine.sequence import SequenceCache, StatePool
from dsv41.model.cache import global_kv_bytes_per_token
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_qdq, fp8_qdq


def test_flash_layout_is_890_bytes_per_token():
    cfg = flash()
    with torch.device("meta"):
        pool = PagedKVPool(cfg, block_size=64, num_blocks=4)
    # spec §8: 288 B per main-KV entry, 68 B per index-key entry
    assert pool.stored_bytes(20, 1) == 288 + 68
    assert pool.bytes_per_block() / 64 == 890
    assert global_kv_bytes_per_token(cfg)["total"] == 890


def test_pool_round_trip_is_exact_on_the_model_grids():
    cfg = tiny()
    pool = PagedKVPool(cfg, block_size=8, num_blocks=6)
    table = torch.tensor([4, 1, 3])  # deliberately scattered blocks
    g = torch.Generator().manual_seed(0)
    for layer in cfg.kv_source_layers:
        n = 24 // cfg.compress_ratios[layer]
        kv = fp4_qdq(torch.randn(n, cfg.head_dim, generator=g).bfloat16() * 3, KV_FP4_BLOCK, "e4m3")
        keys = fp4_qdq(torch.randn(n, cfg.index_head_dim, generator=g).bfloat16(), FP4_BLOCK, "ue8m0")
        kv[2] = 0  # an all-zero entry
        # a block whose maximum lies in [9, 10) x 2^-9: fp4_qdq picks a subnormal E4M3 scale that plain
        # re-quantising of the rounded values does not find again (0.0156 read back as 0.0117)
        kv[3, :16] = fp4_qdq(torch.full((1, 16), 9.5 * 2**-9).bfloat16(), KV_FP4_BLOCK, "e4m3")
        pool.write(layer, table, 0, kv[:5], keys[:5])
        pool.write(layer, table, 5, kv[5:], keys[5:])  # a write that starts mid-block
        entries = torch.arange(n)
        assert torch.equal(pool.read_kv(layer, table, entries), kv)
        assert torch.equal(pool.read_keys(layer, table, entries), keys)
        picked = torch.tensor([n - 1, 0, 3])
        assert torch.equal(pool.read_kv(layer, table, picked), kv[picked])


def test_window_ring_is_fp8_and_exact():
    cfg = tiny()
    pool = PagedKVPool(cfg, block_size=8, num_blocks=2)
    cache = SequenceCache(cfg, pool, StatePool(cfg, 2), 1)
    assert cache.window_codes.dtype == torch.float8_e4m3fn
    values = fp8_qdq(torch.randn(1, 5, cfg.head_dim).bfloat16() * 10)
    slots = torch.tensor([7, 0, 1, 2, 3])
    cache.window_write(3, 1, slots, values)
    assert torch.equal(cache.window_read(3, 1)[0, slots], values[0])
    # 1 byte per value plus one scale byte per 32 values
    per_slot = cache.window_codes[0, 0].numel() + cache.window_scale[0, 0].numel()
    assert per_slot == cfg.head_dim + cfg.head_dim // 32


def test_allocator_refcounts_and_lru_eviction():
    alloc = BlockAllocator(3)
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    alloc.register(a, 111)
    alloc.register(b, 222)
    try:
        alloc.allocate()
        raise AssertionError("expected PoolExhausted")
    except PoolExhausted:
        pass
    alloc.release(a)
    alloc.release(b)
    alloc.release(c)  # unhashed: straight back to the free list
    assert alloc.num_available() == 3 and alloc.num_used() == 0
    alloc.acquire_cached(alloc.lookup(222))  # revive b
    assert alloc.allocate() == c
    assert alloc.allocate() == a  # evicts the oldest cached block
    assert alloc.lookup(111) is None and alloc.lookup(222) == b


def test_block_key_reads_equal_entry_reads():
    """`keys_of_blocks` / `read_key_range` (whole-block gathers, the indexer's scans) return exactly the
    per-entry reads, for scattered tables and ranges that start and end inside blocks."""
    cfg = tiny()
    pool = PagedKVPool(cfg, block_size=8, num_blocks=7)
    table = torch.tensor([5, 0, 3, 6])
    g = torch.Generator().manual_seed(1)
    for layer in cfg.kv_source_layers:
        n = 32 // cfg.compress_ratios[layer]
        keys = fp4_qdq(torch.randn(n, cfg.index_head_dim, generator=g).bfloat16() * 4, FP4_BLOCK, "ue8m0")
        kv = fp4_qdq(torch.randn(n, cfg.head_dim, generator=g).bfloat16(), KV_FP4_BLOCK, "e4m3")
        pool.write(layer, table, 0, kv, keys)
        assert torch.equal(pool.keys_of_blocks(layer, table), keys)
        assert torch.equal(pool.keys_of_blocks(layer, table.view(2, 2)), keys.view(2, n // 2, -1))
        for start, end in ((0, n), (1, n - 1), (3, 5), (n - 2, n)):
            assert torch.equal(pool.read_key_range(layer, table, start, end), keys[start:end]), (layer, start, end)
            assert torch.equal(
                pool.read_key_range(layer, table, start, end), pool.read_keys(layer, table, torch.arange(start, end))
            )
