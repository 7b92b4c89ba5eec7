"""Paged, packed storage for the persistent global KV of many sequences (spec-v41.md §8).

Only the kv-source layers (2, 8, 14, 20 in Flash) persist per-token state. For each of them the pool keeps,
per block of `block_size` tokens (`block_size / ratio` compressed entries):
- main KV: E2M1 codes packed two per byte [entries, head_dim/2] + one E4M3 scale per 16 channels
  [entries, head_dim/16] (256 + 32 = 288 bytes per entry at head_dim 512);
- indexer keys: E2M1 codes [entries, index_head_dim/2] + one UE8M0 scale per 32 [entries, index_head_dim/32]
  (64 + 4 = 68 bytes per entry at 128).
A block id addresses the same token range in every kv-source layer (vLLM's paged layout), so one block
table per sequence serves all four caches. Blocks are reference counted: full blocks can be shared by
several sequences with the same prefix (the prefix cache, dsv41.engine.prefix_cache).

Values written here were already rounded by the model onto exactly these grids (fake quantisation after
RoPE, spec §8), so packing them is lossless: reading back returns the same numbers the reference cache
holds in its bf16 containers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.config import ModelConfig
from dsv41.ops import paged
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK, fp4_quant_rounded


class PoolExhausted(RuntimeError):
    """No free or evictable block is left."""


@dataclass(frozen=True)
class SourceLayout:
    layer: int
    ratio: int
    entries_per_block: int


class PagedKVPool:
    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, device=None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        ratios = [cfg.compress_ratios[s] for s in cfg.kv_source_layers]
        if block_size <= 0 or any(block_size % r for r in ratios):
            raise ValueError(
                f"block_size must be a positive multiple of every compress ratio {sorted(set(ratios))}, "
                f"got {block_size}"
            )
        self.cfg, self.block_size, self.num_blocks = cfg, block_size, num_blocks
        self.head_dim, self.index_dim = cfg.head_dim, cfg.index_head_dim
        self.sources = {s: SourceLayout(s, r, block_size // r) for s, r in zip(cfg.kv_source_layers, ratios)}
        self.kv_codes: dict[int, torch.Tensor] = {}
        self.kv_scale: dict[int, torch.Tensor] = {}
        self.key_codes: dict[int, torch.Tensor] = {}
        self.key_scale: dict[int, torch.Tensor] = {}
        for s, lay in self.sources.items():
            rows = num_blocks * lay.entries_per_block  # flat row r = block * entries_per_block + entry
            self.kv_codes[s] = torch.zeros(rows, self.head_dim // 2, dtype=torch.uint8, device=device)
            self.kv_scale[s] = torch.zeros(
                rows, self.head_dim // KV_FP4_BLOCK, dtype=torch.float8_e4m3fn, device=device
            )
            self.key_codes[s] = torch.zeros(rows, self.index_dim // 2, dtype=torch.uint8, device=device)
            # UE8M0 kept as raw bytes: torch has no indexed writes for float8_e8m0fnu
            self.key_scale[s] = torch.zeros(rows, self.index_dim // FP4_BLOCK, dtype=torch.uint8, device=device)

    # ------------------------------------------------------------------ sizes
    def bytes_per_block(self) -> int:
        return sum(
            t[0].numel() * t.element_size() * lay.entries_per_block
            for s, lay in self.sources.items()
            for t in (self.kv_codes[s], self.kv_scale[s], self.key_codes[s], self.key_scale[s])
        )

    def stored_bytes(self, layer: int, n_entries: int) -> int:
        """Bytes that n entries of one kv source occupy (codes + scales, main KV + index keys)."""
        per_entry = sum(
            t[0].numel() * t.element_size()
            for t in (self.kv_codes[layer], self.kv_scale[layer], self.key_codes[layer], self.key_scale[layer])
        )
        return per_entry * n_entries

    # ------------------------------------------------------------------ addressing
    def rows(self, layer: int, table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Flat pool rows of the given entry indices of a sequence with block table `table` (int64)."""
        per = self.sources[layer].entries_per_block
        return table[entries // per] * per + entries % per

    def rows_batched(self, layer: int, tables: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Flat rows for many sequences at once: tables [B, max_blocks] (padded), entries [B, T] -> [B, T].
        Entries must lie inside each sequence's table (clamp padding before calling)."""
        return paged.page_rows(tables, entries, self.sources[layer].entries_per_block)

    def write_rows(self, layer: int, rows: torch.Tensor, kv: torch.Tensor, keys) -> None:
        """Store entries at flat rows [n]: kv [n, head_dim], keys [n, index_dim] or None, values already
        on the model's grids (packed losslessly: `fp4_quant_rounded`)."""
        kv_packed = fp4_quant_rounded(kv, KV_FP4_BLOCK, "e4m3")
        key_packed = None if keys is None else fp4_quant_rounded(keys, FP4_BLOCK, "ue8m0")
        self.write_packed(layer, rows, kv_packed, key_packed)

    def write_packed(self, layer: int, rows: torch.Tensor, kv: tuple, keys) -> None:
        """Store entries already packed: kv = (codes [n, head_dim/2] uint8, scales [n, head_dim/16] fp32
        E4M3 values), keys likewise (UE8M0 values per 32) or None."""
        self.kv_codes[layer][rows] = kv[0]
        self.kv_scale[layer][rows] = kv[1].to(torch.float8_e4m3fn)
        if keys is not None:
            self.key_codes[layer][rows] = keys[0]
            self.key_scale[layer][rows] = keys[1].to(torch.float8_e8m0fnu).view(torch.uint8)

    def pages(self, layer: int) -> paged.PagedCache:
        """One kv source's packed storage, as the paged ops (dsv41.ops.paged) take it."""
        return paged.PagedCache(
            self.kv_codes[layer],
            self.kv_scale[layer],
            self.key_codes[layer],
            self.key_scale[layer],
            self.sources[layer].entries_per_block,
        )

    def kv_at(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Dequantised main KV at flat rows (any shape [...]) -> bf16 [..., head_dim]."""
        return paged.gather_kv(self.pages(layer), rows)

    def keys_at(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Dequantised index keys at flat rows (any shape [...]) -> bf16 [..., index_dim]."""
        return paged.gather_keys(self.pages(layer), rows)

    def keys_of_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """Dequantised index keys of whole blocks: block ids [..., nb] -> bf16 [..., nb * entries_per_block,
        index_dim], in entry order (`paged.block_keys`)."""
        return paged.block_keys(self.pages(layer), blocks)

    def read_key_range(self, layer: int, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Dequantised index keys of entries start..end-1 of one sequence -> bf16 [end - start, index_dim]."""
        per = self.sources[layer].entries_per_block
        first, last = start // per, -(-end // per)
        keys = self.keys_of_blocks(layer, table[first:last])
        return keys[start - first * per : end - first * per]

    # ------------------------------------------------------------------ access
    def write(self, layer: int, table: torch.Tensor, first: int, kv: torch.Tensor, keys) -> None:
        """Store entries first..first+n-1 of one sequence: kv [n, head_dim], keys [n, index_dim] or None."""
        rows = self.rows(layer, table, torch.arange(first, first + kv.size(0), device=table.device))
        self.write_rows(layer, rows, kv, keys)

    def read_kv(self, layer: int, table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Dequantised main KV of the given entries -> bf16 [len(entries), head_dim]."""
        return self.kv_at(layer, self.rows(layer, table, entries))

    def read_keys(self, layer: int, table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Dequantised index keys -> bf16 [len(entries), index_dim]."""
        return self.keys_at(layer, self.rows(layer, table, entries))

    def export_entries(self, layer: int, table: torch.Tensor, entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The packed bytes of some entries (for snapshots outside the pool)."""
        rows = self.rows(layer, table, entries)
        return tuple(t[layer][rows].clone() for t in (self.kv_codes, self.kv_scale, self.key_codes, self.key_scale))

    def import_entries(
        self, layer: int, table: torch.Tensor, entries: torch.Tensor, packed: tuple[torch.Tensor, ...]
    ) -> None:
        rows = self.rows(layer, table, entries)
        for t, value in zip((self.kv_codes, self.kv_scale, self.key_codes, self.key_scale), packed):
            t[layer][rows] = value


class BlockAllocator:
    """Reference-counted block ids with an LRU of unreferenced-but-cached blocks.

    A block with refcount 0 that carries a prefix hash stays in `evictable` (oldest first) and can be
    revived by a prefix-cache hit until an allocation needs its space.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_blocks
        self.block_hash: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.evictable: dict[int, None] = {}  # insertion-ordered: oldest first
        self.evictions = 0

    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def num_used(self) -> int:
        """Blocks referenced by live sequences."""
        return self.num_blocks - self.num_available()

    def allocate(self) -> int:
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block = next(iter(self.evictable))
            del self.evictable[block]
            del self.by_hash[self.block_hash.pop(block)]
            self.evictions += 1
        else:
            raise PoolExhausted("the KV pool has no free block")
        self.refcount[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] < 0:
            raise RuntimeError(f"block {block} released more often than referenced")
        if self.refcount[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, block_hash: int) -> None:
        """Publish a full block under its prefix hash (first writer wins; a duplicate stays private)."""
        if block_hash not in self.by_hash and block not in self.block_hash:
            self.block_hash[block] = block_hash
            self.by_hash[block_hash] = block

    def lookup(self, block_hash: int):
        return self.by_hash.get(block_hash)

    def acquire_cached(self, block: int) -> None:
        """Take a reference to a cached block (reviving it from the evictable LRU)."""
        if self.refcount[block] == 0:
            self.evictable.pop(block, None)
        self.refcount[block] += 1
