"""The engine's scheduler: what one step computes, and a sequence's admission and release (spec-v41.md §8, §9).

`Scheduling` is the part of `LLMEngine` (engine/llm_engine.py) that plans a step: a decode token for every
running sequence that finished its prefill, then prefill chunks at fixed boundaries, then newly admitted
requests; block reservation with preemption of the newest request when the pool runs out; a request's
start (prefix-cache match, snapshot restore, window rebuild, or a KV hand-off from a prefill worker); the
registration of full blocks in the prefix cache, the message-boundary snapshot, and the release of a
finished sequence's blocks. It is a mixin: the state it reads (pool, allocator, queues, stats) is
created by `LLMEngine.__init__`.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from dsv41.engine.handoff import export_sequence, import_sequence, model_identity
from dsv41.engine.kv_pool import PoolExhausted
from dsv41.engine.prefix_cache import Snapshot, chain_hashes, prefix_key
from dsv41.engine.runner import Chunk
from dsv41.engine.sequence import Sequence, SequenceCache, Status
from dsv41.engine.types import RequestOutput

log = logging.getLogger("dsv41.engine")


class Scheduling:
    """Step planning, admission, hand-off import, snapshots and release for `LLMEngine`."""

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> list[tuple[Sequence, Chunk, str]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self._admit()
        plan = []
        # decodes first (one token each), then prefill work, each in arrival order
        order = sorted(self.running, key=lambda s: (s.in_prefill or s.needs_rebuild, s.arrival))
        suspects = [s for s in order if s.suspect_until is not None]
        if suspects:  # after a failed batch: the oldest suspect runs alone until it catches up
            order = [min(suspects, key=lambda s: s.arrival)]
        for seq in order:
            if seq.status != Status.RUNNING or seq.restored_logits is not None:
                continue  # preempted earlier in this loop, or nothing to compute (a whole-prompt hit)
            tokens = seq.all_ids
            if seq.needs_rebuild:
                start, end, kind = seq.rebuild_from, seq.num_computed, "rebuild"
            elif seq.in_prefill:
                start = seq.num_computed
                end = min(seq.prefill_target, (start // cfg.prefill_chunk_size + 1) * cfg.prefill_chunk_size)
                kind = "prefill"
            else:
                start, end, kind = seq.num_computed, len(tokens), "decode"
                if seq.draft_tokens and end + len(seq.draft_tokens) - start > budget:
                    seq.draft_tokens, seq.draft_logits = [], None  # no room this step: verify nothing
                end += len(seq.draft_tokens)
                tokens = tokens + seq.draft_tokens
            if end - start > budget:
                continue
            if not self._reserve_blocks(seq, end, plan):
                continue
            budget = cfg.max_num_batched_tokens - sum(c.end - c.start for _, c, _ in plan) - (end - start)
            lookback = self.model_config.engram_max_ngram_size - 1
            every = kind == "prefill" and seq.needs_prompt_logprobs  # logits at every position (prompt logprobs)
            chunk = Chunk(
                seq.cache,
                tokens[start:end],
                start,
                tokens[max(0, start - lookback) : start],
                decoder_from=seq.rebuild_decoder_from if kind == "rebuild" else seq.decoder_from,
                want_logits=kind != "rebuild" and (end >= seq.prefill_target or every),
                end=end,
                decode=kind == "decode" and end - start == 1,
                verify=kind == "decode" and end - start > 1,
                n_logits=len(seq.draft_tokens) + 1 if kind == "decode" else end - start if every else 1,
            )
            if seq.images:
                self._attach_images(seq, chunk, start - len(chunk.context), end)
            plan.append((seq, chunk, kind))
        return plan

    def _attach_images(self, seq: Sequence, chunk: Chunk, first: int, end: int) -> None:
        """The chunk's image rows (slices of each span's embeddings, computed once per request) and its
        image-position flags over context + tokens. A chunk may hold any part of a span."""
        chunk.image_mask = seq.image_positions(first, end)
        for k, a, b in seq.image_spans(chunk.start, end):
            span_start, image = seq.images[k]
            if k not in seq.image_embeds:
                seq.image_embeds[k] = self.runner.embed_image(image)  # [span_length, dim]
            chunk.image_rows.append((a - chunk.start, seq.image_embeds[k][a - span_start : b - span_start]))

    def _reserve_blocks(self, seq: Sequence, end: int, plan: list) -> bool:
        """Make the sequence's block table cover positions < end, preempting newer requests if needed
        (dropping their work from this step's plan)."""
        needed = math.ceil(end / self.config.block_size) - len(seq.cache.blocks)
        while needed > 0:
            try:
                seq.cache.append_block(self.allocator.allocate())
                needed -= 1
            except PoolExhausted:
                victims = [s for s in self.running if s is not seq and s.arrival > seq.arrival]
                victim = max(victims, key=lambda s: s.arrival) if victims else seq
                self._preempt(victim)
                plan[:] = [entry for entry in plan if entry[0] is not victim]
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.counters["preemptions_total"] += count
        # keep arrival order among the waiting: a preempted request goes back before later arrivals
        index = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(index, seq)

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._start(seq):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.queue_time_s is None:
                seq.queue_time_s = time.monotonic() - seq.arrival_time
            self.running.append(seq)

    def _start(self, seq: Sequence) -> bool:
        """Set up a sequence's cache for (re)prefill of all its tokens, reusing what the prefix cache
        holds. Returns False (changing nothing) when the pool cannot take it yet."""
        mcfg, bs = self.model_config, self.config.block_size
        if seq.handoff is not None:
            return self._start_from_handoff(seq)
        tokens = seq.key_ids  # what the prefix cache hashes (image spans keyed by their pixels)
        n = len(tokens)
        seq.draft_tokens, seq.draft_logits, seq.saved_state = [], None, None  # a new cache: no draft, no rows
        seq.spans, seq.routing = [], []  # record_routing: recomputed from position 0 (no prefix cache then)
        seq.rows_first, seq.rows_end = None, 0
        hashes = chain_hashes(tokens, bs, [])
        w = mcfg.window_size
        bounded = self.config.prefill_mode == "bounded"
        if seq.decoder_start is None:  # fixed at first admission, so a recompute takes the same path
            # prompt logprobs need the logits of every prompt position: the decoder runs over all of them
            full = not bounded or seq.params.prompt_logprobs is not None
            seq.decoder_start = 0 if full else max(0, len(seq.prompt_ids) - w)
        start = seq.decoder_start
        exact = self.config.exact_prefix_reuse
        # prompt logprobs still to compute: every prompt position runs here, nothing is read from the cache
        lookup = self.config.enable_prefix_caching and not seq.needs_prompt_logprobs
        matched: list[int] = []
        if lookup:
            for h in hashes[: (n if exact else n - 1) // bs]:
                block = self.allocator.lookup(h)
                if block is None:
                    break
                matched.append(block)
        snap = None
        if lookup:
            if exact:
                # resume only where a miss computes the same: the windows kept, and the decoder either
                # not yet started there (its windows begin at `start` in both paths) or started at `start`
                # (a snapshot of the whole prompt serves when it kept the logits of its last position)
                snap = self.snapshots.find(
                    tokens,
                    bs,
                    hashes,
                    len(matched),
                    n,
                    exact_blocks=False,
                    accept=lambda s: (
                        s.window_valid
                        and (s.length <= start or s.decoder_start == start)
                        and (s.length < n or s.logits is not None)
                    ),
                )
                matched = matched[: snap.length // bs] if snap is not None else []
            else:
                snap = self.snapshots.find(tokens, bs, hashes, len(matched), n - 1)
        revived = sum(1 for b in matched if self.allocator.refcount[b] == 0)
        to_allocate = math.ceil(n / bs) - len(matched)
        if self.allocator.num_available() - revived < to_allocate + len(self.running):
            if self.running or self.allocator.num_available() - revived < to_allocate:
                return False
        if lookup:
            self.stats.queried_tokens += n
        for b in matched:
            self.allocator.acquire_cached(b)
        cache = SequenceCache(mcfg, self.pool, self.states, self.states.acquire())
        cache.set_blocks(list(matched))
        seq.cache = cache
        seq.block_hashes = hashes[: len(matched)]
        length = len(matched) * bs
        window_from = 0
        if snap is not None:
            length = snap.length
            if length % bs:
                cache.append_block(self.allocator.allocate())
                for layer, packed in snap.tail.items():
                    entries = torch.arange(
                        len(matched) * bs // self.pool.sources[layer].ratio, length // self.pool.sources[layer].ratio
                    )
                    self.pool.import_entries(layer, cache.table, entries, packed)
            if snap.window_valid:
                cache.import_state(snap.state)
                window_from = None
            else:
                for k, (a, b) in snap.state["group"].items():
                    cache.group[k][0].copy_(a)
                    cache.group[k][1].copy_(b)
            self.stats.snapshot_hits += 1
            if snap.length == n:  # nothing left to compute: the first token comes from the kept logits
                seq.restored_logits = snap.logits
        self.stats.hit_tokens += length
        seq.num_cached_tokens = length
        seq.num_computed = length
        seq.prefill_target = n
        seq.needs_rebuild = False
        seq.decoder_from = max(length, start) if bounded else 0
        decoder_needs_history = not bounded or start < length
        if window_from is not None:  # no ring state: rebuild it from the cached global KV if needed
            window_from = max(0, length - w)
            cache.first = [window_from] * mcfg.n_layers
            if length > 0:
                seq.needs_rebuild = True
                seq.rebuild_from = window_from
                seq.rebuild_decoder_from = window_from if decoder_needs_history else length
                self.stats.window_rebuilds += 1
        if not decoder_needs_history:
            for layer in range(self.boundary, mcfg.n_layers):
                cache.first[layer] = seq.decoder_from
        if seq.preemptions == 0:
            self.counters["prompt_tokens_total"] += n
        return True

    # ------------------------------------------------------------------ disaggregation (engine/handoff.py)
    def identity(self) -> dict:
        """The model's identity, which a hand-off must carry to be imported here (computed once)."""
        if self._identity is None:
            self._identity = model_identity(self.model)
        return self._identity

    def _start_from_handoff(self, seq: Sequence) -> bool:
        """Admit a request from its KV hand-off: blocks for the prompt, the state written, the first token
        sampled from the handed-off logits by the next step. False (nothing changed) when there is no room."""
        blocks = math.ceil(len(seq.prompt_ids) / self.config.block_size)
        if self.allocator.num_available() < blocks + len(self.running):
            if self.running or self.allocator.num_available() < blocks:
                return False
        cache = SequenceCache(self.model_config, self.pool, self.states, self.states.acquire())
        for _ in range(blocks):
            cache.append_block(self.allocator.allocate())
        import_sequence(self, seq, seq.handoff, cache)
        seq.handoff = None  # consumed: a recompute after preemption prefills here, from the same decoder start
        self._register_full_blocks(seq)
        self.counters["handoffs_imported_total"] += 1
        # an imported prompt is admitted as a prefilled one is (usage and vLLM's prompt_tokens count it);
        # how many of those tokens someone else computed is the hand-off counter
        self.counters["prompt_tokens_total"] += len(seq.prompt_ids)
        self.counters["handoff_imported_tokens_total"] += len(seq.prompt_ids)
        return True

    def _export_handoff(self, seq: Sequence, logits: torch.Tensor, chunk: Chunk | None) -> RequestOutput:
        """A prefill-only request computed its prompt: keep its snapshot, write the drafter rings of the last
        chunk (what the draft after the first token would have written), export, finish and release."""
        try:
            self._save_snapshot(seq, logits)
            if self.speculative and chunk is not None and chunk.main_hidden is not None:
                first_pos = chunk.hidden_start
                start = max(first_pos, seq.rows_end if seq.rows_first is not None else first_pos)
                if start < seq.num_computed:
                    self.runner.draft_rows(
                        chunk.main_hidden[start - first_pos : seq.num_computed - first_pos].unsqueeze(0),
                        start,
                        seq.cache,
                    )
                    self._rows_written(seq, start, seq.num_computed)
            handoff = export_sequence(self, seq, logits)
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            return self._fail(seq, exc)
        seq.finish_reason = "handoff"
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._release(seq)
        self._finish(seq)
        out = self._output(seq)
        out.handoff = handoff
        self.counters["handoffs_exported_total"] += 1
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _register_full_blocks(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed // self.config.block_size
        if full > len(seq.block_hashes):
            seq.block_hashes = chain_hashes(
                seq.key_ids[: full * self.config.block_size], self.config.block_size, seq.block_hashes
            )
            for i in range(full):
                self.allocator.register(seq.cache.blocks[i], seq.block_hashes[i])

    def _save_snapshot(self, seq: Sequence, logits: torch.Tensor | None = None) -> None:
        """Keep the partial tail block, partial groups and window rings at a message boundary, and at the
        end of a prompt the logits of its last position (a repeat of the prompt then computes nothing)."""
        if not self.config.enable_prefix_caching or seq.cache is None:
            return
        bs, length = self.config.block_size, seq.num_computed
        if length == 0:
            return
        tokens = seq.key_ids[:length]
        hashes = chain_hashes(tokens, bs, seq.block_hashes[: length // bs])
        tail = {}
        for layer, lay in self.pool.sources.items():
            first = (length // bs) * bs // lay.ratio
            entries = torch.arange(first, length // lay.ratio)
            if entries.numel():
                tail[layer] = self.pool.export_entries(layer, seq.cache.table, entries)
        snap = Snapshot(
            length,
            tail,
            seq.cache.export_state(),
            time.monotonic(),
            decoder_start=seq.decoder_start,
            logits=None if logits is None else logits.clone(),
        )
        self.snapshots.put(prefix_key(tokens, length, bs, hashes), snap)

    def _release(self, seq: Sequence) -> None:
        if seq.cache is not None:
            for block in seq.cache.blocks:
                self.allocator.release(block)
            self.states.release(seq.cache.slot)
            seq.cache = None
        seq.num_computed = 0
        seq.block_hashes = []
