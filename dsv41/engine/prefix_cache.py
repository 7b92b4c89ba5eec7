"""Prefix caching at message granularity (spec-v41.md §8 "Serving cache policy").

Two tiers, as in V4.1's serving stack:
- Global KV (compressed entries + index keys) of full blocks stays in the paged pool after its sequence
  finishes, keyed by a chain hash of the block's tokens and all tokens before it, and is evicted LRU only
  when an allocation needs the space (the pool size is the memory budget).
- At message boundaries (end of a prompt's prefill, end of a request) a snapshot keyed by the hash of
  all tokens so far keeps what a full block cannot: the global entries of the partial last block, the
  ratio-2 compressors' partial group, and the window rings. The rings are the only non-persistent part:
  they expire after `window_ttl_s`; a later hit then rebuilds them by bounded replay of the last
  `window_size` prefix tokens over the cached global KV.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


def chain_hashes(tokens: list[int], block_size: int, start_hashes: list[int]) -> list[int]:
    """Extend `start_hashes` (hashes of the first len(start_hashes) full blocks) over all full blocks."""
    hashes = list(start_hashes)
    prev = hashes[-1] if hashes else 0
    for i in range(len(hashes), len(tokens) // block_size):
        prev = hash((prev, tuple(tokens[i * block_size : (i + 1) * block_size])))
        hashes.append(prev)
    return hashes


def prefix_key(tokens: list[int], length: int, block_size: int, block_hashes: list[int]) -> int:
    """Hash of tokens[:length] given the chain hashes of its full blocks."""
    full = length // block_size
    prev = block_hashes[full - 1] if full else 0
    return hash((prev, "tail", tuple(tokens[full * block_size : length])))


@dataclass
class Snapshot:
    length: int
    tail: dict  # kv-source layer -> packed entries of the partial last block
    state: dict  # SequenceCache.export_state() (window rings, partial groups, window starts)
    created: float
    window_valid: bool = True
    decoder_start: int = 0  # the position the decoder layers' windows started at when this was computed
    logits: torch.Tensor | None = None  # fp32 [vocab] of the last position (end-of-prompt snapshots)


@dataclass
class PrefixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    snapshot_hits: int = 0
    window_rebuilds: int = 0


class SnapshotStore:
    """LRU of message-boundary snapshots, at most `max_entries`; window rings expire after `ttl_s`."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self.entries: OrderedDict[int, Snapshot] = OrderedDict()
        self.lengths: dict[int, int] = {}  # length -> number of snapshots of that length

    def put(self, key: int, snap: Snapshot) -> None:
        if self.max_entries <= 0:
            return
        if key in self.entries:
            self._drop(key)
        self.entries[key] = snap
        self.lengths[snap.length] = self.lengths.get(snap.length, 0) + 1
        while len(self.entries) > self.max_entries:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        snap = self.entries.pop(key)
        self.lengths[snap.length] -= 1
        if not self.lengths[snap.length]:
            del self.lengths[snap.length]

    def find(
        self,
        tokens: list[int],
        block_size: int,
        block_hashes: list[int],
        n_full_blocks: int,
        max_length: int,
        exact_blocks: bool = True,
        accept: Callable[[Snapshot], bool] | None = None,
    ) -> Snapshot | None:
        """Longest snapshot that is a prefix of tokens, leaves at least one token to compute (length <=
        max_length), extends the first n_full_blocks matched full blocks (exactly those with
        `exact_blocks`, else at most those), and that `accept` takes."""
        for length in sorted(self.lengths, reverse=True):
            blocks = length // block_size
            if length > max_length or blocks > n_full_blocks or (exact_blocks and blocks != n_full_blocks):
                continue
            key = prefix_key(tokens, length, block_size, block_hashes)
            snap = self.entries.get(key)
            if snap is not None and snap.length == length:
                if snap.window_valid and self.clock() - snap.created > self.ttl_s:
                    snap.window_valid = False
                    snap.state = {k: v for k, v in snap.state.items() if k == "group"}
                if accept is not None and not accept(snap):
                    continue
                self.entries.move_to_end(key)
                return snap
        return None
