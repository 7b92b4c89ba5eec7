"""Engram: conditional n-gram hash memory added to the residual stream before a block (spec-v41.md §5).

Layout: for each Engram layer and each n-gram order 2..max_ngram_size and each head, a prime-sized bucket
range; primes are the next unused primes above `engram_vocab_size - 1`, never reused across layers, and
a layer's table is their concatenation (sum of primes = `engram_num_embeddings`). Token ids are first
mapped to compressed ids (tokenizer-normalised; a stub map when no tokenizer is given).

Read and gate: rows are dequantised from FP8 (UE8M0 per 32), `wkv` turns the 24 rows into one key per
hc copy plus a shared value, and a signed-sqrt sigmoid of a normalised dot product gates the value into
every copy of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model.layers import Linear
from dsv41.ops import canonical
from dsv41.ops.lanes import per_call


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the bases below are a proven witness set)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab: int) -> torch.Tensor:
    """Odd int64 multipliers [n_layers, max_ngram_size], from numpy's PCG64 seeded with 10007 * layer_id,
    bounded so that id * multiplier never overflows int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer in layer_ids
    ]
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class EngramLayout:
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][order - 2][head]

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> EngramLayout | None:
        if not cfg.engram_layer_ids:
            return None
        seen: set[int] = set()
        primes = []
        for _ in cfg.engram_layer_ids:
            per_order = []
            for _ in range(cfg.engram_max_ngram_size - 1):
                sizes, candidate = [], cfg.engram_vocab_size - 1
                for _ in range(cfg.engram_n_heads):
                    candidate += 1
                    while candidate in seen or not is_prime(candidate):
                        candidate += 1
                    seen.add(candidate)
                    sizes.append(candidate)
                per_order.append(tuple(sizes))
            primes.append(tuple(per_order))
        return cls(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, tuple(primes))

    def table_rows(self) -> tuple[int, ...]:
        return tuple(sum(p for order in layer for p in order) for layer in self.primes)


class NgramHasher(nn.Module):
    """Token ids -> Engram row ids for every Engram layer, with the id history kept in the cache."""

    def __init__(self, cfg: ModelConfig, layout: EngramLayout):
        super().__init__()
        flat = [[p for order in layer for p in order] for layer in layout.primes]
        offsets = [np.cumsum([0] + sizes[:-1]) for sizes in flat]
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(np.array(offsets), dtype=torch.int64), persistent=False)
        self.register_buffer(
            "multipliers",
            hash_multipliers(layout.layer_ids, layout.max_ngram_size, cfg.engram_compressed_vocab_size),
            persistent=False,
        )
        # raw id -> compressed id; a deterministic stub until a tokenizer-derived map is installed
        stub = torch.arange(cfg.vocab_size, dtype=torch.int64) % cfg.engram_compressed_vocab_size
        self.register_buffer("token_map", stub, persistent=False)
        self.pad_token = cfg.engram_pad_id
        self.compressed_vocab = cfg.engram_compressed_vocab_size

    def set_token_map(self, token_map: torch.Tensor) -> None:
        token_map = torch.as_tensor(token_map, dtype=torch.int64)
        if token_map.shape != self.token_map.shape:
            raise ValueError(
                f"engram token map needs shape {tuple(self.token_map.shape)}, got {tuple(token_map.shape)}"
            )
        if token_map.min() < 0 or token_map.max() >= self.compressed_vocab:
            raise ValueError(f"engram token map values must lie in [0, {self.compressed_vocab})")
        self.token_map = token_map.to(self.token_map.device)

    def forward(
        self, input_ids: torch.Tensor, start_pos: int, history: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [B, S]; history [>=B, max_len] is updated in place. Returns [B, S, L, cols] int64."""
        b, s = input_ids.shape
        compressed = self.token_map[input_ids]
        if token_mask is not None:
            compressed = torch.where(token_mask, compressed, ops.engram_hash.DEAD)
        history[:b, start_pos : start_pos + s] = compressed
        pad_id = int(self.token_map[self.pad_token])
        return ops.ngram_hash(history[:b], start_pos, s, self.multipliers, self.primes, self.offsets, pad_id)


class EngramTable(nn.Module):
    """One layer's hash table, FP8 E4M3 rows with a UE8M0 scale per 32 channels, dequantised on lookup."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.block = 32
        self.weight = nn.Parameter(torch.zeros(rows, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(rows, dim // self.block, dtype=torch.float8_e8m0fnu), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> bf16 [..., dim] (or the table's own dtype once made trainable)."""
        if self.scale is None:  # trainable: F.embedding's backward is deterministic on CPU with many
            return F.embedding(ids, self.weight)  # threads, unlike indexing's (issue 11)
        return self.read(self.weight, self.scale, ids, self.block)

    @staticmethod
    def read(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
        """Rows `ids` [...] of FP8 `weight` [rows, dim] with UE8M0 `scale` [rows, dim / block] (or its uint8 bits),
        dequantised -> bf16 [..., dim]. Element by element, so a row's bits do not depend on which other rows are
        read with it (the sharded tables of dsv41.distributed.engram_parallel rely on it)."""
        if scale.dtype == torch.uint8:  # the UE8M0 bits (a compiled region's: inductor takes no float8_e8m0fnu
            # tensor) shifted into an fp32 exponent field: the same power of two for bits 1..254
            scales = (scale[ids].to(torch.int32) << 23).view(torch.float32)
        else:
            scales = scale[ids].float()
        values = weight[ids].float().unflatten(-1, (-1, block)) * scales.unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16)

    def make_trainable(self, dtype: torch.dtype = torch.float32) -> None:
        """Replace the FP8 rows and scales by one dequantised, trainable table (training.md §2)."""
        rows = (self.weight.float().unflatten(-1, (-1, self.block)) * self.scale.float().unsqueeze(-1)).flatten(-2)
        self.weight = nn.Parameter(rows.to(dtype), requires_grad=True)
        self.scale = None


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, table_rows: int):
        super().__init__()
        self.layer_id = layer_id
        self.dim, self.hc = cfg.dim, cfg.hc_mult
        self.eps = cfg.norm_eps
        self.embed = EngramTable(table_rows, cfg.engram_head_dim)
        self.wkv = Linear(cfg.n_hash_columns * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), cfg.dtype)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16))
        # canonical numerics (dsv41.ops.canonical) for the two rstd statistics, the gate's dot product and its
        # sigmoid: the same bits on every CPU, slower (see Transformer.set_reference_numerics)
        self.reference_numerics = False

    def forward(
        self,
        h: torch.Tensor,
        hash_ids: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        calls=None,
        scale_bits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [B, S, hc, dim] bf16; hash_ids [B, S, cols]; token_mask [B, S] (False = gate shut); calls: the
        tokens' separate calls when several sequences' chunks share this one (`ops.lanes.per_call`);
        scale_bits: the table's scales as uint8 bits (a compiled region's way to read them).
        Returns h + gate * value, gate per (token, copy), value shared by the copies."""
        if scale_bits is None:
            rows = self.embed(hash_ids)
        else:
            rows = EngramTable.read(self.embed.weight, scale_bits, hash_ids, self.embed.block)
        kv = self.wkv(rows.flatten(-2))  # [B, S, (hc + 1) * dim]
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        weight = self.q_weight.float() * self.k_weight.float()  # only their product matters
        hf = h.float()
        # each (token, copy) normalised over dim separately, not jointly over the copies
        ref = self.reference_numerics
        rsqrt = ops.reductions.rsqrt
        rstd = rsqrt(ops.mean_of_squares(hf, ref) + self.eps, ref) * rsqrt(
            ops.mean_of_squares(key, ref) + self.eps, ref
        )
        dot = ops.sum_fp32_terms(hf * weight * key, ref) * rstd * self.dim**-0.5
        signed_sqrt = torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot)
        # as if each call of `calls` tokens ran alone (dsv41.ops.lanes: the engine's batch invariance)
        gate = canonical.sigmoid(signed_sqrt) if ref else per_call("sigmoid", signed_sqrt, calls)
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
