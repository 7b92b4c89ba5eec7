"""The engine's attention backend (dsv41.model.forward.AttentionBackend) for one ragged forward: the scheduled
chunks laid out as one row of T tokens, each sequence's keys in the paged pool (spec-v41.md §3, §4, §2.1).

The model's layer loop hands every block's normed attention input here. The projections run once over all T
tokens; the sequence mixing runs per prefill chunk against that sequence's own cache (`Attention.attend` on
a `SequenceCache`), and decode tokens, or the tokens of speculative verify chunks, as batched decode steps
(dsv41.engine.batched.decode_attend). At the decoder boundary `trim` implements the CED bounded replay:
positions below a chunk's `decoder_from` get the boundary layer's compressed entries and index keys from the
encoder output, and then leave the batch.
"""

from __future__ import annotations

import functools

import torch

from dsv41.engine.batched import DecodeBatch, chunk_decode_attend, decode_attend
from dsv41.model.forward import AttentionBackend


class PagedAttention(AttentionBackend):
    """One forward's chunks (`dsv41.engine.runner.Chunk`), their positions [T] and decode steps (a
    `DecodeBatch` and its member chunks per step), and the compiled decode regions when a `fast` decode batch
    has them. `per_chunk`: token-wise functions as if each chunk ran alone (the deterministic mode's lanes);
    `boundary`: the decoder's first layer."""

    def __init__(
        self,
        chunks: list,
        positions: torch.Tensor,
        steps: list[tuple[DecodeBatch, list]],
        regions=None,
        per_chunk: bool = False,
        boundary: int = -1,
    ):
        self.chunks, self.positions, self.steps, self.regions = chunks, positions, steps, regions
        self.per_chunk, self.boundary = per_chunk, boundary
        # `fast` numerics: the decode steps' tokens as one batch (`_chunked`), built on the first layer, and its
        # compiled regions (the indexer's query) where the runner has them for that many rows
        self.flat, self.flat_regions = None, None
        self.chunk_steps = True  # False: one decode step per position, as the other modes run them
        self.rope_rows: dict = {}  # id(RotaryTable) -> (positions, its RoPE rows), for this forward

    def token_calls(self) -> list[int] | None:
        """Each chunk's token count; a verify chunk's tokens each a call of one, as the decode steps that
        would have computed them (None outside the deterministic mode: the batch is one call)."""
        if not self.per_chunk:
            return None
        return [n for c in self.chunks for n in ([1] * len(c.tokens) if c.verify else [len(c.tokens)])]

    def trim(self, layer, h: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor | None:
        if layer.layer_id != self.boundary:
            return None
        keep = self._skip_decoder(layer, self.chunks, h, pre_mix)
        if keep is not None:
            self.positions = self.positions[keep]
            self.chunks = [c for c in self.chunks if c.tokens]
        return keep

    def _rope(self, attn, device) -> torch.Tensor:
        """The RoPE rows of this forward's positions in the layer's table, once per table (two tables: plain
        and YaRN layers) until the bounded-replay trim changes the positions."""
        rows = self.rope_rows.get(id(attn.rope))
        if rows is None or rows[0] is not self.positions:
            rows = self.rope_rows[id(attn.rope)] = (self.positions, attn.rope.at(self.positions, device))
        return rows[1]

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        """Projections over every token of the batch, then the sequence mixing: each chunk against its own
        cache, decode tokens (and stepped verify chunks) as batched decode steps over the paged pool."""
        attn, chunks, steps, regions = layer.attn, self.chunks, self.steps, self.regions
        freqs = self._rope(attn, x.device)
        qr, q, kv = attn.project(x, freqs) if regions is None else regions.project(attn, x, freqs)
        # the output projection by the same regions as the input's (the deterministic tiles' bits hold only if
        # every forward, prefill or decode, runs both through them)
        output = attn.output if regions is None else functools.partial(regions.output, attn)
        if not steps:
            outs, a = [], 0
            for c in chunks:
                b = a + len(c.tokens)
                outs.append(attn.attend(x[:, a:b], qr[:, a:b], q[:, a:b], kv[:, a:b], c.start, c.cache, c.shared))
                a = b
            return output(torch.cat(outs, dim=1), freqs)
        caches = steps[0][1][0].cache
        states, pool = caches.states, caches.pool
        if self.decode_only:  # token i is sequence i
            return output(self.decode_mix(attn, x, qr, q, kv), freqs)
        out = q.new_empty(q.shape)  # [1, T, H, D]
        offset, a = {}, 0
        for c in chunks:
            b = a + len(c.tokens)
            if c.decode or c.stepped:
                offset[id(c)] = a
            else:
                out[:, a:b] = attn.attend(x[:, a:b], qr[:, a:b], q[:, a:b], kv[:, a:b], c.start, c.cache, c.shared)
            a = b
        kept = _verify_group_rows(attn, steps, states)
        if self._chunked(steps, offset, attn.window, x.device):
            rows = self.flat_rows
            step_rows = []
            for (batch, _), index in zip(steps, self.step_index):
                batch.record_rows = {} if kept else None
                step_rows.append((batch, index))
            out[0, rows] = chunk_decode_attend(
                attn,
                *_tokens_at(rows, x, qr, q, kv),
                self.flat,
                self.flat_starts,
                self.chunk_rows,
                step_rows,
                states,
                pool,
            )[:, 0]
            if kept:
                for batch, members in steps:
                    _keep_step_rows(kept, batch, members, attn.layer_id)
            steps = []  # done
        for batch, members in steps:
            at = torch.tensor([offset[id(c)] + batch.token_index for c in members], device=x.device)
            batch.record_rows = {} if kept else None
            out[0, at] = decode_attend(
                attn,
                *_tokens_at(at, x, qr, q, kv),
                batch,
                states,
                pool,
            )[:, 0]
            if kept:
                _keep_step_rows(kept, batch, members, attn.layer_id)
        for c in chunks:
            if id(c) in kept:
                first, kvs, scores = kept[id(c)]
                c.cache.keep_group_rows(
                    attn.layer_id, first, torch.cat(kvs).unsqueeze(0), torch.cat(scores).unsqueeze(0)
                )
        return output(out, freqs)

    @property
    def decode_only(self) -> bool:
        """The forward is one decode step of its sequences: token i is sequence i's new token."""
        steps = self.steps
        return len(steps) == 1 and len(steps[0][1]) == len(self.positions)

    def freqs(self, attn) -> torch.Tensor:
        """The RoPE rows [T, rope/2] of this forward's positions in the layer's table."""
        return self._rope(attn, self.positions.device)

    def decode_mix(self, attn, x, qr, q, kv, index=None, latent=None) -> torch.Tensor:
        """A decode-only forward's sequence mixing, projections given: x [1, B, dim], qr, q [1, B, H, D], kv
        -> o [1, B, H, D] before the output projection. index: the indexer's (query heads, weights) and latent:
        a ratio-1 compressor's packed new entries, where the caller computed them with the projections
        (`compiled.enter`)."""
        batch = self.steps[0][0]
        if index is not None:
            batch.given[("index", attn.layer_id)] = index
        if latent is not None:
            batch.given[("latent", attn.layer_id)] = latent
        cache = self.steps[0][1][0].cache
        states, pool = cache.states, cache.pool
        rows = lambda t: t[0].unsqueeze(1)  # noqa: E731 - [1, B, ...] -> [B, 1, ...]
        o = decode_attend(attn, rows(x), rows(qr), rows(q), rows(kv), batch, states, pool)  # [B, 1, H, D]
        return o.view(1, o.size(0), *o.shape[2:])

    def _chunked(self, steps: list, offset: dict, window: int, device) -> bool:
        """Whether the decode steps run as one `chunk_decode_attend` (`fast` numerics, every chunk no longer
        than the window), building its metadata on the first layer: the tokens' rows in the forward, a
        `DecodeBatch` over them, each token's chunk start and chunk rows, each step's rows among them."""
        if not steps[0][0].fast or not self.chunk_steps:
            return False
        if self.flat is None:
            members = steps[0][1]  # every stepped chunk has a token in the first step
            n = len(steps)
            if n > window:
                self.flat = False
                return False
            caches, positions, starts, chunk_rows = [], [], [], []
            first_row: dict = {}
            for c in members:
                first_row[id(c)] = len(caches)
                for i in range(len(c.tokens)):
                    caches.append(c.cache)
                    positions.append(c.start + i)
                    starts.append(c.start)
                    chunk_rows.append([first_row[id(c)] + min(j, len(c.tokens) - 1) for j in range(n)])
            self.flat = DecodeBatch.build(caches, positions, device)
            self.flat.fast = self.flat.dense = True
            self.flat.regions = self.flat_regions
            self.flat_offsets = None
            self.flat_starts = torch.tensor(starts, device=device)
            self.chunk_rows = torch.tensor(chunk_rows, device=device)
            self.step_index = [
                torch.tensor([first_row[id(c)] + i for c in members_i], device=device)
                for i, (_, members_i) in enumerate(steps)
            ]
        if self.flat is False:
            return False
        members = steps[0][1]
        offsets = [offset[id(c)] for c in members]
        if offsets != self.flat_offsets:  # the tokens' rows in this layer's batch (a bounded replay may trim)
            self.flat_offsets = offsets
            rows = [a + i for a, c in zip(offsets, members) for i in range(len(c.tokens))]
            self.flat_rows = torch.tensor(rows, device=device)
        return True

    def _skip_decoder(self, layer, chunks: list, h: torch.Tensor, pre_mix: torch.Tensor):
        """For positions below each chunk's decoder_from: write the boundary layer's compressed entries
        and index keys from the encoder output, then drop them. Returns the kept token indices, or None."""
        attn = layer.attn
        keep, a, dropped = [], 0, False
        for c in chunks:
            n = len(c.tokens)
            skip = min(max(c.decoder_from - c.start, 0), n)
            if skip:
                dropped = True
                if attn.compressor is not None:
                    attn.write_compressed(
                        layer.attn_input(h[:, a : a + skip], pre_mix[:, a : a + skip]), c.start, c.cache
                    )
                c.tokens, c.start = c.tokens[skip:], c.start + skip
                if not c.tokens:
                    c.want_logits = False
            keep.extend(range(a + skip, a + n))
            a += n
        if not dropped:
            return None
        return torch.tensor(keep, dtype=torch.int64, device=h.device)


def _tokens_at(at: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Tokens `at` of each [1, T, ...] tensor as one sequence each: [len(at), 1, ...]."""
    return [t[0, at].unsqueeze(1) for t in tensors]


def _keep_step_rows(kept: dict, batch, members: list, layer: int) -> None:
    """Append the fp32 rows (kv, score) [B_i, D] a decode step's compressor recorded to each kept chunk's lists."""
    kv_rows, score_rows = batch.record_rows[layer]
    for row, c in enumerate(members):
        if id(c) in kept:
            kept[id(c)][1].append(kv_rows[row : row + 1])
            kept[id(c)][2].append(score_rows[row : row + 1])


def _verify_group_rows(attn, steps, states) -> dict:
    """For a ratio>1 compressor: each verify chunk that may roll back (`SequenceCache.keep_group_rows`)
    gets its fp32 rows from its group's first position on: the group's pending rows as they are before
    the chunk, then (appended by the caller) the row each decode step computes. Keyed by id(chunk):
    (first position, kv rows, score rows)."""
    if attn.compressor is None or attn.ratio < 2:
        return {}
    layer, ratio, kept = attn.layer_id, attn.ratio, {}
    for c in (c for _, members in steps for c in members):  # (every chunk has its first token in some step)
        if c.verify and id(c) not in kept and c.cache.keep_group_rows is not None:
            pending, slot = c.start % ratio, c.cache.slot
            kept[id(c)] = (
                c.start - pending,
                [states.group_kv[layer][slot, :pending].clone()],
                [states.group_score[layer][slot, :pending].clone()],
            )
    return kept
