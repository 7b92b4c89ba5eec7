"""N-gram hashing for Engram (spec-v41.md §5 "Hash").

For each position p the compressed ids at p, p-1, ..., p-(n-1) are multiplied by per-(layer, lookback)
odd multipliers and XOR-ed together one lookback at a time; after i lookbacks the running value is the
hash of the (i+1)-gram. Each (order, head) reduces it modulo its own prime and adds the offset of its
bucket range. Lookback stops at the sequence start and at dead (image) tokens, which read as `pad_id`.
"""

from __future__ import annotations

import torch

DEAD = -1  # compressed id of a token that takes part in no n-gram (image spans)


def ngram_hash(
    history: torch.Tensor,
    start: int,
    length: int,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    pad_id: int,
) -> torch.Tensor:
    """Hash ids of the n-grams ending at positions start..start+length-1.

    history [B, >= start + length] int64: compressed ids from position 0 (DEAD for image tokens).
    multipliers [L, n] int64 (n = max n-gram size); primes [L, n-1, heads] int64; offsets [L, (n-1)*heads].
    Returns int64 [B, length, L, (n-1) * heads] row ids into each layer's table.
    """
    b = history.size(0)
    n = multipliers.size(1)
    positions = torch.arange(start, start + length, device=history.device).expand(b, length)
    blocked = torch.zeros_like(positions, dtype=torch.bool)
    grams = []
    for shift in range(n):
        token = history.gather(1, (positions - shift).clamp_min(0))
        blocked = blocked | (positions < shift) | (token == DEAD)
        grams.append(torch.where(blocked, pad_id, token))
    tokens = torch.stack(grams, dim=-1)  # [B, S, n]
    products = tokens.unsqueeze(2) * multipliers  # [B, S, L, n]
    rolling = products[..., 0]
    columns = []
    for i in range(1, n):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        columns.append(rolling.unsqueeze(-1) % primes[:, i - 1])  # [B, S, L, heads]
    return torch.cat(columns, dim=-1) + offsets
