"""Attention for a batch of decode tokens, one per sequence, in one set of tensor ops (spec-v41.md §3, §4).

The per-chunk path (`Attention.attend` against a `SequenceCache`) costs a few dozen small tensor ops per
sequence per layer, which dominates decode once many sequences run together. Here the same computation
is done for B sequences at once, each at its own position: window rings are read from and written to the
shared `StatePool` by slot, compressed entries and index keys are gathered from the paged pool through a
padded block-table tensor, ratio-2 compressors keep their partial groups in the pool (a token lands in
group slot pos % ratio; a full group is pooled, RoPE'd, rounded and stored), and the indexer scores each
sequence's visible entries (padding masked to -inf).

Numerics follow the per-chunk path operation for operation: the selection is padded to `index_topk`
entries (unusable picks last) and each row is attended at the width a lone decode would list, so a
sequence's result does not depend on the other sequences in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41 import ops
from dsv41.engine.kv_pool import PagedKVPool
from dsv41.engine.sequence import StatePool
from dsv41.model.attention import ring_ids
from dsv41.ops import attn_cpu
from dsv41.ops.quant import (
    FP4_BLOCK,
    KV_FP4_BLOCK,
    fp4_quant_rounded,
    fp8_dequant,
    fp8_quant,
)


@dataclass
class DecodeBatch:
    """Per-step metadata shared by all layers: positions, state slots, padded block tables, and what the
    layers would otherwise each recompute from them (window ids, ring slots, RoPE rows, attention widths),
    built on first use and kept for the step: they depend on the positions and a layer's shape only."""

    caches: list
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, max_blocks] int64, padded with each sequence's first block
    shared: dict = field(default_factory=dict)  # per-step selections: "topk" by index source, "candidate_blocks"
    memo: dict = field(default_factory=dict)  # per-step derived tensors, keyed by what they depend on
    # when a dict: each ratio>1 compressor leaves its fp32 rows (kv [B, D], score [B, D]) of this step
    # under its layer id (a speculative verify keeps them to rebuild partial groups after a rejection)
    record_rows: dict | None = None
    token_index: int = 0  # the members' token in their chunks: a forward's i-th decode step runs their i-th
    # `fast` numerics: the indexer's picks in torch.topk's order, any tie; else in canonical order
    fast: bool = False
    # the attention as one dense softmax over the window and the selected rows at a fixed width, masked
    # (`window_attention`, ops.dense_decode_attn): `fast` numerics, and `deterministic` ones with compiled tiles
    # (each row at the same width whatever the batch: batch-invariant by construction); else every op as the
    # per-chunk path computes it, each row at a lone decode's width
    dense: bool = False
    # the compiled regions of this batch's attention (dsv41.engine.compiled: the window attention, the indexer's
    # query, the compressors' entries): `fast` numerics' bucket, or the `deterministic` tiles'; None: eager
    regions: object = None
    # values a compiled block entry computed with the projections (dsv41.engine.compiled.enter), taken once by the
    # layer: ("index", layer) -> the indexer's (query heads, weights); ("latent", layer) -> a ratio-1 compressor's
    # packed new entries
    given: dict = field(default_factory=dict)

    @classmethod
    def build(cls, caches: list, positions: list[int], device) -> DecodeBatch:
        width = max(len(c.blocks) for c in caches)
        tables = torch.tensor(
            [c.blocks + [c.blocks[0]] * (width - len(c.blocks)) for c in caches], dtype=torch.int64, device=device
        )
        return cls(
            caches,
            torch.tensor(positions, device=device),
            torch.tensor([c.slot for c in caches], device=device),
            tables,
        )

    def _memo(self, key, make):
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = make()
        return value

    def window_ids(self, layer: int, window: int) -> torch.Tensor:
        """[B, 1, W] ids into cat(ring as it was, the new token), oldest first, -1 before the window's
        first position (layers share them unless a bounded replay gave them different firsts)."""
        first = tuple(c.first[layer] for c in self.caches)

        def make():
            at = self.positions.unsqueeze(1)  # each sequence's chunk is its one new token
            firsts = torch.tensor(first, device=at.device).unsqueeze(1)
            return ring_ids(at, at, firsts, window).unsqueeze(1)

        return self._memo(("window_ids", window, first), make)

    def window_valid(self, layer: int, window: int) -> torch.Tensor:
        """[B, W+1] True at the rows of cat(ring as it was, the new token) inside each query's window (the
        set `window_ids` lists, for a kernel that does not care about their order)."""
        first = tuple(c.first[layer] for c in self.caches)

        def make():
            ids = self.window_ids(layer, window)[:, 0]  # [B, W]
            hits = torch.zeros(ids.size(0), window + 1, dtype=torch.int16, device=ids.device)
            return hits.scatter_add_(1, ids.clamp_min(0), (ids >= 0).to(torch.int16)) > 0

        return self._memo(("window_valid", window, first), make)

    def chunk_window_valid(self, layer: int, window: int, starts: torch.Tensor, width: int) -> torch.Tensor:
        """For a batch whose rows are the tokens of multi-token chunks (`chunk_decode_attend`): [N, W + width]
        True at the rows of cat(ring as it was before the chunk, the chunk's `width` rows) inside each token's
        window. starts [N]: the first position of each token's chunk."""
        first = tuple(c.first[layer] for c in self.caches)

        def make():
            at = self.positions.unsqueeze(1)
            firsts = torch.tensor(first, device=at.device).unsqueeze(1)
            ids = ring_ids(at, starts.unsqueeze(1), firsts, window)  # [N, W] into cat(ring, chunk rows)
            hits = torch.zeros(ids.size(0), window + width, dtype=torch.int16, device=ids.device)
            return hits.scatter_add_(1, ids.clamp_min(0), (ids >= 0).to(torch.int16)) > 0

        return self._memo(("chunk_window_valid", window, first), make)

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distinct state slots [S], each row's index among them [B]): a batch whose rows are the tokens of
        multi-token chunks reads each sequence's state once."""
        return self._memo("sequences", lambda: self.slots.unique(return_inverse=True))

    def ring_slots(self, window: int) -> torch.Tensor:
        """[B] ring slot of each new token."""
        return self._memo(("ring_slots", window), lambda: self.positions % window)

    def rope(self, table) -> torch.Tensor:
        """RoPE rows [B, rope/2] of the new tokens in one of the model's tables."""
        return self._memo(("rope", id(table)), lambda: table.at(self.positions, self.positions.device))

    def lone_widths(self, ratio: int, k: int) -> list:
        """How a lone decode at each position lists its compressed entries: [] when every row is at the
        full width `k`, else (width, rows) groups of equal width."""

        def make():
            width = ((self.positions + 1) // ratio).clamp(max=k)  # [B]
            if bool((width == k).all()):
                return []
            return [(w, (width == w).nonzero().flatten()) for w in width.unique().tolist()]

        return self._memo(("lone_widths", ratio, k), make)

    def compressed_ids(self, offset: int, picked: torch.Tensor) -> torch.Tensor:
        """[B, 1, k] ids of the compressed rows (after `offset` window rows), -1 for unused picks; the
        layers reading one selection share them."""
        return self._memo(
            ("compressed_ids", offset, id(picked)),
            lambda: torch.where(picked >= 0, offset + torch.arange(picked.size(-1), device=picked.device), -1),
        )


def _rope_rows(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """RoPE for rows at different positions: x [B, 1, ...] with freqs [B, rope/2]."""
    return ops.apply_rope(x.transpose(0, 1), freqs, rope_dim).transpose(0, 1)


def _scale_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """UE8M0 bits (uint8, 1..254) -> the fp32 power of two 2^(bits - 127) they stand for, by an integer shift
    into an fp32's exponent field: inductor has no kernel for float8_e8m0fnu conversions (each became an
    ~80 us fallback call inside a compiled region)."""
    return (bits.to(torch.int32) << 23).view(torch.float32)


def _bits_of_scale(scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `_scale_of_bits` for fp32 powers of two (what `fp8_quant` returns as scales)."""
    return (scale.view(torch.int32) >> 23).to(torch.uint8)


def window_attention(q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale: float):
    """The `fast` decode attention of one layer: the FP8 window ring decoded, the new token's row appended
    and encoded for the ring, and the dense softmax over the window and the selected compressed rows
    (`ops.dense_decode_attn`). ring_codes [B, W, D] e4m3, ring_scale [B, W, D/FP8_BLOCK] uint8 (UE8M0 bits),
    kv [B, 1, D], valid [B, W + 1 (+ k)], selected [B, k, D] or None -> (o [B, 1, H, D] bf16, the new row's
    codes [B, D] and scale bits [B, D/FP8_BLOCK]). Also a compiled region (dsv41.engine.compiled)."""
    ring = fp8_dequant(ring_codes, _scale_of_bits(ring_scale)).to(kv.dtype)
    rows = torch.cat([ring, kv] if selected is None else [ring, kv, selected], dim=1)
    codes, new_scale = fp8_quant(kv[:, 0])
    o = ops.dense_decode_attn(q, rows, valid, attn_sink, softmax_scale)
    return o, codes, _bits_of_scale(new_scale)


def index_query(idx, qr: torch.Tensor, x: torch.Tensor, freqs: torch.Tensor):
    """The indexer's per-token work of a decode step: its RoPE'd, FP4-rounded query heads [B, 1, h, d] and
    head weights [B, 1, h]. freqs [B, rope/2] (one position per row). Also a compiled region."""
    q = idx.wq_b(qr).unflatten(-1, (idx.n_heads, idx.head_dim))
    return ops.fp4_qdq(_rope_rows(q, freqs, idx.rope_dim), FP4_BLOCK, "ue8m0"), idx.weights_proj(x) * idx.weight_scale


def compress_group(attn, x: torch.Tensor, group_kv: torch.Tensor, group_score: torch.Tensor, slot, freqs):
    """A ratio > 1 compressor's per-token work of a decode step, for every row as if its token completed its
    group: x [B, 1, dim]; group_kv and group_score [B, ratio, D] fp32 (each sequence's kept partial group);
    slot [B] int64 (the token's place in its group); freqs [B, rope/2] (RoPE rows of each group's first
    position) -> (the token's fp32 rows kv, score [B, D]; `pack_entries` of each row's group with this token in
    it). The caller keeps the packed entries of the rows whose token does complete a group. Also a compiled
    region (dsv41.engine.compiled)."""
    comp = attn.compressor
    kv, score = comp.wkv(x.float())[:, 0], comp.wgate(x.float())[:, 0]  # [B, D] fp32
    mine = (torch.arange(group_kv.size(1), device=x.device) == slot.unsqueeze(1)).unsqueeze(-1)  # [B, ratio, 1]
    g_kv = torch.where(mine, kv.unsqueeze(1), group_kv)
    g_score = torch.where(mine, score.unsqueeze(1), group_score)
    latent = comp.norm((g_kv * g_score.softmax(dim=1)).sum(dim=1).to(x.dtype))  # [B, D]
    return kv, score, pack_entries(attn, latent, freqs)


def pack_entries(attn, latent: torch.Tensor, freqs: torch.Tensor):
    """Completed groups' latents [C, D] at their RoPE rows freqs [C, rope/2] -> their packed FP4 KV (codes,
    scales) and, where the layer owns index keys, their packed FP4 keys (codes, scales), else None. The KV is
    quantised once from the unrounded latent: its codes decode to exactly the model's fp4_qdq values."""
    latent = latent.unsqueeze(0)  # [1, C, D]: one row of C groups at their own positions
    keys = attn.indexer.make_keys(latent, freqs)[0] if attn.indexer is not None else None
    kv = ops.fp4_quant(ops.apply_rope(latent, freqs, attn.rope_dim)[0], KV_FP4_BLOCK, "e4m3")
    return kv, None if keys is None else fp4_quant_rounded(keys, FP4_BLOCK, "ue8m0")


def decode_attend(
    attn,
    x: torch.Tensor,
    qr: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: DecodeBatch,
    states: StatePool,
    pool: PagedKVPool,
) -> torch.Tensor:
    """x [B, 1, dim], qr [B, 1, q_lora], q [B, 1, H, D] and kv [B, 1, D] (RoPE'd, FP8-rounded) for one new
    token per sequence. Returns [B, 1, H, D] like `Attention.attend`."""
    layer, w = attn.layer_id, attn.window
    slots = batch.slots
    if batch.dense:  # the window and the selected rows as one dense softmax, compiled where the step has regions
        valid = batch.window_valid(layer, w)  # [B, W+1]
        selected = None
        if attn.ratio:
            picked, selected = _compressed(attn, x, qr, batch, states, pool)
            valid = torch.cat([valid, picked[:, 0] >= 0], dim=1)
        at = batch.ring_slots(w)
        if batch.regions is not None and batch.regions.attn_kernel:
            # the C++ kernel reads each ring and writes the new row where they lie: no gathered copies
            return attn_cpu.decode_ring_attn_cpu(
                q,
                states.window_codes,
                states.window_scale,
                slots,
                layer,
                at,
                kv,
                valid,
                selected,
                attn.attn_sink,
                attn.softmax_scale,
            )
        attend = window_attention if batch.regions is None else batch.regions.window_attention
        o, codes, scale = attend(
            q,
            states.window_codes[slots, layer],
            states.window_scale[slots, layer],
            kv,
            valid,
            selected,
            attn.attn_sink,
            attn.softmax_scale,
        )
        states.window_codes[slots, layer, at] = codes
        states.window_scale[slots, layer, at] = scale
        return o

    # window: the ring as it was, then the new token; ids oldest first, -1 before the window's first position
    ring = fp8_dequant(
        states.window_codes[slots, layer], states.window_scale[slots, layer].view(torch.float8_e8m0fnu).float()
    ).bfloat16()
    rows = torch.cat([ring, kv], dim=1)  # [B, W+1, D]
    ids = batch.window_ids(layer, w)  # [B, 1, W]
    codes, scale = fp8_quant(kv[:, 0])
    at = batch.ring_slots(w)
    states.window_codes[slots, layer, at] = codes
    states.window_scale[slots, layer, at] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)

    if not attn.ratio:
        return ops.paged_sparse_attn(
            q,
            rows,
            ids,
            None,
            batch.tables,
            None,
            attn.attn_sink,
            attn.softmax_scale,
            heads_per_call=attn.heads_per_call,
        )
    picked, selected = _compressed(attn, x, qr, batch, states, pool)
    # a lone decode lists min(index_topk, visible entries) selected slots, and the attention's block sums
    # depend on that width; so rows are attended in groups of equal width, each at its own width (most
    # rows, past index_topk entries, share the full one)
    return ops.paged_sparse_attn(
        q,
        rows,
        ids,
        pool.pages(attn.kv_source),
        batch.tables,
        picked,
        attn.attn_sink,
        attn.softmax_scale,
        batch.lone_widths(attn.ratio, picked.size(-1)),
        selected,
        attn.heads_per_call,
    )


def chunk_decode_attend(
    attn,
    x: torch.Tensor,
    qr: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    flat: DecodeBatch,
    starts: torch.Tensor,
    chunk_rows: torch.Tensor,
    steps: list,
    states: StatePool,
    pool: PagedKVPool,
) -> torch.Tensor:
    """`fast` numerics: the tokens of several sequences' chunks of consecutive new positions (speculative
    verify chunks, decode tokens) attended in one set of ops, rather than as one decode step per position.
    x [N, 1, dim], qr, q [N, 1, H, D], kv [N, 1, D] for the N tokens, chunk after chunk; flat: a `DecodeBatch`
    whose rows are those tokens (each with its sequence's cache, slot and block table); starts [N]: each
    token's chunk start; chunk_rows [N, n]: for each token, the rows of its chunk's tokens (the last repeated
    past the chunk's end); steps: (batch, rows) for position i of every chunk, in order.

    What one position writes and a later one reads is kept in position order: the compressors write every
    entry the chunks complete first (a ratio-1 compressor in one call, a ratio-2 one by `_compress_chunks`,
    with each step's rows recorded for a verify's rollback), and the indexer lets each token see only the
    entries complete at its position. Each token reads its window as cat(the ring as it was before the
    chunk, the chunk's own rows) masked to its positions; the ring gets every token's row last.
    Returns [N, 1, H, D]."""
    layer, w = attn.layer_id, attn.window
    valid = flat.chunk_window_valid(layer, w, starts, chunk_rows.size(1))  # [N, W + n]
    selected = None
    if attn.ratio:
        if attn.ratio == 1 and attn.compressor is not None:  # each token completes its own group: one call
            _compress(attn, x, flat, states, pool)
        elif attn.compressor is not None:
            kv_rows, score_rows = _compress_chunks(attn, x, flat, starts, chunk_rows[:, 0], states, pool)
            for batch, rows in steps:  # what each step's `_compress` would have recorded (a verify's rollback)
                if batch.record_rows is not None:
                    batch.record_rows[layer] = (kv_rows[rows], score_rows[rows])
        if attn.indexer is not None:
            flat.shared.setdefault("topk", {})[layer] = _select(attn, x, qr, flat, pool)
        picked = flat.shared["topk"][attn.index_source]  # [N, 1, index_topk]
        gathered = flat.shared.setdefault("gathered", {})
        key = (attn.kv_source, attn.index_source)
        if key not in gathered:
            gathered[key] = ops.gather_picked(pool.pages(attn.kv_source), flat.tables, picked)  # [N, k, D]
        selected = gathered[key]
        valid = torch.cat([valid, picked[:, 0] >= 0], dim=1)
    seq_slots, seq_of = flat.sequences()
    ring_codes, ring_bits = states.window_codes[seq_slots, layer], states.window_scale[seq_slots, layer]  # [S, W, ...]
    chunk = kv[:, 0][chunk_rows]  # [N, n, D] the chunk's rows: each token's own, earlier ones
    if flat.regions is not None and flat.regions.attn_kernel:  # each token's rows read where they lie, in C++
        o = attn_cpu.chunk_attn_cpu(
            q, ring_codes, ring_bits, seq_of, chunk, valid, selected, attn.attn_sink, attn.softmax_scale
        )
    else:
        # the rings decoded once per sequence (not per token), as `window_attention` decodes them; the rows kept
        # in fp32, which holds every FP8 and bf16 value exactly (`dense_decode_attn` computes in fp32 anyway)
        ring = fp8_dequant(ring_codes, _scale_of_bits(ring_bits))[seq_of]  # [N, W, D] fp32
        parts = [ring, chunk.float()]
        rows = torch.cat(parts if selected is None else parts + [selected.float()], dim=1)
        o = ops.dense_decode_attn(q, rows, valid, attn.attn_sink, attn.softmax_scale)
    slots = flat.slots
    codes, scale = fp8_quant(kv[:, 0])
    at = flat.ring_slots(w)  # distinct per sequence while a chunk is no longer than the window
    states.window_codes[slots, layer, at] = codes
    states.window_scale[slots, layer, at] = _bits_of_scale(scale)
    return o


def _compress_chunks(attn, x, flat: DecodeBatch, starts, first_row, states: StatePool, pool: PagedKVPool):
    """A ratio>1 compressor over the tokens of multi-token chunks (`chunk_decode_attend`) in one set of ops,
    leaving the pool and the partial groups as `_compress` does position after position: each group a token
    completes pools its members from the chunk's rows or, for positions before the chunk, from the partial
    group kept in the state; the state then keeps the positions after each sequence's last completed group.
    first_row [N]: the row of each token's chunk's first token. Returns the fp32 rows (kv, score) [N, D]."""
    comp, ratio, layer = attn.compressor, attn.ratio, attn.layer_id
    pos, slots = flat.positions, flat.slots
    kv, score = comp.wkv(x.float())[:, 0], comp.wgate(x.float())[:, 0]  # [N, D] fp32
    group_kv, group_score = states.group_kv[layer], states.group_score[layer]  # [slots, ratio, D]
    done = (pos % ratio == ratio - 1).nonzero().flatten()
    if done.numel():
        start = starts[done].unsqueeze(1)
        members = pos[done].unsqueeze(1) - (ratio - 1) + torch.arange(ratio, device=pos.device)  # [C, ratio]
        ours = (members >= start).unsqueeze(-1)  # a member computed in this forward, else kept in the state
        row = first_row[done].unsqueeze(1) + (members - start).clamp_min(0)
        kept = slots[done]
        g_kv = torch.where(ours, kv[row], group_kv[kept])  # [C, ratio, D]: member j at state slot j
        g_score = torch.where(ours, score[row], group_score[kept])
        latent = comp.norm((g_kv * g_score.softmax(dim=1)).sum(dim=1).to(x.dtype))  # [C, D]
        group = pos[done] // ratio
        packed, keys = pack_entries(attn, latent, attn.rope.at(group * ratio, x.device))
        pool.write_packed(layer, pool.rows_batched(layer, flat.tables[done], group.unsqueeze(1))[:, 0], packed, keys)
        # a sequence whose chunk completed a group starts its state afresh after the last one
        group_score[kept] = -torch.inf
        group_kv[kept] = 0.0
        seq_slots, seq_of = flat.sequences()
        last = torch.full_like(seq_slots, -1).scatter_reduce_(0, seq_of[done], pos[done], "amax")
        after = (pos > last[seq_of]).nonzero().flatten()
    else:
        after = torch.arange(pos.numel(), device=pos.device)
    group_kv[slots[after], pos[after] % ratio] = kv[after]
    group_score[slots[after], pos[after] % ratio] = score[after]
    return kv, score


def _compressed(attn, x, qr, batch: DecodeBatch, states: StatePool, pool: PagedKVPool):
    """This step's selection [B, 1, k] for the layer's kv source and, once per (source, selection), the
    selected entries' KV [B, k, D]: Reuse layers attend exactly what their source attended."""
    src = attn.kv_source
    if attn.compressor is not None:
        _compress(attn, x, batch, states, pool)
    if attn.indexer is not None:
        batch.shared.setdefault("topk", {})[attn.layer_id] = _select(attn, x, qr, batch, pool)
    picked = batch.shared["topk"][attn.index_source]  # [B, 1, index_topk] entry ids, -1 unused
    gathered = batch.shared.setdefault("gathered", {})
    key = (src, attn.index_source)
    if key not in gathered:
        gathered[key] = ops.gather_picked(pool.pages(src), batch.tables, picked)  # [B, k, D]
    return picked, gathered[key]


def _compress(attn, x, batch: DecodeBatch, states: StatePool, pool: PagedKVPool) -> None:
    """Add each sequence's token to its compressor; store the latents of the groups it completes."""
    comp, ratio, layer = attn.compressor, attn.ratio, attn.layer_id
    pos, slots = batch.positions, batch.slots
    given = batch.given.pop(("latent", layer), None)  # computed with the projections (compiled.enter)
    if ratio == 1 and (given is not None or batch.regions is not None):  # every token completes its group: compiled
        kv, keys = given if given is not None else batch.regions.compress_latent(attn, x, batch.rope(attn.rope))
        pool.write_packed(layer, pool.rows_batched(layer, batch.tables, pos.unsqueeze(1))[:, 0], kv, keys)
        return
    if ratio == 1:
        latent, done = comp.norm(comp.wkv(x)), torch.ones_like(pos, dtype=torch.bool)  # [B, 1, D]
        latent = latent[:, 0]
    else:
        slot_in_group = pos % ratio
        region = None if batch.regions is None else batch.regions.compress_group
        if region is not None:  # one compiled region: the rows, and every row's group as if it completed it
            kv, score, (packed, keys) = region(
                attn,
                x,
                states.group_kv[layer][slots],
                states.group_score[layer][slots],
                slot_in_group,
                attn.rope.at(pos // ratio * ratio, x.device),
            )
        else:
            kv, score = comp.wkv(x.float())[:, 0], comp.wgate(x.float())[:, 0]  # [B, D] fp32
        if batch.record_rows is not None:
            batch.record_rows[layer] = (kv, score)
        states.group_kv[layer][slots, slot_in_group] = kv
        states.group_score[layer][slots, slot_in_group] = score
        done = slot_in_group == ratio - 1
        if not bool(done.any()):
            return
        full = slots[done]
        if region is None:
            group_kv, group_score = states.group_kv[layer][full], states.group_score[layer][full]  # [C, ratio, D]
            latent = comp.norm((group_kv * group_score.softmax(dim=1)).sum(dim=1).to(x.dtype))  # [C, D]
        states.group_score[layer][full] = -torch.inf
        states.group_kv[layer][full] = 0.0
        if region is not None:  # the completed groups' entries, as the region packed them
            packed = tuple(t[done] for t in packed)
            keys = None if keys is None else tuple(t[done] for t in keys)
            rows = pool.rows_batched(layer, batch.tables[done], (pos[done] // ratio).unsqueeze(1))[:, 0]
            pool.write_packed(layer, rows, packed, keys)
            return
    group = pos[done] // ratio
    kv, keys = pack_entries(attn, latent, attn.rope.at(group * ratio, x.device))  # stamped with its first token
    pool.write_packed(layer, pool.rows_batched(layer, batch.tables[done], group.unsqueeze(1))[:, 0], kv, keys)


def _select(attn, x, qr, batch: DecodeBatch, pool: PagedKVPool) -> torch.Tensor:
    """Indexer top-k for each sequence's new token -> entry ids [B, 1, index_topk] (-1 unused).

    A Reindex layer scores only the entries of the candidate blocks its candidate source picked this
    step (the hierarchical indexer, spec §4), so its cost does not grow with the context."""
    idx, src, ratio = attn.indexer, attn.kv_source, attn.ratio
    pos = batch.positions
    b = pos.numel()
    visible = (pos + 1) // ratio  # [B] complete groups each query sees
    t = int(visible.max())
    given = batch.given.pop(("index", attn.layer_id), None)
    if t == 0:
        return torch.full((b, 1, idx.topk), -1, dtype=torch.int64, device=pos.device)
    if given is not None:
        q, weights = given
    else:
        freqs = batch.rope(attn.rope)
        q, weights = (index_query if batch.regions is None else batch.regions.index_query)(idx, qr, x, freqs)
    if idx.uses_candidates:  # the entries of the candidate blocks the candidate source picked this step
        entries, usable = ops.candidate_entries(
            batch.shared["candidate_blocks"], visible.view(b, 1, 1), idx.candidate_block_size
        )
        scores = ops.paged_index_scores(q, weights, pool.pages(src), batch.tables, visible, entries, usable)
    else:  # every visible entry, a whole block of keys at a time
        scores = ops.paged_index_scores(q, weights, pool.pages(src), batch.tables, visible)  # [B, 1, t]
        entries = torch.arange(t, device=pos.device).expand(b, 1, t)
    if idx.is_candidate_source:
        batch.shared["candidate_blocks"] = ops.candidate_blocks(
            scores,
            visible.view(b, 1, 1),
            idx.candidate_blocks,
            idx.candidate_block_size,
            idx.canonical_ties and not batch.fast,
        )
    k = min(idx.topk, scores.size(-1))
    if batch.fast:  # the attention reads the picks as a set (ops.dense_decode_attn): any order, any tie
        top = scores.topk(k, dim=-1, sorted=False).indices
        picked = torch.where(scores.gather(-1, top) > -torch.inf, entries.gather(-1, top), -1)
        return torch.nn.functional.pad(picked, (0, idx.topk - k), value=-1) if k < idx.topk else picked
    if idx.canonical_ties:  # ties by entry position, not by where the gather put an entry in this row
        top = ops.topk_canonical(scores, k, positions=entries if idx.uses_candidates else None)
    else:
        top = scores.topk(k, dim=-1, sorted=False).indices
    picked, usable_pick = entries.gather(-1, top), scores.gather(-1, top) > -torch.inf
    # ascending positions with the unusable picks last (then -1), like the per-chunk path: a row of the
    # batch whose candidates are fewer than k picks padding entries, and sorting those in among the real
    # ones would interleave -1s and change its attention's reduction order with the batch (issue 15)
    order = torch.where(usable_pick, picked, torch.iinfo(torch.int64).max).argsort(dim=-1)
    picked = torch.where(usable_pick.gather(-1, order), picked.gather(-1, order), -1)
    if picked.size(-1) < idx.topk:  # a fixed width keeps each row's attention independent of the batch
        picked = torch.nn.functional.pad(picked, (0, idx.topk - picked.size(-1)), value=-1)
    return picked
