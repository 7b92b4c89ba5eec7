"""Prefix-cache-aware placement (issue 32): send a request to the worker (or data-parallel rank) that already
holds the start of its prompt, so a conversation's next turn finds its earlier turns in that worker's prefix
cache instead of being prefilled again elsewhere.

The model is SGLang's cache-aware router: each worker has an approximate record of the prompts sent to it;
a request goes to the worker whose record matches the longest start of its prompt when that match covers
at least `threshold` of the prompt and that worker is not overloaded (at most `balance_abs` more outstanding
requests than the least loaded one); otherwise to the least loaded worker. Either way the prompt is then
recorded for the chosen worker.

The record is a hash per leading block, not a radix tree: block k's key is a hash chained over blocks 0..k
(as the engine's own prefix cache keys its KV blocks), so "how many leading blocks does this worker have"
is one lookup per block. Blocks are `chunk` items of whatever the caller has: token ids on a data-parallel
front, characters of the request's prompt text on the router (which holds no tokenizer). Each worker keeps
at most `max_blocks` keys, least recently used dropped first (the worker's own cache evicts too, so this is
only ever an estimate: a wrong guess costs a cache miss, never a wrong answer).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class AffinityConfig:
    chunk: int = field(default=16, metadata={"help": "items (tokens or characters) per hashed block"})
    threshold: float = field(
        default=0.3,
        metadata={"help": "least fraction of the prompt a worker's record must match for the request to follow it"},
    )
    balance_abs: int = field(
        default=8,
        metadata={
            "help": "the cache's choice is dropped when it has this many more outstanding requests than the least loaded"
        },
    )
    max_blocks: int = field(default=65536, metadata={"help": "keys kept per worker (LRU)"})

    def validate(self) -> None:
        if self.chunk < 1 or self.max_blocks < 1 or self.balance_abs < 0 or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"bad prefix affinity settings: {self}")


def block_keys(items: Sequence, chunk: int) -> list[bytes]:
    """The chained key of every full leading block of `items` (ints or a str)."""
    keys, h = [], b""
    for start in range(0, len(items) - chunk + 1, chunk):
        block = items[start : start + chunk]
        data = block.encode() if isinstance(block, str) else repr(list(block)).encode()
        h = hashlib.blake2b(h + data, digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixAffinity:
    """Which worker has seen which prompt starts. Not thread-safe: call it from one thread or event loop."""

    def __init__(self, config: AffinityConfig | None = None):
        self.config = config or AffinityConfig()
        self.config.validate()
        self._seen: dict[Hashable, OrderedDict] = {}
        self.cache_choices = 0  # placements that followed a worker's record
        self.balance_choices = 0  # placements by load (no record matched enough, or its worker was too busy)

    def keys(self, items: Sequence) -> list[bytes]:
        return block_keys(items, self.config.chunk)

    def matched(self, worker: Hashable, keys: list[bytes]) -> int:
        """Leading blocks of `keys` that `worker` has been sent."""
        seen = self._seen.get(worker)
        n = 0
        if seen:
            for key in keys:
                if key not in seen:
                    break
                n += 1
        return n

    def choose(self, workers: Sequence[Hashable], keys: list[bytes], load: dict) -> Hashable:
        """The worker for a prompt with these block keys among `workers` (non-empty, in preference order for
        ties), given each one's outstanding requests; records the prompt for it."""
        least = min(workers, key=lambda w: load.get(w, 0))
        best, best_n = None, 0
        for w in workers:
            n = self.matched(w, keys)
            if n > best_n:
                best, best_n = w, n
        cfg = self.config
        if (
            best is not None
            and best_n >= cfg.threshold * len(keys)
            and load.get(best, 0) - load.get(least, 0) <= cfg.balance_abs
        ):
            choice = best
            self.cache_choices += 1
        else:
            choice = least
            self.balance_choices += 1
        self.record(choice, keys)
        return choice

    def record(self, worker: Hashable, keys: list[bytes]) -> None:
        seen = self._seen.setdefault(worker, OrderedDict())
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.config.max_blocks:
            seen.popitem(last=False)

    def forget(self, worker: Hashable) -> None:
        """A worker that went down (its cache is gone with it)."""
        self._seen.pop(worker, None)
