"""CSA2 attention: sliding window + compressed sparse attention (spec-v41.md §3, §4).

Every layer attends over its own 128-token window of raw KV. Layers with compress ratio > 0 also attend
to up to `index_topk` entries of a compressed cache, all in one `sparse_attn` call:
- Full layers (kv sources) own a `Compressor` (ratio-1 projection or ratio-2 softmax pooling) and an
  indexer that also derives index keys from the pre-RoPE latent;
- Reindex layers run their own indexer queries against the source's keys, restricted to the candidate
  pool built by the candidate-source layer (the hierarchical indexer);
- Reuse layers read the compressed KV and the top-k selection of the latest source.

Rounding points follow the reference: window KV FP8-rounded after RoPE, compressed KV rounded to E2M1
with E4M3 scales per 16 after RoPE, indexer q/k rounded to MXFP4 after RoPE; bf16 everywhere else
except the fp32 ratio-2 pooling.

Positions: a forward covers tokens start_pos..start_pos+S-1. The reference supports a prefill at 0 and
one-token decode; this module also accepts multi-token chunks at start_pos > 0 (chunked prefill), using
the decode ordering of window entries.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model.layers import Linear, RMSNorm
from dsv41.ops import attn_cpu, canonical, index_cpu
from dsv41.ops.qat import rounded
from dsv41.ops.quant import FP4_BLOCK, KV_FP4_BLOCK


class Compressor(nn.Module):
    """Turns the attention input into one 512-d latent per group of `ratio` tokens (spec §3.1).

    ratio 1: RMSNorm(wkv(x)) in bf16. ratio 2: kv = wkv(x), score = wgate(x) in fp32; a channel-wise
    softmax over each group's tokens weights the kv, then RMSNorm. Returns the pre-RoPE latent of each
    group completed in this call (or None); incomplete groups wait in the cache.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.ratio = cfg.compress_ratios[layer_id]
        self.layer_id = layer_id
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # the pooled path runs in fp32 (the reference promotes these bf16 weights to fp32)
        fmt = "fp32" if self.ratio > 1 else "bf16"
        self.wkv = Linear(cfg.dim, cfg.head_dim, fmt)
        if self.ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, fmt)
        self.reference_numerics = False  # canonical pooling softmax and sum (dsv41.ops.canonical)

    def forward(self, x: torch.Tensor, start_pos: int, cache) -> torch.Tensor | None:
        """x [B, S, dim] bf16 -> latents [B, G, head_dim] bf16 for the G groups completed, or None."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        b, s, _ = x.shape
        ratio = self.ratio
        kv, score = self.wkv(x.float()), self.wgate(x.float())  # [B, S, head_dim] fp32
        pending = start_pos % ratio  # tokens of the current group already seen
        state_kv, state_score = cache.group_state(self.layer_id)
        if pending:
            kv = torch.cat([state_kv[:b, :pending], kv], dim=1)
            score = torch.cat([state_score[:b, :pending], score], dim=1)
        keep = getattr(cache, "keep_group_rows", None)  # a cache that may roll back to inside this chunk
        if keep is not None:
            keep(self.layer_id, start_pos - pending, kv, score)
        n_groups = (pending + s) // ratio
        used = n_groups * ratio
        leftover = pending + s - used
        if leftover:
            state_kv[:b, :leftover] = kv[:, used:]
            state_score[:b, :leftover] = score[:, used:]
        if n_groups == 0:
            return None
        kv = kv[:, :used].unflatten(1, (n_groups, ratio))
        score = score[:, :used].unflatten(1, (n_groups, ratio))
        if self.reference_numerics:  # the softmax in float64, the fp32 products summed in float64
            pooled = canonical.sum(kv * canonical.softmax(score, dim=2), dim=2)
        else:
            pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Scores compressed positions for each query and keeps the top `index_topk` (spec §4).

    Index-key owners (kv sources) also turn the pre-RoPE latent into 128-d keys. The candidate source
    scores every visible position and publishes the candidate pool; Reindex layers score only inside it.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim = cfg.rope_head_dim
        self.topk = cfg.index_topk
        self.owns_keys = layer_id in cfg.kv_source_layers
        self.is_candidate_source = layer_id == cfg.candidate_source_layer
        self.uses_candidates = 0 <= cfg.candidate_source_layer < layer_id
        self.candidate_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        # top-k ties to the lowest position (layout-independent); False: torch.topk's, like the reference
        self.canonical_ties = True
        # canonical ties: score key blocks with a running top-k (False: materialise all scores; both tested equal)
        self.streaming = True
        self.score_budget = 1 << 22  # per-head scores held at once while streaming (tests shrink it)
        # pieces scored per merge: the [S, H, piece] intermediates stay small (the scoring is memory-bound)
        # while the top-k merge, whose cost is per call, runs once per merge_every pieces
        self.merge_every = 8
        # a chunk's scoring work (queries x keys) from which a Full layer's selection runs as one C++ kernel
        # on a CPU (dsv41.ops.index_cpu, the same picks; measured no slower from 512 keys x 1,024 queries): a
        # short prompt (a chat turn) never waits for the kernel's one-time build (~8 s a machine)
        self.cpu_kernel_min_pairs = 1 << 19
        # the stored format of the index keys: MXFP4 (the release, spec §8). False keeps them in bf16, only to
        # measure what FP4 storage costs (dsv41.eval.cost); the engine's packed pool stores E2M1, so it
        # needs True
        self.fp4_keys = True
        self.reference_numerics = False  # canonical scores and RoPE (dsv41.ops.canonical)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, cfg.dtype)
        self.weights_proj = Linear(cfg.dim, self.n_heads, "bf16")
        if self.owns_keys:
            self.wk = Linear(cfg.head_dim, self.head_dim, "bf16")
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    # the indexer's outputs are discrete (a selection) or only feed one: nothing of it needs a gradient in
    # the inference forward, also when that forward runs under autograd (dsv41.model.replay); the training
    # forward trains the indexer through its own KL path (dsv41.model.training)
    @torch.no_grad()
    def make_keys(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE latents [B, G, head_dim] -> index keys [B, G, index_head_dim], RoPE'd and MXFP4-rounded
        (bf16 when `fp4_keys` is off)."""
        k = ops.apply_rope(self.k_norm(self.wk(latent)), freqs, self.rope_dim, reference=self.reference_numerics)
        return ops.fp4_qdq(k, FP4_BLOCK, "ue8m0") if self.fp4_keys else k

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cache,
        source: int,
        n_keys: int,
        freqs: torch.Tensor,
        visible: torch.Tensor,
        offset: int,
        shared: dict,
    ) -> torch.Tensor:
        """x [B, S, dim], qr [B, S, q_lora]; the index keys are the first `n_keys` entries of layer `source`
        in `cache` (those visible to the last query); visible [S, 1] complete groups per query. Returns
        int32 [B, S, min(topk, n_keys)] row ids + offset, ascending, -1 for unusable picks."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.fp4_qdq(ops.apply_rope(q, freqs, self.rope_dim, reference=self.reference_numerics), FP4_BLOCK, "ue8m0")
        weights = self.weights_proj(x) * self.weight_scale
        k = min(self.topk, n_keys)
        if self.canonical_ties and self.streaming:
            return self._select_streaming(q, weights, cache, source, n_keys, visible, offset, k, shared)
        index_k = cache.read_index_keys(source, x.size(0), n_keys)
        scores = ops.mask_invisible(
            ops.index_scores(q, index_k, weights, self.reference_numerics), visible
        )  # [B, S, T]
        if self.is_candidate_source:
            shared["candidates"] = ops.candidate_pool(
                scores, visible, self.candidate_blocks, self.candidate_block_size, self.canonical_ties
            )
            _trace(shared, f"debug.layers.{self.layer_id}.candidates", shared["candidates"])
        elif self.uses_candidates:
            scores = scores.masked_fill(~shared["candidates"], -torch.inf)
        return ops.select_topk(scores, k, offset, self.canonical_ties)

    def _cpu_kernel_serves(self, q: torch.Tensor, pairs: int) -> bool:
        """Does the C++ kernel take this selection: a CPU with AVX512-VNNI, MXFP4 keys, not the reference's
        numerics, and enough work to pay (builds the kernel the first time it would)."""
        return (
            pairs >= self.cpu_kernel_min_pairs
            and self.fp4_keys
            and not self.reference_numerics
            and index_cpu.fits(q)
            and index_cpu.available()
        )

    def _select_streaming(
        self, q, weights, cache, source: int, n_keys: int, visible: torch.Tensor, offset: int, k: int, shared: dict
    ) -> torch.Tensor:
        """The same selection as the materialised path (tested equal) without ever holding scores for
        all keys: key blocks are read (dequantised) one at a time, scored and merged into a running top-k
        (`ops.merge_topk`); the candidate source keeps a running top-n of block maxima the same way; a
        Reindex layer scores only the entries of its candidate blocks. Memory per step does not grow with
        the context; time grows only through the Full layers' scoring."""
        b, s = q.shape[:2]
        device = q.device
        if self.uses_candidates:
            blocks = shared["candidate_blocks"]  # [B, S, n_blocks], from this forward's candidate source
            entries, usable = ops.candidate_entries(blocks, visible, self.candidate_block_size)  # [B, S, E]
            keys = cache.read_index_keys_at(source, b, entries.clamp_max(n_keys - 1))  # [B, S, E, D]
            scores = ops.index_scores_gathered(q, keys, weights).masked_fill(~usable, -torch.inf)
            top = ops.topk_canonical(scores, k, positions=entries)
            picked_scores, picked = scores.gather(-1, top), entries.gather(-1, top)
            # ascending positions, unusable picks last (their slots become -1 below)
            order = torch.where(picked_scores > -torch.inf, picked, torch.iinfo(torch.int64).max).argsort(dim=-1)
            picked, picked_scores = picked.gather(-1, order), picked_scores.gather(-1, order)
        elif not self.is_candidate_source and self._cpu_kernel_serves(q, s * n_keys):
            # all keys at once (the kernel packs them to int8 itself): 128 B an entry in bf16, 64 MB at 1M tokens
            keys = cache.read_index_keys(source, b, n_keys)  # [B, T, D]
            rows = visible.reshape(-1).expand(s)
            picked = torch.stack([index_cpu.index_topk_cpu(q[i], keys[i], weights[i], rows, k) for i in range(b)])
            return torch.where(picked >= 0, picked + offset, -1).int()
        else:
            # key blocks of about `score_budget` per-head scores, a whole number of candidate blocks
            size = self.candidate_block_size
            step = max(size, self.score_budget // max(b * s * self.n_heads, 1) // size * size)
            picked_scores = q.new_empty(b, s, 0)
            picked = torch.empty(b, s, 0, dtype=torch.int64, device=device)
            if self.is_candidate_source:
                newest = torch.div(visible - 1, size, rounding_mode="floor")  # [S, 1]: always kept
                n_top_blocks = min(self.candidate_blocks, -(-n_keys // size))
                block_scores = q.new_empty(b, s, 0)
                block_ids = torch.empty(b, s, 0, dtype=torch.int64, device=device)
            span = step * self.merge_every  # keys scored (in pieces of `step`) per merge into the top-k
            all_visible = int(visible.min())  # keys below this are visible to every query: nothing to mask
            for start in range(0, n_keys, span):
                end = min(n_keys, start + span)
                pos = torch.arange(start, end, device=device)
                scores = torch.cat(
                    [
                        ops.index_scores_mm(q, cache.read_index_keys(source, b, min(end, a + step), a), weights)
                        for a in range(start, end, step)
                    ],
                    dim=-1,
                )
                if end > all_visible:
                    scores = scores.masked_fill(pos >= visible, -torch.inf)  # [B, S, end - start]
                picked_scores, picked = ops.merge_topk(picked_scores, picked, scores, pos, k)
                if self.is_candidate_source:
                    ids = torch.arange(start // size, -(-end // size), device=device)
                    maxima = ops.block_maxima(scores, size)
                    if end > all_visible - size:  # a query's newest block may lie in this span
                        maxima = maxima.masked_fill(ids == newest, torch.inf)
                    block_scores, block_ids = ops.merge_topk(block_scores, block_ids, maxima, ids, n_top_blocks)
            if self.is_candidate_source:
                # `candidate_blocks` order: best first, ties to the lowest block; -1 where nothing is visible
                order = block_scores.argsort(dim=-1, descending=True, stable=True)
                block_scores, block_ids = block_scores.gather(-1, order), block_ids.gather(-1, order)
                shared["candidate_blocks"] = torch.where(block_scores > -torch.inf, block_ids, -1)
                if shared.get("trace") is not None:
                    _trace(
                        shared,
                        f"debug.layers.{self.layer_id}.candidates",
                        ops.blocks_to_mask(shared["candidate_blocks"], n_keys, size),
                    )
        # picks in ascending positions (the merge keeps position order, and a Full layer's -inf picks are
        # the invisible positions, after every visible one); -1 for those not visible or not in the pool
        return torch.where(picked_scores > -torch.inf, picked + offset, -1).int()


class Attention(nn.Module):
    """One layer's attention: q LoRA, window KV, optional compressed KV + top-k, sparse attention with a
    per-head sink, inverse RoPE on the output and the grouped output LoRA (spec §3 steps 1-6)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: ops.RotaryTable):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.window_size
        self.ratio = cfg.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim**-0.5
        self.kv_source = cfg.kv_source_of(layer_id)
        self.index_source = cfg.index_source_of(layer_id)
        self.rope = rope  # shared table; a plain attribute, not a submodule

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, cfg.dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, cfg.dtype)
        self.wkv = Linear(cfg.dim, self.head_dim, cfg.dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        # block-diagonal: group g maps its own heads (n_heads/o_groups x head_dim) to o_lora_rank
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, "bf16")
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, cfg.dim, cfg.dtype)
        self.compressor = Compressor(cfg, layer_id) if self.kv_source == layer_id else None
        self.indexer = Indexer(cfg, layer_id) if self.index_source == layer_id else None
        # the stored format of a kv source's compressed KV: E2M1 + E4M3 per 16 (the release, spec §8). False
        # keeps the latents in bf16, only to measure what FP4 storage costs (dsv41.eval.cost); the engine's
        # packed pool stores E2M1, so it needs True
        self.fp4_kv = True
        self.reference_numerics = False  # canonical sparse attention and RoPE (dsv41.ops.canonical)
        # `fast` numerics (the engine's default, Transformer.numerics(fast=True)): a prefill chunk's attention as
        # one fp32 softmax per query in C++ (dsv41.ops.attn_cpu), judged statistically like every fast kernel
        self.fast_kernels = False
        # > 0 (the engine's batch-invariant numerics): the attention's head products in GEMMs of one output
        # group's heads each, so tensor parallelism (whole groups per rank) gives one device's bits
        self.row_chunk = 0
        self.heads_per_group = cfg.n_heads // cfg.o_groups

    @property
    def heads_per_call(self) -> int:
        """Heads per attention GEMM (`ops.sparse_attn`): one output group's under batch-invariant numerics."""
        return self.heads_per_group if self.row_chunk else 0

    # ------------------------------------------------------------------ window
    def _window(self, kv: torch.Tensor, start_pos: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this chunk's window KV into the ring; return the rows the queries read and their ids.

        Returns (rows [B, N, head_dim], ids int32 [B, S, window]); a query at p sees
        max(first, p-window+1)..p, where first = `cache.window_first(layer)` is 0 except after a bounded
        replay (spec §2.1, §9), which rebuilds the rings from a later position.
        """
        b, s, _ = kv.shape
        w = self.window
        first_valid = cache.window_first(self.layer_id)
        device = kv.device
        pos = torch.arange(start_pos, start_pos + s, device=device).unsqueeze(1)  # [S, 1]
        if start_pos == first_valid:
            # fresh window: rows are the chunk itself; valid ids first, then -1
            rows = kv
            rel = pos - start_pos
            ids = (rel - w + 1).clamp_min(0) + torch.arange(min(s, w), device=device)
            ids = torch.where(ids > rel, -1, ids)
        else:
            # continuing: rows are the ring as it was (older positions) followed by the chunk, and each
            # query lists its window oldest first with not-yet-existing positions as -1 (decode order)
            rows = torch.cat([cache.window_read(self.layer_id, b), kv], dim=1)
            ids = ring_ids(pos, start_pos, first_valid, w)  # [S, W]
        keep = min(s, w)
        slots = torch.arange(start_pos + s - keep, start_pos + s, device=device) % w
        cache.window_write(self.layer_id, b, slots, kv[:, s - keep :])
        return rows, ids.int().unsqueeze(0).expand(b, -1, -1)

    # ------------------------------------------------------------------ compressed
    def _compressed(
        self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, offset: int, cache, shared: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the compressed cache if this layer is a kv source, then pick the entries each query
        reads. Returns (rows [B, T, head_dim], ids int32 [B, S, k] into cat(window, rows))."""
        b, s, _ = x.shape
        ratio = self.ratio
        end = start_pos + s
        n_visible = end // ratio  # complete groups visible to the last query
        if self.compressor is not None:
            self.write_compressed(x, start_pos, cache)
            if shared.get("trace") is not None:
                _trace(
                    shared,
                    f"debug.layers.{self.layer_id}.compress_kv",
                    cache.read_compressed(self.kv_source, b, n_visible),
                )
                _trace(
                    shared, f"debug.layers.{self.layer_id}.index_k", cache.read_index_keys(self.kv_source, b, n_visible)
                )

        if self.indexer is not None:
            if n_visible == 0:
                ids = torch.empty(b, s, 0, dtype=torch.int32, device=x.device)
            else:
                visible = (torch.arange(start_pos + 1, end + 1, device=x.device) // ratio).unsqueeze(-1)
                freqs = self.rope(start_pos, s, x.device)
                ids = self.indexer(x, qr, cache, self.kv_source, n_visible, freqs, visible, offset, shared)
            shared.setdefault("topk", {})[self.layer_id] = ids
            _trace(shared, f"debug.layers.{self.layer_id}.topk_idxs", torch.where(ids >= 0, ids - offset, -1))
        else:
            ids = shared["topk"][self.index_source]
        return cache.read_selected(self.kv_source, b, n_visible, ids, offset)

    def write_compressed(self, x: torch.Tensor, start_pos: int, cache) -> None:
        """Run this kv source's compressor over x (tokens start_pos..) and store the completed groups'
        latents (RoPE'd, E2M1-rounded) and index keys (MXFP4-rounded) in the cache."""
        latent = self.compressor(x, start_pos, cache)
        if latent is None:
            return
        ratio = self.ratio
        first = start_pos // ratio
        n_new = latent.size(1)
        group_pos = torch.arange(first, first + n_new) * ratio  # a group is stamped with its first token
        freqs = self.rope.at(group_pos, x.device)
        keys = self.indexer.make_keys(latent, freqs) if self.indexer is not None else None
        # straight-through under autograd (the RL learner's replay), the plain rounding otherwise
        latent = ops.apply_rope(latent, freqs, self.rope_dim, reference=self.reference_numerics)
        if self.fp4_kv:
            latent = rounded(latent, ops.fp4_qdq, KV_FP4_BLOCK, "e4m3")
        cache.write_compressed(self.layer_id, x.size(0), first, latent, keys)

    def project(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-wise projections. x [..., S, dim] -> (qr [..., S, q_lora], q [..., S, H, head_dim] RoPE'd,
        kv [..., S, head_dim] RoPE'd and FP8-rounded, the window-KV storage format)."""
        ref = self.reference_numerics
        qr = self.q_norm(self.wq_a(x))
        q = ops.apply_rope(
            self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), freqs, self.rope_dim, reference=ref
        )
        kv = ops.apply_rope(self.kv_norm(self.wkv(x)), freqs, self.rope_dim, reference=ref)
        return qr, q, rounded(kv, ops.fp8_qdq)

    def attend(
        self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, start_pos: int, cache, shared: dict
    ) -> torch.Tensor:
        """The sequence-mixing part for one run of consecutive positions: update the window ring and the
        compressed cache, select, and attend. Returns [B, S, H, head_dim] (still RoPE'd)."""
        rows, ids = self._window(kv, start_pos, cache)
        window, lone = ids.size(-1), False
        if self.ratio:
            comp_rows, comp_ids = self._compressed(x, qr, start_pos, rows.size(1), cache, shared)
            rows = torch.cat([rows, comp_rows], dim=1)
            ids = torch.cat([ids, comp_ids], dim=-1)
            lone = bool(shared.get("lone_widths")) and comp_ids.size(-1) > 0
        if self._fast_attention_serves(q, rows):  # one fp32 softmax a query: the widths do not matter
            return attn_cpu.sparse_attn_cpu(q, rows, self.attn_sink, ids, self.softmax_scale)
        if lone:
            return self._attend_at_lone_widths(q, rows, ids, start_pos, window)
        return ops.sparse_attn(
            q, rows, self.attn_sink, ids, self.softmax_scale, self.reference_numerics, self.heads_per_call
        )

    def _fast_attention_serves(self, q: torch.Tensor, rows: torch.Tensor) -> bool:
        """Under `fast` numerics (`fast_kernels`, set by the engine's runner), a chunk of 256 queries or more
        runs the C++ attention (dsv41.ops.attn_cpu) where the CPU has bf16 dot products; the first such chunk
        builds it (~8 s, once a machine). Smaller chunks (a chat turn, decode-sized verify chunks), where it
        saves little, keep the model's attention: which path a chunk takes depends on its size only."""
        return (
            self.fast_kernels
            and q.size(1) >= 256
            and not self.reference_numerics
            and attn_cpu.fits(q, rows)
            and attn_cpu.available()
        )

    def _attend_at_lone_widths(
        self, q: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, start_pos: int, window: int
    ) -> torch.Tensor:
        """Each query attended at the width a lone decode at its position lists: `window` slots plus
        min(k, its visible groups) compressed ones (the chunk lists k = the last query's count for all).
        The online softmax sums in 64-index blocks, so trailing unused slots change the rounding; the
        engine asks for this on a speculative verify chunk so that every verified token gets the bits a
        decode step would have given it (dsv41.engine.batched.decode_attend groups its rows the same way)."""
        s, k = q.size(1), ids.size(-1) - window
        pos = torch.arange(start_pos, start_pos + s)
        width = ((pos + 1) // self.ratio).clamp(max=k)  # [S]
        if bool((width == k).all()):
            return ops.sparse_attn(
                q, rows, self.attn_sink, ids, self.softmax_scale, self.reference_numerics, self.heads_per_call
            )
        out = q.new_empty(q.shape)
        for w in width.unique().tolist():
            group = (width == w).nonzero().flatten().to(q.device)
            out[:, group] = ops.sparse_attn(
                q[:, group],
                rows,
                self.attn_sink,
                ids[:, group, : window + w],
                self.softmax_scale,
                self.reference_numerics,
                self.heads_per_call,
            )
        return out

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE and the grouped output LoRA: [..., S, H, head_dim] -> [..., S, dim]."""
        o = ops.apply_rope(o, freqs, self.rope_dim, inverse=True, reference=self.reference_numerics)
        o = o.unflatten(-2, (self.n_groups, -1)).flatten(-2)  # [..., S, G, H/G * head_dim]
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        if self.wo_a.rows_kernel and self.wo_a._rows_kernel_serves(o[..., 0, :]):
            # each group's rows by the few-row kernel, where the layer takes it (dsv41.ops.linear_cpu)
            groups = [ops.linear_cpu.rows_linear(o[..., g, :], wo_a[g]) for g in range(self.n_groups)]
            o = torch.stack(groups, dim=-2).to(o.dtype)
        else:
            o = ops.grouped_linear(o, wo_a, self.wo_a.row_chunk, self.wo_a.reference_numerics)
        return self.wo_b(o.flatten(-2))

    def forward(self, x: torch.Tensor, start_pos: int, cache, shared: dict) -> torch.Tensor:
        """x [B, S, dim] bf16 (normed attention input) -> [B, S, dim] bf16."""
        freqs = self.rope(start_pos, x.size(1), x.device)
        qr, q, kv = self.project(x, freqs)
        return self.output(self.attend(x, qr, q, kv, start_pos, cache, shared), freqs)


def ring_ids(query_pos: torch.Tensor, start, first, window: int) -> torch.Tensor:
    """The window each query reads, as ids into cat(ring as it was before the chunk, the chunk's KV).

    query_pos [..., 1]; start: the chunk's first position; first: the first position the window may hold
    (both ints or tensors broadcasting like query_pos). Returns [..., window], oldest first, -1 where the
    position does not exist (before `first`). Ring slot of position p is p % window."""
    window_pos = query_pos - window + 1 + torch.arange(window, device=query_pos.device)
    ids = torch.where(window_pos < start, window_pos % window, window + window_pos - start)
    return torch.where(window_pos < first, -1, ids)


def _trace(shared: dict, name: str, value: torch.Tensor) -> None:
    """Record an intermediate when the caller asked for captures (see Transformer.forward `trace`)."""
    trace = shared.get("trace")
    if trace is not None:
        trace[name] = value.detach().clone()
